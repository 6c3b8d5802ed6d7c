"""The cache service: what the ducks and the host hold, and invalidation of one
duck, one model, or everything. Plain dataclasses in and out, duckd.errors for
what is wrong; duckd.server adapts it to gRPC."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

from duckd.errors import FailedPrecondition, NotFound

log = logging.getLogger("duckd.cache")


@dataclass(slots=True)
class CacheEntry:
    digest: str              # content hash of the packed fp9 slice
    name: str                # e.g. layers.3.experts.7.gate_up[1/4]
    bytes: int
    model: str
    ducks: list[int] = field(default_factory=list)   # the ducks that hold it


@dataclass(slots=True, frozen=True)
class CacheListing:
    entries: list[CacheEntry]
    host_cache_bytes: int


@dataclass(slots=True, frozen=True)
class Invalidated:
    entries_removed: int
    message: str


class CacheService:
    def __init__(self, daemon):
        self.daemon = daemon

    def _manifest(self) -> dict:
        path = self.daemon.state_dir / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _transport(self):
        d = self.daemon
        if d.transport is None:
            raise FailedPrecondition(f"the model does not run on the fleet (backend {d.cfg.model.backend}): "
                                     "the ducks hold no weights")
        return d.transport

    def list(self, duck_id: int | None = None) -> CacheListing:
        """Every cached slice (of one duck, or of all with duck_id None)."""
        transport = self._transport()
        manifest = self._manifest()
        ducks = list(range(transport.n_ducks)) if duck_id is None else [self.daemon.duck(duck_id).id]
        entries: dict[str, CacheEntry] = {}
        per_duck = manifest.get("ducks", [])
        for d in ducks:
            for digest, name, nbytes in per_duck[d] if d < len(per_duck) else []:
                entries.setdefault(digest, CacheEntry(digest, name, nbytes, manifest.get("model", ""))).ducks.append(d)
        packs = self.daemon.packs
        return CacheListing(list(entries.values()), packs.total_bytes() if packs else 0)

    async def _invalidate(self, ducks=None) -> list[int]:
        """Drops the entries not in use; a duck that keeps entries its open session
        uses says so, and that becomes FailedPrecondition with its words."""
        from native.transport import DuckError
        transport = self._transport()

        def work():
            with self.daemon.model.lock:          # taken in the worker: a running chat must not stall the loop
                return transport.invalidate(None, ducks)
        try:
            return await asyncio.to_thread(work)
        except DuckError as e:
            raise FailedPrecondition(f"{e}; entries in use stay until the session closes (restart duckd with "
                                     "another model, tp or multiple_of to drop them)") from None

    async def invalidate_duck(self, duck_id: int) -> Invalidated:
        duck = self.daemon.duck(duck_id)
        counts = await self._invalidate([duck.id])
        msg = f"duck {duck.id}: dropped {counts[0]} cache entries not in use"
        self.daemon.events.add("cache", msg, duck.id)
        return Invalidated(counts[0], msg)

    async def invalidate_model(self, model: str) -> Invalidated:
        self._transport()
        if model not in (self._manifest().get("model"), self.daemon.model.name):
            raise NotFound(f"model {model!r}: not on this fleet (serving {self.daemon.model.name!r})")
        return await self.invalidate_all()

    async def invalidate_all(self) -> Invalidated:
        counts = await self._invalidate()
        self.daemon.drop_host_packs()
        msg = f"dropped {sum(counts)} duck cache entries not in use and the host's packed slices"
        self.daemon.events.add("cache", msg)
        return Invalidated(sum(counts), msg)
