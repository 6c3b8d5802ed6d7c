"""The fleet manager: every duck's lifecycle

    OFFLINE -> BOOTING -> LINK_WAIT -> READY -> SYNCING -> SERVING
    FAILED (with a reason) and DRAINING from any state

boot through a driver, link-wait with a deadline and backoff, periodic
health pings with RTT and counters, failure detection, restart where the
driver can. What READY ducks need (weights, a session) is the daemon's:
it is told through on_ready.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from duck_proto import duck_pb2 as pb
from duckd.drivers.base import DuckSpec, Driver
from duckd.events import EventLog

log = logging.getLogger("duckd.fleet")


class State(enum.IntEnum):
    OFFLINE = pb.OFFLINE
    BOOTING = pb.BOOTING
    LINK_WAIT = pb.LINK_WAIT
    READY = pb.READY
    SYNCING = pb.SYNCING
    SERVING = pb.SERVING
    FAILED = pb.FAILED
    DRAINING = pb.DRAINING


LIVE = (State.READY, State.SYNCING, State.SERVING)

# every reason a duck drops a datagram (firmware/core.c): summed as a duck's `drops`
DROP_REASONS = ("malformed", "unauthenticated", "bad_mac", "replayed", "no_run", "stale", "injected_drops")


@dataclass(slots=True)
class Duck:
    spec: DuckSpec
    state: State = State.OFFLINE
    reason: str = ""
    time_to_link_ms: float = 0.0
    rtt_us: float = 0.0
    last_ok: float = 0.0
    restarts: int = 0
    cache_entries: int = 0
    cache_hits: int = 0
    counters: dict = field(default_factory=dict)
    gbps: float = 0.0
    kernel_ms: float = 0.0
    probe: object = None          # a native.transport.Fleet of this duck alone, for pings
    recovering: bool = False
    waiting: bool = False         # FAILED, its driver cannot restart it: its hello is asked until it answers
    checks: int = 0

    @property
    def id(self) -> int:
        return self.spec.index

    @property
    def dropped(self) -> int:
        """Datagrams the duck dropped, for any reason (DROP_REASONS)."""
        return sum(self.counters.get(k, 0) for k in DROP_REASONS)

    def status(self) -> pb.DuckStatus:
        c = self.counters
        host, port = self.spec.address or ("", 0)
        return pb.DuckStatus(
            id=self.id, address=f"{host}:{port}" if host else "", subnet=self.spec.subnet, state=int(self.state),
            reason=self.reason, time_to_link_ms=self.time_to_link_ms, rtt_us=self.rtt_us, gbps=self.gbps,
            kernel_ms=self.kernel_ms, cache_entries=self.cache_entries, cache_hits=self.cache_hits,
            # every datagram the duck refused (malformed, no or a wrong MAC, a replay, no run, stale) and every
            # request it failed: a forged flood shows here; drops: the datagrams alone (DROP_REASONS)
            errors=self.dropped - c.get("injected_drops", 0) + c.get("errors", 0),
            bytes_streamed=c.get("bytes_streamed", 0), requests=c.get("requests", 0),
            retransmits=c.get("resends", 0), drops=self.dropped, restarts=self.restarts,
            cache_corrupt=c.get("cache_corrupt", 0))


class FleetManager:
    def __init__(self, cfg, driver: Driver, key: bytes, events: EventLog, on_ready=None, on_failed=None,
                 on_healthy=None, session=None):
        self.cfg, self.driver, self.key, self.events = cfg, driver, key, events
        self.ducks = [Duck(spec) for spec in driver.specs()]
        self.on_ready = on_ready            # async (duck) -> None: sync and serve
        self.on_failed = on_failed          # (duck) -> None: it just failed (its slices go elsewhere)
        self.on_healthy = on_healthy        # async (duck) -> None: a health check it passed
        self.session = session              # () -> the daemon's open session id (0: none), or None
        self._monitor: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.stopping = False
        # the probes' blocking calls have threads of their own: queued chats cannot starve the health checks
        self._probes = ThreadPoolExecutor(max_workers=len(self.ducks) + 2, thread_name_prefix="duck-probe")

    async def _probe(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._probes, fn)

    # -- state ----------------------------------------------------------------
    def set_state(self, duck: Duck, state: State, reason: str = "") -> None:
        if duck.state == state and duck.reason == reason:
            return
        old, duck.state, duck.reason = duck.state, state, reason
        level = logging.WARNING if state == State.FAILED else logging.INFO
        text = f"{old.name} -> {state.name}" + (f": {reason}" if reason else "")
        self.events.add("failed" if state == State.FAILED else "state", text, duck.id, level)

    def all_in(self, *states: State) -> bool:
        return all(d.state in states for d in self.ducks)

    def addresses(self) -> list[tuple[str, int]]:
        return [d.spec.address for d in self.ducks]

    # -- boot and link --------------------------------------------------------
    async def start(self) -> None:
        """Boots every duck and waits for its link; raises if one never links."""
        await asyncio.gather(*(self._bring_up(d) for d in self.ducks))
        self._monitor = asyncio.create_task(self._monitor_loop(), name="fleet-monitor")

    async def _bring_up(self, duck: Duck) -> None:
        self.set_state(duck, State.BOOTING)
        t0 = time.monotonic()
        try:
            await self.driver.boot(duck.spec)
        except Exception as e:
            self.set_state(duck, State.FAILED, f"boot failed: {e}")
            raise RuntimeError(f"duck {duck.id}: boot failed: {e}") from e
        self.events.add("boot", f"booted ({self.driver.name}) at {duck.spec.address[0]}:{duck.spec.address[1]}",
                        duck.id)
        self.set_state(duck, State.LINK_WAIT)
        await self._link_wait(duck, t0)
        self.set_state(duck, State.READY)

    async def _link_wait(self, duck: Duck, t0: float) -> None:
        from native.transport import DuckError, Fleet

        deadline = t0 + self.cfg.link_timeout_s
        backoff = 0.02
        if duck.probe is not None:
            duck.probe.close()
        # a health ping fails after fail_after_s of silence, as the config says: a duck busy with a
        # long forward (a slow box, a prefill chunk) is not failed sooner (it was capped at 500 ms)
        duck.probe = Fleet([duck.spec.address], self.key, mtu=self.cfg.mtu, retransmit_ms=20,
                           deadline_ms=max(100.0, self.cfg.fail_after_s * 1000))
        while True:
            try:   # hello alone: a probe must not open a run of its own (it would take the daemon's)
                info = (await self._probe(duck.probe.hello_only))[0]
                break
            except DuckError as e:
                if time.monotonic() + backoff > deadline:
                    self.set_state(duck, State.FAILED, f"no link within {self.cfg.link_timeout_s:.0f} s: {e}")
                    raise RuntimeError(f"duck {duck.id}: no link within {self.cfg.link_timeout_s:.0f} s") from e
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
        duck.time_to_link_ms = (time.monotonic() - t0) * 1000
        duck.last_ok = time.monotonic()
        duck.cache_entries = info.cache_entries
        self.events.add("link", f"link became up after {duck.time_to_link_ms:.0f}ms "
                        f"(firmware {info.firmware}, {info.threads} threads, {info.cache_entries} cached)", duck.id)

    # -- health ---------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        interval = self.cfg.health_interval_s
        while not self.stopping:
            t0 = time.monotonic()
            live = [d for d in self.ducks if d.state in LIVE]
            # one check's unexpected error must not end every duck's health checks for good
            for d, r in zip(live, await asyncio.gather(*(self._check(d, interval) for d in live),
                                                       return_exceptions=True)):
                if isinstance(r, Exception):
                    log.error("duck %d: health check failed: %r", d.id, r)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))

    async def _check(self, duck: Duck, interval: float) -> None:
        from native.transport import ClosedError, DuckError, DuckTimeout

        gone = self.driver.exited(duck.spec)
        if gone:
            return self.fail(duck, gone)
        probe = duck.probe
        try:
            rtt = (await self._probe(probe.ping))[0]
            counters = (await self._probe(probe.stats))[0]
            duck.checks += 1
            before = self.session() if self.session else 0   # the daemon's session when the hello was asked
            info = (await self._probe(probe.hello_only))[0]
            duck.cache_entries = info.cache_entries
        except ClosedError:
            # a restart's link wait closed this probe under the check (and puts a new one in place): the
            # duck is being brought up again, and this check says nothing of it
            return
        except DuckError as e:
            # the probe fleet holds this duck alone: its own message would call it "duck 0"
            what = "no answer" if isinstance(e, DuckTimeout) else f"error {e.status}"
            if duck.state in LIVE:
                return self.fail(duck, f"stopped answering: {what} to health pings for "
                                       f"{duck.probe.deadline_ms:.0f} ms at {duck.spec.address[0]}:{duck.spec.address[1]}")
            return
        now = time.monotonic()
        prev, dt = duck.counters, now - duck.last_ok
        if prev and dt > 0:
            dbytes = counters["bytes_streamed"] - prev.get("bytes_streamed", 0)
            dkern = counters["kernel_ns"] - prev.get("kernel_ns", 0)
            dfwd = counters["forwards"] - prev.get("forwards", 0)
            duck.gbps = max(0, dbytes) / dt / 1e9
            duck.kernel_ms = dkern / 1e6 / dfwd if dfwd > 0 else 0.0
        duck.counters, duck.rtt_us, duck.last_ok = counters, rtt, now
        self._check_session(duck, info.session, before)
        if self.on_healthy is not None and duck.state == State.SERVING and not duck.recovering:
            await self.on_healthy(duck)

    def check_soon(self, duck: Duck) -> None:
        """A health check now, not at the next round (a forward found the duck lost)."""
        if duck.state in LIVE and not self.stopping:
            self._spawn(self._check(duck, self.cfg.health_interval_s))

    def _check_session(self, duck: Duck, reported: int, before: int) -> None:
        """A serving duck whose hello names a session that is not the daemon's (it restarted,
        or another host opened one there) gets the daemon's back: run, weights, session. Not
        while a duck is being brought back: a hello may then name the session of before."""
        ours = self.session() if self.session else 0
        if not ours or reported in (ours, before) or duck.state != State.SERVING or not self.on_ready or \
                any(d.recovering for d in self.ducks):
            return
        self.events.add("session", f"reports session {reported:08x}, not the daemon's {ours:08x} (restarted, or "
                        "another host opened one): reopening", duck.id, logging.WARNING)
        self._spawn(self._reopen(duck))

    async def _reopen(self, duck: Duck) -> None:
        duck.recovering = True
        try:
            await self.on_ready(duck)
        except Exception as e:
            log.warning("duck %d: reopening the session failed: %s", duck.id, e)
            self.set_state(duck, State.FAILED, f"reopening the session failed: {e}")
        finally:
            duck.recovering = False

    def fail(self, duck: Duck, reason: str) -> None:
        """Marks a duck FAILED and, where the driver can, brings it back."""
        if duck.state == State.FAILED or self.stopping:
            return
        self.set_state(duck, State.FAILED, reason)
        duck.gbps = 0.0
        if self.on_failed is not None:
            self.on_failed(duck)
        if self.cfg.restart and self.driver.can_restart and not duck.recovering:
            self._spawn(self._recover(duck))
        elif not self.driver.can_restart and not duck.waiting and duck.probe is not None:
            self._spawn(self._await_return(duck))

    async def _await_return(self, duck: Duck) -> None:
        """A duck its driver cannot restart (a box of its own that reboots, or whose link comes
        back): its hello is asked every health interval, and when it answers it is READY and
        brought back (on_ready: run, weights, session) as a restarted duck is."""
        from native.transport import DuckError

        duck.waiting = True
        log.info("duck %d: asking its hello until it answers (the %s driver cannot restart it)", duck.id,
                 self.driver.name)
        try:
            while not self.stopping and duck.state == State.FAILED:
                await asyncio.sleep(max(self.cfg.health_interval_s, 0.1))
                try:
                    await self._probe(duck.probe.hello_only)
                except DuckError as e:
                    log.debug("duck %d: no hello yet: %s", duck.id, e)
                    continue
                self.events.add("link", "answers again", duck.id)
                duck.last_ok = time.monotonic()
                self.set_state(duck, State.READY)
                if self.on_ready is None:
                    self.set_state(duck, State.SERVING)
                    break
                duck.recovering = True
                try:
                    await self.on_ready(duck)
                except Exception as e:   # it failed again: keep asking
                    log.warning("duck %d: bringing it back failed: %s", duck.id, e)
                    self.set_state(duck, State.FAILED, f"bringing it back failed: {e}")
                finally:
                    duck.recovering = False
        finally:
            duck.waiting = False

    async def _recover(self, duck: Duck) -> None:
        duck.recovering = True
        try:
            await asyncio.sleep(self.cfg.restart_delay_s)
            self.events.add("restart", "restarting", duck.id)
            duck.restarts += 1
            await self.driver.stop(duck.spec)
            await self._bring_up(duck)
            if self.on_ready:
                await self.on_ready(duck)
        except Exception as e:
            log.warning("duck %d: recovery failed: %s", duck.id, e)
            if duck.state != State.FAILED:
                self.set_state(duck, State.FAILED, f"recovery failed: {e}")
        finally:
            duck.recovering = False

    async def restart(self, duck: Duck) -> None:
        """Operator-requested restart (console, RPC)."""
        if not self.driver.can_restart:
            raise RuntimeError(f"the {self.driver.name} driver cannot restart duck {duck.id}")
        if duck.recovering:
            raise RuntimeError(f"duck {duck.id} is already restarting")
        self.set_state(duck, State.DRAINING, "restart requested")
        # the recovery outlives the caller: a cancelled RPC must not leave the duck half-booted
        task = self._spawn(self._recover(duck))
        await asyncio.shield(task)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- stop -----------------------------------------------------------------
    async def stop(self) -> None:
        self.stopping = True
        if self._monitor:
            self._monitor.cancel()
        for t in list(self._tasks):
            t.cancel()
        for d in self.ducks:
            if d.state != State.OFFLINE:
                self.set_state(d, State.DRAINING, "daemon stopping")
        await asyncio.gather(*(self.driver.stop(d.spec) for d in self.ducks), return_exceptions=True)
        for d in self.ducks:
            if d.probe is not None:
                d.probe.close()
                d.probe = None
            self.set_state(d, State.OFFLINE)
        self._probes.shutdown(wait=False)
        await self.driver.close()
