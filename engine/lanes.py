"""A decode step as segments between FFN calls, and two of them interleaved.

A forward of the model over T tokens alternates host work (norms, attention,
router, shared experts) with FFN calls (one per layer) that go to the ducks.
A *lane* exposes that alternation:

    req = lane.start(ids, positions)      # host work up to the first FFN call
    while req is not None:
        y = backend.forward(req.layer, req.x, req.ids, req.weights)
        req = lane.resume(y)              # host work up to the next FFN call
    lane.hidden                           # [T, H], the model's output

EagerLane runs the unmodified model in a thread of its own and stops it at
every FFN call (the model's FFN modules call engine.ffn.ffn_call, which hands
the call to the lane of its thread; the lane passes the request out and waits
for the answer); a CUDA-graph lane replays captured segments instead
(engine.gpu). Only one lane runs host code at a time: the caller drives them.

Dual lane (MTP1's verification pair, the seeds' "two-lane overlap"): token A and
draft B at consecutive positions go through the model as two lanes, B one
stage behind A. While the ducks compute A's FFN of layer L, the host computes
B's attention of layer L (it needs A's keys/values of layer L, written when A
reached that FFN call); while the ducks compute B's FFN of L, the host computes
A's layer L+1. The result is exactly that of the 2-token forward: the caches
see the same writes in the same order per layer. What it buys is overlap; what
it costs, against the 2-token batch forward, is that the ducks stream each
token's experts separately.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.ffn import FfnBackend, FfnRequest, set_lane

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepTrace:
    """Where the time of one decode step went (seconds). host: the lanes' host
    segments; ffn_wait: the host waiting for FFN results it could not overlap;
    ffn: wall time of the FFN calls themselves; kernel: the slowest duck's
    kernel time summed over the calls (0 when the backend does not report it)."""
    wall: float = 0.0
    host: float = 0.0
    ffn: float = 0.0
    ffn_wait: float = 0.0
    kernel: float = 0.0
    calls: int = 0


@contextmanager
def calls_to(lane):
    """Within (on this thread), the model's FFN calls go to lane._ffn_call(FfnRequest) -> y:
    how a CUDA-graph lane cuts its capture into segments (engine.gpu.graphs); EagerLane's
    thread sets the same thing itself."""
    before = set_lane(lane)
    try:
        yield
    finally:
        set_lane(before)


class EagerLane:
    """The model's own forward, stopped at each FFN call (see the module docstring).
    One thread per lane, kept for the lane's life; close() ends it."""

    def __init__(self, model, cache, name: str = "lane"):
        self.model, self.cache, self.name = model, cache, name
        self._todo: queue.SimpleQueue = queue.SimpleQueue()    # to the lane thread: work, or FFN results
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # from it: FfnRequest, ("done",), exception
        self._thread = threading.Thread(target=self._main, name=f"duck-{name}", daemon=True)
        self._thread.start()
        self.hidden: torch.Tensor | None = None

    # -- caller side -------------------------------------------------------------------
    def start(self, ids: torch.Tensor, positions: torch.Tensor) -> FfnRequest | None:
        self.hidden = None
        self._todo.put(("run", ids, positions))
        return self._next()

    def resume(self, y: torch.Tensor) -> FfnRequest | None:
        self._todo.put(("y", y))
        return self._next()

    def close(self) -> None:
        if self._thread.is_alive():
            self._todo.put(("stop",))
            self._thread.join(5)

    def _next(self) -> FfnRequest | None:
        ev = self._events.get()
        if isinstance(ev, BaseException):
            raise ev
        return ev if isinstance(ev, FfnRequest) else None

    # -- lane thread ------------------------------------------------------------------
    def _main(self) -> None:
        set_lane(self)
        while True:
            job = self._todo.get()
            if job[0] == "stop":
                return
            if job[0] != "run":     # a result nobody asked for: the caller broke the protocol
                self._events.put(RuntimeError(f"{self.name}: FFN result given while no FFN call was pending"))
                continue
            try:
                with torch.inference_mode():
                    self.hidden = self.model(job[1], job[2], self.cache)
                self._events.put(("done",))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
                self._events.put(e)

    def _ffn_call(self, req: FfnRequest) -> torch.Tensor:
        self._events.put(req)
        job = self._todo.get()
        if job[0] != "y":
            raise RuntimeError(f"{self.name}: expected the FFN result of layer {req.layer}, got {job[0]!r}")
        return job[1]


