"""GEMV / GEMM: AVX2 against the scalar reference against float64, on odd
shapes and on the real slice shapes."""
import numpy as np
import pytest
import torch

from native.fp9 import Fp9Tensor
from native.kernels import Pool, gemm, kernels, kernels_name, matmul

# Error of an fp32 dot product of K terms, relative to sum |w| |x|: both
# kernels accumulate in fp32 in blocks, so it stays far below K * 2^-24.
DOT_REL_TOL = 2e-6

ODD_SHAPES = [(1, 1), (3, 3), (17, 33), (33, 17), (127, 129), (129, 127), (1, 4100), (3, 2049)]
SLICE_SHAPES = {
    "deepseek_v3.gate_up": (128, 7168),    # 2 x 64 rows of moe_intermediate 2048 / tp 32
    "deepseek_v3.down": (7168, 64),
    "qwen3_30b_a3b.gate_up": (128, 2048),  # 2 x 64 rows of 768 / tp 12
    "qwen3_30b_a3b.down": (2048, 64),
}


def _check(t: Fp9Tensor, x: np.ndarray, y: np.ndarray, what: str):
    w64 = t.to_float().astype(np.float64)
    exact = x.astype(np.float64) @ w64.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w64).T + 1e-30
    err = np.max(np.abs(y - exact) / scale)
    assert err <= DOT_REL_TOL, f"{what}: relative error {err:.3g} > {DOT_REL_TOL}"


FAST = ("avx2-xor", "avx2-blend")


def test_an_avx2_variant_is_chosen_on_this_cpu():
    assert kernels_name(kernels()) in FAST


@pytest.mark.parametrize("shape", ODD_SHAPES + list(SLICE_SHAPES.values()),
                         ids=[f"{r}x{c}" for r, c in ODD_SHAPES] + list(SLICE_SHAPES))
@pytest.mark.parametrize("ntok", [1, 2, 7])
def test_gemm_avx2_and_ref_match_float64(shape, ntok):
    rng = np.random.default_rng(shape[0] * 7 + shape[1] + ntok)
    t = Fp9Tensor.from_float(rng.standard_normal(shape).astype(np.float32) * 0.03, "w")
    x = rng.standard_normal((ntok, shape[1])).astype(np.float32)
    for kernel_set in ("ref",) + FAST:
        _check(t, x, gemm(t, x, kernel_set), kernel_set)


@pytest.mark.parametrize("ntok", [6, 13, 64, 65])
def test_gemm_batches_match_gemv_per_token(ntok):
    rng = np.random.default_rng(ntok)
    t = Fp9Tensor.from_float(rng.standard_normal((33, 2500)).astype(np.float32), "w")
    x = rng.standard_normal((ntok, 2500)).astype(np.float32)
    batched = gemm(t, x, "avx2")
    one_by_one = np.concatenate([gemm(t, x[i:i + 1], "avx2") for i in range(ntok)])
    _check(t, x, batched, "batched")
    _check(t, x, one_by_one, "one by one")


def test_block_scales_are_applied_per_128_columns():
    rng = np.random.default_rng(9)
    codes = rng.integers(0, 0x7E, size=(130, 300), dtype=np.uint8)
    scale = rng.uniform(1e-3, 5e-3, size=(2, 3)).astype(np.float32)
    t = Fp9Tensor.from_fp8(codes, scale, "w")
    assert t.has_block_scales
    for ntok in (1, 3):
        x = rng.standard_normal((ntok, 300)).astype(np.float32)
        for kernel_set in ("ref",) + FAST:
            _check(t, x, gemm(t, x, kernel_set), kernel_set)


def test_accumulate_adds_to_the_output():
    rng = np.random.default_rng(10)
    t = Fp9Tensor.from_float(rng.standard_normal((5, 70)).astype(np.float32), "w")
    x = rng.standard_normal((2, 70)).astype(np.float32)
    for kernel_set in ("ref",) + FAST:
        base = np.full((2, 5), 3.0, dtype=np.float32)
        out = gemm(t, x, kernel_set, accumulate_into=base.copy())
        np.testing.assert_allclose(out, 3.0 + gemm(t, x, kernel_set), rtol=1e-6, atol=1e-6)


def test_padded_slice_rows_contribute_nothing():
    """A slice whose intermediate size does not divide by tp * 64: zero rows."""
    rng = np.random.default_rng(11)
    w = np.zeros((192, 2048), dtype=np.float32)
    w[:150] = rng.standard_normal((150, 2048)) * 0.02       # 768 / tp 5 = 153.6 -> 192 wide slices
    t = Fp9Tensor.from_float(w, "w")
    x = rng.standard_normal((2, 2048)).astype(np.float32)
    y = gemm(t, x, "avx2")
    assert np.all(y[:, 150:] == 0.0)
    _check(t, x, y, "padded")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threaded_matmul_is_identical_to_one_thread(threads):
    rng = np.random.default_rng(12)
    t = Fp9Tensor.from_float(rng.standard_normal((301, 4100)).astype(np.float32), "w")
    x = rng.standard_normal((3, 4100)).astype(np.float32)
    one = gemm(t, x, "avx2")
    assert np.array_equal(matmul(t, x, Pool(threads)), one)


def test_bf16_and_fp32_sources_agree_within_bf16_rounding():
    rng = np.random.default_rng(13)
    w32 = rng.standard_normal((64, 256)).astype(np.float32)
    wbf = torch.from_numpy(w32).to(torch.bfloat16)
    t = Fp9Tensor.from_float(wbf, "w")
    x = rng.standard_normal((1, 256)).astype(np.float32)
    _check(t, x, gemm(t, x, "avx2"), "bf16 source")
