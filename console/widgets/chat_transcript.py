"""The conversation as it is shown: user turns, answers streaming in token by
token, the model's tool calls (a line each: → name(arguments)), a stats line
after each answer, errors. What is *sent* (the history) is the chat screen's;
this only displays."""
from __future__ import annotations

from textual.containers import VerticalScroll

from console.widgets.chat_bubble import ChatBubble
from duck_proto import duck_pb2 as pb


def stats_text(stats: pb.GenerationStats) -> str:
    line = stats.line or (
        f"Generation stats: time {stats.time_s:.2f} s, input {stats.input_len} tokens, "
        f"output {stats.output_len} tokens, TTFT {stats.ttft_s * 1000:.0f} ms, "
        f"TPOT {stats.tpot_s * 1000:.1f} ms, prefill {stats.prefill_tok_s:.1f} tok/s, "
        f"decode {stats.decode_tok_s:.1f} tok/s")
    if stats.finish_reason and stats.finish_reason not in line:
        line += f" · finish: {stats.finish_reason}"
    return line


def tool_call_text(call: pb.ToolCall) -> str:
    return f"→ {call.name}({call.arguments})"


class ChatTranscript(VerticalScroll):
    DEFAULT_CSS = """
    ChatTranscript {
        height: 1fr;
        padding: 0 1;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.answer: ChatBubble | None = None

    def add_user(self, text: str) -> None:
        self.mount(ChatBubble("user", text))
        self.answer = ChatBubble("assistant")
        self.mount(self.answer)
        self.scroll_end(animate=False)

    def add_token(self, token: str) -> None:
        if self.answer is None:     # tokens without a question: show them anyway
            self.answer = ChatBubble("assistant")
            self.mount(self.answer)
        self.answer.append(token)
        self.scroll_end(animate=False)

    def add_tool_call(self, call: pb.ToolCall) -> None:
        """A call the model made, whole, as a line of its own below the answer's text (an answer
        that is nothing but calls shows no empty bubble); text after it starts a new bubble."""
        if self.answer is not None and not self.answer.text:
            self.answer.remove()
        self.mount(ChatBubble("tool-call", tool_call_text(call)))
        self.answer = None
        self.scroll_end(animate=False)

    def finish(self, stats: pb.GenerationStats) -> None:
        self.mount(ChatBubble("stats", stats_text(stats)))
        self.answer = None
        self.scroll_end(animate=False)

    def add_note(self, role: str, text: str) -> None:
        """A stats-styled note (a cancelled answer) or an error."""
        self.mount(ChatBubble(role, text))
        self.answer = None
        self.scroll_end(animate=False)

    @property
    def answers(self) -> list[str]:
        return [b.text for b in self.query(ChatBubble) if b.role == "assistant"]

    @property
    def tool_calls(self) -> list[str]:
        return [b.text for b in self.query(ChatBubble) if b.role == "tool-call"]

    @property
    def stats_lines(self) -> list[str]:
        return [b.text for b in self.query(ChatBubble) if b.role == "stats"]
