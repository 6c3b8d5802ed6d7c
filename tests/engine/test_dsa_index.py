"""DeepSeek-V3.2's lightning-indexer scores (engine.gpu.dsa_index): the Triton kernel (in Triton's
interpreter, a worker process: tests/engine/conftest.py `interpreted`) gives the torch reference's
scores on ragged shapes (T and S no multiple of the tiles, fewer heads and a head_dim smaller than a
dot's 16), causal masks with positions past the cache and before it, n_keys, a caller's out, a slot
cache; and the reference is a naive triple loop of the formula. On CUDA (fp8, DeepSeek's sizes):
tests/gpu/test_dsa_index_cuda.py."""
from __future__ import annotations

import math

import pytest
import torch

from engine.gpu.dsa_index import index_scores, index_scores_ref

# (T, H, D, S, positions: "prefill" = the last T of S - 3 (ascending, ending before S),
#  "mixed" = before, inside and past the cache, "early" < 40, "edge" 128 then 5)
CASES = [
    (1, 16, 32, 70, "mixed"),      # a decode step
    (5, 4, 20, 150, "mixed"),      # 4 heads and D 20, padded to the dot's 16 and 32
    (70, 16, 32, 200, "prefill"),  # two chunks of queries (64 + 6), ragged tiles
    (9, 12, 16, 300, "early"),     # every position < 40: the later tiles skip their dots
    (2, 16, 16, 260, "edge"),      # the last position on a tile's first key (64 and 128 keys a tile)
]


def make(t, h, d, s, positions, dtype, seed, slots: int = 0):
    """Random inputs of the indexer (signed w, as DeepSeek's weights_proj gives) and positions."""
    g = torch.Generator().manual_seed(seed)
    kshape = (slots, s, d) if slots else (s, d)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(*kshape, generator=g).to(dtype)
    w = torch.randn(t, h, generator=g) / math.sqrt(h)
    k_scale = torch.rand(*kshape[:-1], generator=g) + 0.5
    if positions == "prefill":
        pos = torch.arange(s - 3 - t, s - 3)
    elif positions == "edge":
        pos = torch.tensor([128, 5])[:t]
    elif positions == "early":
        pos = torch.randint(0, 40, (t,), generator=g)
    else:
        pos = torch.randint(-2, s + 50, (t,), generator=g)
        pos[0] = s + 1000                           # past the cache: every key
        if t > 1:
            pos[1] = -1                             # before it: a row of -inf
    return q, w, k, k_scale, pos


def assert_scores_close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    """-inf at the same places; elsewhere |got - want| <= rtol * (|want| + max |want|) (signed weights
    cancel, so a score's error follows the largest scores, not its own size)."""
    assert got.shape == want.shape and got.dtype == torch.float32, (what, got.shape, want.shape, got.dtype)
    masked = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), masked), f"{what}: -inf at other places"
    g, r = got[~masked], want[~masked].float()
    assert torch.isfinite(g).all(), f"{what}: a non-finite score"
    if r.numel():
        top = r.abs().max()
        err = (g - r).abs()
        assert (err <= rtol * (r.abs() + top)).all(), f"{what}: max err {err.max():.3g} of max |score| {top:.3g}"


def _kernel_vs_reference(dtype_name: str) -> bool:
    from engine.gpu import dsa_index
    assert dsa_index.INTERPRETED
    dtype = getattr(torch, dtype_name)
    for i, (t, h, d, s, positions) in enumerate(CASES):
        q, w, k, ks, pos = make(t, h, d, s, positions, dtype, seed=i)
        for p in (pos, pos.int()):
            got = index_scores(q, w, k, ks, p)
            assert_scores_close(got, index_scores_ref(q, w, k, ks, p), 1e-4, f"{dtype_name} case {i} {p.dtype}")
        n = s * 2 // 3                                                      # n_keys, into a wider out
        wide = torch.full((t, n + 7), 7.0)
        got = index_scores(q, w, k, ks, pos, out=wide[:, :n], n_keys=n)
        assert got.data_ptr() == wide.data_ptr()
        assert_scores_close(got, index_scores_ref(q, w, k, ks, pos, n_keys=n), 1e-4, f"{dtype_name} case {i} n_keys")
        assert (wide[:, n:] == 7.0).all(), "wrote past n_keys"
    return True


