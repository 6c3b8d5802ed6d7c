"""The streamed prefill (engine.gpu.expert_stream, engine.gpu.hybrid_prefill) on the CPU: the
"GPU" share runs on this host's torch from the ducks' own fp9 slices, the rest on real local
ducks. For the MoE families (and the dense ones: one expert, all or nothing) the hybrid
prefill's logits are the fleet's within the tolerance of a different summation order, the
greedy continuation after it is the fleet's, in every split: the ducks alone, the GPU alone, and
what the balancer picks from the measured rates. tests/gpu/test_hybrid_prefill_cuda.py runs the
same on the device's GPU (bf16, Triton)."""
from __future__ import annotations

import pytest
import torch

from engine.fleet_ffn import FleetFfn
from engine.gpu.expert_stream import ExpertStream
from engine.gpu.hybrid_prefill import HybridPrefill, PrefillSplit, StreamedPrefill
from engine.loader import load_model
from tests.engine.test_prefill import _prompt, _rel, family  # noqa: F401 (fixture)

HYBRID_VS_FLEET_RTOL = 1e-4    # fp32 model: the same weights, sums in other orders (GEMM vs the ducks' kernels)
DUCKS = 3
PROMPT = 96


class _Fixed(PrefillSplit):
    """A split that gives the GPU a fixed number of experts per layer (the tests' cases)."""

    def __init__(self, g: int):
        super().__init__()
        self.g = g

    def share(self, experts, held, expert_bytes, tokens):
        return max(0, min(held, self.g if self.g >= 0 else experts + self.g))


