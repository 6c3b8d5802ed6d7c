"""A UDP relay between the host and one duck that stands for a path with a
smaller MTU: it drops every datagram above a size (IP and UDP headers
counted), in either direction, as a link that does not fragment would. The
host talks to .address; the duck sees the relay as its peer. The limits can
change while it runs (a route that changes under a session)."""
from __future__ import annotations

import select
import socket
import threading

IP_UDP_BYTES = 28


class Relay:
    def __init__(self, duck: tuple[str, int], to_duck: int = 65535, to_host: int = 65535):
        self.to_duck, self.to_host = to_duck, to_host
        self.dropped = {"to_duck": 0, "to_host": 0}
        self._front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._front.bind(("127.0.0.1", 0))
        self._back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._back.bind(("127.0.0.1", 0))
        self._back.connect(duck)
        for s in (self._front, self._back):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self._host = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._front.getsockname()

    def __enter__(self) -> "Relay":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._front.close()
        self._back.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._front, self._back], [], [], 0.05)
            for s in ready:
                try:
                    data, addr = s.recvfrom(65535)
                    if s is self._front:
                        self._host = addr
                        self._pass(data, self.to_duck, "to_duck", lambda d: self._back.send(d))
                    elif self._host is not None:
                        self._pass(data, self.to_host, "to_host", lambda d: self._front.sendto(d, self._host))
                except ConnectionRefusedError:
                    pass   # the duck is down (its port unreachable): a datagram lost, as on a real link

    def _pass(self, data: bytes, limit: int, way: str, send) -> None:
        if len(data) + IP_UDP_BYTES > limit:
            self.dropped[way] += 1
        else:
            send(data)
