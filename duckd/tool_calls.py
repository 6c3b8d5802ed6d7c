"""Tool (function) calls the way each model family writes them: the system-prompt text that
describes the tools to a model whose chat template does not, the history (past calls and their
results) in the shape the family's template reads, a grammar that holds the model to well-formed
calls (tool_choice "required" or a named function), and a parser that takes the completion's
text deltas as they come and gives the content apart from the calls.

    fmt = tool_format(tokenizer)                    # the family, from the chat template and vocabulary
    tools = check_tools(request_tools)              # ToolFormatError names the bad field
    messages = fmt.template_messages(messages)      # OpenAI history -> what the template expects
    prompt = tokenizer.apply_chat_template(messages, tools=tools)   # when fmt.renders_tools,
    # else the first system message gets fmt.tools_prompt(tools)
    grammar = fmt.lark(tools, names=["get_weather"], parallel=False)   # a forced call (Lark, llguidance)
    parser = fmt.parser(tools)
    content, calls = parser.feed(delta)             # ... for each delta
    content, calls = parser.flush()                 # at the end: held-back text, an unfinished call's text

Families: hermes (Qwen2.5, Qwen3, QwQ: <tool_call> JSON </tool_call>; also the fallback for a
template that renders no tools, which then gets a Qwen2.5-like tools prompt), qwen3-xml (Qwen3.5 /
Qwen3.6: <function=NAME><parameter=P>VALUE</parameter>), deepseek-v3 (V3 / R1:
function<｜tool▁sep｜>NAME and a ```json fence), deepseek-v3.1 (NAME<｜tool▁sep｜>ARGS) and llama3-json
(Llama 3.1, 3.2, 3.3: {"name": NAME, "parameters": ARGS} as the answer, no marker around it).
A marker that is one token of the vocabulary is written in a grammar as that token (<[id]>):
llguidance does not match an added token's text as a string.
"""
from __future__ import annotations

import copy
import json
import logging
import re
import secrets
from dataclasses import dataclass

log = logging.getLogger(__name__)

# JSON in a grammar the way the templates write it (tojson's separators), no other whitespace:
# the same options as engine.grammar.JSON_OPTIONS
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for a function name
MAX_CALLS = 4   # parallel calls a forced grammar allows in one answer: a small model that loops would
                # otherwise write calls until max_tokens cuts one in half

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# a template that writes past calls the hermes way: '<tool_call>\n{"name": ' (Qwen2.5, Qwen3, QwQ)
HERMES_TEMPLATE = re.compile(r'<tool_call>(?:\\n|\n)\{\\?"name\\?":')


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


class ToolFormatError(ValueError):
    """A bad tools list, tool choice or history: the message names the field."""


# -- the request's tools ---------------------------------------------------------------------------

