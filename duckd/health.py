"""Health that tells the truth: the daemon is healthy while its engine makes
progress on the work it holds. A request that runs or waits while neither a
token reaches a caller nor a fleet call ends (Fleet.progress: every reply,
every run's end) for daemon.stall_after_s is a stall: gRPC Health and
/health say NOT_SERVING, the log says why once, and the systemd watchdog
stops getting its keep-alives, so systemd restarts a daemon that cannot
recover by itself. Progress again makes it healthy again."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("duckd.health")


class StepWatch:
    def __init__(self, daemon, stall_after_s: float):
        self.daemon = daemon
        self.stall_after_s = stall_after_s
        self.stalled = ""              # why the engine counts as stuck; "" while it is not
        self._mark: tuple = ()
        self._since = time.monotonic()  # when the mark last moved (or the engine last had nothing to do)

    @property
    def ok(self) -> bool:
        return not self.stalled

    def _progress(self) -> tuple:
        transport = self.daemon.transport
        return self.daemon.chat.tokens_out, transport.progress() if transport is not None else 0

    def check(self, now: float | None = None) -> bool:
        """Looks once (the daemon's event loop, about every second); True when ok changed."""
        now = time.monotonic() if now is None else now
        chat = self.daemon.chat
        busy = chat.running + chat.queued
        mark = self._progress()
        if not busy or mark != self._mark or not self.daemon.ready:
            self._mark, self._since = mark, now
            if self.stalled:
                log.warning("the engine makes progress again: healthy")
                self.stalled = ""
                return True
            return False
        idle = now - self._since
        if idle <= self.stall_after_s or self.stalled:
            return False
        self.stalled = (f"no step progress for {idle:.1f} s while {busy} request(s) run or wait "
                        f"(daemon.stall_after_s = {self.stall_after_s:g})")
        log.error("%s: not serving; the systemd watchdog gets no keep-alive until it moves", self.stalled)
        return True
