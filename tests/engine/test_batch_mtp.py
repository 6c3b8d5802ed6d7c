"""MTP1 drafts inside continuous batching (engine.batch with mtp, the torch path): every
decoding sequence feeds (its last token, its MTP draft) in the step's one forward and
verifies the draft as engine.mtp does. Greedy output is token-identical to plain decoding
(alone and batched), drafts are both accepted and rejected, a sequence with a repetition
penalty takes none, sampled output repeats with its seed."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder, batch_decoder
from engine.generate import generate
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.test_batch import drain, drain_results
from tests.engine.test_deepseek import TINY_DS
from tests.engine.test_deepseek_mtp import KIND, mtp_checkpoint  # noqa: F401 - the fixture

SLOTS = 3


def _requests() -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(21)
    out = []
    for i in range(6):
        prompt = torch.randint(2, TINY_DS[KIND]["vocab_size"], (3 + 7 * i,), generator=g).tolist()   # 3 .. 38
        params = SamplingParams(max_tokens=10 + 4 * i, ignore_eos=True)
        if i == 2:
            params = SamplingParams(max_tokens=16, repetition_penalty=1.3, ignore_eos=True)
        if i == 4:
            params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=9, ignore_eos=True)
        out.append((prompt, params))
    return out


def _batch(lm, mtp: bool, slots: int = SLOTS, max_model_len: int = 96) -> BatchDecoder:
    return BatchDecoder(lm.model, lm.tokenizer, slots=slots, max_model_len=max_model_len, step_tokens=24,
                        path="torch", mtp=mtp)


@pytest.mark.parametrize("backend", ["fp9", "fleet"])
def test_batched_mtp_greedy_is_token_identical_and_drafts_are_verified(mtp_checkpoint, backend, report):
    from engine.fleet_ffn import FleetFfn
    fleet = FleetFfn(local_ducks=2) if backend == "fleet" else None
    try:
        lm = load_model(mtp_checkpoint, device="cpu", backend=fleet or "fp9")
        requests = _requests()
        with_mtp = drain_results(_batch(lm, mtp=True), requests)
        plain = drain(_batch(lm, mtp=False), requests)
        accepted = verified = 0
        for (prompt, params), got, want in zip(requests, with_mtp, plain):
            assert len(got.token_ids) == params.max_tokens
            if params.temperature == 0:
                assert got.token_ids == want
                assert got.token_ids == generate(lm.model, lm.tokenizer, prompt, params).token_ids
            if params.repetition_penalty != 1.0:
                assert got.stats.mtp is None     # drafts know no penalty: this one decodes plainly
                continue
            accepted, verified = accepted + got.stats.mtp[0], verified + got.stats.mtp[1]
        report(f"tiny {KIND} + MTP1 in a batch of {SLOTS} ({backend}): greedy identical, accept=1 "
               f"{accepted}/{verified}")
        assert 0 < accepted < verified, "both accepted and rejected drafts occur"
    finally:
        if fleet is not None:
            fleet.close()


def test_batched_mtp_sampling_repeats_with_its_seed_and_stops_at_the_cache_end(mtp_checkpoint):
    lm = load_model(mtp_checkpoint, device="cpu", backend="fp9")
    prompt = list(range(5, 17))
    sampled = (prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=4, ignore_eos=True))
    runs = [drain_results(_batch(lm, mtp=True), [sampled])[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30
    # a cache of 24 positions: a pair needs two, the last step feeds one; as many tokens as plain decoding
    greedy = (prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    got = drain_results(_batch(lm, mtp=True, slots=2, max_model_len=24), [greedy])[0]
    want = generate(lm.model, lm.tokenizer, prompt, greedy[1], max_model_len=24)
    assert got.finish_reason == "length" and got.token_ids == want.token_ids


def test_a_batch_takes_mtp_only_where_it_can(mtp_checkpoint, tiny_checkpoint):
    lm = load_model(mtp_checkpoint, device="cpu", backend="fp9")
    assert batch_decoder(lm.model, lm.tokenizer, 4, 64, mtp=True).mtp
    assert not batch_decoder(lm.model, lm.tokenizer, 4, 64, mtp=False).mtp
    # steps too short for a pair per sequence: batching goes on without drafts
    assert not batch_decoder(lm.model, lm.tokenizer, 4, 64, step_tokens=6, mtp=True).mtp
    with pytest.raises(ValueError, match="2 x model.max_seqs"):
        BatchDecoder(lm.model, lm.tokenizer, slots=4, max_model_len=64, step_tokens=6, path="torch", mtp=True)
    folder, _ = tiny_checkpoint("llama")     # no MTP head: plain batching
    llama = load_model(folder, device="cpu", backend="fp9")
    assert not batch_decoder(llama.model, llama.tokenizer, 2, 32, mtp=True).mtp
