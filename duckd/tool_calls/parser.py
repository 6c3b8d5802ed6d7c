"""The streaming parser: a completion's text deltas -> (content, calls), the calls as ToolCalls.
ToolCallParser reads calls between a begin and an end marker, in a block of them where the family
writes one (DeepSeek); each family gives it the function that reads one call's body (args_object
reads the arguments' JSON text)."""
from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str          # "call_" + 24 hex digits
    name: str
    arguments: str   # JSON text of the arguments object

    @classmethod
    def new(cls, name: str, arguments: dict) -> "ToolCall":
        return cls("call_" + secrets.token_hex(12), name, json.dumps(arguments, ensure_ascii=False))

    def openai(self) -> dict:
        """The call as an OpenAI message's tool_calls item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def args_object(text: str) -> dict | None:
    """A call's arguments JSON text as the object (none at all: {}); None when it is no object."""
    text = text.strip()
    if not text:
        return {}
    obj = json.loads(text, strict=False)
    return obj if isinstance(obj, dict) else None


TEXT, BLOCK, CALL = "text", "block", "call"


def _first(s: str, markers: list[str]) -> tuple[int, str]:
    """The first marker in s: (where, which), (-1, "") when none is."""
    best = (-1, "")
    for m in markers:
        at = s.find(m)
        if at >= 0 and (best[0] < 0 or at < best[0]):
            best = (at, m)
    return best


def _partial(s: str, markers: list[str]) -> int:
    """The length of the longest end of s that may begin a marker."""
    for k in range(min(len(s), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(s[-k:]) for m in markers):
            return k
    return 0


class ToolCallParser:
    """A completion's text deltas -> (content, calls). Text that may begin a marker is held back
    until it is whole, and a call until it is closed; the whitespace around calls is the format's;
    a call that does not parse, or is unfinished at flush(), comes back as content."""

    def __init__(self, begin: str, end: str, parse, block: tuple[str, str] | None = None):
        self.begin, self.end, self.parse = begin, end, parse
        self.block = block   # (open, close) around a run of calls (DeepSeek), or None
        self.opens = [block[0], begin] if block else [begin]
        self.state = TEXT
        self.pending = ""    # text not given out yet: a possible marker's start, whitespace, a call's body
        self.raw = ""        # the call region's text so far: content again if no call comes of it
        self.searched = 0    # how much of a call's body has been searched for its end
        self.strip = False   # whitespace at the start of content is the format's (after a call)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """A delta -> (content surely outside calls, the calls it completed)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        s, self.pending = self.pending + delta, ""
        while s:
            s = self._step(s, content, calls)
        return "".join(content), calls

    def _step(self, s: str, content: list[str], calls: list[ToolCall]) -> str:
        """Reads s in the current state; returns what is left of it."""
        if self.state == TEXT:
            return self._text(s, content)
        if self.state == BLOCK:
            return self._in_block(s, content)
        return self._in_call(s, content, calls)

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the end: the text held back, an unfinished call's included, as content."""
        content: list[str] = []
        s, self.pending = self.pending, ""
        if self.state == BLOCK and not self.raw and self.block[1].startswith(s.strip()):
            s = ""   # calls done, the block's end cut off
        self._say(content, self.raw + s if self.state != TEXT else s)
        self.state, self.raw, self.searched = TEXT, "", 0
        return "".join(content), []

    # -- states -----------------------------------------------------------------------------------
    def _text(self, s: str, content: list[str]) -> str:
        at, marker = _first(s, self.opens)
        if marker:
            head = s[:at].rstrip()
            self._say(content, head)
            self.raw, s = s[len(head):at], s[at:]   # the whitespace before a call: content only if it fails
            if self.block:
                self.state = BLOCK
                if marker == self.block[0]:
                    self.raw, s = self.raw + marker, s[len(marker):]
            else:
                self.raw, s = self.raw + marker, s[len(marker):]
                self.state, self.searched = CALL, 0
            return s
        keep = len(s) - _partial(s, self.opens)
        head = s[:keep].rstrip()
        self._say(content, head)
        self.pending = s[len(head):]
        return ""

    def _in_block(self, s: str, content: list[str]) -> str:
        t = s.lstrip()
        close = self.block[1]
        if t.startswith(self.begin):
            self.raw += s[:len(s) - len(t)] + self.begin
            self.state, self.searched = CALL, 0
            return t[len(self.begin):]
        if t.startswith(close):
            self.state, self.raw, self.strip = TEXT, "", True
            return t[len(close):]
        if not t or self.begin.startswith(t) or close.startswith(t):
            self.pending = s
            return ""
        self._say(content, self.raw)   # text no call has: the block is over
        self.state, self.raw = TEXT, ""
        return t

    def _in_call(self, s: str, content: list[str], calls: list[ToolCall]) -> str:
        at = s.find(self.end, max(0, self.searched - len(self.end) + 1))
        if at < 0:
            self.pending, self.searched = s, len(s)
            return ""
        body, rest = s[:at], s[at + len(self.end):]
        call = self._call(body)
        if call is not None:
            calls.append(call)
        else:
            self._say(content, self.raw + body + self.end)
        self.raw, self.strip = "", True
        self.state = BLOCK if self.block else TEXT
        return rest

    def _call(self, body: str) -> ToolCall | None:
        try:
            parsed = self.parse(body)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            parsed = None
            log.debug("a tool call that does not parse (%s): %.200r", e, body)
        if parsed is None or parsed[1] is None or not parsed[0]:
            return None
        return ToolCall.new(*parsed)

    def _say(self, content: list[str], text: str) -> None:
        if self.strip:
            text = text.lstrip()
            self.strip = not text
        if text:
            content.append(text)
