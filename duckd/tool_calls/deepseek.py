"""The DeepSeek families: the calls in a block (<｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>),
each in <｜tool▁call▁begin｜> ... <｜tool▁call▁end｜> with <｜tool▁sep｜> inside; deepseek-v3 (V3, R1
and their distills: function<｜tool▁sep｜>NAME and a ```json fence, the calls a newline apart) and
deepseek-v3.1 (NAME<｜tool▁sep｜>ARGS, one after another). The two differ only in the layout of a
call, which gives the tools prompt's example and the grammar, and in how a call's body is read."""
from __future__ import annotations

import abc
import json
import logging
import re

from duckd.tool_calls.format import ToolFormat, content_text
from duckd.tool_calls.grammar import MAX_CALLS, chosen_functions, json_rule, lit
from duckd.tool_calls.parser import ToolCallParser, args_object
from duckd.tool_calls.tools import check_tools

log = logging.getLogger(__name__)

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
LAYOUT_SLOTS = re.compile(r"(\{sep\}|\{args\})")


class _DeepSeekFormat(ToolFormat):
    """The calls inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>, each in <｜tool▁call▁begin｜>
    ... <｜tool▁call▁end｜>. The templates render no tools. A family says how it writes one call
    (layout), how calls are chained (separator, and in words, chaining) and how it reads a call's
    body (_name_args)."""
    # one call between <｜tool▁call▁begin｜> and <｜tool▁call▁end｜>, its text with {name}, {sep}
    # (<｜tool▁sep｜>) and {args} (the arguments' JSON) in their places
    layout: str
    chaining: str    # how calls follow one another, in the tools prompt's words
    separator = ""   # between two calls

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._rule = None   # (content of a message that only calls, content beside calls rendered?)

    def tools_prompt(self, tools) -> str:
        # the tool prompt DeepSeek publishes for V3.1, with this family's call syntax
        parts = ["## Tools\nYou have access to the following tools:\n"]
        for t in check_tools(tools):
            fn = t["function"]
            parts.append(f"### {fn['name']}\nDescription: {fn.get('description', '')}\n\n"
                         f"Parameters: {json.dumps(fn['parameters'], ensure_ascii=False)}\n")
        example = self.layout.replace("{name}", "tool_call_name").replace("{sep}", DS_SEP) \
            .replace("{args}", "tool_call_arguments")
        parts.append("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                     f"{DS_CALLS}{DS_CALL}{example}{DS_CALL_END}{{{{additional_tool_calls}}}}{DS_CALLS_END}\n\n"
                     "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
                     "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                     f"- For multiple tool calls, {self.chaining}")
        return "\n".join(parts)

    def _assistant(self, m, calls):
        content = content_text(m.get("content"))
        empty, keeps = self._content_rule()
        if content and not keeps:
            log.debug("the chat template drops an assistant's content beside tool calls")
        return {**m, "content": content if content and keeps else empty,
                "tool_calls": [{"type": "function", "function": {"name": n, "arguments": text}}
                               for n, _, text in calls]}

    def _content_rule(self) -> tuple[str | None, bool]:
        """(the content for an assistant message that only calls, whether content beside calls is
        rendered): DeepSeek-V3's template renders the calls only when content is None, another
        wants a string; a render of a probe tells."""
        if self._rule is None:
            self._rule = (None, False)
            if getattr(self.tokenizer, "chat_template", None):
                for empty in (None, ""):
                    if self._renders_calls(empty):
                        self._rule = (empty, self._renders_calls("probe content"))
                        break
        return self._rule

    def _renders_calls(self, content) -> bool:
        messages = [{"role": "user", "content": "u"},
                    {"role": "assistant", "content": content,
                     "tool_calls": [{"type": "function", "function": {"name": "probe_fn", "arguments": "{}"}}]}]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        except Exception:   # noqa: BLE001 - a template that cannot take this content
            return False
        return "probe_fn" in text and (content is None or content == "" or content in text)

    def lark(self, tools, names=None, parallel=True):
        # the layout's text before {name} is every call's; from {name} on, the tool's (tool_i)
        fns = chosen_functions(tools, names)
        more = f"{{0,{MAX_CALLS - 1}}}"
        calls = f"call ({lit(self.separator)} call){more}" if self.separator and parallel else \
            f"call call{more}" if parallel else "call"
        head, _, tail = self.layout.partition("{name}")
        head = self._layout_rule(head)
        rules = [f"start: {self._mark(DS_CALLS)} {calls} {self._mark(DS_CALLS_END)}",
                 f'call: {self._mark(DS_CALL)} {head + " " if head else ""}'
                 f'({" | ".join(f"tool_{i}" for i in range(len(fns)))}) {self._mark(DS_CALL_END)}']
        for i, fn in enumerate(fns):
            rules.append(f"tool_{i}: {self._layout_rule(fn['name'] + tail, f'args_{i}')}")
            rules.append(f"args_{i}: {json_rule(fn['parameters'])}")
        return "\n".join(rules) + "\n"

    def _layout_rule(self, text: str, args: str = "") -> str:
        """A piece of the layout as a Lark sequence: its text as literals, {sep} the separator's
        marker, {args} the rule args."""
        pieces = []
        for part in LAYOUT_SLOTS.split(text):
            if part == "{sep}":
                pieces.append(self._mark(DS_SEP))
            elif part == "{args}":
                pieces.append(args)
            elif part:
                pieces.append(lit(part))
        return " ".join(pieces)

    def parser(self, tools=None):
        return ToolCallParser(DS_CALL, DS_CALL_END, self._parse, block=(DS_CALLS, DS_CALLS_END))

    def _parse(self, body: str):
        """A call's body -> (name, arguments); None without the separator."""
        before, sep, after = body.partition(DS_SEP)
        if not sep:
            return None
        name, args = self._name_args(before, after)
        return name.strip(), args_object(args)

    @staticmethod
    @abc.abstractmethod
    def _name_args(before: str, after: str) -> tuple[str, str]:
        """A call's body, the text before and after <｜tool▁sep｜> -> (name, arguments' JSON text)."""


class DeepSeekV3Format(_DeepSeekFormat):
    """<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>, the
    calls a newline apart (DeepSeek-V3, R1 and their distills)."""
    name = "deepseek-v3"
    layout = "function{sep}{name}\n```json\n{args}\n```"
    separator = "\n"
    chaining = "write one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> after another, a newline apart"

    @staticmethod
    def _name_args(before, after):
        # the name on the separator's line, the arguments below it (the ```json fence taken off)
        name, _, args = after.partition("\n")
        args = args.strip()
        if args.startswith("```"):
            args = args[3:].removeprefix("json")
            args = args.removesuffix("```") if args.endswith("```") else args
        return name, args


class DeepSeekV31Format(_DeepSeekFormat):
    """<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>, the calls one after another
    (DeepSeek-V3.1)."""
    name = "deepseek-v3.1"
    layout = "{name}{sep}{args}"
    chaining = "chain them directly without separators or spaces"

    @staticmethod
    def _name_args(before, after):
        return before, after
