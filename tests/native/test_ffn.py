"""MLP / MoE slice forward against a torch float64 implementation of the same
math on the same (decoded) weights."""
import threading
import time

import numpy as np
import pytest
import torch

from native._native import lib
from native.fp9 import Fp9Error, Fp9Tensor, pack_gate_up
from native.kernels import BATCH_INVARIANT_SETS, MAX_TOKENS, ExpertSlice, MoeSlice, Pool, Workspace, kernels_available

# Relative to the output's scale (max |y| of the float64 result): the fp32
# kernels and the fp32 silu stay well inside this.
FFN_REL_TOL = 1e-5


def make_experts(n, hidden, width, rng, active_rows=None):
    """n expert slices of `width` intermediate units; rows past active_rows are
    the zero padding of a slice whose size does not divide evenly."""
    experts, dense = [], []
    for i in range(n):
        gate = rng.standard_normal((width, hidden)).astype(np.float32) * 0.05
        up = rng.standard_normal((width, hidden)).astype(np.float32) * 0.05
        down = rng.standard_normal((hidden, width)).astype(np.float32) * 0.05
        if active_rows is not None:
            gate[active_rows:] = up[active_rows:] = 0.0
            down[:, active_rows:] = 0.0
        e = ExpertSlice(Fp9Tensor.from_float(pack_gate_up(gate, up), f"e{i}.gate_up"),
                        Fp9Tensor.from_float(down, f"e{i}.down"))
        gu = torch.from_numpy(e.gate_up.to_float()).double()
        dense.append((gu[0::2], gu[1::2], torch.from_numpy(e.down.to_float()).double()))
        experts.append(e)
    return experts, dense


def torch_moe(dense, x, ids, weights, h_bf16=False):
    """y[t] = sum_k w[t,k] * down(silu(gate x) * up x) in float64; h_bf16: the intermediate
    rounded to bf16, as the slice does on bf16 activations (a bf16 model's own precision)."""
    x = torch.from_numpy(x).double()                          # [T, H]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            if e < 0:
                continue
            gate, up, down = dense[e]
            h = torch.nn.functional.silu(gate @ x[t]) * (up @ x[t])   # [S]
            if h_bf16:
                h = h.float().to(torch.bfloat16).double()
            y[t] += float(w) * (down @ h)                             # [H]
    return y.numpy()


def _assert_close(y, ref, what, tol=FFN_REL_TOL):
    err = np.max(np.abs(y - ref)) / np.max(np.abs(ref))
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


# bf16 activations: h is rounded to bf16, and an h within a few fp32 ulps of a rounding midpoint
# (one in ~10^4 of them) rounds either way by the last bits of its gate and up sums, which no two
# orders of summation share; such a flip moves its token's whole output by |down| x one bf16 ulp
# (2^-8 of h): 1.9e-5 of the largest output, seen on AMX tiles against the float64 reference.
BF16_FLIP_TOL = 1e-4


@pytest.mark.parametrize("ntok", [1, 64, 320])   # 320: a prefill chunk, ~64 tokens per expert (the GEMM)
@pytest.mark.parametrize("shape", [("deepseek_v3", 7168, 64, 24), ("qwen3_30b_a3b", 2048, 64, 40)])
def test_moe_slice_matches_torch(shape, ntok):
    name, hidden, width, n_experts = shape
    rng = np.random.default_rng(ntok + hidden)
    experts, dense = make_experts(n_experts, hidden, width, rng)
    layer = MoeSlice(experts, hidden, name)
    x = rng.standard_normal((ntok, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(n_experts, size=8, replace=False) for _ in range(ntok)]).astype(np.int32)
    ids[0, 3] = -1                                   # an empty slot is skipped
    weights = rng.uniform(0.05, 0.3, size=ids.shape).astype(np.float32)
    y = layer.forward(x, ids, weights, Pool(2))
    _assert_close(y, torch_moe(dense, x, ids, weights), name)
    assert layer.bytes_streamed > 0


