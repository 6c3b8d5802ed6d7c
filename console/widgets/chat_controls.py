"""Sampling settings for the next answer: temperature (0 = greedy) and max tokens
(0 = the daemon's default)."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.validation import Integer, Number
from textual.widgets import Input, Label


class ChatControls(Horizontal):
    DEFAULT_CSS = """
    ChatControls {
        height: 3;
        padding: 0 1;
    }
    ChatControls Label {
        padding: 1 1 0 2;
    }
    ChatControls Input {
        width: 12;
    }
    """

    def __init__(self, temperature: float = 0.0, max_tokens: int = 256, **kwargs) -> None:
        super().__init__(**kwargs)
        self._defaults = (temperature, max_tokens)

    def compose(self) -> ComposeResult:
        yield Label("temperature")
        yield Input(str(self._defaults[0]), type="number", id="temperature",
                    validators=[Number(minimum=0.0, maximum=10.0)])
        yield Label("max tokens")
        yield Input(str(self._defaults[1]), type="integer", id="max-tokens",
                    validators=[Integer(minimum=0, maximum=1 << 20)])

    @property
    def temperature(self) -> float:
        field = self.query_one("#temperature", Input)
        return float(field.value) if field.is_valid and field.value else self._defaults[0]

    @property
    def max_tokens(self) -> int:
        field = self.query_one("#max-tokens", Input)
        return int(field.value) if field.is_valid and field.value else self._defaults[1]
