"""Continuous batching for DeepSeek-V3 / V3.2 (engine.batch on the torch path, the latent
cache per slot: engine.models.deepseek_v3.SlotMlaCache): every request's tokens are those
it gets alone and those of generate(); a decode step's one absorbed call over the gathered
slots gives each sequence's logits alone; a CPU host batches the family on the torch path
since the native decoder lacks it."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder, batch_decoder
from engine.generate import generate
from engine.loader import load_model
from engine.models import deepseek_v3 as ds
from engine.tokens import SamplingParams
from tests.engine.test_batch import drain
from tests.engine.test_deepseek import TINY_DS, ds_checkpoint  # noqa: F401 - the fixture

KINDS = sorted(TINY_DS)


@pytest.fixture
def ds_folder(ds_checkpoint):
    return lambda kind: ds_checkpoint(kind)[0]


def _requests(vocab: int, n: int = 6) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        prompt = torch.randint(2, vocab, (4 + 6 * i,), generator=g).tolist()   # 4 .. 34 tokens
        params = SamplingParams(max_tokens=5 + 2 * i, ignore_eos=True)
        if i == 3:
            params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
        out.append((prompt, params))
    return out


def _batch(lm, slots: int, step_tokens: int) -> BatchDecoder:
    return BatchDecoder(lm.model, lm.tokenizer, slots=slots, max_model_len=64, step_tokens=step_tokens, path="torch")


# step_tokens 24: prefill runs past ABSORB_MAX_TOKENS take the expanded MLA path, shorter ones the absorbed
@pytest.mark.parametrize("kind", KINDS)
def test_a_deepseek_batch_gives_each_request_what_it_gets_alone(kind, ds_folder):
    lm = load_model(ds_folder(kind), device="cpu", backend="fp9")
    requests = _requests(TINY_DS[kind]["vocab_size"])
    together = drain(_batch(lm, 3, 24), requests)
    assert together == [drain(_batch(lm, 1, 24), [r])[0] for r in requests]
    for (prompt, params), got in zip(requests, together):
        assert len(got) == params.max_tokens
        if params.temperature == 0:
            assert generate(lm.model, lm.tokenizer, prompt, params).token_ids == got


def test_deepseek_batch_through_real_ducks(ds_folder):
    from engine.fleet_ffn import FleetFfn
    fleet = FleetFfn(local_ducks=2)
    try:
        lm = load_model(ds_folder("deepseek_v3"), device="cpu", backend=fleet)
        requests = _requests(TINY_DS["deepseek_v3"]["vocab_size"], n=4)
        together = drain(_batch(lm, 3, 16), requests)
        for (prompt, params), got in zip(requests, together):
            if params.temperature == 0:
                assert generate(lm.model, lm.tokenizer, prompt, params).token_ids == got
    finally:
        fleet.close()


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v3_plain"])
def test_deepseek_slot_logits_match_one_sequence_alone(kind, ds_folder):
    """A mixed step (two slots decoding, one prefilling 20 tokens: the expanded path), then a
    decode step of all three in one absorbed call, against each sequence alone in a fresh
    cache. The slot cache starts full of NaN: what a slot has not written must not leak."""
    from engine.batch_torch import TorchSlotDecoder

    lm = load_model(ds_folder(kind), device="cpu", backend="fp9")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, TINY_DS[kind]["vocab_size"], (n,), generator=g).tolist() for n in (6, 11, 20)]
    cache = lm.model.make_slot_cache(4, 48)
    cache.latent.fill_(float("nan"))
    cache.k_rope.fill_(float("nan"))
    dec = TorchSlotDecoder(lm.model, cache, max_tokens=48)
    for slot, p in ((3, prompts[0]), (0, prompts[1])):
        dec.layers(torch.tensor(p[:-1]), torch.arange(len(p) - 1), torch.full((len(p) - 1,), slot))
    ids = [prompts[0][-1], prompts[1][-1]] + prompts[2]
    positions = [len(prompts[0]) - 1, len(prompts[1]) - 1] + list(range(len(prompts[2])))
    y = dec.layers(torch.tensor(ids), torch.tensor(positions), torch.tensor([3, 0] + [2] * len(prompts[2])))
    got = dec.logits(y, [0, 1, len(ids) - 1])
    nxt = [int(row.argmax()) for row in got]
    y = dec.layers(torch.tensor(nxt), torch.tensor([len(p) for p in prompts]), torch.tensor([3, 0, 2]))
    assert dec.last_batch.decode_rows is not None, "one token per slot takes the one-call path"
    then = dec.logits(y)
    assert torch.isfinite(then).all()
    for row, row2, p, t in zip(got, then, prompts, nxt):
        alone = lm.model.make_cache(48)
        with torch.inference_mode():
            want = lm.model.compute_logits(lm.model(torch.tensor(p), torch.arange(len(p)), alone)[-1:])[0]
            want2 = lm.model.compute_logits(lm.model(torch.tensor([t]), torch.tensor([len(p)]), alone))[0]
        torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row2, want2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v3_plain"])
def test_a_static_slot_step_with_an_mtp_pair_equals_the_eager_step(kind, ds_folder):
    """The step a CUDA graph replays (engine.gpu.batch_graphs: SlotBatch.static under static_decode,
    each row over its whole slot, masked on the device) against the eager step of the same rows: a
    pair of one sequence (its token and a draft, consecutive positions), another sequence's one row,
    and a padding row (row 0 again, writing at the slot's last position). The cache is NaN where
    nothing was written: the whole-slot read must not let it in. Run here on the CPU."""
    from engine.batch_torch import TorchSlotDecoder
    from engine.layers import SlotBatch, static_decode

    lm = load_model(ds_folder(kind), device="cpu", backend="fp9")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, TINY_DS[kind]["vocab_size"], (n,), generator=g).tolist() for n in (7, 12)]
    cache = lm.model.make_slot_cache(4, 40)
    for t in cache.per_position():
        t.fill_(float("nan"))
    dec = TorchSlotDecoder(lm.model, cache, max_tokens=40)
    for slot, p in ((2, prompts[0]), (1, prompts[1])):
        dec.layers(torch.tensor(p), torch.arange(len(p)), torch.full((len(p),), slot))
    ids, positions, slots = [5, 9, 17], [7, 8, 12], [2, 2, 1]   # slot 2: token + draft; slot 1: one token
    before = [t.clone() for t in cache.per_position()]
    eager = dec.layers(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots))
    for t, saved in zip(cache.per_position(), before):
        t.copy_(saved)
    batch = SlotBatch.static(cache, 4, "cpu")
    batch.positions.copy_(torch.tensor(positions + positions[:1]))
    batch.slots.copy_(torch.tensor(slots + slots[:1]))
    batch.flat.copy_(torch.tensor([s * 40 + p for s, p in zip(slots, positions)] + [slots[0] * 40 + 39]))
    with torch.inference_mode(), static_decode():
        static = lm.model(torch.tensor(ids + ids[:1]), batch.positions, batch)
    assert torch.isfinite(static).all()
    torch.testing.assert_close(static[:3], eager, rtol=1e-5, atol=1e-5)


def test_a_cpu_host_batches_deepseek_on_the_torch_path_with_v32s_indexer_cache(ds_folder):
    lm = load_model(ds_folder("deepseek_v32"), device="cpu", backend="fp9")
    batch = batch_decoder(lm.model, lm.tokenizer, slots=2, max_model_len=64)
    assert batch is not None and batch.path == "torch" and isinstance(batch.cache, ds.SlotMlaCache)
    assert batch.cache.latent.shape[:3] == (TINY_DS["deepseek_v32"]["num_hidden_layers"], 2, 64)
    assert batch.cache.index_k.shape == (TINY_DS["deepseek_v32"]["num_hidden_layers"], 2, 64, 32)
    assert lm.model.make_slot_cache(2, 128).index_scale.shape[1:] == (2, 128)   # past index_topk
