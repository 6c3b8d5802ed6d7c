"""The native CPU decoder's C side (engine.cpu): fp32 kernels (ref / AVX2 /
AVX-512), the host ops built on them, and the per-layer decode step over a
model's own weights and KV cache. native.host.ops is the Python face of the
single ops (tests, benchmarks); engine.cpu.decode drives the decoder."""
