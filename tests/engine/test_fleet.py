"""The fleet backend (4 local duckfw processes, tensor-parallel fp9 slices)
against the local fp9 backend and the fp32 reference on the tiny models."""
from __future__ import annotations

import pytest
import torch

from engine.fleet_ffn import FleetFfn
from engine.generate import forward_logits, generate
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.conftest import TINY
from tests.engine.test_models import FP9_MIN_TOP1_AGREEMENT, FP9_STEPS, _prompt

DUCKS = 4
# fleet vs local fp9 logits: max |diff| / max |fp9|. Slices decode to the same fp9
# values, but the partials of the ducks are summed in another order: not bit-equal.
FLEET_VS_FP9_RTOL = 1e-5


@pytest.mark.parametrize("kind", sorted(TINY))
def test_fleet_matches_local_fp9_and_agrees_with_fp32(kind, tiny_checkpoint, report):
    folder, _ = tiny_checkpoint(kind)
    ref = load_model(folder, backend="torch")
    fp9 = load_model(folder, backend="fp9")
    fleet = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        prompt = _prompt(kind, seed=3)
        gold = generate(ref.model, ref.tokenizer, prompt, SamplingParams(max_tokens=FP9_STEPS, ignore_eos=True)).token_ids
        seq = prompt + gold
        l9 = forward_logits(fp9.model, seq)
        lf = forward_logits(fleet.model, seq)
        rel = ((lf - l9).abs().max() / l9.abs().max()).item()
        top1 = lf[len(prompt) - 1:-1].argmax(-1).tolist()
        agree = sum(a == b for a, b in zip(top1, gold)) / FP9_STEPS
        report(f"tiny {kind}: fleet ({DUCKS} ducks) vs local fp9 logits rel err {rel:.1e}; "
               f"fleet top-1 agreement with fp32 {agree:.1%} over {FP9_STEPS} steps")
        assert fleet.ffn.bytes_streamed > 0
        assert rel <= FLEET_VS_FP9_RTOL
        assert agree >= FP9_MIN_TOP1_AGREEMENT
    finally:
        fleet.ffn.close()


def test_synthetic_layers_are_made_by_the_ducks(caplog):
    """load_synthetic_layer: no torch weights; the ducks generate the slices at
    finish_loading, and the forward equals the local fp9 reference on the same
    tensors generated here."""
    import numpy as np
    import torch

    from native.kernels import ExpertSlice, MoeSlice

    hidden, inter, n_experts = 256, 200, 4
    ffn = FleetFfn(local_ducks=2)
    try:
        for index in (0, 3):
            ffn.load_synthetic_layer(index, n_experts, hidden, inter, seed=11)
        with caplog.at_level("INFO"):
            ffn.finish_loading()
        assert "32 synthesized" in caplog.text
        assert ffn.layers[0][0][0].gate_up.digest() != ffn.layers[3][0][0].gate_up.digest()
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, hidden, generator=gen)
        ids = torch.stack([torch.randperm(n_experts, generator=gen)[:2] for _ in range(5)])
        w = torch.rand(5, 2, generator=gen)
        for index in (0, 3):
            y = ffn.forward(index, x, ids, w).numpy()
            ref = sum(MoeSlice([ExpertSlice(e.gate_up.materialize(), e.down.materialize()) for e in slices],
                               hidden).forward(x.numpy(), ids.numpy(), w.numpy()) for slices in ffn.layers[index])
            assert np.isfinite(y).all() and np.abs(ref).max() > 0
            assert np.abs(y - ref).max() <= FLEET_VS_FP9_RTOL * np.abs(ref).max()
    finally:
        ffn.close()


def _alone_and_in_calls_of(ffn, kind: str, sizes) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Layer 0's FFN output for 40 tokens one by one, and in calls of each size."""
    cfg = TINY[kind]
    experts, k = cfg.get("num_experts", 1), cfg.get("num_experts_per_tok", 1)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, cfg["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(40)]).to(torch.int32)
    w = torch.rand(40, k, generator=g) if experts > 1 else torch.ones(40, 1)
    alone = torch.cat([ffn.forward(0, x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(40)])
    return alone, {n: torch.cat([ffn.forward(0, x[i:i + n], ids[i:i + n], w[i:i + n]) for i in range(0, 40, n)])
                   for n in sizes}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_tokens_ffn_output_through_the_ducks_is_the_same_alone_and_in_a_batch(kind, tiny_checkpoint):
    """Batch invariance end to end (native/kernels/kernels.h): a layer's FFN output for a token,
    through real ducks (their kernels, the wire, the host's sum of their partials), is the same
    bits alone and among 2-40 other tokens, which changes how many tokens each duck's GEMMs
    take (a dense MLP: all of them; experts: those routed to each). What keeps a sequence's
    text the same alone and in a batch."""
    folder, _ = tiny_checkpoint(kind)
    lm = load_model(folder, backend=FleetFfn(local_ducks=2))
    try:
        alone, together = _alone_and_in_calls_of(lm.ffn, kind, (2, 5, 13, 40))
        for n, y in together.items():
            assert torch.equal(y, alone), f"{kind}, calls of {n} tokens"
    finally:
        lm.ffn.close()


def test_ducks_started_with_batch_invariance_off_say_so_and_take_the_faster_gemm(tiny_checkpoint, monkeypatch):
    """DUCK_BATCH_INVARIANT=0 in the environment of the process that starts local ducks (duckd's):
    each duck's start line says so, and 40 tokens in one call (the tile GEMM) differ from the
    tokens alone in their last bits, within the fp9 kernels' tolerance."""
    monkeypatch.setenv("DUCK_BATCH_INVARIANT", "0")
    folder, _ = tiny_checkpoint("llama")
    lm = load_model(folder, backend=FleetFfn(local_ducks=2))
    try:
        alone, together = _alone_and_in_calls_of(lm.ffn, "llama", (40,))
        logs = [lm.ffn.local.log_path(i).read_text() for i in range(2)]
    finally:
        lm.ffn.close()
    assert all("batch invariance off" in log for log in logs), logs
    assert not torch.equal(together[40], alone)
    torch.testing.assert_close(together[40], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
