"""A persistent session: layer plans resident on every duck, one forward per layer."""
from __future__ import annotations

import logging
import sys

import numpy as np

from native._native import ffi, lib
from native.fp9 import _to_numpy
from native.kernels import ExpertSlice
from native.transport.errors import DuckError, DuckTimeout

log = logging.getLogger("duck.transport")

MAX_TOKENS = lib.WIRE_TOKENS_DEFAULT   # per request to ducks whose hello did not say (see DuckInfo.max_tokens)
F32, BF16 = lib.DUCK_DT_F32, lib.DUCK_DT_BF16
_NUMPY_DTYPES = {np.dtype(np.float32): F32, np.dtype(np.uint16): BF16}   # bf16 as its bits
_torch_dtypes: dict = {}


def _torch_dtype(dtype):
    """The wire dtype of a torch dtype (None if not fp32/bf16); torch is imported by whoever made the tensor."""
    if not _torch_dtypes:
        torch = sys.modules["torch"]
        _torch_dtypes.update({torch.float32: F32, torch.bfloat16: BF16})
    return _torch_dtypes.get(dtype)


def _wire_view(a, writable: bool = False):
    """(pointer, wire dtype, shape) of a C-contiguous fp32/bf16 CPU buffer, viewed
    (numpy float32 or uint16 bf16 bits, torch float32 or bfloat16); None otherwise."""
    if type(a) is np.ndarray:
        code = _NUMPY_DTYPES.get(a.dtype)
        if code is None or not a.flags.c_contiguous or (writable and not a.flags.writeable):
            return None
        return ffi.cast("char *", ffi.from_buffer(a)), code, a.shape
    if hasattr(a, "data_ptr") and a.is_cpu and a.is_contiguous():
        code = _torch_dtype(a.dtype)
        if code is not None:
            return ffi.cast("char *", a.data_ptr()), code, a.shape
    return None


def _routing_view(a, np_dtype, torch_name: str, ctype: str):
    """(typed pointer, element count, owner) of ids (int32) or weights (fp32), converted only if needed."""
    if type(a) is np.ndarray and a.dtype == np_dtype and a.flags.c_contiguous:
        return ffi.from_buffer(ctype + "[]", a), a.size, a
    if hasattr(a, "data_ptr") and a.is_cpu and a.is_contiguous() and str(a.dtype) == torch_name:
        return ffi.cast(ctype + " *", a.data_ptr()), a.numel(), a
    arr = np.ascontiguousarray(_to_numpy(a), dtype=np_dtype)
    return ffi.from_buffer(ctype + "[]", arr), arr.size, arr


def forward_plan(fleet, ntok: int, hidden: int, topk: int = 1, x_dtype: int = F32, y_dtype: int = F32,
                 request_tokens: int = 0, pipeline: int = 0, group_tokens: int = 0) -> dict:
    """How a forward of ntok tokens would be cut (nothing is sent): requests,
    request_tokens, pipeline (in flight per duck), group (requests per kernel
    pass on the ducks) and rcvbuf_short."""
    a, res = ffi.new("duck_forward_args *"), ffi.new("duck_forward_result *")
    a.ntok, a.hidden, a.topk, a.x_dtype, a.y_dtype = ntok, hidden, topk, x_dtype, y_dtype
    a.request_tokens, a.pipeline, a.group_tokens = request_tokens, pipeline, group_tokens
    with fleet._lock:
        lib.duck_transport_plan(fleet._open(), a, res)
    return {"requests": res.requests, "request_tokens": res.request_tokens, "pipeline": res.pipeline,
            "group": res.group, "rcvbuf_short": bool(res.rcvbuf_short)}


