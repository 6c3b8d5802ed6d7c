"""A decode step of CUDA graphs and fleet forwards in one C call (step.h), and
one of the CPU host decoder's layers and fleet forwards (host_step.h).

    step = NativeStep(session, stream, graphs, calls, io)   # once per captured lane
    times = step.run()                                      # per step: every graph, every forward

    step = HostStep(session, decoder, n_layers, io...)      # engine.cpu.decode.CpuDecoder, once per session
    times = step.run(ntok)                                  # after duck_host_begin_slots: every layer

`graphs` are the lane's cudaGraphExec_t handles in replay order, `calls` the
(layer, topk) of the FFN call that ends each graph but the last, `io` the
pinned buffers (x, ids, weights, y) the graphs copy into and out of
(engine.host_ffn.FfnIO). The caller has queued the step's inputs on `stream`
before run(); when it returns, the last graph is done.
"""
from __future__ import annotations

from dataclasses import dataclass

from native._native import ffi, lib
from native.transport.session import Session, _wire_view


def cuda_driver_problem() -> str | None:
    """None when the C step can drive CUDA here, else why not."""
    err = ffi.new("char[]", 200)
    return None if lib.duck_step_cuda_available(err, 200) == 0 else ffi.string(err).decode(errors="replace")


@dataclass(slots=True)
class StepTimes:
    """One step, from C (seconds): the graphs' launch-to-done, the forwards' wall times and the
    slowest duck's kernel time per call, and every call's expert ids ([calls][ntok * topk])."""
    gpu: list[float]
    ffn: list[float]
    kernel: list[float]
    ids: list[list[int]]


class NativeStep:
    def __init__(self, session: Session, stream: int, graphs: list[int], calls: list[tuple[int, int]], io,
                 ntok: int, *, yield_cpu: bool = False):
        if len(graphs) != len(calls) + 1:
            raise ValueError(f"a step of {len(graphs)} graphs has {len(graphs) - 1} FFN calls, got {len(calls)}")
        x, y = _wire_view(io.x, writable=False), _wire_view(io.y, writable=True)
        if x is None or y is None or io.ids.dtype.itemsize != 4 or not io.x.is_pinned():
            raise ValueError("the step's buffers must be pinned host tensors in the wire's types (engine.host_ffn)")
        self.session, self.ntok = session, ntok
        self.topk = max((k for _, k in calls), default=1)
        n = len(graphs)
        self._keep = [ffi.new("uint64_t[]", graphs), ffi.new("uint32_t[]", [layer for layer, _ in calls] or [0]),
                      ffi.new("uint32_t[]", [k for _, k in calls] or [0])]
        self._gpu_ns, self._ffn_ns = ffi.new("uint64_t[]", n), ffi.new("uint64_t[]", max(1, n - 1))
        self._kernel_us = ffi.new("uint32_t[]", max(1, n - 1))
        self._ids = ffi.new("int32_t[]", max(1, n - 1) * ntok * self.topk)
        s = self._step = ffi.new("duck_step *")
        s.stream, s.n_segments = stream, n
        s.graphs, s.layers, s.topks = self._keep
        a = s.args
        a.session, a.hidden, a.ntok = session.id, session.hidden, ntok
        a.x, a.x_dtype = x[0], x[1]
        a.y, a.y_dtype = y[0], y[1]
        a.expert_ids = ffi.cast("int32_t *", io.ids.data_ptr())
        a.expert_weights = ffi.cast("float *", io.weights.data_ptr())
        s.spin_yield = int(yield_cpu)
        s.ids_log, s.ids_log_stride = self._ids, ntok * self.topk
        s.gpu_ns, s.ffn_ns, s.kernel_us = self._gpu_ns, self._ffn_ns, self._kernel_us
        self._io = io   # the buffers live as long as the step
        self._res = ffi.new("duck_step_result *")
        self.calls = calls   # (layer, topk) of each FFN call, in order

    def run(self) -> StepTimes:
        session, res = self.session, self._res
        with session.fleet._lock:
            rc = lib.duck_step_run(session.fleet._open(), self._step, res)
        n, per = len(self.calls), self.ntok * self.topk
        kernel = _account(session, rc, res, n, self._kernel_us, "native decode step",
                          (lib.DUCK_STEP_ENOCUDA, lib.DUCK_STEP_ECUDA))
        return StepTimes(gpu=[self._gpu_ns[i] * 1e-9 for i in range(n + 1)],
                         ffn=[self._ffn_ns[i] * 1e-9 for i in range(n)], kernel=kernel,
                         ids=[list(self._ids[i * per:i * per + self.ntok * k]) for i, (_, k) in enumerate(self.calls)])


