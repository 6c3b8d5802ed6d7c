"""Continuous batching on the CPU host (engine.batch): many requests in one forward
per step, each token in its own sequence's cache slot. Every request's tokens must be
those it gets alone (a batch of one), bit for bit, and those of generate(); through
the local fp9 kernels and through a fleet of real ducks."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder
from engine.generate import generate
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.conftest import TINY

KINDS = ["llama", "qwen3", "qwen3_moe"]
REQUESTS = 7      # more than the slots: some wait for a slot to free
SLOTS = 3


def _requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(REQUESTS):
        prompt = torch.randint(2, vocab, (3 + 5 * i,), generator=g).tolist()   # 3 .. 33 tokens: chunked prefills
        params = SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)
        if i == 2:
            params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
        if i == 4:
            params = SamplingParams(max_tokens=12, repetition_penalty=1.3, ignore_eos=True)
        out.append((prompt, params))
    return out


def drain(batch: BatchDecoder, requests) -> list[list[int]]:
    """Every request through the batch, added as slots free; their tokens, in order."""
    return [r.token_ids for r in drain_results(batch, requests)]


def drain_results(batch: BatchDecoder, requests) -> list:
    """drain()'s GenerationResults."""
    waiting, seqs = list(enumerate(requests)), {}
    while waiting or batch.active:
        while waiting:
            seq = batch.add(*waiting[0][1])
            if seq is None:
                break
            seqs[waiting.pop(0)[0]] = seq
        batch.step()
    assert len(batch.free) == batch.slots and batch.steps > 0
    return [seqs[i].result for i in range(len(requests))]


def _run_batch(lm, requests, slots: int, step_tokens: int = 16, path: str = "native") -> list[list[int]]:
    return drain(BatchDecoder(lm.model, lm.tokenizer, slots=slots, max_model_len=64, step_tokens=step_tokens,
                              path=path), requests)


@pytest.fixture(scope="module", params=["fp9", "fleet"])
def backend(request):
    if request.param == "fp9":
        yield lambda: "fp9"
        return
    from engine.fleet_ffn import FleetFfn
    made = []

    def make():
        made.append(FleetFfn(local_ducks=2))
        return made[-1]
    yield make
    for f in made:
        f.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_gives_each_request_what_it_gets_alone(kind, tiny_checkpoint, backend):
    folder, _ = tiny_checkpoint(kind)
    lm = load_model(folder, device="cpu", backend=backend())
    requests = _requests(TINY[kind]["vocab_size"])
    together = _run_batch(lm, requests, SLOTS)
    alone = [_run_batch(lm, [r], 1)[0] for r in requests]
    assert together == alone
    for (prompt, params), got in zip(requests, together):
        assert len(got) == params.max_tokens
        if params.temperature == 0:   # generate(): prefill in torch, then native steps
            assert generate(lm.model, lm.tokenizer, prompt, params).token_ids == got


