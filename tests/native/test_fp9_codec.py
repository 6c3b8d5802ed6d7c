"""fp9 codec: exact decode of every code, RNE encode, layout, bf16 error
bound, bit-exact fp8 conversion, and refusal of bad input."""
import numpy as np
import pytest
import torch

from native._native import lib
from native.fp9 import Fp9Error, Fp9Tensor
from native.kernels import gemm
from tests.native import fp9_spec

# |decoded - source| <= 2^-4 |source| in the normal range (half an ulp of a
# 3-bit mantissa); below it the step is 2^-17 * prescale, so half of that.
BF16_REL_BOUND = 2.0 ** -4
SUBNORMAL_ABS_BOUND = 2.0 ** -18


def test_all_512_codes_decode_exactly():
    for code in range(256):
        assert lib.fp9_decode(code, 0) == fp9_spec.TABLE[code]
        assert lib.fp9_decode(code, 1) == -fp9_spec.TABLE[code]


def _all_codes_tensor(negative_odd: bool) -> tuple[Fp9Tensor, np.ndarray]:
    """A 2x128 tensor holding each code once, built byte by byte from the spec."""
    data = bytearray(fp9_spec.pack(np.zeros((2, 128))))
    values = np.zeros((2, 128))
    for g in range(2):
        block = 64 + g * 144
        signs = [0, 0]
        for r in range(2):
            for c in range(64):
                code = (2 * g + r) * 64 + c
                neg = (code % 2 == 1) == negative_odd
                data[block + 16 + r * 64 + c] = code
                signs[r] |= int(neg) << c
                values[r, 64 * g + c] = -fp9_spec.TABLE[code] if neg else fp9_spec.TABLE[code]
        data[block:block + 16] = signs[0].to_bytes(8, "little") + signs[1].to_bytes(8, "little")
    return Fp9Tensor.from_bytes(bytes(data)), values


@pytest.mark.parametrize("negative_odd", [True, False])
def test_every_code_and_sign_through_unpack_and_kernels(negative_odd):
    t, values = _all_codes_tensor(negative_odd)
    assert np.array_equal(t.to_float().astype(np.float64), values)
    eye = np.eye(128, dtype=np.float32)
    for kernel_set in ("ref", "avx2-xor", "avx2-blend"):
        # each unit vector picks one weight: the kernels must decode it exactly
        assert np.array_equal(gemm(t, eye, kernel_set).T.astype(np.float64), values), kernel_set


def test_encode_is_rne_and_saturating():
    rng = np.random.default_rng(1)
    table = fp9_spec.TABLE
    mids = (table[:-1] + table[1:]) / 2          # exact ties
    randoms = np.exp2(rng.uniform(-20, 18, size=20000))
    near = table[rng.integers(0, 256, 2000)] * (1 + rng.uniform(-0.07, 0.07, 2000))
    mags = np.concatenate([mids, randoms, near, [0.0, 2.0 ** -18, 2.0 ** -17, 130000.0, 1e30]])
    mags = mags.astype(np.float32).astype(np.float64)   # what fp32 can carry
    got = np.array([lib.fp9_encode_rne(float(v)) for v in mags])
    assert np.array_equal(got, fp9_spec.encode(mags))


