"""The pieces of the Lark grammars (llguidance) that hold a model to well-formed calls: the
functions a tool choice allows, string literals, JSON under a schema written the way the
templates write it, the start rule (one call, or up to MAX_CALLS), and the rules of calls
written as one JSON object each (hermes, llama3-json)."""
from __future__ import annotations

import json

from duckd.tool_calls.tools import ToolFormatError, check_tools

# JSON in a grammar the way the templates write it (tojson's separators), no other whitespace:
# the same options as engine.grammar.JSON_OPTIONS
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CALLS = 4   # parallel calls a forced grammar allows in one answer: a small model that loops would
                # otherwise write calls until max_tokens cuts one in half


def chosen_functions(tools, names) -> list[dict]:
    """The functions a grammar allows: those named (all when names is None), in the tools' order."""
    fns = [t["function"] for t in check_tools(tools)]
    if names is None:
        chosen = fns
    else:
        known = {f["name"] for f in fns}
        for n in names:
            if n not in known:
                raise ToolFormatError(f"tool_choice.function.name: no tool is named {n!r}")
        chosen = [f for f in fns if f["name"] in set(names)]
    if not chosen:
        raise ToolFormatError("tools: a call is required but there is no tool to call")
    return chosen


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: dict) -> str:
    """%json of a schema, written the way the templates write JSON."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def hoist_defs(params: dict) -> dict:
    """The definitions of a parameters schema, for a schema that nests it (its $refs point at the root)."""
    return {k: params[k] for k in ("$defs", "definitions") if k in params}


def start_rule(parallel: bool, separator: str) -> str:
    """The start rule: one call, or (parallel) up to MAX_CALLS, separator (a Lark expression) apart."""
    return f"start: call ({separator} call){{0,{MAX_CALLS - 1}}}" if parallel else "start: call"


def json_call_rules(rules: list[str], fns: list[dict], key: str) -> str:
    """The grammar: rules, then tool_i, a call of fns[i] written as the JSON object {"name": ...,
    key: its arguments under the function's schema}."""
    for i, fn in enumerate(fns):
        params = fn["parameters"]
        body = {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key], "additionalProperties": False, **hoist_defs(params)}
        rules.append(f"tool_{i}: {json_rule(body)}")
    return "\n".join(rules) + "\n"
