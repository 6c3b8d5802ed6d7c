"""The native decoder's fp32 kernels (native/host/), with fp32 or float16
weights: AVX2 and AVX-512 against the scalar reference against float64, on odd sizes, with NaN-poisoned outputs and
NaN padding beside every row (a kernel writing past its output or reading past
its input shows as NaN)."""
import numpy as np
import pytest

from native.host import ops
from native.kernels import Pool

# Error of an fp32 sum of K products, relative to sum |w| |x|: the sets sum in
# different orders (one scalar chain; 8 or 16 lanes), all far below K * 2^-24.
DOT_REL_TOL = 4e-6

FAST = ("avx2", "avx512")
SETS = ("ref",) + FAST
KS = [1, 3, 17, 33, 576]
NS = [1, 5, 4099]          # 4099: the lm_head's 49152 rows cut down, not a multiple of the 4-row block
TS = [1, 2, 3]


def kernel_set(name: str) -> str:
    """name, or a skip saying which instructions this CPU lacks."""
    if not ops.available(name):
        pytest.skip(f"this CPU lacks the instructions of the {name} host kernels "
                    f"({'AVX-512F' if name == 'avx512' else 'AVX2 and FMA'}): not testable here")
    return name


def _check_rel(y: np.ndarray, exact: np.ndarray, scale: np.ndarray, what: str, tol: float = DOT_REL_TOL):
    assert np.all(np.isfinite(y)), f"{what}: unwritten (NaN) or non-finite outputs"
    err = float(np.max(np.abs(y - exact) / (scale + 1e-30)))
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _data(*shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_the_best_set_is_the_widest_this_cpu_runs():
    best = ops.kernels_name(ops.host_kernels("best"))
    assert best == next(s for s in ("avx512", "avx2", "ref") if ops.available(s))


def test_unknown_set_is_named():
    with pytest.raises(ValueError, match="unknown host kernel set 'sse9'"):
        ops.host_kernels("sse9")


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("t", TS)
def test_gemm_matches_float64(name, n, k, t):
    w, x = _data(n, k, seed=n * 1000 + k), _data(t, k, seed=k + t)
    y = ops.kernel_gemm(w, x, kernel_set(name), pad=3)
    assert np.all(np.isnan(y[:, n:])), f"{name}: wrote past the output rows"
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    _check_rel(y[:, :n], x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, f"{name} gemm {t}x{k} by {n}x{k}")


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("k", KS)
def test_fast_gemm_agrees_with_ref(name, k):
    w, x = _data(37, k, seed=k), _data(3, k, seed=k + 1)
    fast, ref = ops.kernel_gemm(w, x, kernel_set(name)), ops.kernel_gemm(w, x, "ref")
    w64, x64 = np.abs(w.astype(np.float64)), np.abs(x.astype(np.float64))
    _check_rel(fast, ref, x64 @ w64.T, f"{name} vs ref", 2 * DOT_REL_TOL)


def _kernel_gemm_h(w16: np.ndarray, x: np.ndarray, name: str, pad: int = 0) -> np.ndarray:
    """The kernel table's gemm_h on this thread over w16 packed (ops.pack_half), x's rows
    `pad` NaN floats longer than K: y [T, N + pad] (the pad must stay NaN)."""
    n, k = w16.shape
    packed, x = ops.pack_half(w16), ops._padded(x, pad)
    y = ops._poisoned((x.shape[0], n + pad))
    ops.host_kernels(name).gemm_h(ops._ptr(packed, "uint16_t *"), k, n, k, x.shape[0], ops._ptr(x), x.shape[1],
                                  ops._ptr(y), y.shape[1])
    return y


def test_half_weights_pack_into_panels_of_sixteen_rows():
    """Panel p holds rows 16p .. 16p + 15 column by column; the last panel's missing rows are zero."""
    w = np.arange(37 * 5, dtype=np.float16).reshape(37, 5)
    packed = ops.pack_half(w).reshape(3, 5, 16)
    padded = np.zeros((48, 5), dtype=np.float16)
    padded[:37] = w
    assert np.array_equal(packed, padded.reshape(3, 16, 5).transpose(0, 2, 1))
    with pytest.raises(ValueError, match=r"out is 7 float16 halves, \[37, 5\] packs into 240"):
        ops.pack_half(w, np.empty(7, dtype=np.float16))


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n, k", [(1, 1), (5, 17), (37, 33), (1027, 576), (64, 1500)])
@pytest.mark.parametrize("t", [1, 2, 3, 5, 7, 13, 40])
def test_half_weights_match_float64(name, n, k, t):
    """gemm_h (the decoder's projections and lm_head) on packed float16 weights, against the
    products in float64: every token-tile size, rows past the last panel's, no write past the
    output rows."""
    w16, x = _data(n, k, seed=n + k).astype(np.float16), _data(t, k, seed=t)
    y = _kernel_gemm_h(w16, x, kernel_set(name), pad=3)
    assert np.all(np.isnan(y[:, n:])), f"{name}: gemm_h wrote past the output rows"
    w64, x64 = w16.astype(np.float64), x.astype(np.float64)
    _check_rel(y[:, :n], x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, f"{name} gemm_h {t}x{k} by {n}x{k}")


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("threads", [1, 3])
def test_half_weights_give_a_token_the_same_bits_alone_and_in_a_batch(name, threads):
    """Each (row, token) sum of gemm_h is one chain over the columns: a token alone, in a
    batch of any size, pooled or not, gets the same bits (a request's tokens do not depend
    on who shares its step)."""
    w16, x = _data(1027, 576, seed=3).astype(np.float16), _data(40, 576, seed=4)
    alone = np.concatenate([_kernel_gemm_h(w16, x[i:i + 1], kernel_set(name)) for i in range(40)])
    for t in (2, 3, 6, 13, 40):
        assert np.array_equal(ops.gemm(w16, x[:t], name, Pool(threads, pin=False)), alone[:t]), t


@pytest.mark.parametrize("name", SETS)
def test_half_weights_agree_with_the_widened_fp32_gemm(name):
    w16, x = _data(1027, 576, seed=5).astype(np.float16), _data(7, 576, seed=6)
    wide = ops.kernel_gemm(w16.astype(np.float32), x, kernel_set(name))
    w64, x64 = np.abs(w16.astype(np.float64)), np.abs(x.astype(np.float64))
    _check_rel(ops.gemm(w16, x, name), wide, x64 @ w64.T, f"{name} gemm_h vs gemm", 2 * DOT_REL_TOL)


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pooled_gemm_is_identical_to_one_thread(name, threads):
    """Rows are split between workers; each (row, token) sum is formed the same way."""
    w, x = _data(4099, 576, seed=1), _data(3, 576, seed=2)
    one = ops.kernel_gemm(w, x, kernel_set(name))
    assert np.array_equal(ops.gemm(w, x, name, Pool(threads, pin=False)), one)
    assert np.array_equal(ops.gemm(w, x, name), one)


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", [1, 3, 17, 33, 576])
def test_dot_matches_float64(name, n):
    a, b = _data(n, seed=n), _data(n, seed=n + 1)
    exact = float(a.astype(np.float64) @ b.astype(np.float64))
    scale = float(np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    _check_rel(np.float32(ops.dot(a, b, kernel_set(name))), exact, scale, f"{name} dot {n}")


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", [1, 3, 17, 33, 64, 65, 200])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gemv_t_matches_float64(name, n, rows):
    p, v = np.abs(_data(rows, seed=rows)), _data(rows, n, seed=n)
    y = ops.gemv_t(p, v, kernel_set(name), pad=5)
    assert np.all(np.isnan(y[n:])), f"{name}: wrote past the output"
    p64, v64 = p.astype(np.float64), v.astype(np.float64)
    _check_rel(y[:n], p64 @ v64, p64 @ np.abs(v64), f"{name} gemv_t {rows}x{n}")


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", [1, 7, 64, 65, 200])
@pytest.mark.parametrize("rows", [1, 74, 300])
def test_gemv_t_h_is_gemv_t_on_the_values_widened(name, n, rows):
    """Over a half cache's values: the same chains, so the same bits as gemv_t on them widened."""
    p, v = np.abs(_data(rows, seed=rows)), _data(rows, n, seed=n).astype(np.float16)
    y = ops.gemv_t_h(p, v, kernel_set(name), pad=5)
    assert np.all(np.isnan(y[n:])), f"{name}: wrote past the output"
    assert np.array_equal(y[:n], ops.gemv_t(p, v.astype(np.float32), kernel_set(name))[:n])


@pytest.mark.parametrize("name", SETS)
def test_to_half_rounds_as_numpy_does(name):
    """The half cache's writes: nearest, ties to even, beyond 65504 infinity, subnormals,
    signed zeros; bit for bit what numpy's float16 conversion gives."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20000) * np.exp2(rng.uniform(-30, 18, 20000))).astype(np.float32)
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = ((halves[:-1] + halves[1:]) / 2).astype(np.float32)     # midpoints between neighbours, exact in fp32
    edges = np.array([0.0, -0.0, 65504, 65519.996, 65520, -65520, 1e30, -np.inf, np.inf, 2.0 ** -25,
                      2.0 ** -24, 3 * 2.0 ** -26, 6.1e-5, -6.1e-5], np.float32)
    x = np.concatenate([x, ties, -ties, edges])
    got = ops.to_half(x, kernel_set(name))
    with np.errstate(over="ignore"):   # beyond 65504 numpy says so while it gives infinity, as it should
        want = x.astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.isnan(ops.to_half(np.array([np.nan], np.float32), kernel_set(name))).all()


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 100, 49152])
def test_argmax_is_torchs(name, n):
    """The greedy token: the first of equal maxima, the first NaN where there is one, every
    position of the maximum (vectors and tail), all -inf; what torch.argmax answers."""
    import torch

    rng = np.random.default_rng(n)
    cases = [rng.standard_normal(n).astype(np.float32), np.full(n, -np.inf, np.float32),
             np.zeros(n, np.float32), np.round(rng.standard_normal(n)).astype(np.float32)]
    for at in sorted({0, n // 2, n - 1}):
        x = rng.standard_normal(n).astype(np.float32)
        x[at] = 100.0
        cases.append(x)
        y = x.copy()
        y[at] = np.nan
        y[-1] = np.nan
        cases.append(y)
    signed = np.zeros(n, np.float32)
    signed[: n // 2] = -0.0
    cases.append(signed)
    for x in cases:
        assert ops.argmax(x, kernel_set(name)) == int(torch.from_numpy(x).argmax()), x[:8]


# exp of the vector sets (a polynomial) against float64: Cephes' bound is 2 ulp.
EXP_REL_TOL = 3e-7


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", [1, 3, 8, 9, 17, 64, 100, 1027])
def test_softmax_exp_matches_float64(name, n):
    """Attention's softmax numerators: exp(scale s - max) and their sum, every tail length;
    scores spread wide enough that some of them underflow beside the largest."""
    s = _data(n, seed=n) * 40.0
    out, total = ops.softmax_exp(s, 0.125, kernel_set(name), pad=3)
    assert np.all(np.isnan(out[n:])), f"{name}: wrote past the scores"
    x = s * np.float32(0.125)                      # the arguments as the kernel rounds them (fp32)
    exact = np.exp((x - x.max()).astype(np.float64))
    err = np.abs(out[:n] - exact) - EXP_REL_TOL * exact
    assert np.all(np.isfinite(out[:n])) and float(err.max()) <= 2e-38, f"{name}: exp off by {float(err.max()):.3g}"
    assert abs(total - exact.sum()) <= n * 2.0 ** -24 * exact.sum()   # one fp32 sum of n terms
    assert out[int(np.argmax(x))] == 1.0


@pytest.mark.parametrize("n", [5, 300])
def test_fast_softmax_exp_agrees_with_ref(n):
    """The vector sets' exp against expf (the reference), within their bound."""
    s = _data(n, seed=7) * 8.0
    ref, ref_sum = ops.softmax_exp(s, 0.3, "ref")
    for name in FAST:
        if ops.available(name):
            fast, fast_sum = ops.softmax_exp(s, 0.3, name)
            assert np.allclose(fast, ref, rtol=2 * EXP_REL_TOL, atol=0), name
            assert abs(fast_sum - ref_sum) <= n * 2.0 ** -24 * ref_sum, name



@pytest.mark.parametrize("n, k", [(5, 17), (37, 33), (1027, 576), (300, 1500), (48, 64)])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 11, 12, 13, 32, 40])
def test_half_weights_avx512_tiles_give_the_avx2_bits(n, k, t):
    """AVX-512's gemm_h (a panel per vector, tiles of up to four panels by twelve tokens, eight
    panels for one token) forms each (row, token) sum as the AVX2 set's one chain over the
    columns: the same bits for every tile shape and tail, so which set a host runs does not
    change its tokens."""
    w16, x = _data(n, k, seed=n * k + t).astype(np.float16), _data(t, k, seed=t + 7)
    wide = _kernel_gemm_h(w16, x, kernel_set("avx512"), pad=5)
    assert np.all(np.isnan(wide[:, n:])), "avx512: gemm_h wrote past the output rows"
    assert np.array_equal(wide, _kernel_gemm_h(w16, x, kernel_set("avx2"), pad=5), equal_nan=True)
