"""The host's cover for lost ducks (native/transport/cover.c, transport_lost.c).

A session's slice d is duck d's. With a cover set, a duck whose forward call
stays silent past its lost deadline (a few of its own measured step times,
not a constant), or that answers without its session, is marked lost: that
forward and the following ones send its slice to its replica (the other duck
that holds it, when there are replicas) or compute it here, from the same
fp9 packs the host uploads, with the same kernel the ducks run. Partials are
summed in slice order whoever computed them: the sum is the undisturbed
run's bits. The host computes at most budget_bytes of slices at a time; past
that a forward fails with DuckError naming the lost ducks and the memory
needed. set_lost(d, False) gives a duck its slices back (it serves again).
"""
from __future__ import annotations

import logging

from native._native import ffi, lib
from native.fp9 import Fp9Tensor
from native.kernels import ExpertSlice, MoeSlice, Pool, kernels

log = logging.getLogger("duck.transport")

# A forward's silence that marks its duck lost: this many of the duck's steps
# (every layer's expected call), within [lost_floor_ms, the fleet's deadline].
LOST_STEPS = 3
LOST_FLOOR_MS = 100.0


class HostCover:
    """layers[layer][d]: slice d's expert slices (split_experts' result, Fp9Tensors);
    replicas[d]: the other duck holding slice d as its layer + replica_layer_offset, or -1."""

    def __init__(self, fleet, layers: dict[int, list[list[ExpertSlice]]], hidden: int, budget_bytes: int,
                 replicas: list[int] | None = None, replica_layer_offset: int = 0, threads: int = 1,
                 kernel_set: str = "best", lost_steps: int = LOST_STEPS, lost_floor_ms: float = LOST_FLOOR_MS):
        n = fleet.n_ducks
        if budget_bytes < 0 or lost_steps < 1 or lost_floor_ms < 0:
            raise ValueError(f"cover: budget_bytes {budget_bytes} >= 0, lost_steps {lost_steps} >= 1 and "
                             f"lost_floor_ms {lost_floor_ms} >= 0 required")
        self.fleet = fleet
        self.pool = Pool(threads, pin=False) if threads > 1 else None
        ptr = lib.duck_cover_create(n, self.pool.ptr if self.pool else ffi.NULL, kernels(kernel_set))
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot make a host cover for {n} slices")
        self._c = ffi.gc(ptr, lib.duck_cover_destroy)
        self._tables: list[MoeSlice] = []            # the C cover points into them
        self.slice_bytes = [0] * n
        for layer, per_slice in sorted(layers.items()):
            if len(per_slice) != n:
                raise ValueError(f"cover: layer {layer} has {len(per_slice)} slices, the fleet {n} ducks")
            for d, experts in enumerate(per_slice):
                bad = [e for e in experts for t in (e.gate_up, e.down) if not isinstance(t, Fp9Tensor)]
                if bad:
                    raise ValueError(f"cover: layer {layer} slice {d} is synthetic (made on the ducks); the host "
                                     "holds no packs to compute it")
                table = MoeSlice(experts, hidden, name=f"layer {layer} slice {d} (host cover)")
                if lib.duck_cover_set_layer(self._c, d, layer, table._table, len(experts)) != 0:
                    raise ValueError(f"cover: layer {layer} slice {d}: layer out of range (< {lib.WIRE_MAX_LAYERS})")
                self._tables.append(table)
                self.slice_bytes[d] += sum(e.gate_up.nbytes + e.down.nbytes for e in experts)
        self.replicas = list(replicas) if replicas else None
        self._cfg = ffi.new("duck_cover_config *")
        lib.duck_cover_attach(self._c, self._cfg)
        self._keep = [ffi.new("uint64_t[]", self.slice_bytes)]
        self._cfg.slice_bytes = self._keep[0]
        self._cfg.budget_bytes = budget_bytes
        if self.replicas:
            self._keep.append(ffi.new("int32_t[]", self.replicas))
            self._cfg.replica = self._keep[-1]
            self._cfg.replica_layer_offset = replica_layer_offset
        self._cfg.lost_calls = lost_steps * max(1, len(layers))
        self._cfg.lost_floor_us = int(lost_floor_ms * 1000)
        err = ffi.new("char[256]")
        with fleet._lock:
            if lib.duck_transport_set_cover(fleet._open(), self._cfg, err, 256) != 0:
                raise ValueError(f"cover: {ffi.string(err).decode()}")
        fleet._cover = self      # the transport calls into this cover: it lives as long as the fleet uses it

    def detach(self) -> None:
        with self.fleet._lock:
            if self.fleet._t is not None:
                lib.duck_transport_set_cover(self.fleet._t, ffi.NULL, ffi.NULL, 0)
        if getattr(self.fleet, "_cover", None) is self:
            self.fleet._cover = None
