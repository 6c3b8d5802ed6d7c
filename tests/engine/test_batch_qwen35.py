"""Continuous batching of Qwen3.5 dense and MoE on the torch path (engine.batch_torch over
engine.models.qwen3_5.SlotHybridCache): every request gets the tokens it gets alone, and
those of generate(), though its slot served an earlier sequence and its prompt is read in
chunks across steps; a step's logits are those of each sequence alone in a fresh cache; the
batched DeltaNet decode step equals the per-sequence mixer; a linear-attention slot refuses
a run that does not continue where its state left off."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder
from engine.batch_torch import TorchSlotDecoder
from engine.delta_rule import gated_delta_mixer, gated_delta_mixer_slots
from engine.generate import generate
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.test_batch import drain
from tests.engine.test_qwen3_5 import KINDS, _prompt

BATCH_VS_ALONE_TOL = 1e-5   # fp32, as tests/engine/test_batch.py: the same math in another order
SLOTS, STEP_TOKENS, MAX_MODEL_LEN = 3, 16, 64
PROMPTS = (1, 7, 20, 33, 4, 12)   # 20 and 33: read over 2-3 steps of 16 tokens, beside other sequences' tokens


def _requests() -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i, n in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=5 + 2 * i, ignore_eos=True)
        if i == 2:
            params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
        if i == 4:
            params = SamplingParams(max_tokens=10, repetition_penalty=1.3, ignore_eos=True)
        out.append((_prompt(n, seed=20 + i), params))
    return out


def _step(dec: TorchSlotDecoder, *runs: tuple[int, list[int], int]) -> torch.Tensor:
    """One step of the runs (slot, tokens, the first one's position) -> the hidden states [T, H]."""
    ids = [t for _, tokens, _ in runs for t in tokens]
    positions = [first + i for _, tokens, first in runs for i in range(len(tokens))]
    slots = [slot for slot, tokens, _ in runs for _ in tokens]
    return dec.layers(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots))


@torch.inference_mode()
def _alone(model, *pieces: list[int]) -> list[torch.Tensor]:
    """The pieces fed in turn to one sequence in a fresh cache: the logits [V] of each one's last token."""
    cache, at, out = model.make_cache(32), 0, []
    for ids in pieces:
        y = model(torch.tensor(ids), torch.arange(at, at + len(ids)), cache)
        out.append(model.compute_logits(y[-1:])[0])
        at += len(ids)
    return out


def _run_batch(lm, requests, slots: int) -> list[list[int]]:
    return drain(BatchDecoder(lm.model, lm.tokenizer, slots=slots, max_model_len=MAX_MODEL_LEN,
                              step_tokens=STEP_TOKENS, path="torch"), requests)


@pytest.mark.parametrize("kind", KINDS)
def test_a_qwen35_batch_gives_each_request_what_it_gets_alone(kind, tiny_family, monkeypatch):
    """Six requests over three slots (three wait, then take slots the first ones leave: the
    states must start from zero), prompts read 16 tokens a step beside other sequences'
    decode tokens (the states must carry over): each request's tokens are those it gets in a
    batch of one, and for greedy those of generate()."""
    monkeypatch.setenv("DUCK_CPU_NATIVE", "0")
    lm = load_model(tiny_family(kind), device="cpu", backend="fp9")
    requests = _requests()
    together = _run_batch(lm, requests, SLOTS)
    for (prompt, params), got in zip(requests, together):
        assert len(got) == params.max_tokens
        if params.temperature == 0:
            assert generate(lm.model, lm.tokenizer, prompt, params).token_ids == got
    assert together == [_run_batch(lm, [r], 1)[0] for r in requests]