@torch.inference_mode()
def _prefill(model, prompt, hook=None):
    cache = model.make_cache(len(prompt) + 8)
    device = model.lm_head.weight.device
    ids, positions = torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device)
    if hook is None:
        hidden = model(ids, positions, cache)
    else:
        with hook:
            hidden = model(ids, positions, cache)
    logits = model.compute_logits(hidden)
    tokens, pos = [], len(prompt)
    nxt = int(logits[-1].argmax())
    for _ in range(6):                           # greedy decode after the prefill, through the ducks
        tokens.append(nxt)
        y = model(torch.tensor([nxt], device=device), torch.tensor([pos], device=device), cache)
        nxt, pos = int(model.compute_logits(y)[-1].argmax()), pos + 1
    return logits, tokens


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "qwen3_5_moe", "llama"])
def test_hybrid_prefill_is_the_fleets(kind, family):  # noqa: F811
    folder, vocab = family(kind)
    lm = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        stream = ExpertStream(lm.ffn.layers, lm.ffn.hidden, "cpu", threads=1)
        prompt = _prompt(vocab, PROMPT, seed=11)
        ref_logits, ref_tokens = _prefill(lm.model, prompt)
        experts = max(stream.experts(layer) for layer in stream.order)
        cases = {"ducks alone": _Fixed(0), "gpu alone": _Fixed(experts), "half": _Fixed(experts // 2 or 1),
                 "balanced": PrefillSplit()}
        for name, split in cases.items():
            hook = HybridPrefill(stream, lm.ffn, split, tokens=PROMPT)
            logits, tokens = _prefill(lm.model, prompt, hook)
            assert _rel(logits, ref_logits) <= HYBRID_VS_FLEET_RTOL, (name, _rel(logits, ref_logits))
            assert tokens == ref_tokens, name
            shares = [layer["gpu_experts"] for layer in hook.layers]
            assert len(hook.layers) == len(stream.order), name
            if name == "gpu alone":
                assert all(layer["duck_s"] == 0 for layer in hook.layers)
            if name == "ducks alone":
                assert shares == [0] * len(shares)
        if experts > 1:                     # a dense model's layer is one expert: the GPU's unless the ducks are faster
            rates = cases["balanced"].moe_rates()
            assert rates.duck_s is not None and rates.duck_s > 0
        stream.close()                      # what duckd does when a model is replaced
        assert not stream.layers
    finally:
        lm.ffn.close()


def test_a_host_that_holds_fewer_experts_leaves_the_rest_to_the_ducks(family):  # noqa: F811
    folder, vocab = family("qwen3_moe")
    lm = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        one = ExpertStream(lm.ffn.layers, lm.ffn.hidden, "cpu", threads=1)
        per_layer = max(one.expert_bytes(layer) for layer in one.order)
        stream = ExpertStream(lm.ffn.layers, lm.ffn.hidden, "cpu", max_bytes=3 * per_layer + per_layer // 2,
                              threads=1)
        assert [stream.held(layer) for layer in stream.order][:2] == [3, 0]
        prompt = _prompt(vocab, PROMPT, seed=12)
        ref_logits, ref_tokens = _prefill(lm.model, prompt)
        hook = HybridPrefill(stream, lm.ffn, PrefillSplit("gpu"), tokens=PROMPT)
        logits, tokens = _prefill(lm.model, prompt, hook)
        assert _rel(logits, ref_logits) <= HYBRID_VS_FLEET_RTOL and tokens == ref_tokens
        assert hook.layers[0]["gpu_experts"] == 3 and hook.layers[0]["duck_s"] > 0
        assert all(layer["gpu_experts"] == 0 for layer in hook.layers[1:])
    finally:
        lm.ffn.close()


def test_the_split_balances_copy_and_ducks():
    moe = (128, 5_000_000)
    split = PrefillSplit(pcie_gbps=50)
    assert split.share(128, 128, 5_000_000, 512) == 64          # nothing measured of the ducks: half
    split.observe(moe, None, duck_seconds=0.05, duck_kernel_s=0.05, duck_experts=64, tokens=512, other_s=0.0)
    b = 0.05 / 64                                                # s per expert on the ducks at 512 tokens
    a = 5_000_000 / 50e9                                         # s per expert over PCIe
    assert split.share(128, 128, 5_000_000, 512) == round(128 * b / (a + b))
    assert split.share(128, 40, 5_000_000, 512) == 40           # never more than the host holds
    slow = PrefillSplit(pcie_gbps=50)                            # a call whose transport costs more than it saves
    slow.observe(moe, None, duck_seconds=0.05, duck_kernel_s=0.001, duck_experts=4, tokens=512, other_s=0.0)
    assert slow.share(128, 128, 5_000_000, 512) == 128
    fast = PrefillSplit(pcie_gbps=1)                             # a GPU far slower than the ducks: none
    fast.observe(moe, None, duck_seconds=0.001, duck_kernel_s=0.001, duck_experts=64, tokens=512, other_s=0.0)
    assert fast.share(128, 128, 5_000_000, 512) == 0
    assert PrefillSplit("gpu").share(128, 100, 1, 1) == 100
    with pytest.raises(ValueError, match="split mode"):
        PrefillSplit("fast")


def test_a_dense_layer_does_not_move_the_moe_layers_split():
    """A dense FFN layer (one expert of all tokens) beside MoE layers: its rates are its own, so
    the MoE layers split as they would alone (one set of rates mixed a dense layer's hundred-fold
    cost per (expert, token) into every MoE layer after it)."""
    moe, dense = (128, 5_000_000), (1, 40_000_000)
    alone, mixed = PrefillSplit(pcie_gbps=50), PrefillSplit(pcie_gbps=50)
    for split in (alone, mixed):
        split.observe(moe, None, duck_seconds=0.05, duck_kernel_s=0.05, duck_experts=64, tokens=512, other_s=0.0,
                      gpu=[(moe, 64, 512, 0.01)])
    mixed.observe(dense, None, duck_seconds=0.3, duck_kernel_s=0.3, duck_experts=1, tokens=512, other_s=0.0,
                  gpu=[(dense, 1, 512, 0.004)])
    assert mixed.share(128, 128, 5_000_000, 512) == alone.share(128, 128, 5_000_000, 512)
    assert mixed.rates(*dense).duck_s == 0.3 / 512 and mixed.moe_rates() is mixed.rates(*moe)
    assert mixed.share(1, 1, dense[1], 512) == 1                 # the dense layer: the GPU's (0.0008 s < 0.3 s)


def test_the_split_times_its_plans_and_keeps_the_faster():
    """Per prompt length (a power of two) the split times both plans of a pass, its model's split
    and every held expert on the GPU, runs the faster and tries the other every EXPLORE_EVERY."""
    from engine.gpu.hybrid_prefill import EXPLORE_EVERY
    split = PrefillSplit(pcie_gbps=50)
    split.observe((128, 5_000_000), None, duck_seconds=0.05, duck_kernel_s=0.05, duck_experts=64, tokens=512,
                  other_s=0.0)
    modeled = split.share(128, 128, 5_000_000, 512)
    assert split.begin(512) == "split" and split.share(128, 128, 5_000_000, 512) == modeled < 128
    split.timed(512, 0.70)                          # the split ran 731 tok/s ...
    assert split.begin(500) == "gpu" and split.share(128, 128, 5_000_000, 512) == 128
    split.timed(500, 0.55)                          # ... the GPU alone 909: it keeps the GPU
    plans = [split.begin(512) for _ in range(2 * EXPLORE_EVERY)]
    assert plans.count("split") == 2 and set(plans) == {"split", "gpu"}
    assert split.begin(2048) == "split"             # another length is timed on its own
    split.timed(2048, 0.5)
    assert split.begin(2048) == "gpu"
    split.timed(2048, 1.0)
    assert split.begin(2048) == "split"
    gpu = PrefillSplit("gpu")
    assert gpu.begin(512) == "gpu" and gpu.share(128, 100, 1, 512) == 100


def test_generate_streams_a_long_prompt_and_keeps_the_tokens(family):  # noqa: F811
    """engine.generate with a model's streamed_prefill: a prompt from min_tokens on goes in passes of
    the stream's chunk (two here), the tokens those of the fleet alone; a shorter one stays on the ducks."""
    from engine.generate import generate
    from engine.tokens import SamplingParams

    folder, vocab = family("deepseek_v3")    # no native CPU decoder: generate's torch path
    lm = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        prompt, params = _prompt(vocab, PROMPT, seed=14), SamplingParams(max_tokens=6, ignore_eos=True)
        ref = generate(lm.model, lm.tokenizer, prompt, params)
        stream = ExpertStream(lm.ffn.layers, lm.ffn.hidden, "cpu", threads=1)
        streamed = lm.model.streamed_prefill = StreamedPrefill(stream, lm.ffn, "hybrid", chunk=64, min_tokens=50)
        got = generate(lm.model, lm.tokenizer, prompt, params)
        assert got.token_ids == ref.token_ids
        assert len(streamed.split.history) == 2 * len(stream.order)     # 96 tokens: passes of 64 and 32
        streamed.split.mode = "gpu"                                      # both passes stream every expert
        assert generate(lm.model, lm.tokenizer, prompt, params).token_ids == ref.token_ids
        assert all(r["gpu_experts"] == r["experts"] for r in streamed.split.history)
        streamed.split.history = []
        short = generate(lm.model, lm.tokenizer, prompt[:40], params)
        assert streamed.split.history == [] and len(short.token_ids) == 6
    finally:
        lm.ffn.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_a_batch_streams_a_long_prompt_alone_beside_decoding_sequences(kind, family):  # noqa: F811
    """engine.batch on the torch path with a model's streamed_prefill (a GPU host with a fleet): a
    prompt from min_tokens on is read alone, in steps of the stream's chunk while its unread rest
    is worth a pass, while two short requests decode around it; every request's tokens are those of the batch without the
    streamed prefill. A prompt that continues a slot's tokens (the prefix cache) is streamed
    only when its unread rest is long enough."""
    from engine.batch import BatchDecoder
    from engine.tokens import SamplingParams
    from engine.gpu.hybrid_prefill import StreamedPrefill
    from tests.engine.test_batch import drain_results

    folder, vocab = family(kind)
    lm = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        long = _prompt(vocab, PROMPT, seed=15)
        requests = [(_prompt(vocab, 9, seed=16), params), (long, params), (_prompt(vocab, 12, seed=17), params)]

        def run(reqs):
            batch = BatchDecoder(lm.model, lm.tokenizer, slots=3, max_model_len=PROMPT + 40, step_tokens=16,
                                 path="torch", prefix_cache=False)
            return [r.token_ids for r in drain_results(batch, reqs)]

        ref = run(requests)
        stream = ExpertStream(lm.ffn.layers, lm.ffn.hidden, "cpu", threads=1)
        streamed = lm.model.streamed_prefill = StreamedPrefill(stream, lm.ffn, "hybrid", chunk=64, min_tokens=50)
        assert run(requests) == ref
        # 96 tokens: a streamed step of 64; the unread 32 are too few for a pass of every expert over PCIe
        assert len(streamed.split.history) == len(stream.order)
        streamed.split.history = []
        assert len(run([(long[:40], params)])[0]) == 6 and streamed.split.history == []   # 40 tokens: the ducks'
        batch = BatchDecoder(lm.model, lm.tokenizer, slots=2, max_model_len=PROMPT + 40, step_tokens=16,
                             path="torch")
        first = drain_results(batch, [(long, params)])[0]
        streamed.split.history = []
        turn = long + first.token_ids + [5, 6, 7]
        second = drain_results(batch, [(turn, params)])[0]
        assert second.stats.cached == len(long) + 5 and streamed.split.history == []   # 8 unread tokens
        lm.model.streamed_prefill = None
        assert second.token_ids == run([(turn, params)])[0]
        # the batch times the steps the ducks prefill: what a streamed prefill with no fixed threshold weighs
        timed = lm.model.streamed_prefill = StreamedPrefill(stream, lm.ffn, "hybrid", chunk=64)
        assert timed.fleet_seconds(20) is None
        run([(long[:20], params)])
        assert timed.fleet_seconds(20) > 0 and timed.split.history == []   # 20 tokens: under the first guess
    finally:
        lm.model.streamed_prefill = None
        lm.ffn.close()


def test_the_fleets_prefill_time_is_fitted_with_a_part_no_token_count_shrinks():
    """A short rest costs the ducks nearly a read of every expert: the fit of the steps' times keeps
    that part (a), where a rate per token (a 256-token step's) would price 41 tokens at a sixth."""
    from engine.gpu.hybrid_prefill import fleet_fit
    assert fleet_fit([], 41) is None
    steps = [(t, 0.2 + 0.004 * t) for t in (32, 256, 1024, 256, 64)]
    assert fleet_fit(steps, 41) == pytest.approx(0.2 + 0.004 * 41)
    assert fleet_fit([(256, 1.0), (256, 1.2)], 128) == pytest.approx(0.55)    # one length: per token
    through_origin = fleet_fit([(10, 0.1), (20, 0.3)], 30)   # a fitted < 0: the slope through 0
    assert through_origin == pytest.approx(30 * (10 * 0.1 + 20 * 0.3) / (10 ** 2 + 20 ** 2))
    stream = type("Stream", (), {"order": [], "layers": {}, "held": None})()
    streamed = StreamedPrefill(stream, None, "hybrid", pcie_gbps=50.0)
    streamed.pass_bytes = int(20e9)                          # a pass: 0.4 s over PCIe
    for t, sec in steps:
        streamed.fleet_timed(t, sec)
    assert not streamed.worth(41) and streamed.worth(64)     # 0.36 s on the ducks at 41, 0.46 at 64
    streamed.split.timed(4000, 0.6)                           # a whole pass measured: slower than its copies
    assert streamed.pass_estimate() == pytest.approx(0.6)
    assert not streamed.worth(64) and streamed.worth(128)    # the ducks: 0.46 s at 64, 0.71 at 128
