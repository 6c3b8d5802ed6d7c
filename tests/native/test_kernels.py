"""GEMV / GEMM: every kernel set (AVX2, AVX-512) against the scalar reference
and float64, on odd shapes and on the real slice shapes. A set this CPU lacks
is skipped with the reason (CI machines may have AVX2 only)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from native.fp9 import Fp9Tensor
from native._native import lib
from native.kernels import (BATCH_INVARIANT_SETS, Pool, batch_invariant, gemm, kernels, kernels_available,
                            kernels_name, matmul, set_batch_invariant)

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


AVAILABLE = kernels_available()
NEEDS = {"avx2-xor": "AVX2+FMA", "avx2-blend": "AVX2+FMA", "avx512": "AVX-512 F/BW/VL",
         "avx512-bf16": "AVX512_BF16", "amx-emu": "AVX512_BF16", "amx": "AMX-BF16"}
BF16_GEMMS = ("avx512-bf16", "amx-emu", "amx")   # the sets with a GEMM of their own on bf16 activations
FAST = tuple(n for n in NEEDS if n in AVAILABLE)
FAST_PARAMS = [pytest.param(n, marks=pytest.mark.skipif(n not in AVAILABLE, reason=f"this CPU has no {NEEDS[n]}"))
               for n in NEEDS]


def _amd() -> bool:
    with open("/proc/cpuinfo") as f:
        return "AuthenticAMD" in f.read()


def test_the_fastest_set_this_cpu_has_is_chosen():
    """amx where the tiles are; the VDPBF16PS GEMM only on AMD (slower than the FMA on Intel's cores)."""
    best = kernels_name(kernels())
    assert best != "amx-emu"
    if "amx" in AVAILABLE:
        assert best == "amx"
    elif "avx512-bf16" in AVAILABLE and _amd():
        assert best == "avx512-bf16"
    elif "avx512" in AVAILABLE:
        assert best == "avx512"
    elif FAST:
        assert best in ("avx2-xor", "avx2-blend")
    else:
        assert best == "ref"


@pytest.mark.parametrize("want", ["ref", "avx2-xor", "avx2-blend", "avx512", "avx512-bf16", "amx", "amx-emu",
                                  "nonsense"])
def test_duck_kernels_in_the_environment_forces_a_set_the_cpu_has(want):
    code = "from native.kernels import kernels, kernels_name; print(kernels_name(kernels()))"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DUCK_KERNELS": want},
                         capture_output=True, text=True, check=True)
    expected = want if want in AVAILABLE else kernels_name(kernels())
    assert run.stdout.strip() == expected


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(a).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("kset", [pytest.param(k, marks=pytest.mark.skipif(k not in AVAILABLE,
                                                                           reason=f"this CPU has no {NEEDS[k]}"))
                                  for k in BF16_GEMMS])
@pytest.mark.parametrize("block_scales", [False, True], ids=["plain", "block_scales"])
@pytest.mark.parametrize("cols", [64, 192, 2048 + 64])
@pytest.mark.parametrize("rows", [3, 33, 384])
def test_the_bf16_gemm_matches_ref_on_bf16_activations(rows, cols, block_scales, kset):
    """avx512-bf16 (VDPBF16PS) and amx (TDPBF16PS; amx-emu its tile program emulated) on
    activations that are bf16 values (5, 12, 67 tokens: the GEMM): as close to float64 as the FMA
    sets, in their own order of sums; weights of e5m3 subnormal codes count (a bf16 subnormal would
    read as 0). Other activations, and the GEMVs, are avx512's bit for bit."""
    rng = np.random.default_rng(rows * 7 + cols + block_scales)
    if block_scales:
        t = _fp8_with_block_scales(rows, cols, rng)
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.03
        w[:, :5] = 3e-8 * 0.03     # the slice's smallest weights: subnormal e5m3 codes
        t = Fp9Tensor.from_float(w, "w")
    for ntok in (5, 12, 67):
        x = _bf16(rng.standard_normal((ntok, cols)).astype(np.float32))
        dots = lib.duck_kernels_amx_emulated_dots()
        y = gemm(t, x, kset)
        _check(t, x, y, f"{kset} ntok {ntok}")
        if kset == "amx-emu":   # the emulated tile program ran
            assert lib.duck_kernels_amx_emulated_dots() > dots
        if cols > 2048 and kset == "avx512-bf16":   # VDPBF16PS sums a pair in its own order
            assert not np.array_equal(y, gemm(t, x, "avx512")), "the bf16 dot products ran"
    x = rng.standard_normal((12, cols)).astype(np.float32)
    if kset == "avx512-bf16":
        assert np.array_equal(gemm(t, x, kset), gemm(t, x, "avx512"))
    else:   # amx: fp32 activations as three exact bf16 parts (test_amx_takes_fp32_activations_in_three_parts)
        _check(t, x, gemm(t, x, kset), f"{kset} fp32 activations")
    x = _bf16(rng.standard_normal((3, cols)).astype(np.float32))
    assert np.array_equal(gemm(t, x, kset), gemm(t, x, "avx512"))