@dataclass(slots=True)
class HostStepTimes:
    """One host step's forwards, from C (seconds): each one's wall time and its slowest
    duck's kernel time."""
    ffn: list[float]
    kernel: list[float]


class HostStep:
    """The CPU host decoder's layers with their FFNs on the fleet, in one C call
    (host_step.h). decoder: the duck_host_decoder *; ffn_in / ffn_out: its FFN buffers
    [max_tokens, hidden] fp32 (ffn_in the decoder's io); routed: (ids, weights, topk) of
    the decoder's io where a layer is routed, else None; dense: (ids, weights) [max_tokens]
    holding 0 and 1. The caller keeps the tensors alive and begins each step first."""

    def __init__(self, session: Session, decoder, n_layers: int, ffn_in, ffn_out, dense, routed=None):
        x, y = _wire_view(ffn_in), _wire_view(ffn_out, writable=True)
        for name, view in (("ffn_in", x), ("ffn_out", y)):
            if view is None or view[1] != lib.DUCK_DT_F32 or view[2][-1] != session.hidden:
                raise ValueError(f"a host step's {name} must be a contiguous fp32 CPU tensor [tokens, "
                                 f"{session.hidden}]")
        self.session, self.n_layers, self.max_tokens = session, n_layers, ffn_in.shape[0]
        s = self._step = ffi.new("duck_host_step *")
        s.decoder, s.n_layers = decoder, n_layers
        a = s.args
        a.session, a.hidden = session.id, session.hidden
        (a.x, a.x_dtype, _), (a.y, a.y_dtype, _) = x, y
        s.dense_ids = ffi.cast("int32_t *", dense[0].data_ptr())
        s.dense_weights = ffi.cast("float *", dense[1].data_ptr())
        if routed is not None:
            s.routed_ids = ffi.cast("int32_t *", routed[0].data_ptr())
            s.routed_weights = ffi.cast("float *", routed[1].data_ptr())
            s.routed_topk = routed[2]
        self._ffn_ns, self._kernel_us = ffi.new("uint64_t[]", n_layers), ffi.new("uint32_t[]", n_layers)
        s.ffn_ns, s.kernel_us = self._ffn_ns, self._kernel_us
        self._res = ffi.new("duck_step_result *")

    def run(self, ntok: int) -> HostStepTimes:
        """Every layer of a step of ntok tokens (begun on the decoder)."""
        if not 1 <= ntok <= self.max_tokens:
            raise ValueError(f"a host step of {ntok} tokens, its buffers hold {self.max_tokens}")
        session, res, a = self.session, self._res, self._step.args
        a.ntok = ntok
        session.cut_args(a)
        with session.fleet._lock:
            rc = lib.duck_host_step_run(session.fleet._open(), self._step, res)
        if rc == lib.DUCK_STEP_EHOST:
            raise HostStepError(f"layer {res.failed_call}: " + ffi.string(res.message).decode(errors="replace"))
        n = self.n_layers
        kernel = _account(session, rc, res, n, self._kernel_us, "host decode step")
        c = res.call
        session.last_requests, session.last_request_tokens, session.last_pipeline, session.last_group = (
            c.requests, c.request_tokens, c.pipeline, c.group)
        return HostStepTimes(ffn=[self._ffn_ns[i] * 1e-9 for i in range(n)], kernel=kernel)


class HostStepError(RuntimeError):
    """The host decoder refused a layer of a host step (says which, and why)."""


def _account(session: Session, rc: int, res, calls: int, kernel_us, what: str, step_errors=()) -> list[float]:
    """A C step's result into the session's counters, as Session.forward keeps them: lost ducks
    reported, an error raised (a forward's as Session.forward raises it); returns each call's
    slowest-duck kernel time (s)."""
    fleet = session.fleet
    session.retransmits += res.retransmits
    if res.mtu_fallbacks:
        session._log_fallback(what, res.mtu_fallbacks)
    if res.lost_new or fleet.lost_changed:     # as Session.forward reports them
        fleet.lost_changed = False
        session._report_lost(res.lost_new, res.host_ns / 1e6 / max(1, calls))
    if res.host_slices:
        session.host_ns_total += res.host_ns
        session.host_forwards += calls
    if rc in step_errors or rc == lib.DUCK_T_EARG and res.failed_call < 0:
        raise RuntimeError(f"{what}: " + ffi.string(res.message).decode(errors="replace"))
    if rc:
        session._raise(rc, res.call)
    session.bytes_streamed += res.bytes_streamed
    session.kernel_us_total += res.kernel_us_sum
    session.wake_ns_max = res.wake_ns_max
    kernel = [kernel_us[i] * 1e-6 for i in range(calls)]
    if kernel and max(kernel) * 1e6 > session.kernel_us_max:
        session.kernel_us_max = int(max(kernel) * 1e6)
    return kernel