def test_pack_f32_is_rne_against_spec_with_unit_prescale():
    rng = np.random.default_rng(2)
    w = np.exp2(rng.uniform(-18, 15, size=(64, 512))) * rng.choice([-1, 1], size=(64, 512))
    w[0, 0] = 2.0 ** 15                          # pins the prescale to 1
    w = w.astype(np.float32)
    t = Fp9Tensor.from_float(w, "w")
    assert t.prescale == 1.0
    want = fp9_spec.TABLE[fp9_spec.encode(np.abs(w.astype(np.float64)))] * np.sign(w)
    assert np.array_equal(t.to_float().astype(np.float64), want)


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (5, 4100), (128, 2048), (7, 130)])
def test_packed_bytes_follow_the_spec_layout(shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    assert Fp9Tensor.from_float(w, "w").to_bytes() == fp9_spec.pack(w.astype(np.float64))


def test_bf16_rounding_error_is_bounded():
    rng = np.random.default_rng(3)
    w = torch.from_numpy(rng.standard_normal((257, 999)).astype(np.float32) * 0.05).to(torch.bfloat16)
    w[0, :50] = torch.tensor(np.exp2(-np.arange(50.0)) * 0.05)     # a tail reaching the subnormals
    t = Fp9Tensor.from_float(w, "w")
    src = w.float().numpy().astype(np.float64)
    err = np.abs(t.to_float() - src)
    normal = np.abs(src) >= t.prescale * 2.0 ** -14
    assert normal.sum() > 0.99 * src.size
    assert np.all(err[normal] <= BF16_REL_BOUND * np.abs(src[normal]))
    assert np.all(err[~normal] <= SUBNORMAL_ABS_BOUND * t.prescale)


def test_fp8_decode_matches_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float().numpy()
    out = np.zeros(1, dtype=np.float32)
    from native._native import ffi
    p = ffi.new("float *")
    for c in range(256):
        rc = lib.fp8_e4m3_to_f32(c, p)
        if np.isnan(ref[c]):
            assert rc != 0
        else:
            assert rc == 0 and p[0] == ref[c] == fp9_spec.e4m3_value(c), c
    del out


def _fp8_codes(rows, cols, rng):
    codes = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C          # no NaN codes
    return codes


def _dequant(codes, scale_inv):
    vals = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
    s = np.repeat(np.repeat(scale_inv.astype(np.float64), 128, 0), 128, 1)[:codes.shape[0], :codes.shape[1]]
    return (vals * s).astype(np.float32)     # the fp32 product is exact for power-of-two scales


def test_every_e4m3_value_times_power_of_two_converts_bit_exactly():
    all_codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    codes = np.resize(all_codes, (2, 256))
    for k in range(-40, 41, 3):
        scale = np.full((1, 2), 2.0 ** k, dtype=np.float32)
        t = Fp9Tensor.from_fp8(codes, scale, f"k={k}")
        assert not t.has_block_scales
        assert np.array_equal(t.to_float(), _dequant(codes, scale)), k


def test_fp8_ue8m0_blocks_fold_into_prescale_with_short_last_block():
    rng = np.random.default_rng(4)
    codes = _fp8_codes(200, 300, rng)          # 2 x 3 blocks, the last ones short
    scale = np.exp2(rng.integers(-12, -6, size=(2, 3))).astype(np.float32)
    t = Fp9Tensor.from_fp8(codes, scale, "w")
    assert not t.has_block_scales
    assert np.array_equal(t.to_float(), _dequant(codes, scale))


def test_fp8_wide_scale_spread_keeps_block_scales_and_stays_exact():
    rng = np.random.default_rng(5)
    codes = _fp8_codes(256, 256, rng)
    scale = np.array([[2.0 ** -30, 2.0 ** 10], [1.0, 2.0 ** -5]], dtype=np.float32)
    t = Fp9Tensor.from_fp8(codes, scale, "w")
    assert t.has_block_scales
    assert np.array_equal(t.to_float(), _dequant(codes, scale))


def test_fp8_non_power_of_two_scales_use_block_scales():
    rng = np.random.default_rng(6)
    codes = _fp8_codes(130, 129, rng)
    scale = rng.uniform(1e-4, 3e-3, size=(2, 2)).astype(np.float32)
    t = Fp9Tensor.from_fp8(codes, scale, "w")
    assert t.has_block_scales
    vals = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    s = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:130, :129]
    assert np.array_equal(t.to_float(), vals * s)


def test_nan_and_inf_are_refused_with_the_tensor_named():
    w = np.ones((4, 70), dtype=np.float32)
    w[2, 65] = np.nan
    with pytest.raises(Fp9Error, match=r"model.layers.3.mlp.up_proj.weight.*NaN or Inf at \[2, 65\]"):
        Fp9Tensor.from_float(w, "model.layers.3.mlp.up_proj.weight")
    w[2, 65] = np.inf
    with pytest.raises(Fp9Error, match="NaN or Inf"):
        Fp9Tensor.from_float(torch.from_numpy(w).to(torch.bfloat16), "w")
    codes = np.zeros((3, 3), dtype=np.uint8)
    codes[1, 2] = 0x7F
    with pytest.raises(Fp9Error, match=r"fp8 NaN code at \[1, 2\]"):
        Fp9Tensor.from_fp8(codes, np.ones((1, 1), dtype=np.float32), "w")
    with pytest.raises(Fp9Error, match="weight_scale_inv has shape"):
        Fp9Tensor.from_fp8(codes, np.ones((2, 2), dtype=np.float32), "w")
    with pytest.raises(Fp9Error, match="block scale"):
        Fp9Tensor.from_fp8(codes, np.zeros((1, 1), dtype=np.float32), "w")


def test_malformed_serialized_tensors_are_refused():
    good = Fp9Tensor.from_float(np.ones((3, 5), dtype=np.float32), "w").to_bytes()
    assert Fp9Tensor.from_bytes(good).to_bytes() == good
    bad_magic = b"XXXX" + good[4:]
    reserved = good[:40] + b"\x01" + good[41:]
    huge = good[:8] + (1 << 30).to_bytes(4, "little") + good[12:]
    for name, data in [("magic", bad_magic), ("truncated", good[:-1]), ("reserved", reserved),
                       ("rows", huge), ("empty", b"")]:
        with pytest.raises(Fp9Error, match="not a valid fp9 tensor"):
            Fp9Tensor.from_bytes(data, name)


def test_digest_is_content_addressed():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    a, b = Fp9Tensor.from_float(w, "a"), Fp9Tensor.from_float(w.copy(), "b")
    assert a.digest() == b.digest()
    w[0, 0] += 1.0
    assert Fp9Tensor.from_float(w, "c").digest() != a.digest()
