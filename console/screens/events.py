"""All fleet events the console has seen, oldest first."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from console.widgets.connection_banner import ConnectionBanner
from console.widgets.events_log import EventsLog
from console.widgets.fleet_header import FleetHeader


class EventsScreen(Screen):
    def compose(self) -> ComposeResult:
        yield ConnectionBanner()
        yield FleetHeader()
        yield EventsLog(id="all-events")
        yield Footer()
