"""Chunked prefill (engine.prefill) against the token-by-token path, for every
family on tiny random checkpoints (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3,
Qwen3.5-MoE), through the fleet (local ducks) and the local fp9 backend:
chunks of 1, 7, 64 and 200 tokens over a prompt longer than a chunk. Each
chunk is one forward whose FFN calls carry all its tokens (the fleet cuts
them into requests of at most the ducks' limit, pipelined). Also generate()'s
first logits for each chunk size (the native CPU decoder's prefill where the
family has one, else torch), and the chunk's validation."""
from __future__ import annotations

import pytest
import torch

from engine.fleet_ffn import FleetFfn
from engine.generate import generate
from engine.loader import load_model
from engine.lanes import StepTrace
from engine.prefill import check_chunk, prefill_chunks, prefill_hidden, prefill_hidden_overlapped
from engine.tokens import SamplingParams
from native.transport.step import HostStep
from tests.engine.conftest import TINY, hf_model, write_word_tokenizer

# max |prefill - token by token| / max |token by token| over every position's logits. The
# same fp32 (and fp9) math; what differs is how sums are ordered: attention over a chunk
# vs one query, GEMMs of T rows vs one, the fleet's partials per request.
PREFILL_VS_STEPWISE_RTOL = 1e-4
CHUNKS = (1, 7, 64, 200)
PROMPT = 230            # longer than every chunk: 200 + 30
DUCKS = 3
FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_moe")


