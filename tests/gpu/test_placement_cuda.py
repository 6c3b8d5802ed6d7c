"""Placement on the device's GPU (engine.placement): a tiny model on CUDA with real local ducks
decodes through the CUDA-graph lanes (a layer the GPU holds whole computed inside the graph,
no cut; a layer held in part cut at its duck call, the GEMV skipping the ducks' experts: from fp9
bytes, or from decoded copies when the budget holds every FFN) and through the batch graphs. In fp32 the greedy tokens are those of budget 0 whatever the
budget. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder
from engine.fleet_ffn import FleetFfn
from engine.generate import generate
from engine.gpu.moe import grouped_gemv
from engine.loader import load_model
from engine.placement import bytes_per_weight, model_ffn_shapes, place
from engine.tokens import SamplingParams
from tests.engine.test_batch import drain
from tests.engine.test_prefill import _prompt, family  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_grouped_gemv_gives_zeros_for_a_pair_of_no_expert():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4, 96, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(3, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.tensor([2, -1, 0, -1, 3, 1], dtype=torch.int32, device="cuda")
    y = grouped_gemv(x, ids, w, 2)
    for j, e in enumerate(ids.tolist()):
        want = torch.zeros(96, device="cuda") if e < 0 else w[e].float() @ x[j // 2].float()
        assert torch.allclose(y[j], want, rtol=2e-2, atol=2e-2), j


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_greedy_tokens_on_cuda_are_the_same_whatever_the_budget(kind, family):  # noqa: F811
    folder, vocab = family(kind)
    lm = load_model(folder, backend=FleetFfn(local_ducks=3), device="cuda", dtype=torch.float32)
    try:
        model = lm.model
        prompt = _prompt(vocab, 24, seed=5)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        ref = generate(model, lm.tokenizer, prompt, params).token_ids
        requests = [(_prompt(vocab, 6 + 5 * i, seed=30 + i), SamplingParams(max_tokens=6, ignore_eos=True))
                    for i in range(3)]
        batch = BatchDecoder(model, lm.tokenizer, slots=4, max_model_len=64, step_tokens=16, path="torch")
        batch_ref = drain(batch, requests)
        shapes = model_ffn_shapes(model)
        per = bytes_per_weight("cuda", torch.float32)         # the ducks' fp9 bytes, read by the fused GEMV
        full = int(sum(s.experts * s.expert_weights * per for s in shapes)) + 1
        moe = [s for s in shapes if not s.dense]
        part = int(min(s.experts * s.expert_weights * per for s in moe)) - 1
        decoded = int(sum(s.experts * s.expert_weights * 4 for s in shapes))   # every FFN in fp32 copies
        for name, budget in (("part", part), ("half", full // 2), ("all", full), ("decoded", decoded)):
            resident = place(model, lm.ffn, budget)
            assert resident is not None and resident.device.type == "cuda", name
            # fp9 bytes (the fused GEMV) where the budget cannot hold every FFN decoded; copies where it can
            assert all((h.fp9 is None) == (name == "decoded") for h in resident.layers.values()), name
            assert generate(model, lm.tokenizer, prompt, params).token_ids == ref, name
            assert drain(batch, requests) == batch_ref, name
        model.set_resident(None)
        assert generate(model, lm.tokenizer, prompt, params).token_ids == ref
    finally:
        lm.ffn.close()
