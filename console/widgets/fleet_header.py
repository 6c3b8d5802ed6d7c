"""The fleet at a glance: model, aggregate GB/s against the roofline, decode
tok/s (and what the roofline allows), duck states, weight sync progress."""
from __future__ import annotations

from collections import Counter

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from console.fleet_state import STATE_STYLE, format_bytes, state_name
from duck_proto import duck_pb2 as pb

BAR_WIDTH = 20


def roofline_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "█" * filled + "░" * (width - filled)


class FleetHeader(Widget):
    DEFAULT_CSS = """
    FleetHeader {
        height: auto;
        padding: 0 1;
        background: $panel;
        color: $text;
    }
    """

    snapshot: reactive[pb.FleetSnapshot | None] = reactive(None, always_update=True)
    model_info: reactive[pb.ModelInfo | None] = reactive(None)

    def on_mount(self) -> None:
        self.watch(self.app, "snapshot", self._take_snapshot)
        self.watch(self.app, "model_info", self._take_model_info)

    def _take_snapshot(self, snapshot: pb.FleetSnapshot | None) -> None:
        self.snapshot = snapshot

    def _take_model_info(self, info: pb.ModelInfo | None) -> None:
        self.model_info = info

    def render(self) -> Text:
        snap, info = self.snapshot, self.model_info
        if snap is None:
            return Text("waiting for the first fleet snapshot…", style="dim")
        line = Text()
        model = snap.model or (info.name if info else "") or "no model"
        line.append(" duck ", style="bold reverse")
        line.append(f" {model}", style="bold")
        if info and info.name:
            line.append(f"  {info.architecture} · tp {info.tp} · {info.backend}", style="dim")
        line.append("\n fleet ")
        line.append(f"{snap.aggregate_gbps:6.1f} GB/s ", style="bold")
        if snap.roofline_gbps > 0:
            fraction = snap.aggregate_gbps / snap.roofline_gbps
            line.append(roofline_bar(fraction), style="green" if fraction >= 0.5 else "yellow")
            line.append(f" {fraction:4.0%} of roofline {snap.roofline_gbps:.1f} GB/s")
        else:
            line.append("(roofline unknown)", style="dim")
        line.append("   decode ")
        line.append(f"{snap.decode_tok_s:.1f} tok/s", style="bold")
        if info and info.ffn_bytes_per_token and snap.roofline_gbps > 0:
            bound = snap.roofline_gbps * 1e9 / info.ffn_bytes_per_token
            line.append(f" (roofline ≤ {bound:.1f})", style="dim")
        line.append("\n ")
        line.append_text(self._states(snap))
        line.append_text(self._sync(snap.sync))
        return line

    @staticmethod
    def _states(snap: pb.FleetSnapshot) -> Text:
        counts = Counter(d.state for d in snap.ducks)
        text = Text(f"{len(snap.ducks)} ducks:")
        for state in sorted(counts):
            text.append(f" {counts[state]} {state_name(state).lower()}", style=STATE_STYLE.get(state, ""))
        return text

    @staticmethod
    def _sync(sync: pb.SyncProgress) -> Text:
        if not sync.phase or sync.phase == "done" or sync.bytes_total == 0:
            return Text()
        fraction = sync.bytes_done / sync.bytes_total
        return Text.assemble(
            "   weights ", (sync.phase, "magenta"),
            f" {format_bytes(sync.bytes_done)} / {format_bytes(sync.bytes_total)} ({fraction:.0%})",
            f" {format_bytes(sync.bytes_per_s)}/s, eta {sync.eta_s:.0f} s")
