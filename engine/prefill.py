"""Prefill in chunks: the prompt goes through the model `chunk` tokens at a
time, each chunk one forward over the cache the chunks before it filled. A
chunk's FFN call per layer carries all its tokens, so the fleet sends it as
one request per duck, and each duck streams each expert it holds once per
chunk instead of once per 64 tokens (the transport cuts a call into several
requests, pipelined, only where the ducks or the datagram sizes take fewer:
docs/wire.md). The chunk also bounds the host's activations for long prompts.

    logits = prefill_logits(model, forward, ids, positions, chunk)   # [V] of the last token
    hidden = prefill_hidden(forward, ids, positions, chunk)          # [T, H] of every token (MTP1 drafts)

forward(ids, positions) -> hidden [T, H] is the model's forward over its
cache (engine.generate gives the CUDA decoder's or the eager one); the CPU's
native decoder chunks the same way (engine.cpu.decode.CpuDecoder.prefill).
The chunk is duckd's `model.prefill_chunk` (docs/duckd-config.md).

A prompt of two chunks or more can go through two lanes (engine.lanes), chunk
k + 1 one stage behind chunk k, the FFN calls on a worker thread:

    hidden = prefill_hidden_overlapped(model, cache, ids, positions, chunk)

While the ducks compute chunk k's FFN of layer L, the host runs chunk k + 1's
attention of layer L (it needs chunk k's keys and values of layer L, written
when chunk k reached that FFN call), so the host's share of each layer hides
behind the ducks' work. The caches see the same writes in the same order per
layer as chunk by chunk, and each FFN call carries the same tokens: the result
is the same, bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_CHUNK = 1024   # one pass of each duck's experts per 1024 tokens (on the H200 host 1024 beat 512 for
                       # DeepSeek-V3.2, Qwen3 and Qwen3.5 alike: bench/results, twelfth session)
MAX_CHUNK = 1 << 16


def check_chunk(chunk: int) -> int:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"prefill chunk {chunk!r}: expected 1..{MAX_CHUNK} tokens")
    return chunk


def prefill_chunks(n: int, chunk: int) -> list[slice]:
    """The token ranges of a prefill of n tokens, in order, each at most chunk long."""
    check_chunk(chunk)
    return [slice(s, min(n, s + chunk)) for s in range(0, n, chunk)]


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.inference_mode()
def prefill_hidden(forward: Forward, ids: torch.Tensor, positions: torch.Tensor, chunk: int = DEFAULT_CHUNK,
                   last_only: bool = False) -> torch.Tensor:
    """ids, positions [T] -> the hidden states [T, H] (or [1, H] of the last token), the cache filled for all."""
    kept = []
    for part in prefill_chunks(ids.shape[0], chunk):
        hidden = forward(ids[part], positions[part])          # [t, H]
        kept.append(hidden[-1:] if last_only else hidden)
    return kept[-1] if last_only else torch.cat(kept)


@torch.inference_mode()
def prefill_logits(model, forward: Forward, ids: torch.Tensor, positions: torch.Tensor,
                   chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """ids, positions [T] -> the logits [V] after the last token, the cache filled for all."""
    return model.compute_logits(prefill_hidden(forward, ids, positions, chunk, last_only=True))[0]


@torch.inference_mode()
def prefill_hidden_overlapped(model, cache, ids: torch.Tensor, positions: torch.Tensor,
                              chunk: int = DEFAULT_CHUNK, last_only: bool = False, trace=None) -> torch.Tensor:
    """prefill_hidden of model(ids, positions, cache) with two chunks in flight (see the module
    docstring; engine.lanes.run_staggered drives them); ids and positions on the model's device.
    trace: an engine.lanes.StepTrace that gets the host / FFN split."""
    from engine.lanes import EagerLane, FfnWorker, run_staggered

    parts = prefill_chunks(ids.shape[0], chunk)
    if len(parts) == 1:
        return prefill_hidden(lambda i, p: model(i, p, cache), ids, positions, chunk, last_only)
    lanes = (EagerLane(model, cache, "prefill-a"), EagerLane(model, cache, "prefill-b"))
    worker = FfnWorker(model.ffn_backend())
    try:
        hidden = run_staggered(lanes, worker, [(ids[part], positions[part]) for part in parts], trace,
                               keep=(lambda h: h[-1:]) if last_only else None)
    finally:
        for part in (*lanes, worker):
            part.close()
    return hidden[-1] if last_only else torch.cat(hidden)