def test_padded_tp_slices_sum_to_the_whole_mlp():
    """intermediate 768 over tp=5 slices of 192 (a multiple of 64): the last
    slice is part zero; the sum of the partials is the unsliced MLP."""
    rng = np.random.default_rng(21)
    hidden, inter, tp, width = 256, 768, 5, 192
    gate = rng.standard_normal((inter, hidden)).astype(np.float32) * 0.05
    up = rng.standard_normal((inter, hidden)).astype(np.float32) * 0.05
    down = rng.standard_normal((hidden, inter)).astype(np.float32) * 0.05
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    total, ref = np.zeros((3, hidden), dtype=np.float32), np.zeros((3, hidden))
    for s in range(tp):
        rows = slice(s * width, min((s + 1) * width, inter))
        g, u, d = (np.zeros((width, hidden), np.float32), np.zeros((width, hidden), np.float32),
                   np.zeros((hidden, width), np.float32))
        n = rows.stop - rows.start
        g[:n], u[:n], d[:, :n] = gate[rows], up[rows], down[:, rows]
        e = ExpertSlice(Fp9Tensor.from_float(pack_gate_up(g, u)), Fp9Tensor.from_float(d))
        total += MoeSlice([e], hidden).forward(x, np.zeros((3, 1)), np.ones((3, 1)))
        gu = torch.from_numpy(e.gate_up.to_float()).double()
        ref += torch_moe([(gu[0::2], gu[1::2], torch.from_numpy(e.down.to_float()).double())], x,
                         np.zeros((3, 1), int), np.ones((3, 1)))
    assert tp * width - inter == 192 and rows.stop - rows.start == 0   # the 5th slice is all padding
    _assert_close(total, ref, "tp=5 padded")


KERNEL_SETS = [pytest.param(n, marks=pytest.mark.skipif(n not in kernels_available(), reason=f"this CPU has no {n}"))
               for n in ("ref", "avx2", "avx512")]


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("hidden", [200, 512])      # 200: gate/up rows take the narrow kernel too
def test_thread_count_does_not_change_a_bit(kernel_set, threads, hidden):
    rng = np.random.default_rng(22)
    experts, _ = make_experts(6, hidden, 128, rng)
    layer = MoeSlice(experts, hidden)
    x = rng.standard_normal((5, hidden)).astype(np.float32)
    ids = rng.integers(0, 6, size=(5, 3)).astype(np.int32)
    w = rng.uniform(size=(5, 3)).astype(np.float32)
    assert np.array_equal(layer.forward(x, ids, w, Pool(threads), kernel_set=kernel_set),
                          layer.forward(x, ids, w, None, kernel_set=kernel_set))


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("ntok", [1, 2, 5])
def test_decode_shape_is_cut_into_pieces_and_stays_exact(kernel_set, ntok):
    """Qwen3-30B-A3B on one of four ducks (H 2048, S 192, top-8): each phase is
    many pieces that the threads claim; any thread count gives the same bits,
    every call, and matches float64."""
    rng = np.random.default_rng(30 + ntok)
    experts, dense = make_experts(12, 2048, 192, rng)
    layer = MoeSlice(experts, 2048)
    x = rng.standard_normal((ntok, 2048)).astype(np.float32)
    ids = np.stack([rng.choice(12, size=8, replace=False) for _ in range(ntok)]).astype(np.int32)
    w = rng.uniform(0.05, 0.3, size=ids.shape).astype(np.float32)
    one = layer.forward(x, ids, w, None, kernel_set=kernel_set)
    _assert_close(one, torch_moe(dense, x, ids, w), kernel_set)
    for threads in (2, 3, 4):
        pool, ws = Pool(threads), Workspace()
        for _ in range(20):
            assert np.array_equal(layer.forward(x, ids, w, pool, ws, kernel_set=kernel_set), one), threads


INVARIANT_SETS = [pytest.param(n, marks=pytest.mark.skipif(n not in kernels_available(), reason=f"this CPU has no {n}"))
                  for n in BATCH_INVARIANT_SETS]


@pytest.mark.parametrize("kernel_set", INVARIANT_SETS)
def test_a_tokens_output_is_the_same_alone_and_in_a_batch(kernel_set):
    """Batch invariance (fp32 activations, on by default): a token's MoE output is the same
    bits whichever tokens share the call, though they change how many tokens each of its
    experts takes (1 alone, up to 40 here: every GEMV and the many-token GEMM) and the
    threads split the work: what makes a sequence's text the same alone and among others."""
    rng = np.random.default_rng(41)
    experts, _ = make_experts(8, 576, 192, rng)
    layer = MoeSlice(experts, 576)
    x = rng.standard_normal((48, 576)).astype(np.float32)
    ids = np.stack([rng.choice(8, size=4, replace=False) for _ in range(48)]).astype(np.int32)
    w = rng.uniform(0.05, 0.3, size=ids.shape).astype(np.float32)
    pool = Pool(2)
    alone = np.concatenate([layer.forward(x[i:i + 1], ids[i:i + 1], w[i:i + 1], None, kernel_set=kernel_set)
                            for i in range(48)])
    for n in (2, 5, 7, 16, 48):
        together = np.concatenate([layer.forward(x[i:i + n], ids[i:i + n], w[i:i + n], pool, kernel_set=kernel_set)
                                   for i in range(0, 48, n)])
        assert np.array_equal(together, alone), f"{kernel_set}, {n} tokens a call"


