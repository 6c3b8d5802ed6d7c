"""A reasoning model's thinking apart from its answer: Qwen3's and DeepSeek's chat templates have
the model write <think> ... </think> before the answer (or open the block in the prompt, so the
completion starts inside it). ReasoningSplit takes the completion's text deltas as they come and
gives each one's (reasoning, content) parts: the text inside the block is reasoning, the rest the
answer; a tag split across deltas is held back until it is whole; the newlines that follow a tag
are the template's, not the text's.

    split = ReasoningSplit(inside=prompt_opens_thinking(tail_text))
    reasoning, content = split.feed(delta)   # ... for each delta
    reasoning, content = split.flush()       # at the end: what a partial tag held back
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block (the template opened it)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ReasoningSplit:
    def __init__(self, inside: bool = False):
        self.inside = inside
        self.pending = ""          # the end of the text so far that may begin a tag
        self.strip = True          # newlines at the start of a part are the template's

    def feed(self, text: str) -> tuple[str, str]:
        """A delta -> its (reasoning, content)."""
        parts = {True: [], False: []}
        s, self.pending = self.pending + text, ""
        while s:
            tag = CLOSE if self.inside else OPEN
            at = s.find(tag)
            if at >= 0:
                self._add(parts, s[:at])
                s, self.inside, self.strip = s[at + len(tag):], not self.inside, True
                continue
            keep = next((k for k in range(min(len(tag) - 1, len(s)), 0, -1) if tag.startswith(s[-k:])), 0)
            self._add(parts, s[:len(s) - keep])
            self.pending, s = s[len(s) - keep:], ""
        return "".join(parts[True]), "".join(parts[False])

    def flush(self) -> tuple[str, str]:
        """What a partial tag held back, as text of the part it is in."""
        parts = {True: [], False: []}
        self._add(parts, self.pending)
        self.pending = ""
        return "".join(parts[True]), "".join(parts[False])

    def _add(self, parts: dict, text: str) -> None:
        if self.strip:
            text = text.lstrip("\n")
            self.strip = not text
        if text:
            parts[self.inside].append(text)
