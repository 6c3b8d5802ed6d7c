"""The fleet screen: header, the table of ducks, the chat requests, the latest events."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from console.screens.duck_detail import DuckDetailScreen
from console.widgets.connection_banner import ConnectionBanner
from console.widgets.events_log import EventsLog
from console.widgets.fleet_header import FleetHeader
from console.widgets.fleet_table import FleetTable
from console.widgets.requests_panel import RequestsPanel


class FleetScreen(Screen):
    def compose(self) -> ComposeResult:
        yield ConnectionBanner()
        yield FleetHeader()
        yield FleetTable(id="fleet-table")
        yield RequestsPanel(id="requests")
        yield EventsLog(id="recent-events")
        yield Footer()

    def on_fleet_table_duck_selected(self, message: FleetTable.DuckSelected) -> None:
        self.app.push_screen(DuckDetailScreen(message.duck_id))
