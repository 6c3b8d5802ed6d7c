"""A titled sparkline of one duck's recent values (bandwidth or RTT), with the
latest value and the peak of the window in its title."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Sparkline


class HistoryChart(Widget):
    DEFAULT_CSS = """
    HistoryChart {
        height: 7;
        border: round $primary 50%;
        border-title-color: $text;
        padding: 0 1;
    }
    HistoryChart > Sparkline {
        height: 1fr;
    }
    """

    values: reactive[list[float]] = reactive(list, always_update=True)

    def __init__(self, title: str, unit: str, fmt: str = ".2f", **kwargs) -> None:
        super().__init__(**kwargs)
        self.title, self.unit, self.fmt = title, unit, fmt

    def compose(self) -> ComposeResult:
        yield Sparkline([], summary_function=max)

    def watch_values(self, values: list[float]) -> None:
        self.query_one(Sparkline).data = values
        if values:
            self.border_title = (f"{self.title}: {values[-1]:{self.fmt}} {self.unit} now, "
                                 f"peak {max(values):{self.fmt}} {self.unit}")
        else:
            self.border_title = f"{self.title}: no samples yet"