def test_stop_cancel_and_length_end_a_sequence_and_free_its_slot(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    lm = load_model(folder, device="cpu", backend="fp9")
    vocab = TINY["llama"]["vocab_size"]
    batch = BatchDecoder(lm.model, lm.tokenizer, slots=2, max_model_len=20, step_tokens=8)
    prompt = list(range(2, 12))
    alone = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    stop_word = lm.tokenizer.decode(alone.token_ids[2:3])
    stopped = batch.add(prompt, SamplingParams(max_tokens=8, stop=(stop_word,), ignore_eos=True))
    cancel = {"now": False}
    cancelled = batch.add(prompt[:4], SamplingParams(max_tokens=30, ignore_eos=True),
                          should_stop=lambda: cancel["now"])
    assert batch.add(prompt, SamplingParams()) is None          # both slots taken
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add(list(range(2, 22)), SamplingParams())
    while stopped.result is None:
        batch.step()
    assert stopped.result.finish_reason == "stop" and stop_word not in stopped.result.text
    cancel["now"] = True
    assert cancelled in batch.step() and cancelled.result.finish_reason == "cancelled"
    assert sorted(batch.free) == [0, 1] and not batch.active
    long = batch.add(list(range(2, 2 + 15)), SamplingParams(max_tokens=100, ignore_eos=True))
    while long.result is None:
        batch.step()
    # as generate() in a cache of 20: the positions 15..19 are fed, 6 tokens come out
    assert long.result.finish_reason == "length" and len(long.result.token_ids) == 20 - 15 + 1
    assert long.result.token_ids == generate(lm.model, lm.tokenizer, list(range(2, 17)),
                                             SamplingParams(max_tokens=100, ignore_eos=True), max_model_len=20).token_ids
    assert all(0 <= t < vocab for t in long.result.token_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_path_batches_what_a_gpu_host_runs(kind, tiny_checkpoint, backend, monkeypatch):
    """The torch path (engine.batch_torch: a GPU host's, here on the CPU): each request's
    tokens are those of generate() on the torch path alone, through the fp9 kernels and
    through real ducks; the steps mix decode tokens and prefill chunks of several slots."""
    monkeypatch.setenv("DUCK_CPU_NATIVE", "0")
    folder, _ = tiny_checkpoint(kind)
    lm = load_model(folder, device="cpu", backend=backend())
    requests = _requests(TINY[kind]["vocab_size"])
    together = _run_batch(lm, requests, SLOTS, path="torch")
    for (prompt, params), got in zip(requests, together):
        assert len(got) == params.max_tokens
        if params.temperature == 0:
            assert generate(lm.model, lm.tokenizer, prompt, params).token_ids == got
    assert together == [_run_batch(lm, [r], 1, path="torch")[0] for r in requests]


def test_torch_batch_logits_match_one_sequence_alone(tiny_checkpoint):
    """One step of three sequences at different positions (two decoding, one prefilling),
    then a decode step of all three (one masked call over the gathered slots), against each
    sequence alone in a fresh cache: the same logits within float rounding. The slot cache
    starts full of NaN: what a slot has not written must never reach a result."""
    folder, _ = tiny_checkpoint("qwen3")
    lm = load_model(folder, device="cpu", backend="fp9")
    from engine.batch_torch import TorchSlotDecoder
    from engine.layers import SlotKVCache

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, TINY["qwen3"]["vocab_size"], (n,), generator=g).tolist() for n in (5, 9, 4)]
    cache = SlotKVCache.allocate(lm.model.config, 4, 32, torch.float32)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    dec = TorchSlotDecoder(lm.model, cache, max_tokens=32)
    # fill slots 3 and 0 with the first two prompts but their last token, then one mixed step
    for slot, p in ((3, prompts[0]), (0, prompts[1])):
        dec.layers(torch.tensor(p[:-1]), torch.arange(len(p) - 1), torch.full((len(p) - 1,), slot))
    ids = [prompts[0][-1], prompts[1][-1]] + prompts[2]
    positions = [len(prompts[0]) - 1, len(prompts[1]) - 1] + list(range(len(prompts[2])))
    slots = [3, 0] + [2] * len(prompts[2])
    y = dec.layers(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots))
    got = dec.logits(y, [0, 1, len(ids) - 1])
    nxt = [int(row.argmax()) for row in got]
    y = dec.layers(torch.tensor(nxt), torch.tensor([len(p) for p in prompts]), torch.tensor([3, 0, 2]))
    assert dec.last_batch.decode_rows is not None, "a step of one token per slot takes the one-call path"
    then = dec.logits(y)
    for row, row2, p, t in zip(got, then, prompts, nxt):
        alone = lm.model.make_cache(32)
        with torch.inference_mode():
            want = lm.model.compute_logits(lm.model(torch.tensor(p), torch.arange(len(p)), alone)[-1:])[0]
            want2 = lm.model.compute_logits(lm.model(torch.tensor([t]), torch.tensor([len(p)]), alone))[0]
        torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row2, want2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_the_static_decode_step_of_a_graph_matches_the_eager_step(kind, tiny_checkpoint):
    """What engine.gpu.batch_graphs captures, run on the CPU: a decode step under
    static_decode over SlotBatch.static (each row's slot over the whole cache, masked on
    the device; padding rows repeating row 0) against the eager step on a copy of the same
    cache, whose unwritten positions are NaN: the same hidden states and cache writes (the
    padding row writes at the last position of row 0's slot only)."""
    from engine.batch_torch import TorchSlotDecoder
    from engine.layers import SlotBatch, SlotKVCache, static_decode

    folder, _ = tiny_checkpoint(kind)
    lm = load_model(folder, device="cpu", backend="fp9")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, TINY[kind]["vocab_size"], (n,), generator=g).tolist() for n in (5, 9, 4)]
    cache = SlotKVCache.allocate(lm.model.config, 4, 32, torch.float32)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    dec = TorchSlotDecoder(lm.model, cache, max_tokens=32)
    for slot, p in zip((3, 0, 1), prompts):
        dec.layers(torch.tensor(p), torch.arange(len(p)), torch.full((len(p),), slot))
    ids, positions, slots = [7, 8, 9], [len(p) for p in prompts], [3, 0, 1]
    eager_cache = SlotKVCache(cache.k.clone(), cache.v.clone())
    want = TorchSlotDecoder(lm.model, eager_cache, max_tokens=32).layers(
        torch.tensor(ids), torch.tensor(positions), torch.tensor(slots))
    batch = SlotBatch.static(cache, 4, "cpu")   # a bucket of 4: the last row repeats row 0
    batch.positions.copy_(torch.tensor(positions + positions[:1]))
    batch.slots.copy_(torch.tensor(slots + slots[:1]))
    last = cache.max_model_len - 1
    batch.flat.copy_(batch.slots * cache.max_model_len + torch.tensor(positions + [last]))
    with torch.inference_mode(), static_decode():
        got = lm.model(torch.tensor(ids + ids[:1]), batch.positions, batch)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[3], got[0], rtol=1e-5, atol=1e-5)
    for s, p in zip(slots, positions):
        torch.testing.assert_close(cache.k[:, s, p], eager_cache.k[:, s, p], rtol=1e-5, atol=1e-5)
    assert not cache.k[:, slots[0], last].isnan().any(), "the padding row wrote at its slot's last position"
    cache.k[:, slots[0], last] = float("nan")
    assert torch.equal(cache.k.isnan(), eager_cache.k.isnan()), "the static step wrote where the eager one did not"


