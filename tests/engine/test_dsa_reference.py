"""The plain-torch DeepSeek-V3.2 reference (tests/engine/dsa_reference.py) held to
transformers' DeepseekV32ForCausalLM (eager attention, fp32) below and well above index_topk,
and its fp8 indexer path (Hadamard rotation + e4m3 block quantization, as DeepSeek's
inference code does and transformers skips) checked against the exact one."""
from __future__ import annotations

import pytest
import torch

from tests.engine.dsa_reference import FP8_MAX, act_quant, dequant, hadamard, load_reference
from tests.engine.test_deepseek import TINY_DS, hf_deepseek

RTOL = 1e-4               # max |reference - transformers| / max |transformers|, fp32
SPARSE_TOPK = 32          # index_topk of the model run at SPARSE_T tokens
SPARSE_T = 300
DENSE_T = 40              # < TINY_DS["deepseek_v32"]["index_topk"] (96): every past key is selected
SPARSE_MATTERS = 1e-3     # the sparse logits differ from the all-keys ones by more than this (relative)
FP8_MIN_OVERLAP = 0.9     # mean |fp8 selection & exact selection| / index_topk, over rows with a choice
FP8_SCORE_RMS = 0.1       # rms(fp8 index scores - exact) / rms(exact): e4m3 carries 3 mantissa bits
FP8_LOGITS_RTOL = 0.6     # loose: a random tiny model's logits move a lot when a few keys change
CHUNK_ATOL = 1e-5


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TINY_DS["deepseek_v32"]["vocab_size"], (n,), generator=g).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _eager(hf):
    hf.set_attn_implementation("eager")
    assert hf.config._attn_implementation == "eager"
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case -> (folder, transformers model): "dense" is test_deepseek's tiny V3.2 (index_topk 96),
    "sparse" the same with index_topk SPARSE_TOPK."""
    made = {}

    def make(case: str):
        if case not in made:
            folder = tmp_path_factory.mktemp(f"deepseek_v32_{case}")
            hf = hf_deepseek("deepseek_v32", **({"index_topk": SPARSE_TOPK} if case == "sparse" else {}))
            hf.save_pretrained(folder)
            made[case] = folder, _eager(hf)
        return made[case]

    return make


@pytest.fixture(scope="module")
def sparse_ref(checkpoint):
    ref = load_reference(checkpoint("sparse")[0])
    ref.scale_fmt = "ue8m0"  # as DeepSeek-V3.2's own checkpoint (quantization_config.scale_fmt)
    return ref


@pytest.mark.parametrize("case", ["dense", "sparse"])
def test_exact_logits_match_transformers(case, checkpoint, report):
    folder, hf = checkpoint(case)
    n = SPARSE_T if case == "sparse" else DENSE_T
    ref = load_reference(folder)
    assert (n > ref.topk) == (case == "sparse")
    prompt = _prompt(n, seed=11)
    ours = ref.logits(prompt, fp8=False)
    with torch.no_grad():
        gold = hf(torch.tensor([prompt])).logits[0]
    rel = _rel(ours, gold)
    line = f"DSA reference: fp32 logits vs transformers rel err {rel:.1e} ({n} tokens, index_topk {ref.topk})"
    if case == "sparse":
        ref.topk = n  # every past key: the sparse mask must have changed the result
        moved = _rel(ref.logits(prompt, fp8=False), ours)
        line += f"; all-keys logits differ by {moved:.1e}"
        assert moved > SPARSE_MATTERS, f"the index_topk={SPARSE_TOPK} selection did not matter ({moved:.1e})"
    report(line)
    assert rel <= RTOL, f"{case}: rel err {rel:.2e} > {RTOL:.0e}"


def test_hadamard_is_orthogonal_and_symmetric():
    for n in (1, 2, 8, 32, 128):
        h = hadamard(n)
        torch.testing.assert_close(h @ h.T, torch.eye(n), rtol=0, atol=1e-6)
        assert torch.equal(h, h.T) and torch.equal(h.abs(), torch.full((n, n), n ** -0.5))
    with pytest.raises(AssertionError):
        hadamard(48)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_block_quantizer_round_trips(scale_fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 256, generator=g) * torch.logspace(-6, 3, 64)[:, None, None]
    x[0, 0, :128] = 0  # an all-zero block: the amax floor keeps its scale finite
    q, s = act_quant(x, 128, scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4, 2)
    assert q.float().abs().max() <= FP8_MAX and torch.isfinite(s).all()
    amax = x.unflatten(-1, (2, 128)).abs().amax(-1).clamp_min(1e-4)
    if scale_fmt == "ue8m0":
        mant, _ = torch.frexp(s)
        assert (mant == 0.5).all(), "ue8m0 scales are powers of two"
        assert (s >= amax / FP8_MAX).all() and (s < 2 * amax / FP8_MAX * (1 + 1e-6)).all()
    else:
        torch.testing.assert_close(s, amax / FP8_MAX)
    # e4m3: 3 mantissa bits (relative half-step 2^-4), subnormal step 2^-9 of the scale
    err = (dequant(q, s) - x).abs()
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * s.repeat_interleave(128, -1)
    assert (err <= bound * (1 + 1e-6)).all()


def test_fp8_indexer_follows_the_exact_one(sparse_ref, report):
    prompt, k = _prompt(SPARSE_T, seed=12), sparse_ref.topk
    tri = torch.ones(SPARSE_T, SPARSE_T, dtype=torch.bool).tril()
    exact, fp8 = (sparse_ref.index_scores(prompt, 0, fp8=f)[tri] for f in (False, True))
    score_rms = ((fp8 - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    overlaps = []
    for layer in range(sparse_ref.n_layers):
        a, b = (sparse_ref.index_topk(prompt, layer, fp8=f)[k - 1:] for f in (False, True))
        same = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).float() / k
        overlaps.append(same.mean().item())
    mean_overlap = sum(overlaps) / len(overlaps)
    exact_logits, fp8_logits = (sparse_ref.logits(prompt, fp8=f) for f in (False, True))
    rel = _rel(fp8_logits, exact_logits)
    dense_prompt = prompt[: k - 1]  # below index_topk fp8 changes nothing: every past key is kept
    dense_rel = _rel(sparse_ref.logits(dense_prompt, fp8=True), sparse_ref.logits(dense_prompt, fp8=False))
    report(f"DSA reference fp8 (ue8m0) vs exact, {SPARSE_T} tokens, index_topk {k}: index scores rms rel "
           f"{score_rms:.3f}; selection overlap per layer {', '.join(f'{o:.1%}' for o in overlaps)} "
           f"(mean {mean_overlap:.1%}); logits rel err {rel:.2f} (bound {FP8_LOGITS_RTOL}), "
           f"{dense_rel:.0e} at {k - 1} tokens")
    assert score_rms <= FP8_SCORE_RMS
    assert mean_overlap >= FP8_MIN_OVERLAP
    assert rel <= FP8_LOGITS_RTOL
    assert dense_rel <= RTOL


def test_ties_are_flagged(sparse_ref):
    """Rows whose k-th score is tied with a left-out key (relu zeroes every head: score exactly 0)."""
    prompt, k = _prompt(SPARSE_T, seed=12), sparse_ref.topk
    scores = sparse_ref.index_scores(prompt, 0, fp8=False)
    ties = sparse_ref.index_ties(prompt, 0, fp8=False)
    kth = scores.topk(k, -1).values[:, -1:]
    expected = ((scores >= kth).sum(-1) > k) & (torch.arange(SPARSE_T) >= k - 1)
    assert torch.equal(ties, expected) and not ties[: k - 1].any()


@pytest.mark.parametrize("fp8", [False, True])
def test_query_chunks_do_not_change_the_logits(fp8, sparse_ref):
    prompt = _prompt(SPARSE_T, seed=13)
    torch.testing.assert_close(sparse_ref.logits(prompt, fp8=fp8, query_chunk=7),
                               sparse_ref.logits(prompt, fp8=fp8, query_chunk=256), rtol=0, atol=CHUNK_ATOL)
    assert torch.equal(sparse_ref.index_topk(prompt, 1, fp8=fp8, query_chunk=7),
                       sparse_ref.index_topk(prompt, 1, fp8=fp8, query_chunk=256))
