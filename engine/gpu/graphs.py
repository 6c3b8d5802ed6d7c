"""CUDA-graph decode ("flattened decode"): one graph replay for the GPU part of a
layer, the duck call, the next replay.

    lane = GraphLane(model, cache, tokens=1)
    req = lane.start(ids, positions)    # inputs into static buffers, replay graph 0 -> layer 0's FFN call
    while req is not None:
        y = backend.forward(req.layer, req.x, req.ids, req.weights, out=req.out)
        req = lane.resume(y)            # y into the static buffer graph i+1 reads, replay it
    lane.hidden                         # [T, H], valid until the next start()

A GraphLane is a lane of engine.lanes (run_lane and run_two_lanes drive it as they
drive an EagerLane). Capture: the model's forward runs once under static_decode()
(fixed shapes, no host sync) on the lane's stream, with its FFN calls routed to
the lane (engine.lanes.calls_to). Each call ends the graph being captured, keeps
the call's x / ids / weights (static tensors: every replay rewrites them), hands
the model a static y buffer and begins the next graph; the last graph ends with
the final norm. All graphs of a lane share one memory pool: tensors that live
across a call (the residual stream) stay allocated, and the graphs always replay
in capture order. Each lane has its own pool and stream, so two lanes can
interleave (the dual lane). The KV / latent / conv / recurrent caches are static
tensors the graphs write in place.

Every start() / resume() returns once its replay is done (an event wait): the
request's tensors are then final whichever thread or stream reads them, and the
host would wait for them anyway. With a backend that computes on the host
(backend.host_io: the fleet, the local fp9 kernels) the FFN host contract of
engine.host_ffn holds: each segment's graph ends by copying x / ids / weights, in
the wire's types, into the lane's pinned FfnIO, the request hands out those host
views with out = the pinned y buffer, and the next segment's graph begins by
copying y back to the device: per layer one replay, one event wait, one C call.
With the fleet (a backend with step_session()), the whole step is one C call
instead (native_step, run_native; native/transport/step.h): the C loop launches
each graph, polls the stream, forwards, launches the next; run_lane picks it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engine.ffn import FfnRequest
from engine.host_ffn import WIRE_DTYPES, FfnIO
from engine.lanes import EagerLane, calls_to
from engine.layers import static_decode

log = logging.getLogger(__name__)

WARMUP_FORWARDS = 2       # eager forwards on the lane's stream before capture (lazy CUDA state, cuBLAS workspaces)


# -- what a cache holds -----------------------------------------------------------------
def _cache_parts(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(per-position tensors [layers, S, ...], per-sequence state tensors) of a cache: what every
    cache class says of itself (per_position, per_sequence)."""
    if not hasattr(cache, "per_position"):
        raise TypeError(f"{type(cache).__name__}: not a cache (it says nothing of per_position, per_sequence)")
    return cache.per_position(), cache.per_sequence()


def reset_sequence_state(cache) -> None:
    """Makes a reused cache ready for a new sequence: the linear-attention states start
    from zero. Per-position slots need nothing: they are written before they are read,
    and static attention masks the rest."""
    for t in _cache_parts(cache)[1]:
        t.zero_()
    if hasattr(cache, "consumed"):
        cache.consumed = None


def set_linear_progress(cache, first: int, end: int, who: str) -> None:
    """The host bookkeeping static decode leaves to its caller: a hybrid cache's
    linear-attention states must continue at `first`; they then have consumed `end` tokens."""
    if not hasattr(cache, "consumed"):
        return
    n = cache.conv.shape[0]
    have = cache.consumed or [0] * n
    if any(c != first for c in have):
        raise ValueError(f"{who}: linear attention continues at token {sorted(set(have))}, got position {first}; "
                         f"its state cannot rewind (use a fresh cache)")
    cache.consumed = [end] * n


class _StateGuard:
    """What a warm-up forward at `positions` writes into a cache, saved to be put back."""

    def __init__(self, cache, positions: torch.Tensor):
        per_position, state = _cache_parts(cache)
        self.positions = positions
        self.slots = [(t, t[:, positions].clone()) for t in per_position]
        self.state = [(t, t.clone()) for t in state]
        self.consumed = getattr(cache, "consumed", None)
        self.cache = cache

    def restore(self) -> None:
        for t, saved in self.slots:
            t[:, self.positions] = saved
        for t, saved in self.state:
            t.copy_(saved)
        if hasattr(self.cache, "consumed"):
            self.cache.consumed = self.consumed


