"""A banner across the top while the daemon is out of reach or refuses our token;
hidden while connected."""
from __future__ import annotations

from textual.reactive import reactive
from textual.widgets import Static

from console.api import Connection


class ConnectionBanner(Static):
    DEFAULT_CSS = """
    ConnectionBanner {
        dock: top;
        height: auto;
        padding: 0 1;
        display: none;
    }
    ConnectionBanner.-lost, ConnectionBanner.-connecting {
        display: block;
        background: $warning;
        color: $text;
    }
    ConnectionBanner.-auth {
        display: block;
        background: $error;
        color: $text;
        text-style: bold;
    }
    """

    connection: reactive[Connection] = reactive(Connection("connecting"))

    def on_mount(self) -> None:
        self.watch(self.app, "connection", self._take_connection)

    def _take_connection(self, connection: Connection) -> None:
        self.connection = connection

    def watch_connection(self, connection: Connection) -> None:
        for status in ("connecting", "lost", "auth"):
            self.set_class(connection.status == status, f"-{status}")
        if connection.status == "connecting":
            self.update(connection.message or "connecting to duckd…")
        else:
            self.update(connection.message)
