"""The C sources of native/, by concern, and their include folders: the one list
that the cffi build (build_ffi.py), the firmware build (firmware/build.py) and the
standalone C tests share. Paths are relative to the project root. Stdlib only:
it is read before anything is installed.

    fp9/        the weight format: codec, synthetic tensors (benchmarks)
    kernels/    GEMV/GEMM kernels, the worker pool, the MoE/MLP slice forward;
                the read-bandwidth probe and int8 peer the kernel benchmark uses
    wire/       the wire protocol: one header, integrity (CRC-32C, BLAKE2b fleet MAC, Poly1305
                link MAC with its AVX2 lanes)
    transport/  the host side of the wire: scatter, gather, retransmit, sum; a decode
                step of CUDA graphs and forwards driven from C (step.c), and one of the
                CPU host decoder and forwards (host_step.c)
    host/       the CPU host path: fp32 kernels, ops and a Llama-family decode step
"""
INCLUDE_DIRS = ["native/fp9", "native/kernels", "native/wire", "native/transport", "native/host"]

FP9 = ["native/fp9/fp9_codec.c", "native/fp9/fp9_synth.c"]
KERNELS = ["native/kernels/kernels_ref.c", "native/kernels/kernels_avx2.c", "native/kernels/kernels_avx512.c",
           "native/kernels/kernels_amx.c", "native/kernels/kernels.c",
           "native/kernels/pool.c", "native/kernels/ffn.c", "native/kernels/act.c"]
KERNEL_PROBES = ["native/kernels/bench.c"]
WIRE = ["native/wire/wire.c", "native/wire/poly1305.c", "native/wire/poly1305_avx2.c"]
TRANSPORT = ["native/transport/transport.c", "native/transport/transport_run.c",
             "native/transport/transport_timing.c", "native/transport/transport_plan.c",
             "native/transport/transport_forward.c", "native/transport/transport_par.c",
             "native/transport/transport_lost.c", "native/transport/cover.c", "native/transport/step.c",
             "native/transport/host_step.c"]
HOST = ["native/host/host_kernels_ref.c", "native/host/host_kernels_avx2.c", "native/host/host_kernels_avx512.c",
        "native/host/host_kernels.c", "native/host/host_ops.c", "native/host/host_decoder.c"]
C_TESTS = ["native/kernels/test_native.c"]
HOST_C_TESTS = ["native/host/test_host.c"]

# what a duck runs (the firmware links these with firmware/*.c)
DUCK = FP9 + KERNELS + WIRE
# the Python extension native._native
EXTENSION = FP9 + KERNELS + KERNEL_PROBES + WIRE + TRANSPORT + HOST


def headers(root) -> list:
    """Every header of native/ under root (a pathlib.Path): rebuild dependencies."""
    return [h for d in INCLUDE_DIRS for h in (root / d).glob("*.h")]
