"""The Triton fp8 block-scale linear compiled for the GPU (the CPU suite runs it under
the interpreter): the same checks against the reference and a float64 product, at
the CI shapes and at DeepSeek-V3.2 host-projection shapes, and an fp8 DeepSeek
checkpoint run with Fp8Linear on the GPU against its dequantized twin. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine.gpu import fp8
from tests.engine.test_fp8_triton import (
    KERNEL_CASES,
    assert_close_to_exact,
    random_fp8_weight,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA device")


def _check_on_cuda(t, n, k, dtype, config, seed):
    gen = torch.Generator().manual_seed(seed)
    codes, scale = random_fp8_weight(n, k, gen)
    x = torch.randn(t, k, generator=gen).to(dtype)
    full = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    exact = x.double() @ (codes.double() * full).T
    dev = torch.device("cuda")
    cfg = config or fp8.choose_config(t, n, k, sm_count=torch.cuda.get_device_properties(dev).multi_processor_count)
    splits, _ = fp8.k_splits(k, cfg)
    out = torch.full((t, n), float("nan"), dtype=dtype, device=dev)
    ws = torch.full((splits, t, n), float("nan"), device=dev)
    y = fp8.fp8_linear_triton(x.to(dev), codes.to(dev), scale.to(dev), config=cfg, out=out, workspace=ws)
    torch.cuda.synchronize()
    assert y is out
    assert_close_to_exact(y.cpu(), exact, f"cuda T={t} N={n} K={k} {dtype} {cfg}")


@pytest.mark.parametrize("t,config", KERNEL_CASES, ids=[f"T{t}-{c.kind if c else 'auto'}{i}"
                                                        for i, (t, c) in enumerate(KERNEL_CASES)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernel_matches_reference(t, config, dtype):
    _check_on_cuda(t, 200, 300, dtype, config, 1000 * t + KERNEL_CASES.index((t, config)))


@pytest.mark.parametrize("n,k", [(1536, 7168), (576, 7168), (7168, 16384), (24576, 1536)])
@pytest.mark.parametrize("t", [1, 2, 16, 1024])
def test_compiled_kernel_at_deepseek_shapes(n, k, t):
    _check_on_cuda(t, n, k, torch.bfloat16, None, n + k + t)


def test_fp8_model_on_the_gpu_matches_its_dequantized_twin(tmp_path):
    """Fp8Linear (compiled kernels) in a tiny fp8 DeepSeek on the GPU vs the same model dequantized, fp32, no TF32."""
    from engine.generate import forward_logits
    from engine.loader import load_model
    from tests.engine.test_fp8_triton import write_fp8_checkpoint

    folder = write_fp8_checkpoint(tmp_path)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        dense = load_model(folder, backend="torch", device="cuda", keep_fp8=False).model
        model = load_model(folder, backend="torch", device="cuda").model   # on CUDA fp8 stays fp8 by default
        swapped = [n for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)]
        assert len(swapped) >= 7 and not any(isinstance(m, fp8.Fp8Linear) for m in dense.modules())
        assert all(model.get_submodule(n).weight.device.type == "cuda" for n in swapped)
        assert all(model.get_submodule(n).weight.dtype == torch.float8_e4m3fn for n in swapped)
        prompt = torch.randint(2, dense.config.vocab_size, (11,), generator=torch.Generator().manual_seed(6)).tolist()
        want, got = forward_logits(dense, prompt), forward_logits(model, prompt)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-5, f"fp8 model on the GPU: logits rel err {rel:.2e}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
