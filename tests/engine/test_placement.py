"""Placement (engine.placement): the plan for a GPU budget, and the model computing the GPU's
share of each FFN call from the ducks' own fp9 weights while real local ducks compute the rest.
On the CPU the "GPU" is this host's torch (fp32); the same code runs on CUDA with the grouped
GEMV inside the decode graphs (tests/gpu/test_placement_cuda.py). Every family's greedy tokens
are the same whatever the budget (none, half, all), alone and batched; the ducks read fewer
bytes as the budget grows, and none of a layer the GPU holds whole."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder
from engine.fleet_ffn import FleetFfn
from engine.generate import generate
from engine.loader import load_model
from engine.placement import (FfnShape, PlacementPlan, RoutingHistogram, model_ffn_shapes, place,
                              plan_placement, GPU_BYTES_PER_WEIGHT)
from engine.tokens import SamplingParams
from tests.engine.test_prefill import _prompt, _rel, family  # noqa: F401 (fixture)

DUCKS = 2
TOKENS = 8
LOGITS_RTOL = 1e-4   # fp32: the same weights, the GPU's share summed apart from the ducks'


def _full_bytes(shapes: list[FfnShape], per_weight: float = GPU_BYTES_PER_WEIGHT) -> int:
    return int(sum(s.experts * s.expert_weights * per_weight for s in shapes))


# -- the plan ------------------------------------------------------------------------------------
QWEN_LIKE = [FfnShape(i, 128, 2048, 768) for i in range(48)]
DEEPSEEK_LIKE = [FfnShape(0, 1, 7168, 18432)] + [FfnShape(i, 256, 7168, 2048) for i in range(1, 4)]


def test_budget_zero_places_nothing_and_the_ducks_read_every_byte():
    plan = plan_placement(QWEN_LIKE, 8, 0)
    assert plan.gpu == {} and plan.gpu_bytes == 0 and plan.duck_calls_per_token == 48
    assert plan.duck_bytes_per_token == pytest.approx(48 * 8 * 3 * 2048 * 768 * 1.125)


def test_dense_layers_go_first_then_whole_layers_under_even_routing():
    dense = DEEPSEEK_LIKE[0].expert_weights * GPU_BYTES_PER_WEIGHT
    plan = plan_placement(DEEPSEEK_LIKE, 8, dense + 10)
    assert plan.gpu == {0: (0,)} and plan.whole(0)
    before = plan_placement(DEEPSEEK_LIKE, 8, 0)
    assert before.duck_bytes_per_token - plan.duck_bytes_per_token == pytest.approx(dense)   # fp9 both sides
    quarter = plan_placement(QWEN_LIKE, 8, _full_bytes(QWEN_LIKE) // 4)
    assert quarter.filling == "whole" and len(quarter.gpu) == 12 and all(quarter.whole(i) for i in quarter.gpu)
    assert quarter.duck_calls_per_token == 36
    assert quarter.duck_bytes_per_token == pytest.approx(0.75 * plan_placement(QWEN_LIKE, 8, 0).duck_bytes_per_token)
    assert quarter.gpu_bytes <= _full_bytes(QWEN_LIKE) // 4


def test_a_skewed_histogram_spreads_the_hottest_experts_when_that_saves_more():
    hist = RoutingHistogram()
    for s in QWEN_LIKE:      # every layer: experts 0..7 take 90 % of the choices
        hist.counts[s.layer] = torch.bincount(torch.tensor([e % 8 for e in range(900)] + list(range(8, 108))),
                                              minlength=s.experts)
    budget = 48 * 8 * QWEN_LIKE[0].expert_weights * GPU_BYTES_PER_WEIGHT    # 8 experts of every layer
    plan = plan_placement(QWEN_LIKE, 8, budget, hist)
    assert plan.filling == "spread"
    assert all(plan.gpu[s.layer] == tuple(range(8)) for s in QWEN_LIKE)
    assert plan.share[0] == pytest.approx(0.9)
    whole = plan_placement(QWEN_LIKE, 8, budget)          # the same budget without a histogram: 3 whole layers
    assert whole.filling == "whole" and sum(whole.whole(i) for i in whole.gpu) == 3
    assert plan.duck_bytes_per_token < whole.duck_bytes_per_token


def test_a_gpu_slower_than_the_fleet_holds_only_what_saves_a_call():
    """With the GPU's read rate in the cost model its time counts too (before or after the ducks', not
    beside): spreading experts over layers a GPU reads slower than the fleet would cost more than it saves."""
    budget = 48 * 8 * QWEN_LIKE[0].expert_weights * GPU_BYTES_PER_WEIGHT + 1
    fast = plan_placement(QWEN_LIKE, 8, budget, gpu_gbps=2000.0)
    assert fast.gpu and fast.seconds(gpu_gbps=2000.0) < plan_placement(QWEN_LIKE, 8, 0).seconds(gpu_gbps=2000.0)
    slow = plan_placement(QWEN_LIKE, 8, budget, gpu_gbps=10.0)     # a quarter of the fleet's 40 GB/s
    assert slow.gpu == {} and slow.filling == "none"


def test_the_summary_says_where_the_bytes_are():
    plan = plan_placement(DEEPSEEK_LIKE, 8, _full_bytes(DEEPSEEK_LIKE[:2]))
    s = plan.summary()
    assert s["gpu_layers_whole"] == [0, 1] or s["gpu_layers_whole"] == [0, 3]
    assert s["duck_calls_per_token"] == 2 and s["gpu_gb"] <= s["budget_gb"]
    assert s["duck_gb"] == pytest.approx(sum(x.experts * x.expert_weights for x in DEEPSEEK_LIKE) * 1.125 / 1e9,
                                         rel=1e-3)


# -- the model with its share on the "GPU" ---------------------------------------------------------
@torch.inference_mode()
def _greedy(model, prompt):
    cache = model.make_cache(len(prompt) + TOKENS)
    logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), cache))
    out, pos = [], len(prompt)
    nxt = int(logits[-1].argmax())
    for _ in range(TOKENS):
        out.append(nxt)
        y = model(torch.tensor([nxt]), torch.tensor([pos]), cache)
        nxt, pos = int(model.compute_logits(y)[-1].argmax()), pos + 1
    return logits, out


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "qwen3_5_moe", "llama"])
def test_greedy_tokens_are_the_same_whatever_the_budget(kind, family, monkeypatch):  # noqa: F811
    monkeypatch.setenv("DUCK_CPU_NATIVE", "0")
    folder, vocab = family(kind)
    lm = load_model(folder, device="cpu", backend=FleetFfn(local_ducks=DUCKS))
    try:
        model, prompt = lm.model, _prompt(vocab, 24, seed=3)
        shapes = model_ffn_shapes(model)
        ref_logits, ref = _greedy(model, prompt)
        bytes_before = lm.ffn.bytes_streamed
        _greedy(model, prompt)
        streamed_none = lm.ffn.bytes_streamed - bytes_before
        requests = [(_prompt(vocab, 5 + 4 * i, seed=20 + i), SamplingParams(max_tokens=5, ignore_eos=True))
                    for i in range(3)]
        batch_ref = _batched(lm, requests)
        moe = [s for s in shapes if not s.dense]
        per = 4    # the CPU keeps decoded fp32 copies (engine.placement.bytes_per_weight)
        budgets = [("half", _full_bytes(shapes, per) // 2), ("all", _full_bytes(shapes, per))]
        if moe:   # less than any MoE layer whole: every layer held in part
            budgets.insert(0, ("part", min(_full_bytes([s], per) for s in moe) - 1))
        for name, budget in budgets:
            resident = place(model, lm.ffn, budget)
            assert resident is not None, name
            if name == "part":
                assert not any(resident.whole(s.layer) for s in moe) and resident.layers
            logits, got = _greedy(model, prompt)
            assert got == ref, name
            assert _rel(logits, ref_logits) <= LOGITS_RTOL, (name, _rel(logits, ref_logits))
            before = lm.ffn.bytes_streamed
            _greedy(model, prompt)
            streamed = lm.ffn.bytes_streamed - before
            if name == "all":
                assert streamed == 0 and all(resident.whole(s.layer) for s in shapes)
            else:
                assert 0 < streamed < streamed_none, (streamed, streamed_none)
            assert _batched(lm, requests) == batch_ref, name
            one = requests[0]
            assert generate(model, lm.tokenizer, *one).token_ids == batch_ref[0], name
        model.set_resident(None)
        assert _greedy(model, prompt)[1] == ref
    finally:
        lm.ffn.close()


def test_the_routing_counted_while_serving_picks_each_layers_experts(family, monkeypatch):  # noqa: F811
    """RoutingHistogram.attach: every routed call counts its choices on the model's device; a plan by
    those counts holds each layer's most chosen experts, and the tokens stay those of budget 0."""
    monkeypatch.setenv("DUCK_CPU_NATIVE", "0")
    folder, vocab = family("qwen3_moe")
    lm = load_model(folder, device="cpu", backend=FleetFfn(local_ducks=DUCKS))
    try:
        model, prompt = lm.model, _prompt(vocab, 40, seed=9)
        hist = RoutingHistogram().attach(model)
        _, ref = _greedy(model, prompt)
        k = model.config.num_experts_per_tok
        shapes = [s for s in model_ffn_shapes(model) if not s.dense]
        assert hist.choices == len(shapes) * (len(prompt) + TOKENS) * k
        dense = sum(s.expert_weights * 4 for s in model_ffn_shapes(model) if s.dense)
        one = shapes[0].expert_weights * 4
        resident = place(model, lm.ffn, dense + 2 * len(shapes) * one + 1, hist)   # the dense, 2 x layers experts
        # the most chosen experts of all layers (each layer counted the same choices): none left out is chosen more
        held = [(s.layer, e) for s in shapes for e in (resident.layers[s.layer].ids if s.layer in resident.layers
                                                       else ())]
        counts = {(s.layer, e): c for s in shapes for e, c in enumerate(hist.counts[s.layer].tolist())}
        assert len(held) == 2 * len(shapes)
        assert min(counts[h] for h in held) >= max(c for key, c in counts.items() if key not in held), (held, counts)
        assert _greedy(model, prompt)[1] == ref
    finally:
        lm.ffn.close()


