"""The benchmarks, in one place. Each prints its numbers (a table, or --json) and
measures ratios within one run, since the machines are shared and noisy:

    kernels        fp9 GEMV / MoE slice vs the read bandwidth and an int8 peer  (duckctl bench kernels)
    transport      per-layer round trip over loopback ducks                      (duckctl bench transport)
    e2e            decode through the running daemon                            (duckctl bench e2e)
    e2e_synthetic  a synthetic model at published widths on local ducks vs
                   every FFN on the GPU and the torch CPU offload               (duckctl bench e2e --synthetic)
                   (its local ducks: synthetic_ducks; its table: e2e_synthetic_table)
    synthetic      the synthetic models that e2e_synthetic builds
    gpu_fp8        the Triton fp8 block-scale linear                            (python bench/gpu_fp8.py)

Results of runs that figures were quoted from are in bench/results/ (its README
names each file's command and machine).
"""