# -- capture ------------------------------------------------------------------------------
class _ZeroFfn:
    """Warm-up: FFN calls answered with zeros (no backend traffic, no host sync)."""

    def _ffn_call(self, req: FfnRequest) -> torch.Tensor:
        return torch.zeros_like(req.x)


class _InlineFfn:
    """A backend that computes on the GPU without host syncs (captures_in_graph): its
    calls stay inside the graph being captured (and run in the warm-up, which compiles them)."""

    def __init__(self, backend):
        self.backend = backend

    def _ffn_call(self, req: FfnRequest) -> torch.Tensor:
        return self.backend.forward(req.layer, req.x, req.ids, req.weights)


@dataclass(slots=True)
class _Segment:
    graph: torch.cuda.CUDAGraph
    call: FfnRequest | None    # the FFN call that ends it: static device tensors, or (host io) the pinned
    #                            host views the graph copied them into, out = where the result is read from
    y: torch.Tensor | None     # the static device buffer that call's result goes to, read by the next segment


class _Capture:
    """Stands in for the lane while the forward is captured: each FFN call cuts the graph.
    With io (FfnIO, pinned), the copies of x / ids / weights to the host end the segment
    inside its graph, and the copy of y back begins the next one."""

    def __init__(self, pool, inline=None, io: FfnIO | None = None):
        self.pool, self.inline, self.io = pool, inline, io   # inline: an _InlineFfn, whose calls do not cut the graph
        self.segments: list[_Segment] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (an EagerLane, the FFN worker) may use CUDA meanwhile
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def _ffn_call(self, req: FfnRequest) -> torch.Tensor:
        if self.inline is not None:
            return self.inline._ffn_call(req)
        call = req
        if self.io is not None:
            t, k = req.ids.shape
            xh, ih, wh, yh = self.io.views(t, k)
            xh.copy_(req.x.to(xh.dtype), non_blocking=True)      # device -> pinned host, in the graph
            ih.copy_(req.ids.to(torch.int32), non_blocking=True)
            wh.copy_(req.weights.to(torch.float32), non_blocking=True)
            call = FfnRequest(req.layer, xh, ih, wh, out=yh)
        self.graph.capture_end()
        y = torch.empty_like(req.x)   # allocated between captures: a plain buffer, alive as long as the lane
        staged = torch.empty(y.shape, dtype=call.out.dtype, device=y.device) if (
            call.out is not None and call.out.dtype != y.dtype) else None
        self.segments.append(_Segment(self.graph, call, y))
        self.graph = None
        self.begin()
        if call.out is not None:   # pinned host -> device, first in the next graph
            if staged is None:
                y.copy_(call.out, non_blocking=True)
            else:
                staged.copy_(call.out, non_blocking=True)
                y.copy_(staged)
        return y

    def end(self) -> list[_Segment]:
        self.graph.capture_end()
        self.segments.append(_Segment(self.graph, None, None))
        self.graph = None
        return self.segments

    def abort(self) -> None:
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except RuntimeError as e:   # the capture was already invalidated by the error being raised
                log.debug("ending an aborted capture: %s", e)
            self.graph = None