def check_tools(tools) -> list[dict]:
    """An OpenAI tools list, checked and normalized: [{"type": "function", "function": {"name",
    "description"?, "parameters", "strict"?}}], parameters {"type": "object", "properties": {}}
    when absent. ToolFormatError names the bad field."""
    if not isinstance(tools, list):
        raise ToolFormatError('tools: expected a list of {"type": "function", "function": {...}} objects')
    out, seen = [], set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolFormatError(f"{at}: expected an object")
        if tool.get("type", "function") != "function":
            raise ToolFormatError(f"{at}.type: only 'function' tools are supported, not {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolFormatError(f"{at}.function: expected an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolFormatError(f"{at}.function.name: {name!r} is not a function name "
                                  f"(1 to 64 of a-z, A-Z, 0-9, _ and -)")
        if name in seen:
            raise ToolFormatError(f"{at}.function.name: {name!r} is named twice")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolFormatError(f"{at}.function.description: expected a string")
        params = fn.get("parameters")
        if params is None or params == {}:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolFormatError(f"{at}.function.parameters: expected a JSON schema object")
        if params.get("type", "object") != "object":
            raise ToolFormatError(f"{at}.function.parameters.type: the arguments must be an object, "
                                  f"not {params.get('type')!r}")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ToolFormatError(f"{at}.function.parameters.properties: expected an object of schemas")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolFormatError(f"{at}.function.parameters.required: expected a list of names")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolFormatError(f"{at}.function.strict: expected true or false")
        norm = {"name": name}
        if desc is not None:
            norm["description"] = desc
        norm["parameters"] = closed_schema(params) if strict else copy.deepcopy(params)
        if strict is not None:
            norm["strict"] = strict
        out.append({"type": "function", "function": norm})
    return out


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")   # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def closed_schema(schema):
    """A copy of a JSON schema whose objects allow no property beyond those they name, where they
    do not say otherwise (additionalProperties absent): OpenAI's strict mode, where such a schema
    must say so itself. A schema given with strict true is read this way."""
    if not isinstance(schema, dict):
        return copy.deepcopy(schema)
    out = copy.deepcopy(schema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed_schema(sub) for sub in schema[key]]
    for key in SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            out[key] = closed_schema(schema[key])
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _chosen(tools, names) -> list[dict]:
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


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: dict) -> str:
    """%json of a schema, written the way the templates write JSON."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _hoist_defs(params: dict) -> dict:
    """The definitions of a parameters schema, for a schema that nests it (its $refs point at the root)."""
    return {k: params[k] for k in ("$defs", "definitions") if k in params}


# -- the history ------------------------------------------------------------------------------------

def _text(content) -> str:
    """A message's content as text (OpenAI allows a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _history_calls(calls, at: str) -> list[tuple[str, dict, str]]:
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


# -- the formats ------------------------------------------------------------------------------------

