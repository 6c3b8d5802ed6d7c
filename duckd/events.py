"""The fleet's event log: boots, link-ups, failures, uploads. Every event is
logged and kept (bounded) for the Watch stream and the console."""
from __future__ import annotations

import collections
import logging
import time

from duck_proto import duck_pb2 as pb

log = logging.getLogger("duckd.events")


class EventLog:
    def __init__(self, keep: int = 1000):
        self._events: collections.deque[tuple[int, pb.FleetEvent]] = collections.deque(maxlen=keep)
        self._seq = 0

    def add(self, kind: str, message: str, duck_id: int = -1, level: int = logging.INFO) -> None:
        self._seq += 1
        self._events.append((self._seq, pb.FleetEvent(unix_time=time.time(), duck_id=duck_id, kind=kind,
                                                      message=message)))
        log.log(level, "%s%s", f"duck {duck_id}: " if duck_id >= 0 else "", message)

    def since(self, cursor: int) -> tuple[list[pb.FleetEvent], int]:
        """Events numbered >= cursor, and the cursor for the next call."""
        out = [e for seq, e in self._events if seq >= cursor]
        return out, self._seq + 1
