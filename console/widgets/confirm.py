"""A yes/no question in front of a destructive action (invalidate, restart)."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmModal(ModalScreen[bool]):
    DEFAULT_CSS = """
    ConfirmModal {
        align: center middle;
    }
    ConfirmModal > Grid {
        grid-size: 2;
        grid-gutter: 1 2;
        grid-rows: auto 3;
        padding: 1 2;
        width: 64;
        height: auto;
        border: thick $error 60%;
        background: $surface;
    }
    ConfirmModal #question {
        column-span: 2;
        width: 100%;
    }
    ConfirmModal Button {
        width: 100%;
    }
    """

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, confirm_label: str = "Yes") -> None:
        super().__init__()
        self.question, self.confirm_label = question, confirm_label

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(self.question, id="question")
            yield Button(f"{self.confirm_label} (y)", variant="error", id="yes")
            yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)
