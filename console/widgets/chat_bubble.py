"""One turn of the conversation: the user's message, the model's answer as it
streams in, a tool call the model made, its stats line, or an error."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class ChatBubble(Static):
    DEFAULT_CSS = """
    ChatBubble {
        width: 1fr;
        height: auto;
        padding: 0 1;
        margin: 1 0 0 0;
    }
    ChatBubble.-user {
        margin-left: 8;
        background: $primary 20%;
        border-left: outer $primary;
    }
    ChatBubble.-assistant {
        margin-right: 8;
        background: $surface;
        border-left: outer $success;
    }
    ChatBubble.-tool-call {
        margin: 0 8 0 0;
        padding: 0 1;
        color: $warning;
        border-left: outer $warning;
    }
    ChatBubble.-stats {
        margin: 0 8 0 0;
        color: $text-muted;
        text-style: italic;
    }
    ChatBubble.-error {
        background: $error 20%;
        border-left: outer $error;
    }
    """

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(classes=f"-{role}", markup=False)
        self.role = role
        self.text = text
        self.update(text)

    def append(self, piece: str) -> None:
        self.text += piece
        self.update(Text(self.text))
