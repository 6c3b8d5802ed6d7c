"""Lost ducks, the daemon's side. The transport marks a duck lost when a
forward finds it gone (native/transport/cover.py) and its slices go to its
replica or to this host; the fleet manager marks it when a health check
fails. Here: the event that says who computes its slices and at what cost,
a health check at once (a dead duck is failed and restarted by the usual
path; a live one that was only slow gets its slices back), and the slices
given back when a restarted duck serves again (between two steps)."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("duckd.lost")


class LostDucks:
    def __init__(self, daemon):
        self.daemon = daemon
        self.reported: set[int] = set()     # lost ducks the events have told of
        self._busy: set[int] = set()        # ducks being marked or given their slices back
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ffn(self):
        ffn = self.daemon.model.ffn
        return ffn if ffn is not None and getattr(ffn, "cover", None) is not None else None

    def attach(self) -> None:
        """After the model is loaded, on the event loop: forwards report lost ducks here."""
        self._loop = asyncio.get_running_loop()
        if self.ffn is not None:
            self.ffn.on_lost = self._from_forward

    def uncovered(self) -> str:
        """Why a lost duck's slices have nobody to compute them ("" when all have someone):
        the ducks, the memory and the cover budget, as a forward that meets it says."""
        ffn = self.ffn
        return ffn.fleet.cover_error() if ffn is not None else ""

    def covers(self, duck_id: int) -> bool:
        """Whether a duck that is not serving has its slices computed elsewhere (a chat may run)."""
        from native._native import lib
        ffn = self.ffn
        return ffn is not None and ffn.fleet.routes()[duck_id] != lib.DUCK_ROUTE_NONE

    # -- from a forward (the generation's thread) -------------------------------
    def _from_forward(self, lost: list[int], host_ms: float) -> None:
        routes = self.ffn.fleet.routes()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._lost, lost, host_ms, routes)

    def _lost(self, lost: list[int], host_ms: float, routes: list[int]) -> None:
        from native._native import lib
        fleet = self.daemon.fleet
        for d in lost:
            if d in self.reported:
                continue
            r = routes[d]
            if r == lib.DUCK_ROUTE_HOST:
                what = f"host computing its slices ({host_ms:.1f} ms per layer)"
            elif r == lib.DUCK_ROUTE_NONE:
                what = ("nobody can compute its slices (more than fleet.host_cover_mb = "
                        f"{self.daemon.cfg.fleet.host_cover_mb} MB); chats fail until it is back")
            else:
                what = f"duck {r} computing its slices (it holds their replica)"
            fleet.events.add("lost", f"duck {d} lost: {what}", d, logging.WARNING)
            fleet.check_soon(fleet.ducks[d])
        self.reported = set(lost)

    # -- from the fleet manager (the event loop) ------------------------------
    def failed(self, duck) -> None:
        """A health check failed the duck: its slices go elsewhere now, not at a forward's deadline,
        also in the forward in flight (a hint: set_lost waits for that forward to end)."""
        if self.ffn is not None:
            self.ffn.fleet.hint_lost(duck.id)
        if self.ffn is not None and duck.id not in self._busy:
            self.daemon.fleet._spawn(self._mark(duck.id))

    async def _mark(self, d: int) -> None:
        from native.transport import DuckError
        self._busy.add(d)
        try:
            await asyncio.to_thread(self.ffn.fleet.set_lost, d, True)
        except DuckError as e:
            log.warning("duck %d: %s", d, e)
        finally:
            self._busy.discard(d)

    async def healthy(self, duck) -> None:
        """A serving duck answered its health check: if a forward found it lost (it was slow,
        or its datagrams were), it computes its slices again."""
        ffn = self.ffn
        if ffn is None or duck.recovering or duck.id in self._busy or duck.id not in ffn.fleet.lost():
            return
        self._busy.add(duck.id)
        try:
            await asyncio.to_thread(self.daemon.model.take_back, duck.id)
            self.daemon.fleet.events.add("lost", f"duck {duck.id} answers again: computes its slices again",
                                         duck.id)
        except Exception as e:   # it went silent again: the next check fails it
            log.warning("duck %d: giving its slices back failed: %s", duck.id, e)
        finally:
            self._busy.discard(duck.id)

    def back(self, duck) -> None:
        """A restarted duck serves again (its slices given back by ModelHost.resync)."""
        if duck.id in self.reported:
            self.daemon.fleet.events.add("lost", f"duck {duck.id} back: computes its slices again", duck.id)
        self.reported.discard(duck.id)
