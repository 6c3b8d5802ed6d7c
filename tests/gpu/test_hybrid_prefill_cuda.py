"""The streamed prefill on the device's GPU: the compiled fp9 decode kernel gives the C codec's
values bit for bit (many tensors, slices side by side, block scales), and a tiny model on CUDA
with real local ducks prefills through the hybrid split, streamed over PCIe from pinned memory:
in fp32 its logits are the fleet's within summation order and its greedy tokens the fleet's; in
bf16 (how it serves) its distance from the fp32 fleet is at most twice the bf16 fleet's own.
A max-error bound on bf16 alone does not hold: the two paths round h, the activation and the
partials in different places, and where that flips a near-tie of a random tiny model's router
one token's logits move far (the tiny DeepSeek-V3: 11 % of the largest logit, H100 2026-12-06).
Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine.fleet_ffn import FleetFfn
from engine.gpu.expert_stream import ExpertStream, pinned_copy_gbps
from engine.gpu.hybrid_prefill import HybridPrefill, PrefillSplit
from engine.loader import load_model
from tests.engine.test_fp9_decode import check_decode
from tests.engine.test_hybrid_prefill import _Fixed, _prefill
from tests.engine.test_prefill import _prompt, _rel, family  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HYBRID_VS_FLEET_FP32_RTOL = 1e-3    # fp32 model: the same weights, sums in other orders (cuBLAS vs the ducks)


@pytest.mark.parametrize("rows,cols,per,scales", [(384, 2048, 4, False), (2048, 192, 4, False), (130, 300, 2, True),
                                                  (7, 4200, 3, False)])
def test_compiled_decode_is_the_codecs(rows, cols, per, scales):
    check_decode(rows, cols, per, scales, "cuda", seed=rows + cols)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_hybrid_prefill_on_cuda_is_the_fleets(kind, family):  # noqa: F811
    folder, vocab = family(kind)
    prompt = _prompt(vocab, 200, seed=13)
    exact, rounded = {}, {}
    for dtype, out in ((torch.float32, exact), (torch.bfloat16, rounded)):
        lm = load_model(folder, backend=FleetFfn(local_ducks=3), device="cuda", dtype=dtype)
        try:
            stream = ExpertStream(lm.ffn.layers, lm.ffn.hidden, "cuda", threads=2)
            out["fleet"] = _prefill(lm.model, prompt)
            experts = max(stream.experts(layer) for layer in stream.order)
            splits = {"gpu alone": _Fixed(experts), "half": _Fixed(experts // 2),
                      "balanced": PrefillSplit("hybrid", pinned_copy_gbps("cuda"))}
            for name, split in splits.items():
                hook = HybridPrefill(stream, lm.ffn, split, tokens=len(prompt))
                out[name] = _prefill(lm.model, prompt, hook)
                assert len(hook.layers) == len(stream.order), name
            assert stream.pcie_seconds_per_byte() is not None
        finally:
            lm.ffn.close()
    ref_logits, ref_tokens = exact.pop("fleet")
    for name, (logits, tokens) in exact.items():
        assert _rel(logits, ref_logits) <= HYBRID_VS_FLEET_FP32_RTOL, (name, _rel(logits, ref_logits))
        assert tokens == ref_tokens, name
    floor = _mean_rel(rounded.pop("fleet")[0].float(), ref_logits)
    for name, (logits, _) in rounded.items():
        err = _mean_rel(logits.float(), ref_logits)
        assert err <= 2 * floor + 1e-3, (name, err, floor)


def _mean_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().mean() / b.abs().mean()).item()
