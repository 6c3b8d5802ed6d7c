"""The weight slices one duck holds (Cache.List for that duck)."""
from __future__ import annotations

import re

from rich.text import Text
from textual.widgets import DataTable

from console.fleet_state import format_bytes
from duck_proto import duck_pb2 as pb


def natural_key(name: str) -> list:
    """layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class CacheTable(DataTable):
    DEFAULT_CSS = """
    CacheTable {
        height: 1fr;
        border: round $primary 50%;
        border-title-color: $text;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.border_title = "cache: loading…"

    def on_mount(self) -> None:
        self.add_column("name", key="name")
        self.add_column("model", key="model")
        self.add_column("size", key="bytes")
        self.add_column("digest", key="digest")

    def show(self, response: pb.CacheListResponse) -> None:
        self.clear()
        total = 0
        for e in sorted(response.entries, key=lambda e: natural_key(e.name)):
            self.add_row(e.name, e.model, Text(format_bytes(e.bytes), justify="right"), e.digest[:16])
            total += e.bytes
        self.border_title = f"cache: {len(response.entries)} entries, {format_bytes(total)}"

    def show_error(self, message: str) -> None:
        self.clear()
        self.border_title = f"cache: {message}"
