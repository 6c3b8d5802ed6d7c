"""systemd notification (sd_notify): READY=1, WATCHDOG=1, STOPPING=1, STATUS=.

A datagram to $NOTIFY_SOCKET, as libsystemd sends it; a no-op when the
variable is unset (not started by systemd)."""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("duckd.sdnotify")


class Notifier:
    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):                  # abstract namespace
            addr = "\0" + addr[1:]
        self._addr = addr or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and (not pid or pid == str(os.getpid())) else 0.0
        self._sock = None
        if self._addr:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> None:
        if not self._sock:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self._addr)
        except OSError as e:
            log.warning("sd_notify to %r failed: %s", self._addr, e)

    def ready(self, status: str = "") -> None:
        self.notify("READY=1", *( [f"STATUS={status}"] if status else []))

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def reloading(self) -> None:
        self.notify("RELOADING=1")