@pytest.mark.parametrize("kind", KINDS)
def test_qwen35_batch_logits_match_one_sequence_alone(kind, tiny_family):
    """As tests/engine/test_batch.py's: a step of two decoding sequences and one prefilling,
    then a decode step of those three and a new one-token prompt (one batched DeltaNet update
    for all four slots, one of them starting from position 0), against each sequence alone in
    a fresh cache. The slot cache starts full of NaN, kv and DeltaNet states alike: a slot's
    states are zeroed when its sequence starts, never read."""
    lm = load_model(tiny_family(kind), device="cpu", backend="fp9")
    prompts = [_prompt(n, seed=30 + n) for n in (5, 9, 4)]
    cache = lm.model.make_slot_cache(4, 32)
    for t in (cache.kv.k, cache.kv.v, cache.conv, cache.recurrent):
        t.fill_(float("nan"))
    dec = TorchSlotDecoder(lm.model, cache, max_tokens=32)
    _step(dec, (3, prompts[0][:-1], 0))
    _step(dec, (0, prompts[1][:-1], 0))
    y = _step(dec, (3, prompts[0][-1:], 4), (0, prompts[1][-1:], 8), (2, prompts[2], 0))
    assert dec.last_batch.decode_rows is None
    got = dec.logits(y, [0, 1, y.shape[0] - 1])
    nxt = [int(row.argmax()) for row in got]
    fresh = _prompt(1, seed=1)
    y = _step(dec, *[(slot, [t], len(p)) for slot, t, p in zip((3, 0, 2), nxt, prompts)], (1, fresh, 0))
    assert dec.last_batch.decode_rows is not None, "a step of one token per slot takes the batched path"
    then = dec.logits(y)
    for row, row2, p, t in zip(got, then, prompts, nxt):
        want, want2 = _alone(lm.model, p, [t])
        torch.testing.assert_close(row, want, rtol=BATCH_VS_ALONE_TOL, atol=BATCH_VS_ALONE_TOL)
        torch.testing.assert_close(row2, want2, rtol=BATCH_VS_ALONE_TOL, atol=BATCH_VS_ALONE_TOL)
    torch.testing.assert_close(then[3], _alone(lm.model, fresh)[0], rtol=BATCH_VS_ALONE_TOL, atol=BATCH_VS_ALONE_TOL)


def test_batched_delta_rule_step_equals_the_mixer_per_sequence():
    """gated_delta_mixer_slots for three of five slots, three steps in a row, against
    gated_delta_mixer (token by token) on each sequence's own states; the two other slots
    are left as they were."""
    g = torch.Generator().manual_seed(7)
    heads = hk, dk, hv, dv = 2, 8, 4, 12
    c, kernel, n_slots = 2 * hk * dk + hv * dv, 4, 5
    conv_weight = torch.randn(c, 1, kernel, generator=g) * 0.5
    a_log, dt_bias = torch.randn(hv, generator=g) * 0.3, torch.randn(hv, generator=g)
    norm_weight, eps = 1 + 0.2 * torch.randn(dv, generator=g), 1e-6
    conv = torch.randn(n_slots, c, kernel - 1, generator=g)
    state = torch.randn(n_slots, hv, dk, dv, generator=g)
    conv_ref, state_ref = conv.clone(), state.clone()
    slots, weights = torch.tensor([4, 0, 2]), (conv_weight, a_log, dt_bias, norm_weight, eps)
    for _ in range(3):
        qkv, z = torch.randn(3, c, generator=g), torch.randn(3, hv * dv, generator=g)
        b, a = torch.randn(3, hv, generator=g), torch.randn(3, hv, generator=g)
        out = gated_delta_mixer_slots(qkv, z, b, a, conv, *weights, state, heads, slots)
        want = torch.cat([gated_delta_mixer(qkv[i:i + 1], z[i:i + 1], b[i:i + 1], a[i:i + 1], conv_ref[s], *weights,
                                            state_ref[s], heads) for i, s in enumerate(slots.tolist())])
        torch.testing.assert_close(out, want, rtol=BATCH_VS_ALONE_TOL, atol=BATCH_VS_ALONE_TOL)
        torch.testing.assert_close(conv, conv_ref, rtol=BATCH_VS_ALONE_TOL, atol=BATCH_VS_ALONE_TOL)
        torch.testing.assert_close(state, state_ref, rtol=BATCH_VS_ALONE_TOL, atol=BATCH_VS_ALONE_TOL)


def test_a_linear_attention_slot_refuses_a_run_that_skips_or_rewinds(tiny_family):
    """Slot 0 holds 5 tokens: a run from position 7 (a skip) or 2 (a rewind) is refused, in a
    step beside a valid run of another slot, before any state changes: afterwards both slots
    continue to the logits they have alone."""
    lm = load_model(tiny_family("qwen3_5"), device="cpu", backend="fp9")
    prompt, other = _prompt(6, seed=40), _prompt(3, seed=41)
    dec = TorchSlotDecoder(lm.model, lm.model.make_slot_cache(2, 16), max_tokens=16)
    _step(dec, (0, prompt[:5], 0), (1, other[:2], 0))
    for first in (7, 2):
        with pytest.raises(ValueError, match=f"slot 0: linear attention continues at token 5, got a run from "
                                             f"position {first}; its state cannot skip or rewind"):
            _step(dec, (0, prompt[5:], first), (1, other[2:], 2))
    y = _step(dec, (0, prompt[5:], 5), (1, other[2:], 2))
    for row, p in zip(dec.logits(y), (prompt, other)):
        torch.testing.assert_close(row, _alone(lm.model, p)[0], rtol=BATCH_VS_ALONE_TOL, atol=BATCH_VS_ALONE_TOL)
