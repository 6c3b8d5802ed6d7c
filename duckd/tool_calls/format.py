"""ToolFormat, what every family's format is: the tools prompt, the history in the shape the
family's template reads (template_messages, with the readers of an OpenAI history it shares:
content_text, history_calls), the grammar of a forced call and the parser of a completion."""
from __future__ import annotations

import abc
import json

from duckd.tool_calls.grammar import lit
from duckd.tool_calls.parser import ToolCallParser
from duckd.tool_calls.tools import ToolFormatError, check_tools


def content_text(content) -> str:
    """A message's content as text (OpenAI allows a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def history_calls(calls, at: str) -> list[tuple[str, dict, str]]:
    """An assistant message's tool_calls -> [(name, arguments, arguments' JSON text)]."""
    if not isinstance(calls, list):
        raise ToolFormatError(f"{at}: expected a list")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolFormatError(f"{at}[{k}].function.name: expected a string")
        args = fn.get("arguments", "{}")
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        try:
            obj = json.loads(text) if text.strip() else {}
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            raise ToolFormatError(f"{at}[{k}].function.arguments: not the JSON text of an object")
        out.append((fn["name"], obj, text))
    return out


def signatures(tools) -> str:
    """The tools, one JSON object a line (the Qwen tools prompts)."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in check_tools(tools))


class ToolFormat(abc.ABC):
    """How one family writes calls. Subclasses set the markers and the pieces below."""
    name = "base"
    renders_tools = False   # the chat template renders the `tools` argument itself
    tool_role = True        # the template renders role "tool" messages (else they become user text)

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def tools_prompt(self, tools) -> str:
        """System-prompt text that describes the tools and how to call them."""

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """OpenAI history -> the messages this family's template expects."""
        out, after_tool = [], False
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role == "assistant" and m.get("tool_calls"):
                out.append(self._assistant(m, history_calls(m["tool_calls"], f"messages[{i}].tool_calls")))
            elif role == "tool":
                text = content_text(m.get("content"))
                if self.tool_role:
                    out.append({"role": "tool", "content": text,
                                **{k: m[k] for k in ("tool_call_id", "name") if k in m}})
                elif after_tool:
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + self._response_text(text)}
                else:
                    out.append({"role": "user", "content": self._response_text(text)})
            else:
                out.append(m)
            after_tool = role == "tool"
        return out

    @abc.abstractmethod
    def lark(self, tools, names: list[str] | None = None, parallel: bool = True) -> str:
        """A Lark grammar (llguidance) for one or more calls (exactly one unless parallel) of the
        named tools (all when names is None), each call's arguments held to its parameters' schema.
        The model's EOS after the calls is the matcher's."""

    @abc.abstractmethod
    def parser(self, tools=None) -> ToolCallParser:
        """The parser of a completion's deltas (tools: those the request gave, where it reads them)."""

    # -- pieces ---------------------------------------------------------------------------------
    def _mark(self, text: str) -> str:
        """A marker in a grammar: its token when it is one in the vocabulary, else its text."""
        hf = getattr(self.tokenizer, "tokenizer", None)
        i = hf.token_to_id(text) if hf is not None else None
        return f"<[{i}]>" if i is not None else lit(text)

    @abc.abstractmethod
    def _assistant(self, m: dict, calls: list[tuple[str, dict, str]]) -> dict:
        """An assistant message with calls (history_calls') as the template reads it."""

    def _response_text(self, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>"

    def __repr__(self):
        return f"<ToolFormat {self.name} renders_tools={self.renders_tools}>"
