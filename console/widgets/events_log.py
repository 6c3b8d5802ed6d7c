"""The fleet's events (boots, link-ups with time-to-link, failures with reasons,
uploads with progress) as a scrolling log; appends what arrived since it last
looked, so every instance (fleet screen, events screen) shows the same book."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from console.fleet_state import format_clock
from duck_proto import duck_pb2 as pb

KIND_STYLE = {
    "failed": "bold red", "error": "bold red", "lost": "bold yellow", "link": "green", "boot": "cyan", "restart": "yellow",
    "upload": "magenta", "sync": "magenta", "invalidate": "yellow", "console": "dim italic",
}


def event_line(e: pb.FleetEvent) -> Text:
    who = "fleet" if e.duck_id < 0 else f"duck {e.duck_id}"
    return Text.assemble(
        (format_clock(e.unix_time), "dim"), "  ", (f"{who:<8}", "bold"), " ",
        (f"{e.kind:<10}", KIND_STYLE.get(e.kind, "")), " ", e.message)


class EventsLog(RichLog):
    DEFAULT_CSS = """
    EventsLog {
        height: 1fr;
        border: round $primary 50%;
        border-title-color: $text-muted;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(wrap=True, markup=False, highlight=False, **kwargs)
        self._seen = 0
        self.border_title = "events"

    def on_mount(self) -> None:
        self.watch(self.app, "events_total", self._take_events, init=False)
        # the backlog waits for the first layout: lines written earlier wrap at RichLog's minimum width
        self.call_after_refresh(lambda: self._take_events(self.app.events_total))

    def _take_events(self, total: int) -> None:
        # wrap at the log's own width (RichLog would measure against the console's)
        width = self.scrollable_content_region.width or None
        for event in self.app.events.since(self._seen):
            self.write(event_line(event), width=width)
        self._seen = total
