"""The lightning-indexer scores kernel (engine.gpu.dsa_index) compiled for the GPU at DeepSeek-V3.2's
indexer sizes (64 heads of 128): fp8 (the indexer's cache) and bf16 against the fp32 reference, a
decode step, a few rows and a prefill chunk over short and long caches; the top-2048 keys it picks
are the reference's; a slot cache; and a CUDA graph replays it with new positions and queries.
The CPU suite (tests/engine/test_dsa_index.py) runs the same kernel under the interpreter. Skipped
without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine.gpu.dsa_index import index_scores, index_scores_ref
from tests.engine.test_dsa_index import assert_scores_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA device")

H, D = 64, 128
TOPK = 2048
# fp8: the e4m3 products are exact, but Hopper's fp8 tensor cores add them in fewer than fp32's bits
RTOL = {torch.float8_e4m3fn: 2e-3, torch.bfloat16: 1e-4}


@pytest.fixture(autouse=True)
def _exact_fp32():
    """The reference's fp32 matmuls in fp32, not TF32."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul


def inputs(t: int, s: int, dtype, seed: int, positions: str = "end", slots: int = 0):
    """The indexer's inputs on CUDA: q and k as fp8 (or bf16) of unit-variance values, signed head
    weights, positive key scales; positions "end" (the last T of the cache, a prefill chunk or a
    decode step), "mixed" (anywhere, past the cache and before it too), "long" (>= TOPK)."""
    g = torch.Generator().manual_seed(seed)
    kshape = (slots, s, D) if slots else (s, D)
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k = torch.randn(*kshape, generator=g).to(dtype)
    w = torch.randn(t, H, generator=g) / H ** 0.5
    k_scale = torch.rand(*kshape[:-1], generator=g) + 0.5
    if positions == "end":
        pos = torch.arange(s - t, s)
    elif positions == "long":
        pos = torch.randint(TOPK, s, (t,), generator=g)
    else:
        pos = torch.randint(-1, s + 100, (t,), generator=g)
    return [x.cuda() for x in (q, w, k, k_scale, pos)]


@pytest.mark.parametrize("s", [1000, 40000])
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("positions", ["end", "mixed"])
def test_kernel_matches_reference(dtype, t, s, positions):
    q, w, k, ks, pos = inputs(t, s, dtype, seed=t + s, positions=positions)
    got = index_scores(q, w, k, ks, pos)
    want = index_scores_ref(q, w, k, ks, pos)
    assert_scores_close(got.cpu(), want.cpu(), RTOL[dtype], f"{dtype} T={t} S={s} {positions}")
    n = s // 3 + 5
    got = index_scores(q, w, k, ks, pos.int(), n_keys=n)
    assert_scores_close(got.cpu(), want[:, :n].cpu(), RTOL[dtype], f"{dtype} T={t} S={s} n_keys={n}")


@pytest.mark.parametrize("config", [dict(block_s=64), dict(block_s=128), dict(block_s=256, num_warps=8),
                                    dict(tpd=2), dict(tpd=2, block_s=256, num_warps=8, block_t=128)], ids=str)
def test_other_tilings_match_reference(config):
    """Tilings plan may pick elsewhere (or on another GPU): the same scores."""
    q, w, k, ks, pos = inputs(300, 5000, torch.float8_e4m3fn, seed=17, positions="mixed")
    got = index_scores(q, w, k, ks, pos, config=config)
    assert_scores_close(got.cpu(), index_scores_ref(q, w, k, ks, pos).cpu(), RTOL[torch.float8_e4m3fn], str(config))


@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_top_k_is_the_references(dtype, t):
    """The top-2048 keys of each row: the reference's set, up to near-ties (a key the kernel picks that the
    reference leaves out scores within the tolerance of the reference's 2048th)."""
    q, w, k, ks, pos = inputs(t, 40000, dtype, seed=11 * t, positions="long")
    got, want = index_scores(q, w, k, ks, pos), index_scores_ref(q, w, k, ks, pos)
    picked = got.topk(TOPK, dim=1).indices
    ref_vals, ref_idx = want.topk(TOPK, dim=1)
    member = torch.zeros(t, want.shape[1], dtype=torch.bool, device=want.device).scatter_(1, ref_idx, True)
    same = member.gather(1, picked)                                                     # in the reference's set
    tol = RTOL[dtype] * 2 * want.masked_fill(torch.isneginf(want), 0).abs().amax(1, keepdim=True)
    tie = want.gather(1, picked) >= ref_vals[:, -1:] - tol
    overlap = (same | tie).float().mean().item()
    exact = same.float().mean().item()
    assert overlap >= 0.999, f"top-{TOPK} overlap {overlap:.5f} (exact set overlap {exact:.5f})"


def test_slot_cache_on_cuda():
    q, w, k, ks, pos = inputs(5, 3000, torch.float8_e4m3fn, seed=3, positions="mixed", slots=3)
    slots = torch.tensor([2, 0, 2, 1, 0], device="cuda")
    got = index_scores(q, w, k, ks, pos, rows_slot=slots)
    want = index_scores_ref(q, w, k, ks, pos, rows_slot=slots)
    assert_scores_close(got.cpu(), want.cpu(), RTOL[torch.float8_e4m3fn], "slots")


@pytest.mark.parametrize("t", [1, 7])
def test_cuda_graph_replays_with_new_positions(t):
    """Captured once (out given: no allocation, no host sync), replayed over new queries and positions."""
    s = 40000
    q, w, k, ks, pos = inputs(t, s, torch.float8_e4m3fn, seed=5, positions="end")
    out = torch.empty(t, s, device="cuda")
    index_scores(q, w, k, ks, pos, out=out)                        # compiles outside the capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_scores(q, w, k, ks, pos, out=out)
    # nothing of the scores' size: a single query's launch takes 1 KB, Triton's own scratch, which
    # the graph keeps for its replays (H100, Triton 3.6; seven queries take none)
    assert torch.cuda.memory_allocated() - before <= 1024, "index_scores allocated with out given"
    for step, new_pos in enumerate((torch.arange(100, 100 + t), torch.arange(s - t, s), torch.full((t,), 7))):
        q2, w2, *_ = inputs(t, s, torch.float8_e4m3fn, seed=50 + step)
        q.copy_(q2)
        w.copy_(w2)
        pos.copy_(new_pos.cuda())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = index_scores(q, w, k, ks, pos)
        assert torch.equal(out, eager), f"replay {step} differs from an eager call"
        assert_scores_close(out.cpu(), index_scores_ref(q, w, k, ks, pos).cpu(), RTOL[torch.float8_e4m3fn],
                            f"replay {step}")