class Session:
    """A persistent session: forward() per layer, plans resident on the ducks.

    request_tokens: most tokens per request (0: as many as every duck takes, its
    hello's max_tokens); pipeline: requests in flight per duck when a forward
    takes several (0: the transport's default, DUCK_PIPELINE_DEFAULT);
    group_tokens: most tokens a duck runs in one kernel pass over requests it
    holds (WIRE_FWD_HOLD; None: its hello's max_tokens, 0: each request its own)."""

    def __init__(self, fleet: Fleet, session_id: int, hidden: int, layers: set[int], request_tokens: int = 0,
                 pipeline: int = 0):
        self.fleet, self.id, self.hidden, self.layers = fleet, session_id, hidden, set(layers)
        self.plans: list = []      # each duck's [(wire layer, expert slices)], for reopen_duck
        self._args = ffi.new("duck_forward_args *")
        self._args.session, self._args.hidden = session_id, hidden
        self._res = ffi.new("duck_forward_result *")
        self.duck_max_tokens = min((i.max_tokens for i in fleet.infos), default=MAX_TOKENS) or MAX_TOKENS
        self.request_tokens = request_tokens
        self.pipeline = pipeline
        self.group_tokens = None
        self.bytes_streamed = 0
        self.kernel_us_max = 0
        self.kernel_us_total = 0   # the slowest duck's kernel time, summed over requests
        self.retransmits = 0
        self.wake_ns_max = 0       # the last call's slowest duck: its request's arrival to its kernel's start
        self.last_requests = 0     # the last call's requests (each to every duck), their tokens, in flight
        self.last_request_tokens = 0
        self.last_pipeline = 0
        self.last_group = 0
        self._warned_rcvbuf = False
        self.host_ns_total = 0     # time this host spent computing lost ducks' slices (native/transport/cover.py)
        self.host_forwards = 0     # forwards with a slice computed here
        # called (from the forwarding thread) with the ducks a forward found lost and what their
        # slices cost this host in that forward, in ms: on_lost(ducks, host_ms)
        self.on_lost = None

    def forward(self, layer: int, x, expert_ids, expert_weights, out=None):
        """x [T, H] fp32 or bf16: numpy (bf16 as uint16 bits) or a CPU torch tensor,
        passed as it is when contiguous (anything else is converted to fp32);
        expert_ids / expert_weights [T, k] int32 / fp32 (numpy or torch; converted
        only if not). Returns y [T, H], the fp32 sum of every duck's partial written
        in out's dtype: out is fp32 or bf16, numpy (float32 or uint16 bits) or a
        contiguous CPU torch tensor; None: a new fp32 numpy array. The partials
        travel in out's dtype (docs/wire.md). T is any count: one C call, cut into
        requests as large as the ducks and the datagram sizes allow, pipelined.
        Raises DuckTimeout naming a duck that did not answer within the deadline,
        DuckError for a duck that refused (unknown layer, expert id out of range)."""
        xv = _wire_view(x)
        if xv is None:
            xf = np.ascontiguousarray(_to_numpy(x), dtype=np.float32)
            xv = ffi.cast("char *", ffi.from_buffer(xf)), F32, xf.shape
        xp, x_dtype, shape = xv
        ntok = shape[0] if len(shape) == 2 else 1
        if shape[-1] != self.hidden or len(shape) > 2:
            raise ValueError(f"forward layer {layer}: activation {tuple(shape)} does not have hidden size "
                             f"{self.hidden}")
        if out is None:
            out = np.empty((ntok, self.hidden), dtype=np.float32)
        yv = _wire_view(out, writable=True)
        if yv is None or yv[2][-1] != self.hidden or (yv[2][0] if len(yv[2]) == 2 else 1) != ntok:
            raise ValueError(f"forward layer {layer}: out must be a contiguous fp32 or bf16 CPU array of "
                             f"{(ntok, self.hidden)} (numpy float32/uint16 or torch float32/bfloat16), got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        yp, y_dtype, _ = yv
        ip, n_ids, keep_i = _routing_view(expert_ids, np.int32, "torch.int32", "int32_t")
        wp, n_w, keep_w = _routing_view(expert_weights, np.float32, "torch.float32", "float")
        topk = n_ids // ntok if ntok else 0
        if n_ids != ntok * topk or n_w != n_ids:
            raise ValueError(f"forward layer {layer}: {n_ids} expert ids and {n_w} weights for {ntok} tokens")
        if topk > lib.WIRE_MAX_TOPK:
            raise ValueError(f"forward layer {layer}: {topk} experts per token, at most {lib.WIRE_MAX_TOPK}")
        a, res, fleet = self._args, self._res, self.fleet
        a.layer, a.ntok, a.topk, a.x_dtype, a.y_dtype = layer, ntok, topk, x_dtype, y_dtype
        a.x, a.y, a.expert_ids, a.expert_weights = xp, yp, ip, wp
        self.cut_args(a)
        with fleet._lock:
            rc = lib.duck_transport_forward(fleet._open(), a, res)
            rcvbuf = lib.duck_transport_rcvbuf(fleet._t) if res.rcvbuf_short else 0
        self.retransmits += res.retransmits
        if res.mtu_fallbacks:
            self._log_fallback(f"forward of layer {layer}", res.mtu_fallbacks)
        if res.rcvbuf_short and not self._warned_rcvbuf:
            self._warned_rcvbuf = True
            log.warning("the host's socket receive buffer (%d bytes) is less than twice one token's partials "
                        "from %d ducks at hidden %d: replies will be dropped and resent; raise "
                        "net.core.rmem_max (sysctl -w net.core.rmem_max=67108864)",
                        rcvbuf, fleet.n_ducks, self.hidden)
        if res.lost_new or fleet.lost_changed:
            fleet.lost_changed = False
            self._report_lost(res.lost_new, res.host_ns / 1e6)
        if rc:
            self._raise(rc, res)
        if res.host_slices:
            self.host_ns_total += res.host_ns
            self.host_forwards += 1
        self.bytes_streamed += res.bytes_streamed
        self.kernel_us_max = max(self.kernel_us_max, res.kernel_us_max)
        self.kernel_us_total += res.kernel_us_sum
        self.wake_ns_max = res.wake_ns_max
        self.last_requests, self.last_request_tokens, self.last_pipeline, self.last_group = (
            res.requests, res.request_tokens, res.pipeline, res.group)
        del keep_i, keep_w
        return out

    def cut_args(self, a) -> None:
        """How a forward's tokens are cut into requests (duck_forward_args): this session's
        settings within what the ducks take."""
        a.request_tokens = min(self.request_tokens or self.duck_max_tokens, self.duck_max_tokens)
        a.pipeline = self.pipeline
        a.group_tokens = self.duck_max_tokens if self.group_tokens is None else min(self.group_tokens,
                                                                                    self.duck_max_tokens)

    def _report_lost(self, lost_new: int, host_ms: float) -> None:
        """Tells on_lost who is lost now and what a forward of their slices costs here (ms)."""
        lost = self.fleet.lost()
        if lost_new:
            routes = self.fleet.routes()
            log.warning("%d duck(s) found lost in a forward; lost now: %s; slices computed by %s", lost_new,
                        lost, ["host" if r == lib.DUCK_ROUTE_HOST else "nobody" if r == lib.DUCK_ROUTE_NONE
                               else f"duck {r}" for r in routes])
        if self.on_lost is not None:
            self.on_lost(lost, host_ms)

    @property
    def host_ms_per_forward(self) -> float:
        """What computing lost ducks' slices costs this host per forward (a layer), on average."""
        return self.host_ns_total / 1e6 / self.host_forwards if self.host_forwards else 0.0

    def _log_fallback(self, where: str, fallbacks: int) -> None:
        sizes = self.fleet.datagram_sizes()
        log.warning("%s: %d duck(s) did not take their agreed datagram size and fell back; "
                    "datagram sizes now %s", where, fallbacks, sizes)

    def _raise(self, rc: int, res) -> None:
        msg = ffi.string(res.message).decode(errors="replace")
        d = res.failed_duck
        if d >= 0:
            msg = msg.replace(f"duck {d}", self.fleet.name(d), 1)
        cls = DuckTimeout if rc == lib.DUCK_T_ETIMEOUT else DuckError   # DUCK_T_ECOVER: lost beyond the cover
        raise cls(msg, d if d >= 0 else None, res.duck_status)

    def reopen_duck(self, duck: int) -> None:
        """This session and its plans on one duck again (a restarted duck lost them)."""
        plan_ducks(self.fleet, self.plans, self.hidden, self.id, [duck])

    def close(self) -> None:
        """Releases the plans on every duck not lost (their cache entries stay)."""
        lost = set(self.fleet.lost())
        self.fleet._all(lib.WIRE_T_SESSION_CLOSE, session=self.id,
                        ducks=[d for d in range(self.fleet.n_ducks) if d not in lost])


# A replica holds slice d of layer L as its layer L + this (the wire's layer numbers are < WIRE_MAX_LAYERS).
REPLICA_LAYER_OFFSET = lib.WIRE_MAX_LAYERS // 2


def duck_plans(layers: dict[int, list[list[ExpertSlice]]], n_ducks: int, replicas: list[int] | None = None):
    """Each duck's layer plans [(wire layer, expert slices)]: its own slice of every layer,
    and, where replicas[d] names it, slice d's as layer + REPLICA_LAYER_OFFSET."""
    plans: list[list[tuple[int, list[ExpertSlice]]]] = [[] for _ in range(n_ducks)]
    for layer, per_duck in sorted(layers.items()):
        if len(per_duck) != n_ducks:
            raise ValueError(f"layer {layer}: slices for {len(per_duck)} ducks, the fleet has {n_ducks}")
        if replicas and layer >= REPLICA_LAYER_OFFSET:
            raise ValueError(f"layer {layer}: replicas need layer numbers below {REPLICA_LAYER_OFFSET}")
        for d, experts in enumerate(per_duck):
            plans[d].append((layer, experts))
            if replicas and replicas[d] >= 0:
                plans[replicas[d]].append((layer + REPLICA_LAYER_OFFSET, experts))
    return plans


def plan_ducks(fleet, plans, hidden: int, session_id: int, ducks) -> None:
    """Opens the session on these ducks and makes their plans resident (one plan per duck per round trip)."""
    ducks = list(ducks)
    so = ffi.new("wire_session_open *")
    so.hidden = hidden
    fleet._all(lib.WIRE_T_SESSION_OPEN, bytes(ffi.buffer(so)), ducks=ducks, session=session_id)
    for i in range(max((len(plans[d]) for d in ducks), default=0)):
        reqs = []
        for d in ducks:
            if i >= len(plans[d]):
                continue
            layer, experts = plans[d][i]
            lp = ffi.new("wire_layer_plan *")
            lp.layer, lp.n_experts, lp.hidden = layer, len(experts), hidden
            digests = b"".join(bytes.fromhex(e.gate_up.digest()) + bytes.fromhex(e.down.digest()) for e in experts)
            reqs.append((d, lib.WIRE_T_LAYER_PLAN, bytes(ffi.buffer(lp)) + digests, 0))
        fleet.call(reqs, session=session_id)


def open_session(fleet, layers: dict[int, list[list[ExpertSlice]]], hidden: int, session_id: int,
                 replicas: list[int] | None = None, **options):
    plans = duck_plans(layers, fleet.n_ducks, replicas)
    plan_ducks(fleet, plans, hidden, session_id, range(fleet.n_ducks))
    log.info("session %08x open on %d ducks: %d layers%s, hidden %d; datagrams of %s bytes", session_id,
             fleet.n_ducks, len(layers), " (each slice on two ducks)" if replicas else "", hidden,
             fleet.datagram_sizes())
    session = Session(fleet, session_id, hidden, set(layers), **options)
    session.plans = plans
    return session
