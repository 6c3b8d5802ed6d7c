"""One duck: its status, bandwidth and RTT history, the slices it caches, and the
operator's actions on it (invalidate its cache, restart it), each behind a
confirmation."""
from __future__ import annotations

import logging

import grpc
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer

from console.api import ActionOutcome, call_error_text
from console.fleet_state import DETAIL_WINDOW_S
from console.widgets.cache_table import CacheTable
from console.widgets.confirm import ConfirmModal
from console.widgets.connection_banner import ConnectionBanner
from console.widgets.duck_panel import DuckPanel
from console.widgets.fleet_header import FleetHeader
from console.widgets.history_chart import HistoryChart
from duck_proto import duck_pb2 as pb

log = logging.getLogger("console.duck_detail")


class DuckDetailScreen(Screen):
    BINDINGS = [
        Binding("escape,backspace", "app.pop_screen", "Back"),
        Binding("i", "invalidate", "Invalidate cache"),
        Binding("r", "restart", "Restart duck"),
        Binding("l", "reload_cache", "Reload cache list"),
    ]

    cache_response: reactive[pb.CacheListResponse | None] = reactive(None, always_update=True)
    cache_error: reactive[str] = reactive("")

    def __init__(self, duck_id: int) -> None:
        super().__init__()
        self.duck_id = duck_id

    def compose(self) -> ComposeResult:
        yield ConnectionBanner()
        yield FleetHeader()
        with Horizontal():
            yield DuckPanel()
            with Vertical():
                yield HistoryChart("bandwidth", "GB/s", id="bandwidth")
                yield HistoryChart("RTT", "µs", fmt=".0f", id="rtt")
                yield CacheTable()
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"duck {self.duck_id}"
        self.watch(self.app, "snapshot", self._take_snapshot)
        self.watch(self.app, "action_outcome", self._take_outcome, init=False)
        self.action_reload_cache()

    def _take_snapshot(self, snapshot: pb.FleetSnapshot | None) -> None:
        if snapshot is None:
            return
        self.query_one(DuckPanel).duck = next((d for d in snapshot.ducks if d.id == self.duck_id), None)
        samples = self.app.history.window(self.duck_id, DETAIL_WINDOW_S)
        self.query_one("#bandwidth", HistoryChart).values = [s.gbps for s in samples]
        self.query_one("#rtt", HistoryChart).values = [s.rtt_us for s in samples]

    def watch_cache_response(self, response: pb.CacheListResponse | None) -> None:
        if response is not None:
            self.query_one(CacheTable).show(response)

    def watch_cache_error(self, message: str) -> None:
        if message:
            self.query_one(CacheTable).show_error(message)

    def action_reload_cache(self) -> None:
        if self.app.api is not None:
            self.load_cache()

    def action_invalidate(self) -> None:
        question = (f"Invalidate everything duck {self.duck_id} caches? "
                    "Its weights are uploaded again at the next sync.")
        self.app.push_screen(ConfirmModal(question, "Invalidate"), self._invalidate_confirmed)

    def action_restart(self) -> None:
        question = f"Restart duck {self.duck_id}? Generation pauses until it is serving again."
        self.app.push_screen(ConfirmModal(question, "Restart"), self._restart_confirmed)

    def _invalidate_confirmed(self, yes: bool | None) -> None:
        if yes and self.app.api is not None:
            self.app.invalidate_duck(self.duck_id)

    def _restart_confirmed(self, yes: bool | None) -> None:
        if yes and self.app.api is not None:
            self.app.restart_duck(self.duck_id)

    def _take_outcome(self, outcome: ActionOutcome | None) -> None:
        if outcome is not None and outcome.duck_id == self.duck_id and outcome.action == "invalidate":
            self.action_reload_cache()

    @work(exclusive=True, group="cache-list")
    async def load_cache(self) -> None:
        try:
            self.cache_response = await self.app.api.cache.List(pb.CacheListRequest(duck_id=self.duck_id),
                                                                timeout=10)
        except grpc.aio.AioRpcError as e:
            log.info("cache list of duck %d failed: %s", self.duck_id, e)
            self.cache_error = call_error_text(e)
