"""Weight sync and session set-up over a Fleet: content-addressed, resumable
uploads (what a duck's cache holds is skipped) and resident layer plans."""
from __future__ import annotations

import logging
import time

from native._native import ffi, lib
from native.fp9 import Fp9Tensor
from native.kernels import ExpertSlice

log = logging.getLogger("duck.transport")

PART = lib.WIRE_UPLOAD_PART_MAX


def _upload_payload(digest: bytes, data: memoryview, offset: int, n: int) -> bytes:
    u = ffi.new("wire_upload *")
    u.digest = list(digest)
    u.total, u.offset, u.len = len(data), offset, n
    return bytes(ffi.buffer(u)) + bytes(data[offset:offset + n])


def upload(fleet, tensors_per_duck: list[list[Fp9Tensor]]) -> dict:
    """Sends each duck the tensors its cache lacks; all ducks progress together,
    one part (<= WIRE_UPLOAD_PART_MAX bytes) per duck per round trip."""
    if len(tensors_per_duck) != fleet.n_ducks:
        raise ValueError(f"upload: {len(tensors_per_duck)} tensor lists for {fleet.n_ducks} ducks")
    t0 = time.perf_counter()
    queues = []
    unique = [{t.digest(): t for t in ts} for ts in tensors_per_duck]
    held = fleet.cache_query([list(u) for u in unique])
    skipped = sum(len(h) for h in held)
    for u, h in zip(unique, held):
        queues.append([(bytes.fromhex(dg), memoryview(t.buf).cast("B"), t.name) for dg, t in u.items() if dg not in h])
    # None: ask the duck how much of the tensor it holds (a resumed upload)
    offsets: list[int | None] = [None] * fleet.n_ducks
    uploaded = nbytes = 0
    while any(queues):
        reqs, who = [], []
        for d, q in enumerate(queues):
            if not q:
                continue
            digest, data, _ = q[0]
            n = 0 if offsets[d] is None else min(PART, len(data) - offsets[d])
            reqs.append((d, lib.WIRE_T_UPLOAD, _upload_payload(digest, data, offsets[d] or 0, n),
                         ffi.sizeof("wire_upload_reply")))
            who.append((d, n))
        for (d, n), (_, body) in zip(who, fleet.call(reqs)):
            rep = ffi.cast("wire_upload_reply *", ffi.from_buffer(body))
            digest, data, name = queues[d][0]
            if rep.complete:
                nbytes += len(data)
                uploaded += 1
                queues[d].pop(0)
                offsets[d] = None
                log.debug("%s: %s stored (%d bytes)", fleet.name(d), name, len(data))
            else:
                if offsets[d] is None and rep.have:
                    log.info("%s: upload of %s resumes at byte %d", fleet.name(d), name, rep.have)
                offsets[d] = rep.have
    dt = time.perf_counter() - t0
    log.info("upload: %d tensors (%.1f MB) in %.2f s, %d already cached", uploaded, nbytes / 1e6, dt, skipped)
    return {"uploaded": uploaded, "skipped": skipped, "bytes": nbytes, "seconds": dt}


def open_session(fleet, layers: dict[int, list[list[ExpertSlice]]], hidden: int, session_id: int):
    from native.transport import Session
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
