"""engine.gpu: the GPU host's fast path. Each Triton kernel here comes with a torch
reference beside it and a CPU test under TRITON_INTERPRET=1.

    fp8.py   fp8 e4m3 block-scale (128x128) linear: Fp8Linear keeps fp8 checkpoints
             fp8 in GPU memory; fp8_linears_from_checkpoint swaps a model's projections
    ops_triton.py        the fused decoder ops of engine.ops (RMSNorm with the residual
                         add, q/k norm + rotary + KV-cache write, the softmax router)
    decode_attention.py  attention over the static KV cache (split + combine), for
                         CUDA-graph decode

Triton is optional: without it the modules import and run their torch references.
"""
