"""GPU time per layer of a decode step, eager vs replayed from CUDA graphs: CUDA
events around every stage (the GPU work between two FFN calls). Part of
`duckctl bench e2e --synthetic` on a GPU host (bench.e2e_synthetic)."""
from __future__ import annotations

import statistics

import torch

from engine.ffn import FfnBackend, FfnRequest
from engine.gpu.graphs import GraphLane
from engine.lanes import calls_to, run_lane


class _EagerTimer:
    """Eager forward cut at its FFN calls by CUDA events (start of a segment, end of it)."""

    def __init__(self, backend, stream):
        self.backend, self.stream = backend, stream
        self.events: list[tuple[int | None, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: torch.cuda.Event | None = None

    def begin(self, first: bool = True) -> None:
        if first:
            self.events.clear()
        self._open = torch.cuda.Event(enable_timing=True)
        self._open.record(self.stream)

    def close(self, layer: int | None) -> torch.cuda.Event:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self.events.append((layer, self._open, end))
        return end

    def _ffn_call(self, req: FfnRequest) -> torch.Tensor:
        self.close(req.layer).synchronize()   # as a real FFN call waits for x: the next stage starts on an idle GPU
        y = torch.zeros_like(req.x) if self.backend is None else self.backend.forward(
            req.layer, req.x, req.ids, req.weights)
        self.begin(first=False)
        return y


def _default_len(model) -> int:
    return min(2048, model.config.max_position_embeddings)


@torch.inference_mode()
def stage_times(model, backend=None, *, steps: int = 20, tokens: int = 1, max_model_len: int | None = None,
                position: int | None = None) -> dict:
    """GPU time of each stage (the GPU work between two FFN calls) of a decode step of
    `tokens` tokens, eager and replayed from CUDA graphs: CUDA events around every stage,
    median over `steps` steps after one warm step. FFN calls go to backend (zeros when None:
    the stage times do not depend on them). Eager runs today's attention over the first
    position + 1 slots, the graphs attend over the whole cache of max_model_len."""
    device = model.model.embed_tokens.weight.device
    if device.type != "cuda":
        raise ValueError(f"stage_times measures CUDA work; the model is on {device}")
    length = max_model_len or _default_len(model)
    position = length // 2 if position is None else position
    if not 0 <= position <= length - tokens:
        raise ValueError(f"position {position} with {tokens} tokens does not fit max_model_len={length}")
    cache = model.make_cache(length)
    ids = torch.full((tokens,), 2, dtype=torch.int64)
    positions = torch.arange(position, position + tokens)
    stream = torch.cuda.current_stream(device)
    timer = _EagerTimer(backend, stream)
    eager: list[list[float]] = []
    layers: list[int | None] = []
    for step in range(steps + 1):
        _rewind(cache, position)
        timer.begin()
        with calls_to(timer):
            model(ids.to(device), positions.to(device), cache)
        timer.close(None)
        torch.cuda.synchronize(device)
        if step:
            eager.append([a.elapsed_time(b) for _, a, b in timer.events])
        layers = [layer for layer, _, _ in timer.events]
    ffn = _ZeroBackend() if backend is None else backend
    lane = GraphLane(model, cache, tokens, name="stage-times", backend=ffn)
    graph: list[list[float]] = []
    try:
        for step in range(steps + 1):
            _rewind(cache, position)
            lane.timing = []
            run_lane(lane, ffn, ids, positions)
            torch.cuda.synchronize(device)
            if step:
                graph.append([a.elapsed_time(b) for _, a, b in lane.timing])
    finally:
        lane.close()
    eager_ms = [statistics.median(s) for s in zip(*eager)]
    graph_ms = [statistics.median(s) for s in zip(*graph)]
    calls = max(1, len(layers) - 1)
    return {"tokens": tokens, "max_model_len": length, "position": position, "steps": steps,
            "segments": [{"ends_at_layer": layer, "eager_ms": e, "graph_ms": g}
                         for layer, e, g in zip(layers, eager_ms, graph_ms)],
            "eager_step_ms": sum(eager_ms), "graph_step_ms": sum(graph_ms),
            "per_layer_eager_ms": sum(eager_ms) / calls, "per_layer_graph_ms": sum(graph_ms) / calls,
            "speedup": sum(eager_ms) / sum(graph_ms) if sum(graph_ms) > 0 else None}


def _rewind(cache, position: int) -> None:
    """Lets a hybrid cache's linear attention run again from `position` (timing only: the state is not restored)."""
    if hasattr(cache, "consumed"):
        cache.consumed = [position] * cache.conv.shape[0]


class _ZeroBackend(FfnBackend):
    """Zeros for every FFN call (stage timing without a backend)."""
    name = "zero"

    def load_layer(self, layer):
        raise RuntimeError("the zero backend holds no layers")

    def forward(self, layer, x, ids, weights, out=None):
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
