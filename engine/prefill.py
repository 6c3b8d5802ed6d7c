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

import time
from collections import deque
from collections.abc import Callable

import torch

DEFAULT_CHUNK = 512
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
    docstring); ids and positions on the model's device. trace: an engine.lanes.StepTrace that
    gets the host / FFN split (ffn_wait: the host waiting on the ducks)."""
    from engine.lanes import EagerLane, FfnWorker, StepTrace

    parts = prefill_chunks(ids.shape[0], chunk)
    if len(parts) == 1:
        return prefill_hidden(lambda i, p: model(i, p, cache), ids, positions, chunk, last_only)
    lanes = [EagerLane(model, cache, "prefill-a"), EagerLane(model, cache, "prefill-b")]
    worker = FfnWorker(model.ffn_backend())
    trace = trace if trace is not None else StepTrace()
    kept: list[torch.Tensor | None] = [None] * len(parts)
    pending: deque = deque()   # (lane, chunk index, future), in submission order
    following = 0              # the next chunk to start
    t_start = time.perf_counter()

    def host(fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            trace.host += time.perf_counter() - t0

    def went(lane, k: int, req) -> None:
        """The lane ran chunk k to an FFN call (submitted) or to its end (kept; the lane takes the next chunk)."""
        nonlocal following
        while req is None:
            kept[k] = lane.hidden[-1:] if last_only else lane.hidden
            if following == len(parts):
                return
            k, following = following, following + 1
            req = host(lane.start, ids[parts[k]], positions[parts[k]])
        pending.append((lane, k, worker.submit(req)))

    try:
        for lane in lanes:
            k, following = following, following + 1
            went(lane, k, host(lane.start, ids[parts[k]], positions[parts[k]]))
        while pending:
            lane, k, fut = pending.popleft()
            t0 = time.perf_counter()
            y, dt, kt = fut.result()
            trace.ffn_wait += time.perf_counter() - t0
            trace.ffn, trace.kernel, trace.calls = trace.ffn + dt, trace.kernel + kt, trace.calls + 1
            went(lane, k, host(lane.resume, y))
    finally:
        for part in (*lanes, worker):
            part.close()
    trace.wall += time.perf_counter() - t_start
    return kept[-1] if last_only else torch.cat(kept)
