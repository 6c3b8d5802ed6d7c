"""The qwen3-xml family (Qwen3.5, Qwen3.6): <tool_call> around <function=NAME> and a
<parameter=P> VALUE </parameter> a parameter, the values text; the parser reads a value as JSON
unless its parameter's schema says string."""
from __future__ import annotations

import json
import re

from duckd.tool_calls.format import ToolFormat, content_text, signatures
from duckd.tool_calls.grammar import chosen_functions, hoist_defs, json_rule, lit, start_rule
from duckd.tool_calls.hermes import TOOL_CALL, TOOL_CALL_END
from duckd.tool_calls.parser import ToolCallParser
from duckd.tool_calls.tools import check_tools


class Qwen3XmlFormat(ToolFormat):
    """<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
    (Qwen3.5, Qwen3.6). A value is text; the parser JSON-decodes it unless the parameter's schema
    says string."""
    name = "qwen3-xml"

    def __init__(self, tokenizer=None, renders_tools: bool = True):
        super().__init__(tokenizer)
        self.renders_tools = renders_tools

    def tools_prompt(self, tools) -> str:
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                f"{signatures(tools)}\n</tools>\n\n"
                "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
                "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
                "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
                "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
                "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> "
                "block must be nested within <tool_call></tool_call> XML tags\n"
                "- Required parameters MUST be specified\n"
                "- You may provide optional reasoning for your function call in natural language BEFORE the "
                "function call, but NOT after\n"
                "- If there is no function call available, answer the question like normal with your current "
                "knowledge and do not tell the user about function calls\n</IMPORTANT>")

    def _assistant(self, m, calls):
        # the template walks arguments|items: a dict
        return {**m, "content": content_text(m.get("content")),
                "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a, _ in calls]}

    def lark(self, tools, names=None, parallel=True):
        # The parameters come in the schema's order, the required ones always, the others maybe; a
        # string enum is one of its words, a boolean true/false (or the template's True/False),
        # another non-string type JSON of its schema; any other value (a string, or a schema
        # without a type) is free text that does not contain "</parameter>": an approximation,
        # such a value's schema (pattern, length, format) is not enforced.
        fns = chosen_functions(tools, names)
        rules = [start_rule(parallel, '"\\n"'),
                 f'call: {self._mark(TOOL_CALL)} "\\n" ({" | ".join(f"fn_{i}" for i in range(len(fns)))}) '
                 f'"\\n" {self._mark(TOOL_CALL_END)}',
                 r"PARAM_TEXT: /(?s:.*)\n<\/parameter>\n/ & ~/(?s:.*<\/parameter>..+)/"]
        for i, fn in enumerate(fns):
            params = fn["parameters"]
            props = params.get("properties", {})
            required = params.get("required", [])
            order = list(props) + [r for r in required if r not in props]
            parts = []
            for j, p in enumerate(order):
                rule = f"fn_{i}_{j}"
                head = lit(f"<parameter={p}>\n")
                types = _types(props.get(p))
                enum = (props.get(p) or {}).get("enum")
                if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
                    words = " | ".join(lit(v) for v in enum)
                    rules.append(f'{rule}: {head} ({words}) "\\n</parameter>\\n"')
                elif types == {"boolean"}:
                    rules.append(f'{rule}: {head} ("true" | "false" | "True" | "False") "\\n</parameter>\\n"')
                elif types and "string" not in types:
                    rules.append(f'{rule}: {head} {rule}_v "\\n</parameter>\\n"')
                    rules.append(f"{rule}_v: {json_rule({**props[p], **hoist_defs(params)})}")
                else:
                    rules.append(f"{rule}: {head} PARAM_TEXT")
                parts.append(rule if p in required else f"{rule}?")
            rules.append(f'fn_{i}: {lit("<function=" + fn["name"] + ">" + chr(10))} {" ".join(parts)} "</function>"')
        return "\n".join(rules) + "\n"

    def parser(self, tools=None):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in check_tools(tools or [])}
        return ToolCallParser(TOOL_CALL, TOOL_CALL_END, lambda body: _parse_xml(body, schemas))


FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _parse_xml(body: str, schemas: dict):
    fn = FUNCTION.search(body)
    if fn is None:
        return None
    name = fn.group(1).strip()
    props = schemas.get(name, {}).get("properties", {})
    args = {}
    for p in PARAMETER.finditer(fn.group(2)):
        value = p.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = p.group(1).strip()
        args[key] = _xml_value(value, props.get(key))
    return name, args


def _types(schema) -> set[str]:
    """The JSON types a schema allows, as far as its type / anyOf / oneOf / enum say."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _types(sub)
    if not types and isinstance(schema.get("enum"), list):
        types = {"string" if isinstance(v, str) else "other" for v in schema["enum"]}
    return types


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def _xml_value(text: str, schema):
    """A parameter's text as its value: the text itself where the schema says string, else JSON
    when it parses (True/False/None as the template writes Python's), else the text."""
    types = _types(schema)
    if "string" in types:
        return text
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        pass
    word = text.strip()
    if word in ("True", "False") and (not types or "boolean" in types):
        return word == "True"
    if word == "None" and (not types or "null" in types):
        return None
    return text
