"""The chat requests duckd holds now (from each Watch snapshot): queued and running,
each with its prompt length, tokens generated so far and decode speed."""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from duck_proto import duck_pb2 as pb

MAX_ROWS = 6


class RequestsPanel(Widget):
    DEFAULT_CSS = """
    RequestsPanel {
        height: auto;
        max-height: 9;
        padding: 0 1;
        border: round $primary 50%;
        border-title-color: $text-muted;
    }
    """

    snapshot: reactive[pb.FleetSnapshot | None] = reactive(None, always_update=True)

    def on_mount(self) -> None:
        self.border_title = "requests"
        self.watch(self.app, "snapshot", self._take_snapshot)

    def _take_snapshot(self, snapshot: pb.FleetSnapshot | None) -> None:
        self.snapshot = snapshot

    def render(self) -> Text:
        requests = list(self.snapshot.requests) if self.snapshot is not None else []
        running = [r for r in requests if r.state == "running"]
        queued = [r for r in requests if r.state != "running"]
        if not requests:
            return Text("no requests", style="dim")
        text = Text()
        text.append(f"{len(running)} running, {len(queued)} queued", style="bold")
        shown = running + queued
        for r in shown[:MAX_ROWS]:
            text.append("\n")
            text.append(f"#{r.id:<5}", style="bold")
            text.append(f" {r.state:<8}", style="green" if r.state == "running" else "yellow")
            text.append(f" prompt {r.prompt_tokens:5d}  out {r.generated_tokens:5d}")
            text.append(f"  {r.tok_s:6.1f} tok/s" if r.state == "running" else " " * 14)
            text.append(f"  {r.age_s:6.1f} s", style="dim")
        if len(shown) > MAX_ROWS:
            text.append(f"\n… {len(shown) - MAX_ROWS} more", style="dim")
        return text