def _batched(lm, requests) -> list[list[int]]:
    from tests.engine.test_batch import drain
    return drain(BatchDecoder(lm.model, lm.tokenizer, slots=2, max_model_len=64, step_tokens=8, path="torch"),
                 requests)


def test_a_part_held_layer_masks_the_gpus_experts_out_of_the_ducks_routing():
    """The split itself, on one call: the GPU's experts reach the backend as -1, the sum is the whole."""
    from engine.ffn import ExpertWeights, TorchFfn, FfnLayer
    from engine.placement import ResidentExperts
    from engine.gpu.moe import stack_experts

    g = torch.Generator().manual_seed(0)
    experts = [ExpertWeights(torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g),
                             torch.randn(8, 16, generator=g)) for _ in range(6)]
    seen = []

    class Recording(TorchFfn):
        def forward(self, layer, x, ids, weights, out=None):
            seen.append(ids.clone())
            return super().forward(layer, x, ids, weights, out)

    backend = Recording()
    backend.load_layer(FfnLayer(0, experts, 8))
    plan = PlacementPlan({0: FfnShape(0, 6, 8, 16)}, 2, 1 << 20, {0: (1, 4)})
    resident = ResidentExperts(plan, "cpu", torch.float32)
    gu, dn = stack_experts([experts[1], experts[4]])
    resident.add(0, (1, 4), 6, gu, dn)
    x = torch.randn(5, 8, generator=g)
    ids = torch.tensor([[1, 2], [4, 1], [0, 5], [3, 4], [2, 0]], dtype=torch.int32)
    w = torch.rand(5, 2, generator=g)
    y = resident.call(backend, 0, x, ids, w)
    want = TorchFfn()
    want.load_layer(FfnLayer(0, experts, 8))
    assert torch.allclose(y, want.forward(0, x, ids, w), rtol=1e-5, atol=1e-5)
    assert seen[0].tolist() == [[-1, 2], [-1, -1], [0, 5], [3, -1], [2, 0]]