def test_slot_batch_plans_refuse_what_would_corrupt_a_cache(tiny_checkpoint):
    from engine.layers import SlotBatch, SlotKVCache

    folder, _ = tiny_checkpoint("llama")
    lm = load_model(folder, device="cpu", backend="fp9")
    cache = SlotKVCache.allocate(lm.model.config, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="slot 5 is not one of the cache's 2"):
        SlotBatch.plan(cache, [0], [5], "cpu")
    with pytest.raises(ValueError, match="consecutive"):
        SlotBatch.plan(cache, [0, 2], [1, 1], "cpu")
    with pytest.raises(ValueError, match="outside the cache"):
        SlotBatch.plan(cache, [7, 8], [0, 0], "cpu")
    with pytest.raises(ValueError, match="one run"):
        SlotBatch.plan(cache, [0, 0, 1], [0, 1, 0], "cpu")
    plan = SlotBatch.plan(cache, [3, 0, 1], [1, 0, 0], "cpu")
    assert plan.runs == [(1, 0, 1), (0, 1, 3)] and plan.ends == [4, 2] and plan.flat.tolist() == [11, 0, 1]


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_lone_prompt_reads_in_prefill_chunks_and_a_shared_step_in_step_tokens(path, tiny_checkpoint, monkeypatch):
    """A step holds step_tokens while a sequence decodes and prefill_chunk while none does (no one
    waits behind a lone prompt: fewer, larger steps, each expert read once per step); the tokens
    are the same either way."""
    if path == "torch":
        monkeypatch.setenv("DUCK_CPU_NATIVE", "0")
    folder, _ = tiny_checkpoint("qwen3_moe")
    lm = load_model(folder, device="cpu", backend="fp9")
    vocab = TINY["qwen3_moe"]["vocab_size"]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, vocab, (40,), generator=g).tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    batch = BatchDecoder(lm.model, lm.tokenizer, slots=2, max_model_len=64, step_tokens=8, path=path,
                         prefill_chunk=32)
    assert (batch.step_tokens, batch.prefill_chunk) == (8, 32)
    batch.trace = []
    lone = batch.add(prompt, params)
    while lone.result is None:
        batch.step()
    reads = [s["prefill"] for s in batch.trace if s["prefill"]]
    assert reads == [32, 8], "alone: a chunk of prefill_chunk, then the rest"
    batch.trace = []
    first = batch.add(prompt[:5], SamplingParams(max_tokens=30, ignore_eos=True))
    batch.step()                     # its prompt read: it decodes from now on
    second = batch.add(prompt[::-1], params)
    while second.result is None:
        batch.step()
    shared = [s for s in batch.trace[1:] if s["prefill"]]
    assert shared and all(s["tokens"] <= 8 for s in shared), "beside a decoding sequence: steps of step_tokens"
    assert lone.result.token_ids == generate(lm.model, lm.tokenizer, prompt, params).token_ids
    assert second.result.token_ids == generate(lm.model, lm.tokenizer, prompt[::-1], params).token_ids
    while first.result is None:
        batch.step()