class ToolFormat:
    """How one family writes calls. Subclasses set the markers and the pieces below."""
    name = "base"
    renders_tools = False   # the chat template renders the `tools` argument itself
    tool_role = True        # the template renders role "tool" messages (else they become user text)

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def tools_prompt(self, tools) -> str:
        """System-prompt text that describes the tools and how to call them."""
        raise NotImplementedError

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """OpenAI history -> the messages this family's template expects."""
        out, after_tool = [], False
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role == "assistant" and m.get("tool_calls"):
                out.append(self._assistant(m, _history_calls(m["tool_calls"], f"messages[{i}].tool_calls")))
            elif role == "tool":
                text = _text(m.get("content"))
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

    def lark(self, tools, names: list[str] | None = None, parallel: bool = True) -> str:
        """A Lark grammar (llguidance) for one or more calls (exactly one unless parallel) of the
        named tools (all when names is None), each call's arguments held to its parameters' schema.
        The model's EOS after the calls is the matcher's."""
        raise NotImplementedError

    def parser(self, tools=None) -> "ToolCallParser":
        raise NotImplementedError

    # -- pieces ---------------------------------------------------------------------------------
    def _mark(self, text: str) -> str:
        """A marker in a grammar: its token when it is one in the vocabulary, else its text."""
        hf = getattr(self.tokenizer, "tokenizer", None)
        i = hf.token_to_id(text) if hf is not None else None
        return f"<[{i}]>" if i is not None else _lit(text)

    def _assistant(self, m: dict, calls: list[tuple[str, dict, str]]) -> dict:
        raise NotImplementedError

    def _response_text(self, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>"

    def __repr__(self):
        return f"<ToolFormat {self.name} renders_tools={self.renders_tools}>"


def _signatures(tools) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in check_tools(tools))


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
                f"{_signatures(tools)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def _assistant(self, m, calls):
        content = _text(m.get("content"))
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
        fns = _chosen(tools, names)
        rules = [_start(parallel, '"\\n"'),
                 f'call: {self._mark(TOOL_CALL)} "\\n" ({" | ".join(f"tool_{i}" for i in range(len(fns)))}) '
                 f'"\\n" {self._mark(TOOL_CALL_END)}']
        return _json_call_rules(rules, fns, "arguments")

    def parser(self, tools=None):
        return ToolCallParser(TOOL_CALL, TOOL_CALL_END, _parse_hermes)


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
                f"{_signatures(tools)}\n</tools>\n\n"
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
        return {**m, "content": _text(m.get("content")),
                "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a, _ in calls]}

    def lark(self, tools, names=None, parallel=True):
        # The parameters come in the schema's order, the required ones always, the others maybe; a
        # string enum is one of its words, a boolean true/false (or the template's True/False),
        # another non-string type JSON of its schema; any other value (a string, or a schema
        # without a type) is free text that does not contain "</parameter>": an approximation,
        # such a value's schema (pattern, length, format) is not enforced.
        fns = _chosen(tools, names)
        rules = [_start(parallel, '"\\n"'),
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
                head = _lit(f"<parameter={p}>\n")
                types = _types(props.get(p))
                enum = (props.get(p) or {}).get("enum")
                if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
                    words = " | ".join(_lit(v) for v in enum)
                    rules.append(f'{rule}: {head} ({words}) "\\n</parameter>\\n"')
                elif types == {"boolean"}:
                    rules.append(f'{rule}: {head} ("true" | "false" | "True" | "False") "\\n</parameter>\\n"')
                elif types and "string" not in types:
                    rules.append(f'{rule}: {head} {rule}_v "\\n</parameter>\\n"')
                    rules.append(f"{rule}_v: {_json_rule({**props[p], **_hoist_defs(params)})}")
                else:
                    rules.append(f"{rule}: {head} PARAM_TEXT")
                parts.append(rule if p in required else f"{rule}?")
            rules.append(f'fn_{i}: {_lit("<function=" + fn["name"] + ">" + chr(10))} {" ".join(parts)} "</function>"')
        return "\n".join(rules) + "\n"

    def parser(self, tools=None):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in check_tools(tools or [])}
        return ToolCallParser(TOOL_CALL, TOOL_CALL_END, lambda body: _parse_xml(body, schemas))


class _DeepSeekFormat(ToolFormat):
    """The calls inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>, each in <｜tool▁call▁begin｜>
    ... <｜tool▁call▁end｜>. The templates render no tools."""
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
        parts.append("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n" + self._example() + "\n\n"
                     "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
                     "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                     f"- For multiple tool calls, {self._chaining}")
        return "\n".join(parts)

    def _assistant(self, m, calls):
        content = _text(m.get("content"))
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
        fns = _chosen(tools, names)
        more = f"{{0,{MAX_CALLS - 1}}}"
        calls = f"call ({_lit(self.separator)} call){more}" if self.separator and parallel else \
            f"call call{more}" if parallel else "call"
        rules = [f"start: {self._mark(DS_CALLS)} {calls} {self._mark(DS_CALLS_END)}",
                 f'call: {self._mark(DS_CALL)} {self._call_head()}'
                 f'({" | ".join(f"tool_{i}" for i in range(len(fns)))}) {self._mark(DS_CALL_END)}']
        for i, fn in enumerate(fns):
            rules.append(f"tool_{i}: {self._tool_rule(fn['name'], f'args_{i}')}")
            rules.append(f"args_{i}: {_json_rule(fn['parameters'])}")
        return "\n".join(rules) + "\n"

    def parser(self, tools=None):
        return ToolCallParser(DS_CALL, DS_CALL_END, self._parse, block=(DS_CALLS, DS_CALLS_END))


class DeepSeekV3Format(_DeepSeekFormat):
    """<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>, the
    calls a newline apart (DeepSeek-V3, R1 and their distills)."""
    name = "deepseek-v3"
    separator = "\n"
    _chaining = "write one <｜tool▁call▁begin｜>...<｜tool▁call▁end｜> after another, a newline apart"

    def _example(self):
        return (f"{DS_CALLS}{DS_CALL}function{DS_SEP}tool_call_name\n```json\ntool_call_arguments\n```{DS_CALL_END}"
                f"{{{{additional_tool_calls}}}}{DS_CALLS_END}")

    def _call_head(self):
        return f'"function" {self._mark(DS_SEP)} '

    def _tool_rule(self, name, args):
        return f'{_lit(name + chr(10) + "```json" + chr(10))} {args} {_lit(chr(10) + "```")}'

    @staticmethod
    def _parse(body):
        _, sep, rest = body.partition(DS_SEP)
        if not sep:
            return None
        name, _, args = rest.partition("\n")
        args = args.strip()
        if args.startswith("```"):
            args = args[3:].removeprefix("json")
            args = args.removesuffix("```") if args.endswith("```") else args
        return name.strip(), _args_object(args)


class DeepSeekV31Format(_DeepSeekFormat):
    """<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>, the calls one after another
    (DeepSeek-V3.1)."""
    name = "deepseek-v3.1"
    _chaining = "chain them directly without separators or spaces"

    def _example(self):
        return (f"{DS_CALLS}{DS_CALL}tool_call_name{DS_SEP}tool_call_arguments{DS_CALL_END}"
                f"{{{{additional_tool_calls}}}}{DS_CALLS_END}")

    def _call_head(self):
        return ""

    def _tool_rule(self, name, args):
        return f"{_lit(name)} {self._mark(DS_SEP)} {args}"

    @staticmethod
    def _parse(body):
        name, sep, args = body.partition(DS_SEP)
        return (name.strip(), _args_object(args)) if sep else None


PYTHON_TAG = "<|python_tag|>"
# a template that writes past calls Llama 3.1's way: '{"name": "' + NAME + '", "parameters": ' and
# tool results in an ipython turn (Llama 3.1, 3.2, 3.3); 3.1's also writes built-in calls after <|python_tag|>
LLAMA3_TEMPLATE = re.compile(r'"parameters": ')


class Llama3JsonFormat(ToolFormat):
    """{"name": NAME, "parameters": {...}} as the answer (Llama 3.1, 3.2, 3.3: Meta's JSON tool
    calling), after <|python_tag|> where the model writes it; parallel calls (the templates render
    one call a turn) "; " apart. The parser also reads a call that begins a line after some text,
    and calls a newline apart (JsonCallParser). The templates render the tools (into the first
    user message) and the results (an ipython turn); a past answer's calls become one assistant
    turn each, its results after it."""
    name = "llama3-json"
    renders_tools = True
    separator = "; "   # between parallel calls (the grammar's; the parser also takes newlines)

    def tools_prompt(self, tools) -> str:
        # Meta's words for JSON tool calling (what the templates write into the first user message)
        signatures = "".join(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n" for t in check_tools(tools))
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                "its value}. Do not use variables.\n\n" + signatures).rstrip("\n")

    def template_messages(self, messages):
        # The templates render one call per assistant message (they raise on more) and ignore the
        # content beside it: a past answer's calls become one assistant message each, followed by
        # its result(s) (by tool_call_id, else in order), the way the model makes calls one at a time.
        out, i = [], 0
        while i < len(messages):
            m = messages[i]
            role = m.get("role") if isinstance(m, dict) else None
            i += 1
            if role == "assistant" and m.get("tool_calls"):
                calls = _history_calls(m["tool_calls"], f"messages[{i - 1}].tool_calls")
                if _text(m.get("content")).strip():
                    log.debug("the chat template drops an assistant's content beside tool calls")
                results = []
                while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
                    results.append(messages[i])
                    i += 1
                ids = [c.get("id") if isinstance(c, dict) else None for c in m["tool_calls"]]
                answers: list[list[dict]] = [[] for _ in calls]
                for r in results:
                    at = r.get("tool_call_id")
                    k = ids.index(at) if at is not None and at in ids else \
                        next((k for k, a in enumerate(answers) if not a), len(calls) - 1)
                    answers[k].append(r)
                for (name, args, _), answer in zip(calls, answers):
                    out.append({**m, "content": "",
                                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
                    out.extend(self._result(r) for r in answer)
            elif role == "tool":
                out.append(self._result(m))
            elif role == "assistant" and "tool_calls" in m:   # an empty list or null: the template reads the key
                out.append({k: v for k, v in m.items() if k != "tool_calls"})
            else:
                out.append(m)
        return out

    @staticmethod
    def _result(m: dict) -> dict:
        # The templates tojson a result that is "iterable", a string included: a result that is
        # JSON text goes as its value (written back as JSON, not as a quoted string)
        text = _text(m.get("content"))
        try:
            value = json.loads(text) if text.lstrip().startswith(("{", "[")) else text
        except ValueError:
            value = text
        return {"role": "tool", "content": value, **{k: m[k] for k in ("tool_call_id", "name") if k in m}}

    def lark(self, tools, names=None, parallel=True):
        fns = _chosen(tools, names)
        rules = [_start(parallel, _lit(self.separator)), f'call: {" | ".join(f"tool_{i}" for i in range(len(fns)))}']
        return _json_call_rules(rules, fns, "parameters")

    def parser(self, tools=None):
        names = {t["function"]["name"] for t in check_tools(tools)} if tools else None
        return JsonCallParser(lambda body: _parse_llama(body, names))


def _json_call_rules(rules: list[str], fns: list[dict], key: str) -> str:
    """The grammar: rules, then tool_i, a call of fns[i] written as the JSON object {"name": ...,
    key: its arguments under the function's schema}."""
    for i, fn in enumerate(fns):
        params = fn["parameters"]
        body = {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key], "additionalProperties": False, **_hoist_defs(params)}
        rules.append(f"tool_{i}: {_json_rule(body)}")
    return "\n".join(rules) + "\n"


def _start(parallel: bool, separator: str) -> str:
    return f"start: call ({separator} call){{0,{MAX_CALLS - 1}}}" if parallel else "start: call"


def tool_format(tokenizer) -> ToolFormat:
    """The family from the tokenizer's chat template; the vocabulary says which markers are tokens."""
    source = getattr(tokenizer, "chat_template", None) or ""
    if "<function=" in source and TOOL_CALL in source:
        return Qwen3XmlFormat(tokenizer, renders_tools=re.search(r"\btools\b", source) is not None)
    if "tool▁call▁begin" in source:
        return DeepSeekV3Format(tokenizer) if "```json" in source else DeepSeekV31Format(tokenizer)
    if HERMES_TEMPLATE.search(source):
        return HermesFormat(tokenizer, renders_tools=True)
    if PYTHON_TAG in source or (LLAMA3_TEMPLATE.search(source) and "ipython" in source):
        return Llama3JsonFormat(tokenizer)
    return HermesFormat(tokenizer, renders_tools=False)


# -- parsing ----------------------------------------------------------------------------------------

def _args_object(text: str) -> dict | None:
    text = text.strip()
    if not text:
        return {}
    obj = json.loads(text, strict=False)
    return obj if isinstance(obj, dict) else None


def _parse_hermes(body: str):
    obj = json.loads(body.strip(), strict=False)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _args_object(args)
    return (obj["name"], args) if isinstance(args, dict) else None


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


def _parse_llama(body: str, names: set[str] | None):
    """{"name": NAME, "parameters": {...}} ("arguments" taken too) -> (name, arguments); None for
    another object, or one naming no tool given (a call has no marker: an answer that is JSON of
    its own is content)."""
    obj = json.loads(body, strict=False)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
            set(obj) - {"name", "parameters", "arguments", "type"} or \
            not ("parameters" in obj or "arguments" in obj) or (names is not None and obj["name"] not in names):
        return None
    args = obj["parameters"] if "parameters" in obj else obj["arguments"]
    if isinstance(args, str):
        args = _args_object(args)
    return (obj["name"], args) if isinstance(args, dict) else None


SEP, NOT_YET, NOT_A_CALL = "sep", -1, -2


class JsonCallParser(ToolCallParser):
    """A completion's text deltas -> (content, calls) for calls written as bare JSON objects
    (Llama 3): a call is an object that begins a line (the answer's first, or one after a newline),
    after <|python_tag|> where that is written, and is read as one by `parse`; calls follow one
    another "; " or newlines apart. A line that may begin a call is held back until the object
    closes (or its first character after "{" is not a key's quote); an object that is no call, or
    is unfinished at flush(), comes back as content."""

    def __init__(self, parse):
        super().__init__("{", "}", parse)
        self.bol = True      # pending begins a line
        self._reset_scan()

    def _reset_scan(self):
        self.depth, self.in_str, self.esc, self.keyed = 0, False, False, False

    def _step(self, s: str, content: list[str], calls: list[ToolCall]) -> str:
        if self.state == SEP:
            return self._in_sep(s)
        return super()._step(s, content, calls)

    def flush(self) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        s, self.pending = self.pending, ""
        self._say(content, self.raw + s if self.state == CALL else s)
        self.state, self.raw, self.searched, self.bol = TEXT, "", 0, True
        self._reset_scan()
        return "".join(content), []

    # -- states -----------------------------------------------------------------------------------
    def _text(self, s: str, content: list[str]) -> str:
        line = 0 if self.bol else s.find("\n") + 1 or -1
        hold = len(s)
        while 0 <= line:
            at = line
            while at < len(s) and s[at] in " \t":
                at += 1
            rest = s[at:]
            if rest.startswith(PYTHON_TAG):
                at += len(PYTHON_TAG)
            elif PYTHON_TAG.startswith(rest):   # the tag's start, or the line's end: may begin a call
                hold = line
                break
            if at == len(s):
                hold = line
                break
            if s[at] == "{":   # a call, maybe
                head = s[:line].rstrip()
                self._say(content, head)
                self.raw = s[len(head):at]   # the whitespace (and tag) before it: content only if it fails
                self.state, self.searched = CALL, 0
                self._reset_scan()
                return s[at:]
            line = s.find("\n", line) + 1 or -1
        head = s[:hold].rstrip()
        self._say(content, head)
        self.bol = self.bol if not head else False
        self.pending = s[len(head):]
        return ""

    def _in_sep(self, s: str) -> str:
        t = s.lstrip(" \t\r\n;")   # between calls: dropped
        if not t or PYTHON_TAG.startswith(t):
            self.pending = t
            return ""
        body = t[len(PYTHON_TAG):] if t.startswith(PYTHON_TAG) else t
        if not body:
            self.pending = t
            return ""
        if body[0] == "{":
            self.raw = t[:len(t) - len(body)]
            self.state, self.searched = CALL, 0
            self._reset_scan()
            return body
        self.state, self.bol = TEXT, True
        return t

    def _in_call(self, s: str, content: list[str], calls: list[ToolCall]) -> str:
        end = self._scan(s)
        if end == NOT_YET:
            self.pending = s
            return ""
        if end == NOT_A_CALL:   # "{" and no key after it: text
            self._say(content, self.raw + "{")
            self.raw, self.state, self.bol = "", TEXT, False
            return s[1:]
        body, rest = s[:end], s[end:]
        call = self._call(body)
        if call is not None:
            calls.append(call)
            self.raw, self.strip, self.state = "", True, SEP
        else:
            self._say(content, self.raw + body)
            self.raw, self.state, self.bol = "", TEXT, False
        return rest

    def _scan(self, s: str) -> int:
        """Where the object that s begins with ends (the index after its "}"), NOT_YET, or
        NOT_A_CALL when what follows its "{" is no key. Goes on from where the last call left off."""
        for i in range(max(self.searched, 1), len(s)):
            c = s[i]
            if not self.keyed:
                if c in " \t\r\n":
                    continue
                if c != '"':
                    return NOT_A_CALL
                self.keyed, self.depth = True, 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.searched = len(s)
        return NOT_YET