class GraphLane:
    """A decode step of `tokens` tokens over `cache`, captured as CUDA graphs between
    FFN calls (see the module docstring), for the FFN backend given (default: the
    model's). A backend that computes on the host gets pinned host copies of x / ids /
    weights in the wire's types, made inside the graphs, and its result goes back the same way."""

    one_sequence = True   # a step's tokens are consecutive positions of one sequence (SlotGraphLane: not)

    def __init__(self, model, cache, tokens: int = 1, *, name: str = "graph", backend=None,
                 warmup: int = WARMUP_FORWARDS, drive_from_c: bool = True):
        device = model.model.embed_tokens.weight.device
        if device.type != "cuda":
            raise ValueError(f"GraphLane needs the model on a CUDA device, it is on {device}; "
                             f"use engine.lanes.EagerLane (or make_lane) there")
        if tokens < 1:
            raise ValueError(f"a GraphLane runs at least 1 token per step, got {tokens}")
        if self.one_sequence and cache.max_model_len < tokens:
            raise ValueError(f"a cache of {cache.max_model_len} positions cannot hold a {tokens}-token step")
        self.model, self.cache, self.tokens, self.name, self.device = model, cache, tokens, name, device
        self.backend = model.ffn_backend() if backend is None else backend
        self.resident = model.__dict__.get("resident")   # engine.placement: what the graphs compute inline
        self.host_io = self.backend.host_io
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self._done = torch.cuda.Event()
        self.io = self._host_buffers() if self.host_io else None
        self._inputs = torch.zeros((2, tokens), dtype=torch.int64, pin_memory=True)   # ids, positions
        self.timing: list | None = None   # a list: (segment, start event, end event) of every replay go there
        self.hidden: torch.Tensor | None = None
        self._next: int | None = None     # the segment resume() replays; None: no step in progress
        self._native = None               # (backend id, NativeStep or None): native_step's answer
        self.drive_from_c = drive_from_c  # False: run_lane drives every step from Python (comparisons)
        with torch.inference_mode():
            self.ids = torch.zeros(tokens, dtype=torch.int64, device=device)
            self.positions = self._capture_positions()
            self.segments, self._hidden = self._capture(warmup)
        log.info("%s: %d-token decode captured as %d CUDA graphs (%d FFN calls%s), cache of %d positions",
                 name, tokens, len(self.segments), len(self.segments) - 1,
                 ", host copies inside the graphs" if self.host_io else "", cache.max_model_len)

    def _host_buffers(self) -> FfnIO:
        config = self.model.config
        dtype = self.model.model.embed_tokens.weight.dtype
        wire = dtype if dtype in WIRE_DTYPES else torch.float32
        return FfnIO.allocate(self.tokens, config.hidden_size, max(1, config.num_experts_per_tok or 1), wire,
                              pinned=True)

    def _capture_positions(self) -> torch.Tensor:
        """The static positions buffer, set where the warm-up and the capture run: the cache's
        last slots (what they write there is put back: _state_guard)."""
        s = self.cache.max_model_len
        return torch.arange(s - self.tokens, s, device=self.device)

    def _state_guard(self):
        """What restores the cache after the warm-up forwards (restore())."""
        return _StateGuard(self.cache, self.positions)

    def _capture(self, warmup: int) -> tuple[list[_Segment], torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        guard = self._state_guard()
        self.stream.wait_stream(current)
        inline = _InlineFfn(self.backend) if self.backend.captures_in_graph else None
        capture = _Capture(self.pool, inline, self.io)
        with torch.cuda.stream(self.stream), static_decode():
            with calls_to(inline or _ZeroFfn()):
                for _ in range(warmup):
                    self.model(self.ids, self.positions, self.cache)
            guard.restore()
            torch.cuda.synchronize(self.device)   # as torch.cuda.graph does: nothing pending when capture begins
            capture.begin()
            try:
                with calls_to(capture):
                    hidden = self.model(self.ids, self.positions, self.cache)
                segments = capture.end()
            except BaseException:
                capture.abort()
                raise
        current.wait_stream(self.stream)
        for seg in segments[:-1]:
            if seg.call.x.shape[0] != self.tokens:
                raise RuntimeError(f"{self.name}: FFN call of layer {seg.call.layer} has {seg.call.x.shape[0]} "
                                   f"tokens in a {self.tokens}-token step")
        return segments, hidden

    # -- the lane protocol ----------------------------------------------------------------
    @torch.inference_mode()
    def start(self, ids: torch.Tensor, positions: torch.Tensor) -> FfnRequest | None:
        self.start_inputs(ids, positions)
        self._next = 0
        return self._replay()

    def start_inputs(self, ids: torch.Tensor, positions: torch.Tensor) -> bool:
        """Checks a step's inputs and queues them into the static buffers on the lane's stream.
        Returns whether a step was in progress (abandoned: its graphs replay from the start)."""
        if self.closed:
            raise RuntimeError(f"{self.name} is closed: its graphs were freed")
        pos = positions.tolist()   # a host tensor is the fast path; a device one costs a sync here
        if len(pos) != self.tokens or ids.shape[0] != self.tokens:
            raise ValueError(f"{self.name} runs {self.tokens}-token steps, got {ids.shape[0]} ids at positions {pos}")
        if pos[-1] >= self.cache.max_model_len or pos[0] < 0:
            raise ValueError(f"position {max(pos)} is beyond the KV cache (max_model_len={self.cache.max_model_len})")
        set_linear_progress(self.cache, pos[0], pos[-1] + 1, self.name)
        self.hidden = None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))   # the caller's readers of the last hidden
        with torch.cuda.stream(self.stream):
            self._to_static(self.ids, ids, 0)
            self._to_static(self.positions, positions, 1)
        return bool(self._next)

    # -- the whole step from C ---------------------------------------------------------------
    def native_step(self, backend):
        """The step as one C call (native/transport/step.py: graph, forward, graph, ...) when
        the backend is a fleet session reached through host io and the CUDA driver is
        usable here; else None (run_lane then drives the lane from Python). Set
        DUCK_NATIVE_STEP=0 to keep the Python driver (comparisons)."""
        session = getattr(backend, "step_session", lambda: None)()
        key = (id(backend), id(session))
        if self._native is not None and self._native[0] == key:
            return self._native[1]
        step = self._make_native_step(session)
        self._native = (key, step)
        return step

    @property
    def driven_from_c(self) -> bool:
        """Whether the last native_step() answered with a C driver."""
        return self._native is not None and self._native[1] is not None

    def _make_native_step(self, session):
        if (session is None or not self.host_io or not self.drive_from_c
                or os.environ.get("DUCK_NATIVE_STEP", "1") == "0"):
            return None
        from native.transport.step import NativeStep, cuda_driver_problem

        problem = cuda_driver_problem()
        if problem or not hasattr(self.segments[0].graph, "raw_cuda_graph_exec"):
            log.info("%s: decode steps driven from Python (%s)", self.name,
                     problem or "this torch has no CUDAGraph.raw_cuda_graph_exec")
            return None
        calls = [(seg.call.layer, seg.call.ids.shape[1]) for seg in self.segments[:-1]]
        step = NativeStep(session, self.stream.cuda_stream, [seg.graph.raw_cuda_graph_exec() for seg in self.segments],
                          calls, self.io, self.tokens)
        log.info("%s: decode steps driven from C (%d graphs, %d forwards per step)", self.name, len(self.segments),
                 len(calls))
        return step

    @torch.inference_mode()
    def run_native(self, step, ids: torch.Tensor, positions: torch.Tensor):
        """One step through native_step's C driver; returns (hidden, native.transport.step.StepTimes)."""
        self.start_inputs(ids, positions)
        try:
            times = step.run()
        finally:
            self._next = None
        self.hidden = self._hidden
        return self.hidden, times

    @torch.inference_mode()
    def resume(self, y: torch.Tensor) -> FfnRequest | None:
        if not self._next:
            raise RuntimeError(f"{self.name}: FFN result given while no FFN call was pending")
        seg = self.segments[self._next - 1]
        if tuple(y.shape) != tuple(seg.y.shape):
            raise ValueError(f"{self.name}: FFN result of layer {seg.call.layer} has shape {tuple(y.shape)}, "
                             f"expected {tuple(seg.y.shape)}")
        if seg.call.out is not None:
            if y is not seg.call.out:
                seg.call.out.copy_(y)   # the next graph copies it to the device
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            y.record_stream(self.stream)
            with torch.cuda.stream(self.stream):
                seg.y.copy_(y, non_blocking=True)
        return self._replay()

    def close(self) -> None:
        """Frees the graphs and their memory pool."""
        self.segments, self._hidden, self.hidden, self._next, self._native = [], None, None, None, None

    @property
    def closed(self) -> bool:
        return not self.segments

    def stale(self, backend) -> bool:
        """Whether the graphs no longer fit the model: closed, another FFN backend, or another
        placement (engine.placement: which layers the graphs compute inline, which they cut at)."""
        return self.closed or self.backend is not backend or self.resident is not self.model.__dict__.get("resident")

    # -- inside -----------------------------------------------------------------------------
    def _to_static(self, dst: torch.Tensor, src: torch.Tensor, row: int) -> None:
        if src.device.type == "cuda":
            dst.copy_(src, non_blocking=True)
        else:   # the previous step's copy out of this pinned row finished before that step returned
            self._inputs[row].copy_(src)
            dst.copy_(self._inputs[row], non_blocking=True)

    def _replay(self) -> FfnRequest | None:
        i = self._next
        seg = self.segments[i]
        with torch.cuda.stream(self.stream):
            if self.timing is not None:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(self.stream)
            seg.graph.replay()
            if self.timing is not None:
                t1.record(self.stream)
                self.timing.append((i, t0, t1))
        if seg.call is None:
            self._done.record(self.stream)
            self._done.synchronize()
            self._next, self.hidden = None, self._hidden
            return None
        self._next = i + 1
        self._done.record(self.stream)
        self._done.synchronize()   # x / ids / weights are final (on the host too, with host io)
        return seg.call


def make_lane(model, cache, tokens: int = 1, name: str = "lane", graphs: bool = True):
    """A GraphLane when the model is on CUDA and graphs are wanted, else an EagerLane:
    the same driver (run_lane, run_two_lanes) runs either."""
    if graphs and model.model.embed_tokens.weight.device.type == "cuda":
        return GraphLane(model, cache, tokens, name=name)
    return EagerLane(model, cache, name)
