"""Chat with the served model: the history is kept here, on the client, and sent
whole with every question (the daemon renders the model's chat template);
tokens stream into the transcript, the stats line follows each answer, and
escape cancels an answer in flight (what came so far stays in the history).

With tools (duck-console --tools FILE: the app's chat_options), every question
offers them; each call the model makes shows as a line of its own
(→ name(arguments)) and stays in the history as the answer's tool_calls.
The console runs no tool: it shows what the model asked for."""
from __future__ import annotations

import logging

import grpc
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Input

from console.api import call_error_text
from console.widgets.chat_controls import ChatControls
from console.widgets.chat_transcript import ChatTranscript
from console.widgets.connection_banner import ConnectionBanner
from console.widgets.fleet_header import FleetHeader
from duck_proto import duck_pb2 as pb

log = logging.getLogger("console.chat")


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel answer"),
        Binding("ctrl+n", "new_conversation", "New conversation"),
    ]

    generating: reactive[bool] = reactive(False)

    def __init__(self) -> None:
        super().__init__()
        self.history: list[pb.ChatMessage] = []
        self._answer = ""
        self._calls: list[pb.ToolCall] = []

    def compose(self) -> ComposeResult:
        yield ConnectionBanner()
        yield FleetHeader()
        yield ChatTranscript()
        yield ChatControls()
        yield Input(placeholder="Ask the model… (enter sends)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        prompt = self.query_one("#prompt", Input)
        tools = getattr(self.app, "tool_names", [])
        if tools:
            choice = getattr(self.app, "chat_options", {}).get("tool_choice") or "auto"
            prompt.border_title = f"tools ({choice}): {', '.join(tools)}"
        prompt.focus()

    def watch_generating(self, generating: bool) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.border_subtitle = "answering… (esc cancels)" if generating else ""

    @on(Input.Submitted, "#prompt")
    def send(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("an answer is still streaming: wait, or press escape to cancel it", severity="warning")
            return
        event.input.clear()
        controls = self.query_one(ChatControls)
        request = self.begin_turn(text, controls.temperature, controls.max_tokens)
        if self.app.api is None:
            self.notify("not connected to a daemon", severity="error")
            return
        self.ask(request)

    def begin_turn(self, text: str, temperature: float, max_tokens: int) -> pb.ChatRequest:
        """Shows the question and returns the request carrying the whole conversation."""
        self.history.append(pb.ChatMessage(role="user", content=text))
        self._answer, self._calls = "", []
        self.generating = True
        self.query_one(ChatTranscript).add_user(text)
        return pb.ChatRequest(messages=self.history, temperature=temperature, max_tokens=max_tokens,
                              **getattr(self.app, "chat_options", {}))

    def apply_chat_event(self, event: pb.ChatEvent) -> None:
        """One event of the Chat stream: a token, a tool call, or the final stats (which end the turn)."""
        transcript = self.query_one(ChatTranscript)
        kind = event.WhichOneof("event")
        if kind == "token":
            if event.token:
                self._answer += event.token
                transcript.add_token(event.token)
        elif kind == "tool_call":
            self._calls.append(event.tool_call)
            transcript.add_tool_call(event.tool_call)
        elif kind == "stats":
            transcript.finish(event.stats)
            self._end_turn()

    def fail_turn(self, message: str) -> None:
        """The call failed: say why; a question that got no answer leaves the history."""
        self.query_one(ChatTranscript).add_note("error", message)
        if self._answer or self._calls:
            self._end_turn()
        else:
            if self.history and self.history[-1].role == "user":
                self.history.pop()
            self.generating = False

    def _end_turn(self) -> None:
        self.history.append(pb.ChatMessage(role="assistant", content=self._answer, tool_calls=self._calls))
        self._answer, self._calls = "", []
        self.generating = False

    @work(exclusive=True, group="chat")
    async def ask(self, request: pb.ChatRequest) -> None:
        call = self.app.api.chat.Chat(request)
        try:
            async for event in call:
                self.apply_chat_event(event)
            if self.generating:    # the stream ended without stats
                self.fail_turn("the answer ended without its stats (daemon stopping?)")
        except grpc.aio.AioRpcError as e:
            log.info("chat failed: %s", e)
            self.fail_turn(call_error_text(e))
        finally:
            call.cancel()

    def action_cancel(self) -> None:
        if not self.generating:
            return
        self.workers.cancel_group(self, "chat")
        self.query_one(ChatTranscript).add_note("stats", f"cancelled after {len(self._answer)} characters")
        if self._answer or self._calls:
            self._end_turn()
        else:
            self.history.pop()
            self.generating = False

    def action_new_conversation(self) -> None:
        self.action_cancel()
        self.history.clear()
        self.query_one(ChatTranscript).remove_children()
        self.notify("new conversation")
