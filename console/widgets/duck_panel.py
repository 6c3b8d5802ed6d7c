"""Everything the daemon reports about one duck, as a two-column panel."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console.fleet_state import STATE_STYLE, format_bytes, state_name
from duck_proto import duck_pb2 as pb


class DuckPanel(Widget):
    DEFAULT_CSS = """
    DuckPanel {
        height: auto;
        width: 44;
        padding: 0 1;
        border: round $primary 50%;
        border-title-color: $text;
    }
    """

    duck: reactive[pb.DuckStatus | None] = reactive(None, always_update=True)

    def watch_duck(self, duck: pb.DuckStatus | None) -> None:
        self.border_title = f"duck {duck.id}" if duck else "duck"

    def render(self) -> Table | Text:
        d = self.duck
        if d is None:
            return Text("not in the latest snapshot", style="dim")
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", justify="right")
        grid.add_column()
        state = Text(state_name(d.state), style=STATE_STYLE.get(d.state, ""))
        rows = [
            ("state", state),
            ("reason", d.reason or "–"),
            ("address", d.address),
            ("subnet", d.subnet),
            ("time to link", f"{d.time_to_link_ms:.0f} ms" if d.time_to_link_ms else "–"),
            ("RTT", f"{d.rtt_us:.0f} µs" if d.rtt_us else "–"),
            ("bandwidth", f"{d.gbps:.2f} GB/s"),
            ("kernel", f"{d.kernel_ms:.2f} ms/forward"),
            ("streamed", format_bytes(d.bytes_streamed)),
            ("requests", f"{d.requests}"),
            ("cache", f"{d.cache_entries} entries, {d.cache_hits} hits"),
            ("retransmits", f"{d.retransmits}"),
            ("drops", f"{d.drops}"),
            ("errors", Text(f"{d.errors}", style="red" if d.errors else "")),
            ("restarts", f"{d.restarts}"),
        ]
        for label, value in rows:
            grid.add_row(label, value)
        return grid