class FfnWorker:
    """One thread that runs FFN calls in submission order, so that the caller's
    thread can compute while the ducks work (the transport releases the GIL)."""

    def __init__(self, backend: FfnBackend):
        self.backend = backend
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="duck-ffn-worker", daemon=True)
        self._thread.start()

    def submit(self, req: FfnRequest) -> Future:
        fut: Future = Future()
        self._q.put((req, fut))
        return fut

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(5)

    def _main(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            req, fut = item
            t0 = time.perf_counter()
            k0 = _kernel_us(self.backend)
            try:
                with torch.inference_mode():   # a thread starts outside it; the request's buffers may be inference tensors
                    y = self.backend.forward(req.layer, req.x, req.ids, req.weights, out=req.out)
            except BaseException as e:  # noqa: BLE001 - the waiter raises it
                fut.set_exception(e)
                continue
            fut.set_result((y, time.perf_counter() - t0, (_kernel_us(self.backend) - k0) * 1e-6))


def _kernel_us(backend: FfnBackend) -> float:
    """Cumulative kernel microseconds the backend reports (the fleet's slowest duck per call)."""
    return float(backend.kernel_us_total)


def run_lane(lane, backend: FfnBackend, ids: torch.Tensor, positions: torch.Tensor,
             trace: StepTrace | None = None) -> torch.Tensor:
    """One lane to completion, FFN calls made on this thread; returns lane.hidden."""
    native = getattr(lane, "native_step", None)
    step = native(backend) if native is not None else None
    if step is not None:
        return _run_native(lane, step, backend, ids, positions, trace)
    t_start = time.perf_counter()
    t = t_start
    req = lane.start(ids, positions)
    while req is not None:
        t1 = time.perf_counter()
        k0 = _kernel_us(backend)
        y = backend.forward(req.layer, req.x, req.ids, req.weights, out=req.out)
        t2 = time.perf_counter()
        if trace is not None:
            kern = (_kernel_us(backend) - k0) * 1e-6
            trace.host += t1 - t
            trace.ffn += t2 - t1
            trace.ffn_wait += t2 - t1
            trace.kernel += kern
            trace.calls += 1
        t = t2
        req = lane.resume(y)
    if trace is not None:
        trace.host += time.perf_counter() - t
        trace.wall += time.perf_counter() - t_start
    return lane.hidden


def _run_native(lane, step, backend, ids, positions, trace: StepTrace | None) -> torch.Tensor:
    """run_lane's step when the lane is driven from C (engine.gpu.graphs.GraphLane.native_step)."""
    t0 = time.perf_counter()
    hidden, times = lane.run_native(step, ids, positions)
    wall = time.perf_counter() - t0
    record = getattr(backend, "record_native_step", None)
    if record is not None:
        record(step, times)
    if trace is not None:
        ffn = sum(times.ffn)
        trace.wall += wall
        trace.host += wall - ffn
        trace.ffn += ffn
        trace.ffn_wait += ffn
        trace.kernel += sum(times.kernel)
        trace.calls += len(times.ffn)
    return hidden


def run_staggered(lanes, worker: FfnWorker, jobs: list[tuple[torch.Tensor, torch.Tensor]],
                  trace: StepTrace | None = None, keep=None) -> list[torch.Tensor]:
    """Jobs (ids, positions) through the lanes, each job one stage behind the one before, the FFN
    calls on the worker in submission order (see the module docstring); a lane that finishes its
    job takes the next one. Job k + 1's layer L runs after job k's (its FFN calls are submitted,
    and answered, after job k's of the same layer), so a job may attend to the positions of the jobs
    before it: the token and draft of the dual lane, the chunks of a prefill. Returns each job's
    hidden states, or what keep(hidden) makes of them (a copy: a prefill keeps a chunk's last row)."""
    t_start = time.perf_counter()
    host = wait = ffn = kern = 0.0
    calls = 0
    out: list[torch.Tensor | None] = [None] * len(jobs)
    pending: deque = deque()   # (lane, job, future), in submission order
    following = 0              # the next job to start

    def timed(fn, *args):
        nonlocal host
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            host += time.perf_counter() - t0

    def went(lane, k: int | None, req) -> None:
        """The lane ran job k to an FFN call (submitted), or to its end (kept; the lane takes the
        next job); k None: the lane is idle."""
        nonlocal following
        while req is None:
            if k is not None:   # a lane's hidden may be its static buffer: a copy where it runs again
                h = keep(lane.hidden) if keep is not None else lane.hidden
                out[k] = h.clone() if keep is not None or following < len(jobs) else h
            if following == len(jobs):
                return
            k, following = following, following + 1
            req = timed(lane.start, *jobs[k])
        pending.append((lane, k, worker.submit(req)))

    for lane in lanes:
        went(lane, None, None)
    while pending:
        lane, k, fut = pending.popleft()
        t0 = time.perf_counter()
        y, dt, kt = fut.result()
        wait += time.perf_counter() - t0
        ffn, kern, calls = ffn + dt, kern + kt, calls + 1
        went(lane, k, timed(lane.resume, y))
    if trace is not None:
        trace.wall += time.perf_counter() - t_start
        trace.host += host
        trace.ffn += ffn
        trace.ffn_wait += wait
        trace.kernel += kern
        trace.calls += calls
    return out


def run_two_lanes(lane_a, lane_b, worker: FfnWorker, ids: torch.Tensor, positions: torch.Tensor,
                  trace: StepTrace | None = None) -> torch.Tensor:
    """Tokens ids[0] and ids[1] at positions[0] and positions[0] + 1 through two lanes,
    B one stage behind A, the FFN calls on the worker (see the module docstring).
    Returns the hidden states [2, H], as the 2-token forward would."""
    if ids.shape[0] != 2 or positions.shape[0] != 2:
        raise ValueError(f"two lanes take exactly 2 tokens, got {ids.shape[0]}")
    return torch.cat(run_staggered((lane_a, lane_b), worker, [(ids[:1], positions[:1]), (ids[1:], positions[1:])],
                                   trace), 0)