@pytest.mark.parametrize("kset", [pytest.param(k, marks=pytest.mark.skipif(k not in AVAILABLE,
                                                                           reason=f"this CPU has no {NEEDS[k]}"))
                                  for k in ("amx-emu", "amx")])
@pytest.mark.parametrize("block_scales", [False, True], ids=["plain", "block_scales"])
@pytest.mark.parametrize("cols", [64, 192, 2048 + 64])
@pytest.mark.parametrize("rows", [3, 33, 384])
def test_amx_takes_fp32_activations_in_three_parts(rows, cols, block_scales, kset, invariance_off):
    """Batch invariance off (kernels.h): fp32 activations (a CPU host's) on the tiles, each value
    split into three bf16 whose sum is exactly it, so every product is exact and only the order
    of the fp32 sums differs from the FMA sets'; as close to float64 as they are, over
    activations of widely different magnitudes (the split's low part is then far below the high
    one). Fewer than five tokens stay avx512's bit for bit."""
    rng = np.random.default_rng(rows * 5 + cols + block_scales)
    if block_scales:
        t = _fp8_with_block_scales(rows, cols, rng)
    else:
        t = Fp9Tensor.from_float(rng.standard_normal((rows, cols)).astype(np.float32) * 0.03, "w")
    for ntok in (5, 16, 33):
        x = rng.standard_normal((ntok, cols)).astype(np.float32)
        x *= np.float32(10.0) ** rng.integers(-6, 4, size=(ntok, cols)).astype(np.float32)
        dots = lib.duck_kernels_amx_emulated_dots()
        y = gemm(t, x, kset)
        _check(t, x, y, f"{kset} fp32 ntok {ntok}")
        if kset == "amx-emu":
            assert lib.duck_kernels_amx_emulated_dots() > dots, "the emulated tile program ran"
    x = rng.standard_normal((4, cols)).astype(np.float32)
    assert np.array_equal(gemm(t, x, kset), gemm(t, x, "avx512"))


@pytest.fixture
def invariance_off():
    set_batch_invariant(False)
    yield
    set_batch_invariant(True)


INVARIANT_PARAMS = [pytest.param(n, marks=pytest.mark.skipif(n not in AVAILABLE and n != "ref",
                                                              reason=f"this CPU has no {NEEDS.get(n)}"))
                    for n in BATCH_INVARIANT_SETS]


@pytest.mark.parametrize("kernel_set", INVARIANT_PARAMS)
@pytest.mark.parametrize("shape", [(33, 2500, False), (40, 576, False), (17, 192, False), (9, 64, False),
                                   (33, 2048 + 64, True), (17, 256, True)],
                         ids=["two-panels", "one-panel", "narrow", "one-group", "two-panels-scaled", "scaled"])
def test_a_tokens_bits_do_not_depend_on_the_tokens_beside_it(kernel_set, shape):
    """Batch invariance (on by default): every token of a call of any size, at any place in it,
    gets the bits it gets alone: the one-token GEMV, the 2-4 token GEMVs and the many-token GEMM
    (its tiles of 1-4 tokens, its blocks of 32, odd row pairs at the end) sum a row in one
    order. 41 activations cut into calls of every size from 1 to 41."""
    rows, cols, scaled = shape
    assert batch_invariant()
    rng = np.random.default_rng(rows + cols)
    t = (_fp8_with_block_scales(rows, cols, rng) if scaled
         else Fp9Tensor.from_float(rng.standard_normal((rows, cols)).astype(np.float32) * 0.03, "w"))
    x = rng.standard_normal((41, cols)).astype(np.float32)
    alone = np.concatenate([gemm(t, x[i:i + 1], kernel_set) for i in range(41)])
    _check(t, x, alone, f"{kernel_set} alone")
    for n in list(range(2, 14)) + [31, 32, 33, 41]:
        together = np.concatenate([gemm(t, x[i:i + n], kernel_set) for i in range(0, 41, n)])
        diff = np.argwhere(together != alone)
        assert diff.size == 0, f"{kernel_set}, calls of {n} tokens: {len(diff)} outputs differ, first {diff[0]}"


@pytest.mark.parametrize("kernel_set", [pytest.param(n, marks=pytest.mark.skipif(
    n not in AVAILABLE, reason=f"this CPU has no {NEEDS[n]}")) for n in ("avx2-xor", "avx512", "amx")])
def test_batch_invariance_off_takes_the_faster_gemm(kernel_set, invariance_off):
    """Off, the many-token GEMM is the FMA (or AMX) tile, whose sums follow the token count:
    still within the dot-product tolerance, and the same bits for 1-4 tokens (the GEMVs)."""
    rng = np.random.default_rng(3)
    t = Fp9Tensor.from_float(rng.standard_normal((64, 2048)).astype(np.float32) * 0.03, "w")
    x = rng.standard_normal((32, 2048)).astype(np.float32)
    together = gemm(t, x, kernel_set)
    _check(t, x, together, f"{kernel_set} invariance off")
    alone = np.concatenate([gemm(t, x[i:i + 1], kernel_set) for i in range(32)])
    assert not np.array_equal(together, alone), "the tile GEMM sums in its own order"
    set_batch_invariant(True)
    assert np.array_equal(gemm(t, x, kernel_set), alone)