def _bf16_bits(y: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does."""
    return torch.from_numpy(y).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("x_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("out_kind", ["numpy-fp32", "torch-fp32", "numpy-bf16", "torch-bf16"])
def test_output_dtypes_write_into_out(x_dtype, out_kind):
    rng = np.random.default_rng(27)
    experts, dense = make_experts(4, 320, 64, rng)
    layer = MoeSlice(experts, 320)
    x32 = rng.standard_normal((3, 320)).astype(np.float32)
    x = x32 if x_dtype == "fp32" else torch.from_numpy(x32).to(torch.bfloat16)
    ids, w = np.array([[0, 2], [1, -1], [3, 0]]), np.array([[0.5, 0.5], [1.0, 0.0], [0.3, 0.7]], dtype=np.float32)
    y32 = layer.forward(x, ids, w, Pool(2))
    x_used = x32 if x_dtype == "fp32" else x.float().numpy()
    _assert_close(y32, torch_moe(dense, x_used, ids, w, h_bf16=x_dtype == "bf16"), f"{x_dtype} in")
    out = {"numpy-fp32": lambda: np.full((3, 320), np.nan, np.float32),
           "torch-fp32": lambda: torch.full((3, 320), float("nan")),
           "numpy-bf16": lambda: np.full((3, 320), 0xFFFF, np.uint16),
           "torch-bf16": lambda: torch.full((3, 320), float("nan"), dtype=torch.bfloat16)}[out_kind]()
    assert layer.forward(x, ids, w, Pool(2), out=out) is out
    got = out if isinstance(out, np.ndarray) else out.view(torch.int16).numpy().view(np.uint16) \
        if out.dtype == torch.bfloat16 else out.numpy()
    if out_kind.endswith("bf16"):   # summed in fp32, rounded once: exactly the fp32 result rounded
        assert np.array_equal(got, _bf16_bits(y32))
    else:
        assert np.array_equal(got, y32)


def test_bf16_output_of_many_tokens_is_chunked_into_the_same_array():
    rng = np.random.default_rng(28)
    experts, _ = make_experts(3, 128, 64, rng)
    layer = MoeSlice(experts, 128)
    n = MAX_TOKENS + 6
    x = rng.standard_normal((n, 128)).astype(np.float32)
    ids, w = rng.integers(0, 3, size=(n, 2)), rng.uniform(size=(n, 2)).astype(np.float32)
    out = torch.empty((n, 128), dtype=torch.bfloat16)
    layer.forward(x, ids, w, out=out)
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), _bf16_bits(layer.forward(x, ids, w)))


def test_bad_out_is_named():
    rng = np.random.default_rng(29)
    experts, _ = make_experts(2, 128, 64, rng)
    layer = MoeSlice(experts, 128, "layers.3.mlp")
    args = (np.ones((2, 128), np.float32), np.zeros((2, 1)), np.ones((2, 1)))
    with pytest.raises(Fp9Error, match=r"layers.3.mlp: out= must be a writable C-contiguous array of shape \(2, 128\)"):
        layer.forward(*args, out=np.zeros((2, 127), np.float32))
    with pytest.raises(Fp9Error, match="out= has dtype float64"):
        layer.forward(*args, out=np.zeros((2, 128)))
    with pytest.raises(Fp9Error, match="contiguous CPU tensor"):
        layer.forward(*args, out=torch.zeros((128, 2)).t())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_big_calls_sum_is_cut_over_the_threads_without_changing_a_bit(dtype):
    """256 tokens x top-4 x hidden 1024 (1M floats of partials): the reduction runs in a
    block of rows per thread (ffn.c DUCK_FFN_REDUCE_SPLIT); any thread count, the same bits,
    as close to torch as ever."""
    rng = np.random.default_rng(31)
    experts, dense = make_experts(6, 1024, 64, rng)
    layer = MoeSlice(experts, 1024)
    x32 = rng.standard_normal((256, 1024)).astype(np.float32)
    x = x32 if dtype == "fp32" else torch.from_numpy(x32).to(torch.bfloat16)
    ids = rng.integers(0, 6, size=(256, 4)).astype(np.int32)
    w = rng.uniform(size=(256, 4)).astype(np.float32)
    y = layer.forward(x, ids, w)
    x_used = x32 if dtype == "fp32" else x.float().numpy()
    _assert_close(y, torch_moe(dense, x_used, ids, w, h_bf16=dtype == "bf16"), f"{dtype} x, 1M partials",
                  FFN_REL_TOL if dtype == "fp32" else BF16_FLIP_TOL)
    for threads in (2, 3, 4):
        assert np.array_equal(y, layer.forward(x, ids, w, Pool(threads))), f"{threads} threads changed bits"


def test_bf16_activations():
    rng = np.random.default_rng(23)
    experts, dense = make_experts(3, 320, 64, rng)
    x = torch.from_numpy(rng.standard_normal((2, 320)).astype(np.float32)).to(torch.bfloat16)
    ids, w = np.array([[0, 2], [1, -1]]), np.array([[0.5, 0.5], [1.0, 0.0]], dtype=np.float32)
    y = MoeSlice(experts, 320).forward(x, ids, w)
    _assert_close(y, torch_moe(dense, x.float().numpy(), ids, w, h_bf16=True), "bf16 x")


@pytest.mark.parametrize("kset", [pytest.param(k, marks=pytest.mark.skipif(k not in kernels_available(),
                                                                           reason=f"this CPU lacks the {k} set"))
                                  for k in ("avx512-bf16", "amx-emu", "amx")])
def test_bf16_activations_of_a_prefill_take_the_bf16_gemm(kset):
    """24 tokens over 3 experts (a GEMM per expert): bf16 activations go through the bf16 dot
    products (VDPBF16PS, or AMX tiles: other sums than avx512's, as close to torch); fp32 ones
    through avx512's FMAs bit for bit on avx512-bf16, on the tiles in three exact bf16 parts on
    amx (as close to torch as the FMAs); threads change no bit of either."""
    rng = np.random.default_rng(25)
    experts, dense = make_experts(3, 320, 64, rng)
    layer = MoeSlice(experts, 320)
    x = torch.from_numpy(rng.standard_normal((24, 320)).astype(np.float32)).to(torch.bfloat16)
    ids = rng.integers(0, 3, size=(24, 2)).astype(np.int32)
    w = rng.uniform(size=(24, 2)).astype(np.float32)
    dots = lib.duck_kernels_amx_emulated_dots()
    y = layer.forward(x, ids, w, kernel_set=kset)
    _assert_close(y, torch_moe(dense, x.float().numpy(), ids, w, h_bf16=True), "bf16 x, bf16 GEMM")
    if kset == "amx-emu":   # the emulated tile program ran
        assert lib.duck_kernels_amx_emulated_dots() > dots
    elif kset == "avx512-bf16":   # (VDPBF16PS sums a pair in its own order)
        assert not np.array_equal(y, layer.forward(x, ids, w, kernel_set="avx512")), "the bf16 GEMM ran"
    assert np.array_equal(y, layer.forward(x, ids, w, Pool(2), kernel_set=kset))
    x32 = x.float().numpy() + np.float32(1e-3)   # no longer bf16 values
    y32 = layer.forward(x32, ids, w, kernel_set=kset)
    if kset == "avx512-bf16":
        assert np.array_equal(y32, layer.forward(x32, ids, w, kernel_set="avx512"))
    else:
        _assert_close(y32, torch_moe(dense, x32, ids, w), "fp32 x, three bf16 parts")
        assert np.array_equal(y32, layer.forward(x32, ids, w, Pool(2), kernel_set=kset))


def test_no_active_expert_gives_zeros():
    rng = np.random.default_rng(24)
    experts, _ = make_experts(2, 128, 64, rng)
    y = MoeSlice(experts, 128).forward(np.ones((2, 128)), -np.ones((2, 4)), np.ones((2, 4)))
    assert np.array_equal(y, np.zeros((2, 128)))


def test_bad_arguments_are_named():
    rng = np.random.default_rng(25)
    experts, _ = make_experts(2, 128, 64, rng)
    layer = MoeSlice(experts, 128, "layers.7.mlp")
    with pytest.raises(Fp9Error, match="layers.7.mlp: expert id out of range"):
        layer.forward(np.ones((1, 128)), np.array([[5]]), np.ones((1, 1)))
    with pytest.raises(Fp9Error, match="layers.7.mlp: activation has 100 columns, hidden size is 128"):
        layer.forward(np.ones((1, 100)), np.array([[0]]), np.ones((1, 1)))
    with pytest.raises(Fp9Error, match="expert 1 has gate_up"):
        MoeSlice([experts[0], ExpertSlice(experts[1].down, experts[1].gate_up)], 128, "bad")


def test_forward_releases_the_gil():
    rng = np.random.default_rng(26)
    experts, _ = make_experts(8, 4096, 256, rng)
    layer = MoeSlice(experts, 4096)
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    ids = np.tile(np.arange(8), (64, 1))
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)
    th = threading.Thread(target=ticker)
    th.start()
    ws = Workspace()
    t0 = time.perf_counter()
    calls = 0
    while calls < 3 or time.perf_counter() - t0 < 0.1:   # long enough for ticks, however fast the kernels
        layer.forward(x, ids, np.ones((64, 8)), None, ws)
        calls += 1
    t1 = time.perf_counter()
    stop.set()
    th.join()
    during = [t for t in ticks if t0 < t < t1]
    # with the GIL held through each call the ticker could not run in between
    assert t1 - t0 > 0.05 and len(during) >= 10, (t1 - t0, len(during))


@pytest.mark.parametrize("bf16", [0, 1])
def test_the_intermediate_has_the_references_bits_and_expfs_precision(bf16):
    """duck_ffn_act (AVX2 where the CPU has it) gives duck_ffn_act_ref's bits for every
    value, the edges of its exp's clamp, zeros, infinities and NaN included (any length:
    the vector loop and its scalar tail); and it is silu(g) * u within 2 ulp (rounded to
    bf16 when asked, then times the scale), against float64."""
    from native._native import ffi
    rng = np.random.default_rng(11)
    edges = np.array([0.0, -0.0, 1e-30, -1e-30, 85.9, -85.9, 86, -86, 87, -87, 88, -88, 89, -89, 100, -100,
                      1e30, -1e30, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45], dtype=np.float32)
    g = np.concatenate([(rng.standard_normal(3000) * 8).astype(np.float32), edges, edges[::-1]])
    u = rng.standard_normal(g.size).astype(np.float32)
    gu = np.stack([g, u], axis=1).ravel()
    ptr = lambda a: ffi.cast("float *", ffi.from_buffer(a))                   # noqa: E731
    for n in (1, 7, g.size):
        for scale in (1.0, 2.0 ** 64, 0.37):
            fast, ref = np.full(g.size, 5.0, np.float32), np.full(g.size, 5.0, np.float32)
            lib.duck_ffn_act(ptr(gu), 0, n, scale, bf16, ptr(fast))
            lib.duck_ffn_act_ref(ptr(gu), 0, n, scale, bf16, ptr(ref))
            same = (fast.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(fast) & np.isnan(ref))
            assert same.all(), f"n {n}, scale {scale}: {np.flatnonzero(~same)[:5]}"
            assert np.all(fast[n:] == 5.0)                                    # nothing past pe written
    assert np.all(np.isnan(ref[np.isnan(g)]))                                 # NaN in, NaN out
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    with np.errstate(all="ignore"):
        h = g64 / (1.0 + np.exp(-g64)) * u64
    want = (torch.from_numpy(h).float().to(torch.bfloat16).double().numpy() if bf16 else h) * 0.37
    ok = np.isfinite(want) & (np.abs(g) < 80) & (np.abs(want) > 1e-30)
    if bf16:   # rounding to bf16 may take a value 2 ulp off to the other bf16 neighbour: within one bf16 step
        assert np.all(np.abs(ref[ok] - want[ok]) <= np.abs(want[ok]) * 2.0 ** -7)
    else:
        assert np.all(np.abs(ref[ok] - want[ok]) <= np.abs(want[ok]) * 2.5 * 2.0 ** -23)
    assert ref[3006] == pytest.approx(86 * u[3006] * 0.37, rel=2.0 ** -7 if bf16 else 1e-6)   # silu(86) = 86
