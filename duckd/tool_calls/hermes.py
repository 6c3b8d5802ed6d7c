"""The hermes family (Qwen2.5, Qwen3, QwQ): <tool_call> JSON </tool_call>; also the fallback for
a chat template that renders no tools, which then gets a Qwen2.5-like tools prompt and the calls
and their results written into the messages' text."""
from __future__ import annotations

import json
import re

from duckd.tool_calls.format import ToolFormat, content_text, signatures
from duckd.tool_calls.grammar import chosen_functions, json_call_rules, start_rule
from duckd.tool_calls.parser import ToolCallParser, args_object

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"

# a template that writes past calls the hermes way: '<tool_call>\n{"name": ' (Qwen2.5, Qwen3, QwQ)
HERMES_TEMPLATE = re.compile(r'<tool_call>(?:\\n|\n)\{\\?"name\\?":')


class HermesFormat(ToolFormat):
    """<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>, one after another (Qwen2.5,
    Qwen3, QwQ); with renders_tools False the fallback for a template that renders no tools: the
    calls are then written into the assistant's text and the results into a user message."""
    name = "hermes"

    def __init__(self, tokenizer=None, renders_tools: bool = False):
        super().__init__(tokenizer)
        self.renders_tools = self.tool_role = renders_tools

    def tools_prompt(self, tools) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{signatures(tools)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def _assistant(self, m, calls):
        content = content_text(m.get("content"))
        if self.renders_tools:   # the templates tojson the arguments: a dict, not its text
            return {**m, "content": content,
                    "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a, _ in calls]}
        written = "\n".join(self.call_text(n, a) for n, a, _ in calls)
        rest = {k: v for k, v in m.items() if k != "tool_calls"}
        return {**rest, "content": f"{content}\n{written}" if content else written}

    @staticmethod
    def call_text(name: str, arguments: dict) -> str:
        """One call as the Qwen templates write it."""
        return (f'{TOOL_CALL}\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
                f'"arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{TOOL_CALL_END}')

    def lark(self, tools, names=None, parallel=True):
        fns = chosen_functions(tools, names)
        rules = [start_rule(parallel, '"\\n"'),
                 f'call: {self._mark(TOOL_CALL)} "\\n" ({" | ".join(f"tool_{i}" for i in range(len(fns)))}) '
                 f'"\\n" {self._mark(TOOL_CALL_END)}']
        return json_call_rules(rules, fns, "arguments")

    def parser(self, tools=None):
        return ToolCallParser(TOOL_CALL, TOOL_CALL_END, _parse_hermes)


def _parse_hermes(body: str):
    obj = json.loads(body.strip(), strict=False)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = args_object(args)
    return (obj["name"], args) if isinstance(args, dict) else None
