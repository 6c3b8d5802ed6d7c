"""The prefix cache of continuous batching (engine.prefix_cache, engine.batch): a sequence whose prompt begins
with tokens a slot already holds (the earlier turns of its chat, a system prompt another
sequence shares) prefills only the rest, and its tokens are those it gets with the cache
off, bit for bit: on the native path and the torch path (Llama, Qwen3, Qwen3-MoE), on
DeepSeek's latent cache with MTP drafts, through the fp9 kernels and through real ducks.
Slots are taken least recently freed first; Qwen3.5 (a DeltaNet state per sequence) has no
prefix cache."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder
from engine.prefix_cache import PREFIX_COPY_MIN, common_prefix
from engine.tokens import SamplingParams
from engine.loader import load_model
from tests.engine.conftest import TINY
from tests.engine.test_batch import drain_results
from tests.engine.test_deepseek_mtp import mtp_checkpoint  # noqa: F401 - the fixture


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(batch: BatchDecoder, requests) -> list:
    return drain_results(batch, requests)


def _fp9_batch(tiny_checkpoint, kind: str, slots: int, step_tokens: int, max_tokens: int):
    """(a native-path batch of a tiny fp9 model, its vocabulary size, greedy params of max_tokens)."""
    folder, _ = tiny_checkpoint(kind)
    lm = load_model(folder, device="cpu", backend="fp9")
    batch = BatchDecoder(lm.model, lm.tokenizer, slots=slots, max_model_len=96, step_tokens=step_tokens)
    return batch, TINY[kind]["vocab_size"], SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _turns(vocab: int) -> tuple[list[int], SamplingParams, list[int]]:
    """A first turn's prompt, the sampling of both turns, the second turn's new tokens."""
    return _prompt(vocab, 37, 1), SamplingParams(max_tokens=9, ignore_eos=True), _prompt(vocab, 5, 2)


def _two_turns(lm, path: str, cache: bool, mtp: bool = False, slots: int = 2):
    batch = BatchDecoder(lm.model, lm.tokenizer, slots=slots, max_model_len=96, step_tokens=16, path=path,
                         mtp=mtp, prefix_cache=cache)
    first, params, more = _turns(lm.model.config.vocab_size)
    one = _run(batch, [(first, params)])[0]
    second = first + one.token_ids + more      # the chat so far, then the user's next words
    sampled = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    two = _run(batch, [(second, params), (second, sampled)])
    return one, two, batch


@pytest.mark.parametrize("kind,path", [("llama", "native"), ("qwen3", "native"), ("qwen3_moe", "native"),
                                       ("qwen3", "torch"), ("qwen3_moe", "torch")])
def test_the_next_turn_reads_only_its_new_tokens_and_decodes_the_same(kind, path, tiny_checkpoint):
    folder, _ = tiny_checkpoint(kind)
    lm = load_model(folder, device="cpu", backend="fp9")
    on = _two_turns(lm, path, cache=True)
    off = _two_turns(lm, path, cache=False)
    assert [r.token_ids for r in [on[0], *on[1]]] == [r.token_ids for r in [off[0], *off[1]]]
    first, params, more = _turns(TINY[kind]["vocab_size"])
    held = len(first) + params.max_tokens - 1          # its last token was never fed
    greedy, sampled = on[1]
    assert on[0].stats.cached == 0
    assert greedy.stats.cached == held                 # the free slot of the first turn, continued
    # the sampled one ran beside it: its prefix was copied from the decoding sequence's slot
    assert sampled.stats.cached == held
    assert on[2].prefixes.cached_tokens == 2 * held and off[2].prefixes.cached_tokens == 0
    assert all(r.stats.cached == 0 for r in off[1])


def test_through_real_ducks_and_with_mtp_drafts_on_the_latent_cache(mtp_checkpoint):
    from engine.fleet_ffn import FleetFfn
    fleet = FleetFfn(local_ducks=2)
    try:
        lm = load_model(mtp_checkpoint, device="cpu", backend=fleet)
        on = _two_turns(lm, "torch", cache=True, mtp=True)
        off = _two_turns(lm, "torch", cache=False, mtp=True)
        assert [r.token_ids for r in [on[0], *on[1]]] == [r.token_ids for r in [off[0], *off[1]]]
        assert all(r.stats.cached > PREFIX_COPY_MIN and r.stats.mtp[1] > 0 for r in on[1])
        first, params, _ = _turns(lm.model.config.vocab_size)
        # the MTP layer read the first turn's tokens up to its last accepted draft, one position less is sure
        assert max(r.stats.cached for r in on[1]) <= len(first) + params.max_tokens - 2
    finally:
        fleet.close()


def test_a_new_chat_evicts_the_least_recently_freed_slot(tiny_checkpoint):
    batch, vocab, params = _fp9_batch(tiny_checkpoint, "qwen3", slots=2, step_tokens=16, max_tokens=4)
    a, b, c = (_prompt(vocab, 30, s) for s in (10, 11, 12))
    ra = _run(batch, [(a, params)])[0]
    rb = _run(batch, [(b, params)])[0]
    assert _run(batch, [(c, params)])[0].stats.cached == 0   # took a's slot, freed before b's
    assert _run(batch, [(b + rb.token_ids, params)])[0].stats.cached == len(b) + 3
    assert _run(batch, [(a + ra.token_ids, params)])[0].stats.cached == 0


def test_a_shared_system_prompt_is_copied_only_when_long_enough_and_a_failed_step_keeps_nothing(tiny_checkpoint):
    batch, vocab, params = _fp9_batch(tiny_checkpoint, "llama", slots=3, step_tokens=64, max_tokens=3)
    system = _prompt(vocab, 40, 20)
    short = system[:PREFIX_COPY_MIN - 1]
    _run(batch, [(system + _prompt(vocab, 30, 21), params)])
    # a new chat with the same system prompt is not the first chat's next turn (that slot holds 32 tokens
    # more): it takes a fresh slot, into which the system prompt is copied, and the first chat keeps its own
    shared = _run(batch, [(system + _prompt(vocab, 5, 22), params)])[0]
    assert shared.stats.cached == len(system)
    assert len(batch.prefixes.held[0]) == len(system) + 30 + 2
    assert _run(batch, [(short + _prompt(vocab, 8, 23), params)])[0].stats.cached == 0
    seq = batch.add(system + [5, 6], params)
    assert seq.cached == len(system)
    batch.step()
    batch.fail_all()
    assert batch.prefixes.held[seq.slot] == []


def test_qwen35_keeps_no_prefix_cache(tiny_family):
    folder = tiny_family("qwen3_5")
    lm = load_model(folder, device="cpu", backend="fp9")
    batch = BatchDecoder(lm.model, lm.tokenizer, slots=2, max_model_len=64, step_tokens=16, path="torch")
    assert not batch.prefix_cache
    prompt = _prompt(lm.model.config.vocab_size, 20, 3)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = _run(batch, [(prompt, params)])[0]
    assert _run(batch, [(prompt + first.token_ids, params)])[0].stats.cached == 0


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([2, 2, 3], [1, 2, 3]) == 0
    a = list(range(1000))
    for n in (1, 2, 500, 999):
        assert common_prefix(a, a[:n] + [-1] + a[n + 1:]) == n


@pytest.mark.parametrize("path", ["native", "torch"])
def test_requests_arriving_together_read_their_shared_prompt_once(path, tiny_checkpoint):
    """Three requests added in one step: two with one system prompt and tails of their own, and
    the same prompt twice (a request's n choices). The later ones wait for the first to read what
    they share, copy it and read only the rest; every one gets the tokens it gets with the cache off."""
    folder, _ = tiny_checkpoint("qwen3")
    lm = load_model(folder, device="cpu", backend="fp9")
    vocab = TINY["qwen3"]["vocab_size"]
    system = _prompt(vocab, 40, 30)
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    requests = [(system + _prompt(vocab, 7, 31), greedy), (system + _prompt(vocab, 4, 32), greedy),
                (system + _prompt(vocab, 7, 31), SamplingParams(max_tokens=5, temperature=1.0, seed=3,
                                                                ignore_eos=True))]

    def run(cache: bool):
        batch = BatchDecoder(lm.model, lm.tokenizer, slots=3, max_model_len=96, step_tokens=16, path=path,
                             prefix_cache=cache)
        return drain_results(batch, requests)

    on, off = run(True), run(False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.stats.cached for r in on] == [0, len(system), len(system) + 7 - 1]
