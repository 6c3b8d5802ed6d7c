"""What the console remembers between Watch snapshots: each duck's recent
bandwidth and RTT (for the sparklines), and the fleet's events (deduplicated,
so a reconnect that asks for the daemon's history again shows nothing twice).

Plain Python, no Textual: the widgets only read it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from duck_proto import duck_pb2 as pb

HISTORY_WINDOW_S = 60.0     # the fleet table's sparkline: the last minute
DETAIL_WINDOW_S = 600.0     # the duck detail screen's charts
MAX_EVENTS = 2000
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


@dataclass(slots=True)
class Sample:
    unix_time: float
    gbps: float
    rtt_us: float


@dataclass
class FleetHistory:
    """Samples per duck id, oldest first, trimmed to DETAIL_WINDOW_S of snapshot time."""
    samples: dict[int, deque[Sample]] = field(default_factory=dict)

    def add(self, snap: pb.FleetSnapshot) -> None:
        now = snap.unix_time or time.time()
        for duck in snap.ducks:
            series = self.samples.setdefault(duck.id, deque())
            if series and series[-1].unix_time >= now:   # a repeated snapshot: keep one sample per instant
                series.pop()
            series.append(Sample(now, duck.gbps, duck.rtt_us))
            while series and series[0].unix_time < now - DETAIL_WINDOW_S:
                series.popleft()

    def window(self, duck_id: int, seconds: float) -> list[Sample]:
        series = self.samples.get(duck_id)
        if not series:
            return []
        start = series[-1].unix_time - seconds
        return [s for s in series if s.unix_time >= start]

    def binned(self, duck_id: int, seconds: float, bins: int, attr: str = "gbps") -> list[float | None]:
        """The mean of `attr` in each of `bins` equal slices of the last `seconds`
        (oldest first); None where no sample fell, e.g. before the console connected."""
        samples = self.window(duck_id, seconds)
        if not samples:
            return [None] * bins
        end, width = samples[-1].unix_time, seconds / bins
        sums, counts = [0.0] * bins, [0] * bins
        for s in samples:
            i = bins - 1 - min(bins - 1, int((end - s.unix_time) / width))
            sums[i] += getattr(s, attr)
            counts[i] += 1
        return [sums[i] / counts[i] if counts[i] else None for i in range(bins)]


def sparkline(values: list[float | None], top: float | None = None) -> str:
    """A one-line bar chart scaled to `top` (default: the max); a blank where a value is None."""
    known = [v for v in values if v is not None]
    top = max(known, default=0.0) if top is None else top
    last = len(SPARK_BLOCKS) - 1

    def block(v: float | None) -> str:
        if v is None:
            return " "
        return SPARK_BLOCKS[min(last, max(0, round(v / top * last)))] if top > 0 else SPARK_BLOCKS[0]
    return "".join(block(v) for v in values)


def event_key(e: pb.FleetEvent) -> tuple:
    return (e.unix_time, e.duck_id, e.kind, e.message)


class EventBook:
    """The fleet's events in arrival order, each once; `total` counts every event ever
    added, so a view can ask for what arrived since it last looked."""

    def __init__(self, limit: int = MAX_EVENTS):
        self.events: deque[pb.FleetEvent] = deque(maxlen=limit)
        self._seen: set[tuple] = set()
        self.total = 0

    def add(self, events) -> int:
        added = 0
        for e in events:
            key = event_key(e)
            if key in self._seen:
                continue
            if len(self.events) == self.events.maxlen:
                self._seen.discard(event_key(self.events[0]))
            self.events.append(e)
            self._seen.add(key)
            added += 1
        self.total += added
        return added

    def since(self, total_seen: int) -> list[pb.FleetEvent]:
        """Events added after the caller had seen `total_seen` of them (at most what is kept)."""
        fresh = min(self.total - total_seen, len(self.events))
        return list(self.events)[len(self.events) - fresh:] if fresh > 0 else []


STATE_STYLE = {
    pb.OFFLINE: "dim", pb.BOOTING: "yellow", pb.LINK_WAIT: "yellow", pb.READY: "cyan",
    pb.SYNCING: "magenta", pb.SERVING: "green", pb.FAILED: "bold red", pb.DRAINING: "yellow",
}


def state_name(state: int) -> str:
    return pb.DuckState.Name(state) if state in pb.DuckState.values() else f"STATE_{state}"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_clock(unix_time: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_time))
