"""Decoding on CUDA for engine.generate and engine.mtp: one static cache per model,
reused by every request it fits, and the CUDA-graph lanes over it (T=1 for plain
decode, T=2 for MTP1's verification pair), captured when a request first asks for
them, before its timing starts. A request that needs a longer cache gets a new
one, and the lanes are captured again.

    decoder = cuda_decoder(model, max_model_len, steps=(1,))   # None: graphs off (DUCK_CUDA_GRAPHS=0) or in use
    try:
        hidden = decoder(ids, positions)   # steps of a size in `steps` from graphs, others (prefill) eagerly
    finally:
        decoder.release()

One request at a time per model: while a decoder is in use, a second request gets
None and runs eagerly with a cache of its own.
"""
from __future__ import annotations

import logging
import os
import threading

import torch

from engine.gpu.graphs import GraphLane, reset_sequence_state
from engine.lanes import run_lane

log = logging.getLogger(__name__)

GRAPHS_ENV = "DUCK_CUDA_GRAPHS"   # 0: decode eagerly on CUDA
CACHE_ROUND = 256                 # cache lengths are rounded up to this, so that similar requests share graphs
CACHE_SLACK = 4                   # a cache is reused while at most this times longer than asked (min 4096)


def graphs_enabled() -> bool:
    return os.environ.get(GRAPHS_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


class CudaDecoder:
    """The cache and graph lanes of one model on CUDA (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        self.device = model.model.embed_tokens.weight.device
        self.cache = None
        self.lanes: dict[tuple[int, str], GraphLane] = {}
        self.lock = threading.Lock()

    # -- per request ------------------------------------------------------------------------
    @torch.inference_mode()
    def begin(self, max_model_len: int, steps: tuple[int, ...] = ()):
        """Readies the cache for a new sequence of at most max_model_len positions, with
        graph lanes for the step sizes in steps (captured now, outside the request's timing)."""
        have = self.cache.max_model_len if self.cache is not None else 0
        if not max_model_len <= have <= max(CACHE_SLACK * max_model_len, 4096):
            if self.cache is not None:
                self.drop()
                torch.cuda.empty_cache()   # the old cache's memory back to the driver before the new one
            self.cache = self.model.make_cache(self._capacity(max_model_len))
            log.info("CUDA decode cache of %d positions (asked: %d)", self.cache.max_model_len, max_model_len)
        reset_sequence_state(self.cache)
        for tokens in steps:
            self.lane(tokens)
        return self.cache

    def release(self) -> None:
        self.lock.release()

    def _capacity(self, n: int) -> int:
        cap = self.model.config.max_position_embeddings
        return max(n, min(cap, -(-n // CACHE_ROUND) * CACHE_ROUND))

    # -- steps ------------------------------------------------------------------------------
    def backend(self):
        """What the lanes' FFN requests go to: the model's backend."""
        return self.model.ffn_backend()

    def lane(self, tokens: int, name: str = "main") -> GraphLane:
        """The graph lane for `tokens`-token steps on the cache (name: one lane per role, e.g. the dual lane's
        a and b), captured again when the model's backend changed since."""
        lane = self.lanes.get((tokens, name))
        if lane is None or lane.stale(self.backend()):
            if lane is not None:
                lane.close()
            lane = self.lanes[(tokens, name)] = GraphLane(self.model, self.cache, tokens, name=f"{name}-{tokens}")
        return lane

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """model(ids, positions, cache): replayed when a graph lane of this step size exists, else eagerly."""
        if (ids.shape[0], "main") in self.lanes:
            return run_lane(self.lane(ids.shape[0]), self.backend(), ids, positions)
        return self.model(ids.to(self.device), positions.to(self.device), self.cache)

    def drop(self) -> None:
        """Frees the cache and the graphs."""
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
        self.cache = None


def cuda_decoder(model, max_model_len: int, steps: tuple[int, ...] = (1,)) -> CudaDecoder | None:
    """The model's decoder, readied for a request with graph lanes for the step sizes in
    steps (call .release() when done); None when CUDA graphs are off or another request holds it."""
    if not graphs_enabled():
        return None
    decoder = getattr(model, "_cuda_decoder", None)
    if decoder is None:
        decoder = CudaDecoder(model)
        model._cuda_decoder = decoder   # the model keeps its graphs; release_cuda_decoder frees them
    if not decoder.lock.acquire(blocking=False):
        log.warning("%s is decoding another request: this one runs eagerly with a cache of its own",
                    type(model).__name__)
        return None
    try:
        decoder.begin(max_model_len, steps)
    except BaseException:
        decoder.release()
        raise
    return decoder


def release_cuda_decoder(model) -> None:
    """Frees the model's CUDA decode cache and graphs (they are made again on the next request)."""
    decoder = getattr(model, "_cuda_decoder", None)
    if decoder is not None:
        with decoder.lock:
            decoder.drop()
        del model._cuda_decoder