def _hf(kind: str):
    if kind in TINY:
        return hf_model(kind), TINY[kind]["vocab_size"]
    if kind == "deepseek_v3":
        from tests.engine.test_deepseek import TINY_DS, hf_deepseek
        return hf_deepseek(kind), TINY_DS[kind]["vocab_size"]
    from tests.engine.test_qwen3_5 import TINY as TINY_35, _hf_model
    return _hf_model(kind), TINY_35[kind]["vocab_size"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """kind -> (checkpoint folder, vocabulary size)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            model, vocab = _hf(kind)
            model.save_pretrained(folder)
            write_word_tokenizer(folder, vocab)
            made[kind] = (folder, vocab)
        return made[kind]

    return make


def _prompt(vocab: int, n: int = PROMPT, seed: int = 4) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def stepwise_logits(model, prompt: list[int]) -> torch.Tensor:
    """Every position's logits [n, V], one token per forward (decode steps)."""
    cache = model.make_cache(len(prompt))
    return torch.cat([model.compute_logits(model(torch.tensor([tok]), torch.tensor([i]), cache))
                      for i, tok in enumerate(prompt)])


@torch.inference_mode()
def chunked_logits(model, prompt: list[int], chunk: int) -> torch.Tensor:
    """Every position's logits [n, V], chunk tokens per forward (the prefill's cut)."""
    cache = model.make_cache(len(prompt))
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    return torch.cat([model.compute_logits(model(ids[part], positions[part], cache))
                      for part in prefill_chunks(len(prompt), chunk)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("backend", ["fleet", "fp9"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_prefill_in_chunks_equals_token_by_token(kind, backend, family, report):
    folder, vocab = family(kind)
    ffn = FleetFfn(local_ducks=DUCKS) if backend == "fleet" else "fp9"
    lm = load_model(folder, backend=ffn)
    try:
        if backend == "fleet":
            lm.ffn.session.request_tokens = 16   # a 200-token chunk: 13 requests per layer, 2 in flight
        prompt = _prompt(vocab)
        steps = stepwise_logits(lm.model, prompt)
        errors = {}
        for chunk in CHUNKS:
            errors[chunk] = _rel(chunked_logits(lm.model, prompt, chunk), steps)
        if backend == "fleet":
            assert lm.ffn.session.last_requests > 1 and lm.ffn.bytes_streamed > 0
        report(f"tiny {kind} via {backend}: prefill in chunks vs token by token, {PROMPT} tokens, rel err per chunk "
               + ", ".join(f"{c}: {e:.1e}" for c, e in errors.items()))
        worst = max(errors, key=errors.get)
        assert errors[worst] <= PREFILL_VS_STEPWISE_RTOL, f"chunk {worst}: {errors[worst]:.2e}"
    finally:
        lm.ffn.close()


NATIVE_FAMILIES = ("llama", "qwen3", "qwen3_moe")   # engine.cpu.host_model.SUPPORTED


@pytest.mark.parametrize("kind,backend", [(k, "fp9") for k in FAMILIES] + [(k, "fleet") for k in NATIVE_FAMILIES])
def test_generate_prefills_in_chunks(kind, backend, family, monkeypatch):
    """generate()'s first logits and greedy tokens do not depend on the chunk; chunk 1 is the
    token-by-token path (the native CPU decoder's prefill for the Llama family, through the
    local fp9 kernels or the fleet; torch for the others)."""
    folder, vocab = family(kind)
    lm = load_model(folder, backend=FleetFfn(local_ducks=DUCKS) if backend == "fleet" else "fp9")
    try:
        tokens_per_call = []
        forward = lm.ffn.forward
        lm.ffn.forward = lambda layer, x, *a, **k: tokens_per_call.append(x.shape[0]) or forward(layer, x, *a, **k)
        run = HostStep.run   # the native decoder's layers over the fleet: one C call for all of them
        monkeypatch.setattr(HostStep, "run", lambda step, ntok: tokens_per_call.append(ntok) or run(step, ntok))
        prompt, params = _prompt(vocab, seed=6), SamplingParams(max_tokens=6, ignore_eos=True)
        runs = {c: generate(lm.model, lm.tokenizer, prompt, params, keep_logits=True, prefill_chunk=c)
                for c in CHUNKS}
        assert max(tokens_per_call) == max(CHUNKS)     # a chunk is one FFN call per layer (or C step)
    finally:
        lm.ffn.close()
    first = {c: r.logits[0] for c, r in runs.items()}
    for c in CHUNKS:
        assert _rel(first[c], first[1]) <= PREFILL_VS_STEPWISE_RTOL, c
        assert runs[c].token_ids == runs[1].token_ids, c


@pytest.mark.parametrize("kind", FAMILIES)
def test_overlapped_prefill_is_the_chunked_prefill_bit_for_bit(kind, family):
    """Two chunks in flight (chunk k + 1 one stage behind chunk k, the FFN calls on a worker
    thread, through local ducks) give the chunk-by-chunk prefill's hidden states and caches
    exactly, for every cache kind: KV, MLA latents, DeltaNet conv and recurrent states."""
    from engine.batch_torch import cache_tensors

    folder, vocab = family(kind)
    lm = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        assert lm.ffn.overlaps_host
        model, prompt = lm.model, torch.tensor(_prompt(vocab, seed=8))
        positions = torch.arange(len(prompt))
        with torch.inference_mode():
            for chunk in (7, 64, 100):      # 33, 4 and 3 chunks (the last one short)
                ref_cache, cache = model.make_cache(PROMPT), model.make_cache(PROMPT)
                ref = prefill_hidden(lambda i, p: model(i, p, ref_cache), prompt, positions, chunk)
                calls = []
                forward = lm.ffn.forward
                lm.ffn.forward = lambda layer, x, *a, **k: calls.append(x.shape[0]) or forward(layer, x, *a, **k)
                trace = StepTrace()
                try:
                    got = prefill_hidden_overlapped(model, cache, prompt, positions, chunk, trace=trace)
                finally:
                    lm.ffn.forward = forward
                assert torch.equal(got, ref), chunk
                for a, b in zip(cache_tensors(cache), cache_tensors(ref_cache)):
                    assert torch.equal(a, b), chunk
                n_chunks = len(prefill_chunks(PROMPT, chunk))
                assert len(calls) == trace.calls == n_chunks * len(model.ffn_modules())   # one call per layer and chunk
                assert max(calls) == chunk and trace.wall > 0 and trace.host > 0
                last = prefill_hidden_overlapped(model, model.make_cache(PROMPT), prompt, positions, chunk,
                                                 last_only=True)
                assert torch.equal(last, ref[-1:])
    finally:
        lm.ffn.close()


def test_chunk_is_checked():
    assert [(p.start, p.stop) for p in prefill_chunks(10, 4)] == [(0, 4), (4, 8), (8, 10)]
    assert prefill_chunks(3, 512) == [slice(0, 3)]
    for bad in (0, -1, 1 << 17, 2.0, True):
        with pytest.raises(ValueError, match="prefill chunk"):
            check_chunk(bad)