def _slot_cache_vs_reference() -> bool:
    q, w, k, ks, pos = make(6, 16, 32, 130, "mixed", torch.float32, seed=9, slots=3)
    slots = torch.tensor([2, 0, 2, 1, 0, 1], dtype=torch.int32)
    got = index_scores(q, w, k, ks, pos, rows_slot=slots, n_keys=100)
    want = index_scores_ref(q, w, k, ks, pos, rows_slot=slots, n_keys=100)
    assert_scores_close(got, want, 1e-4, "slots")
    for t, sl in enumerate(slots.tolist()):                               # a row is its own slot's cache
        one = index_scores_ref(q[t:t + 1], w[t:t + 1], k[sl], ks[sl], pos[t:t + 1], n_keys=100)
        assert_scores_close(got[t:t + 1], one, 1e-4, f"slots row {t}")
    return True


def _other_tilings_vs_reference() -> bool:
    """Tilings plan doesn't pick at these sizes (config): BLOCK_S 128 (a launch of many programs on the GPU),
    several queries a dot (TPD), short chunks of queries."""
    for cfg in ({"block_s": 128}, {"tpd": 2}, {"tpd": 4, "block_t": 6}, {"block_s": 128, "tpd": 2, "block_t": 3}):
        for i, (t, h, d, s, positions) in enumerate(CASES):
            q, w, k, ks, pos = make(t, h, d, s, positions, torch.float32, seed=20 + i)
            assert_scores_close(index_scores(q, w, k, ks, pos, config=cfg), index_scores_ref(q, w, k, ks, pos), 1e-4,
                                f"{cfg} case {i}")
    return True


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float8_e4m3fn"])
def test_the_kernel_is_the_reference_under_the_interpreter(interpreted, dtype_name):
    assert interpreted(_kernel_vs_reference, dtype_name)


def test_the_kernel_reads_a_slot_cache_under_the_interpreter(interpreted):
    assert interpreted(_slot_cache_vs_reference)


def test_other_tilings_under_the_interpreter(interpreted):
    assert interpreted(_other_tilings_vs_reference)


def naive(q, w, k, k_scale, q_pos, n):
    t_, h_, d_ = q.shape
    out = torch.empty(t_, n, dtype=torch.float64)
    for t in range(t_):
        for s in range(n):
            if s > q_pos[t]:
                out[t, s] = float("-inf")
                continue
            total = 0.0
            for h in range(h_):
                dot = sum(float(q[t, h, d]) * float(k[s, d]) for d in range(d_))
                total += float(w[t, h]) * max(dot, 0.0)
            out[t, s] = float(k_scale[s]) * total
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_the_reference_is_the_formula(dtype):
    q, w, k, ks, pos = make(4, 3, 5, 9, "mixed", dtype, seed=1)
    for n in (9, 6):
        want = naive(q, w, k, ks, pos, n)
        assert_scores_close(index_scores_ref(q, w, k, ks, pos, n_keys=n), want, 1e-6, f"n_keys {n}")
    sl = torch.tensor([1, 0, 1, 1])
    q, w, k, ks, pos = make(4, 3, 5, 9, "mixed", dtype, seed=2, slots=2)
    got = index_scores_ref(q, w, k, ks, pos, rows_slot=sl)
    for t in range(4):
        want = naive(q[t:t + 1], w[t:t + 1], k[sl[t]], ks[sl[t]], pos[t:t + 1], 9)
        assert_scores_close(got[t:t + 1], want, 1e-6, f"slot row {t}")


def test_off_the_kernel_the_reference_answers():
    """A CPU tensor outside the interpreter: index_scores is the reference, into out, empty shapes included."""
    q, w, k, ks, pos = make(3, 4, 8, 20, "mixed", torch.float32, seed=4)
    out = torch.empty(3, 12)
    assert index_scores(q, w, k, ks, pos, out=out, n_keys=12) is out
    assert_scores_close(out, index_scores_ref(q, w, k, ks, pos, n_keys=12), 1e-6, "cpu")
    assert index_scores(q, w, k, ks, pos, n_keys=0).shape == (3, 0)
    assert index_scores(q[:0], w[:0], k, ks, pos[:0]).shape == (0, 20)


@pytest.mark.parametrize("bad", ["k_dtype", "w_shape", "pos_dtype", "n_keys", "out_shape", "k_scale"])
def test_bad_arguments_are_refused(bad):
    q, w, k, ks, pos = make(3, 4, 8, 20, "mixed", torch.float32, seed=4)
    kw = {}
    if bad == "k_dtype":
        k = k.bfloat16()
    elif bad == "w_shape":
        w = w[:, :2]
    elif bad == "pos_dtype":
        pos = pos.float()
    elif bad == "n_keys":
        kw["n_keys"] = 21
    elif bad == "out_shape":
        kw["out"] = torch.empty(3, 19)
    else:
        ks = ks[:10]
    with pytest.raises(ValueError, match="index_scores"):
        index_scores(q, w, k, ks, pos, **kw)