def _fp8_with_block_scales(rows: int, cols: int, rng: np.random.Generator) -> Fp9Tensor:
    codes = rng.integers(0, 0x7E, size=(rows, cols), dtype=np.uint8)
    codes[:, ::7] |= 0x80                                   # some negative weights
    scale = rng.uniform(1e-3, 5e-3, size=(-(-rows // 128), -(-cols // 128))).astype(np.float32)
    t = Fp9Tensor.from_fp8(codes, scale, "w")
    assert t.has_block_scales                              # scales not powers of two: kept per block
    return t


@pytest.mark.parametrize("kernel_set", FAST_PARAMS)
@pytest.mark.parametrize("block_scales", [False, True], ids=["plain", "block_scales"])
@pytest.mark.parametrize("cols", [64, 128, 192, 2048 + 64])
@pytest.mark.parametrize("rows", [1, 3, 17, 33])
def test_every_set_matches_ref_on_odd_shapes(kernel_set, rows, cols, block_scales):
    """Tokens 1 and 2 (registers), 5 and 64 + 3 (the decode-into-L1 path: full and partial token tiles)."""
    rng = np.random.default_rng(rows * 1000 + cols + block_scales)
    t = (_fp8_with_block_scales(rows, cols, rng) if block_scales
         else Fp9Tensor.from_float(rng.standard_normal((rows, cols)).astype(np.float32) * 0.03, "w"))
    for ntok in (1, 2, 5, 64 + 3):
        x = rng.standard_normal((ntok, cols)).astype(np.float32)
        ref = gemm(t, x, "ref")
        _check(t, x, ref, "ref")
        _check(t, x, gemm(t, x, kernel_set), f"{kernel_set} ntok {ntok}")


@pytest.mark.parametrize("shape", ODD_SHAPES + list(SLICE_SHAPES.values()),
                         ids=[f"{r}x{c}" for r, c in ODD_SHAPES] + list(SLICE_SHAPES))
@pytest.mark.parametrize("ntok", [1, 2, 7])
def test_gemm_avx2_and_ref_match_float64(shape, ntok):
    rng = np.random.default_rng(shape[0] * 7 + shape[1] + ntok)
    t = Fp9Tensor.from_float(rng.standard_normal(shape).astype(np.float32) * 0.03, "w")
    x = rng.standard_normal((ntok, shape[1])).astype(np.float32)
    for kernel_set in ("ref",) + FAST:
        _check(t, x, gemm(t, x, kernel_set), kernel_set)


@pytest.mark.parametrize("kernel_set", FAST_PARAMS)
@pytest.mark.parametrize("ntok", [3, 6, 13, 64, 65])
def test_gemm_batches_match_gemv_per_token(kernel_set, ntok):
    rng = np.random.default_rng(ntok)
    t = Fp9Tensor.from_float(rng.standard_normal((33, 2500)).astype(np.float32), "w")
    x = rng.standard_normal((ntok, 2500)).astype(np.float32)
    batched = gemm(t, x, kernel_set)
    one_by_one = np.concatenate([gemm(t, x[i:i + 1], kernel_set) for i in range(ntok)])
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
    for kernel_set in ("ref",) + FAST:
        y = gemm(t, x, kernel_set)
        assert np.all(y[:, 150:] == 0.0)
        _check(t, x, y, f"padded, {kernel_set}")


@pytest.mark.parametrize("kernel_set", FAST_PARAMS)
@pytest.mark.parametrize("shape", [(301, 4100), (7168 + 66, 192)], ids=["wide", "narrow"])
@pytest.mark.parametrize("ntok", [1, 2, 5])
def test_threaded_matmul_is_identical_to_one_thread(kernel_set, shape, ntok):
    rng = np.random.default_rng(12)
    t = Fp9Tensor.from_float(rng.standard_normal(shape).astype(np.float32), "w")
    x = rng.standard_normal((ntok, shape[1])).astype(np.float32)
    one = gemm(t, x, kernel_set)
    for threads in (1, 2, 3, 5):
        assert np.array_equal(matmul(t, x, Pool(threads), kernel_set=kernel_set), one), threads


def test_bf16_and_fp32_sources_agree_within_bf16_rounding():
    rng = np.random.default_rng(13)
    w32 = rng.standard_normal((64, 256)).astype(np.float32)
    wbf = torch.from_numpy(w32).to(torch.bfloat16)
    t = Fp9Tensor.from_float(wbf, "w")
    x = rng.standard_normal((1, 256)).astype(np.float32)
    _check(t, x, gemm(t, x, "best"), "bf16 source")
