"""engine.cpu: the CPU host's fast path, the twin of engine.gpu. A model on the
CPU decodes through native C (native/host/) over its own fp32 weights and KV
cache; the prefill stays in torch on the same cache.

    host_model.py   which tensors of a Llama / Qwen3 / Qwen3-MoE model the C reads, checked
    decode.py       CpuDecoder: one decode step = a C call per layer + the FFN call between
"""
