"""A persistent session: layer plans resident on every duck, one forward per layer."""
from __future__ import annotations

import logging

import numpy as np

from native._native import ffi, lib
from native.kernels import ExpertSlice, ffn_inputs
from native.transport.errors import DuckError, DuckTimeout

log = logging.getLogger("duck.transport")

MAX_TOKENS = lib.WIRE_MAX_TOKENS


class Session:
    """A persistent session: forward() per layer, plans resident on the ducks."""

    def __init__(self, fleet: Fleet, session_id: int, hidden: int, layers: set[int]):
        self.fleet, self.id, self.hidden, self.layers = fleet, session_id, hidden, set(layers)
        self._args = ffi.new("duck_forward_args *")
        self._args.session, self._args.hidden = session_id, hidden
        self._res = ffi.new("duck_forward_result *")
        self.bytes_streamed = 0
        self.kernel_us_max = 0
        self.kernel_us_total = 0   # the slowest duck's kernel time, summed over calls
        self.retransmits = 0

    def forward(self, layer: int, x, expert_ids, expert_weights, out: np.ndarray | None = None) -> np.ndarray:
        """x [T, H] (fp32 numpy, or torch fp32/bf16 on the CPU), expert_ids / weights [T, k]
        -> [T, H] fp32: the sum of every duck's partial. T is any count (chunks of 64).
        Raises DuckTimeout naming a duck that did not answer within the deadline,
        DuckError for a duck that refused (unknown layer, expert id out of range)."""
        xn, bf16, ids, wts = ffn_inputs(x, expert_ids, expert_weights)
        ntok = xn.shape[0]
        if xn.ndim != 2 or xn.shape[1] != self.hidden:
            raise ValueError(f"forward layer {layer}: activation {xn.shape} does not have hidden size {self.hidden}")
        if ids.shape[1] > lib.WIRE_MAX_TOPK:
            raise ValueError(f"forward layer {layer}: {ids.shape[1]} experts per token, at most {lib.WIRE_MAX_TOPK}")
        y = out if out is not None else np.empty((ntok, self.hidden), dtype=np.float32)
        if y.shape != (ntok, self.hidden) or y.dtype != np.float32 or not y.flags.c_contiguous:
            raise ValueError(f"forward layer {layer}: out must be a contiguous float32 array of {(ntok, self.hidden)}")
        a, res = self._args, self._res
        a.layer, a.topk, a.x_is_bf16 = layer, ids.shape[1], int(bf16)
        step = MAX_TOKENS
        for t0 in range(0, ntok, step):
            if ntok <= step:
                xs, ys, si, sw = xn, y, ids, wts
            else:
                xs, ys, si, sw = xn[t0:t0 + step], y[t0:t0 + step], ids[t0:t0 + step], wts[t0:t0 + step]
            a.ntok = xs.shape[0]
            a.expert_ids = ffi.from_buffer("int32_t[]", si)
            a.expert_weights = ffi.from_buffer("float[]", sw)
            a.x = ffi.from_buffer(xs)
            a.y = ffi.from_buffer("float[]", ys, require_writable=True)
            with self.fleet._lock:
                rc = lib.duck_transport_forward(self.fleet._t, a, res)
            self.retransmits += res.retransmits
            if rc != lib.DUCK_T_OK:
                self._raise(rc, res)
            self.bytes_streamed += res.bytes_streamed
            if res.kernel_us_max > self.kernel_us_max:
                self.kernel_us_max = res.kernel_us_max
            self.kernel_us_total += res.kernel_us_max
        return y

    def _raise(self, rc: int, res) -> None:
        msg = ffi.string(res.message).decode(errors="replace")
        d = res.failed_duck
        if d >= 0:
            msg = msg.replace(f"duck {d}", self.fleet.name(d), 1)
        cls = DuckTimeout if rc == lib.DUCK_T_ETIMEOUT else DuckError
        raise cls(msg, d if d >= 0 else None, res.duck_status)

    def close(self) -> None:
        """Releases the plans on every duck (their cache entries stay)."""
        self.fleet._all(lib.WIRE_T_SESSION_CLOSE, session=self.id)


def open_session(fleet, layers: dict[int, list[list[ExpertSlice]]], hidden: int, session_id: int):
    so = ffi.new("wire_session_open *")
    so.hidden = hidden
    fleet._all(lib.WIRE_T_SESSION_OPEN, bytes(ffi.buffer(so)), session=session_id)
    for layer, per_duck in sorted(layers.items()):
        if len(per_duck) != fleet.n_ducks:
            raise ValueError(f"layer {layer}: slices for {len(per_duck)} ducks, the fleet has {fleet.n_ducks}")
        reqs = []
        for d, experts in enumerate(per_duck):
            lp = ffi.new("wire_layer_plan *")
            lp.layer, lp.n_experts, lp.hidden = layer, len(experts), hidden
            digests = b"".join(bytes.fromhex(e.gate_up.digest()) + bytes.fromhex(e.down.digest()) for e in experts)
            reqs.append((d, lib.WIRE_T_LAYER_PLAN, bytes(ffi.buffer(lp)) + digests, 0))
        fleet.call(reqs, session=session_id)
    log.info("session %08x open on %d ducks: %d layers, hidden %d", session_id, fleet.n_ducks, len(layers), hidden)
    return Session(fleet, session_id, hidden, set(layers))
