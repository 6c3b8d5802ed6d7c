"""The Cache API: what the ducks and the host hold, and invalidation of one
duck, one model, or everything."""
from __future__ import annotations

import asyncio
import json
import logging

import grpc

from duck_proto import duck_pb2 as pb
from duckd.server import ApiError

log = logging.getLogger("duckd.cache")


def _manifest(daemon) -> dict:
    path = daemon.state_dir / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def cache_list(daemon, duck_id: int | None) -> pb.CacheListResponse:
    if daemon.transport is None:
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, "the model does not run on the fleet (backend "
                       f"{daemon.cfg.model.backend}): the ducks hold no weights")
    manifest = _manifest(daemon)
    ducks = list(range(daemon.transport.n_ducks)) if duck_id is None else [daemon._duck(duck_id).id]
    entries: dict[str, pb.CacheEntry] = {}
    per_duck = manifest.get("ducks", [])
    for d in ducks:
        for digest, name, nbytes in per_duck[d] if d < len(per_duck) else []:
            e = entries.setdefault(digest, pb.CacheEntry(digest=digest, name=name, bytes=nbytes,
                                                         model=manifest.get("model", "")))
            e.ducks.append(d)
    return pb.CacheListResponse(entries=list(entries.values()),
                                host_cache_bytes=daemon.packs.total_bytes() if daemon.packs else 0)


async def _invalidate(daemon, ducks=None) -> list[int]:
    """Drops the entries not in use; a duck that keeps entries its open session
    uses says so, and that becomes FAILED_PRECONDITION with its words."""
    from native.transport import DuckError
    def work():
        with daemon.model.lock:          # taken in the worker: a running chat must not stall the loop
            return daemon.transport.invalidate(None, ducks)
    try:
        return await asyncio.to_thread(work)
    except DuckError as e:
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                       f"{e}; entries in use stay until the session closes (restart duckd with another "
                       "model, tp or multiple_of to drop them)") from None


async def cache_invalidate(daemon, request: pb.InvalidateRequest) -> pb.InvalidateResponse:
    if daemon.transport is None:
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, "the model does not run on the fleet: nothing cached")
    target = request.WhichOneof("target")
    if target == "duck_id":
        duck = daemon._duck(request.duck_id)
        counts = await _invalidate(daemon, [duck.id])
        msg = f"duck {duck.id}: dropped {counts[0]} cache entries not in use"
        daemon.events.add("cache", msg, duck.id)
        return pb.InvalidateResponse(entries_removed=counts[0], message=msg)
    if target == "model":
        manifest = _manifest(daemon)
        if request.model not in (manifest.get("model"), daemon.model.name):
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"model {request.model!r}: not on this fleet "
                           f"(serving {daemon.model.name!r})")
    counts = await _invalidate(daemon)
    daemon.drop_host_packs()
    msg = f"dropped {sum(counts)} duck cache entries not in use and the host's packed slices"
    daemon.events.add("cache", msg)
    return pb.InvalidateResponse(entries_removed=sum(counts), message=msg)
