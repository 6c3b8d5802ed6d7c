"""The fleet table: one row per duck, updated in place from each Watch snapshot
(the cursor stays on its duck), with a sparkline of the duck's GB/s over the
last minute. Enter or a click opens that duck."""
from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.message import Message
from textual.widgets import DataTable

from console.fleet_state import HISTORY_WINDOW_S, STATE_STYLE, FleetHistory, sparkline, state_name
from duck_proto import duck_pb2 as pb

SPARK_BINS = 20     # 3 s per character over the last minute

COLUMNS = [  # key, label
    ("id", "duck"), ("subnet", "subnet"), ("address", "address"), ("state", "state"),
    ("link", "link ms"), ("rtt", "RTT µs"), ("cache", "cache"), ("gbps", "GB/s"),
    ("spark", "last minute"), ("kernel", "kernel ms"), ("errors", "errors"), ("restarts", "restarts"), ("reason", "reason"),
]


def _num(value: float, fmt: str, zero: str = "–") -> Text:
    return Text(format(value, fmt) if value else zero, justify="right")


def duck_cells(duck: pb.DuckStatus, spark: str) -> dict[str, object]:
    state = Text(state_name(duck.state), style=STATE_STYLE.get(duck.state, ""))
    return {
        "id": Text(str(duck.id), justify="right"),
        "subnet": duck.subnet,
        "address": duck.address,
        "state": state,
        "link": _num(duck.time_to_link_ms, ".0f"),
        "rtt": _num(duck.rtt_us, ".0f"),
        "cache": Text(str(duck.cache_entries), justify="right"),
        "gbps": _num(duck.gbps, ".2f", "0.00"),
        "spark": Text(spark, style="green"),
        "kernel": _num(duck.kernel_ms, ".2f"),
        "errors": Text(str(duck.errors), justify="right", style="red" if duck.errors else ""),
        "restarts": Text(str(duck.restarts), justify="right"),
        "reason": Text(duck.reason if duck.state in (pb.FAILED, pb.DRAINING) else "", style="dim"),
    }


class FleetTable(DataTable):
    DEFAULT_CSS = """
    FleetTable {
        height: 1fr;
    }
    """

    @dataclass
    class DuckSelected(Message):
        duck_id: int

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._ids: list[int] = []

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self.watch(self.app, "snapshot", self._take_snapshot)

    def _take_snapshot(self, snapshot: pb.FleetSnapshot | None) -> None:
        if snapshot is not None:
            self.show(snapshot, self.app.history)

    def show(self, snapshot: pb.FleetSnapshot, history: FleetHistory) -> None:
        ducks = sorted(snapshot.ducks, key=lambda d: d.id)
        series = {d.id: history.binned(d.id, HISTORY_WINDOW_S, SPARK_BINS) for d in ducks}
        top = max((v for s in series.values() for v in s if v is not None), default=0.0)
        rows = {d.id: duck_cells(d, sparkline(series[d.id], top)) for d in ducks}
        ids = [d.id for d in ducks]
        if ids != self._ids:
            self._rebuild(ids, rows)
            return
        for duck_id, cells in rows.items():
            for key, value in cells.items():
                self.update_cell(str(duck_id), key, value)

    def _rebuild(self, ids: list[int], rows: dict[int, dict[str, object]]) -> None:
        selected = self.selected_duck
        self.clear()
        for duck_id in ids:
            self.add_row(*(rows[duck_id][key] for key, _ in COLUMNS), key=str(duck_id))
        self._ids = ids
        if selected in ids:
            self.move_cursor(row=ids.index(selected))

    @property
    def selected_duck(self) -> int | None:
        if not self._ids or not 0 <= self.cursor_row < len(self._ids):
            return None
        return self._ids[self.cursor_row]

    def state_of(self, duck_id: int) -> str:
        """The state word shown for a duck (what an operator reads; tests use it too)."""
        return self.get_cell(str(duck_id), "state").plain

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.post_message(self.DuckSelected(int(event.row_key.value)))
