"""The llama3-json family (Llama 3.1, 3.2, 3.3: Meta's JSON tool calling): {"name": NAME,
"parameters": ARGS} as the answer, after <|python_tag|> where the model writes it, with no marker
around it; JsonCallParser reads such calls where they begin a line."""
from __future__ import annotations

import json
import logging
import re

from duckd.tool_calls.format import ToolFormat, content_text, history_calls
from duckd.tool_calls.grammar import chosen_functions, json_call_rules, lit, start_rule
from duckd.tool_calls.parser import CALL, TEXT, ToolCall, ToolCallParser, args_object
from duckd.tool_calls.tools import check_tools

log = logging.getLogger(__name__)

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
                calls = history_calls(m["tool_calls"], f"messages[{i - 1}].tool_calls")
                if content_text(m.get("content")).strip():
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
                for call, answer in zip(calls, answers):
                    out.append(self._assistant(m, [call]))
                    out.extend(self._result(r) for r in answer)
            elif role == "tool":
                out.append(self._result(m))
            elif role == "assistant" and "tool_calls" in m:   # an empty list or null: the template reads the key
                out.append({k: v for k, v in m.items() if k != "tool_calls"})
            else:
                out.append(m)
        return out

    def _assistant(self, m, calls):
        # one call a message (template_messages), its arguments a dict (the templates tojson them)
        return {**m, "content": "",
                "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a, _ in calls]}

    @staticmethod
    def _result(m: dict) -> dict:
        # The templates tojson a result that is "iterable", a string included: a result that is
        # JSON text goes as its value (written back as JSON, not as a quoted string)
        text = content_text(m.get("content"))
        try:
            value = json.loads(text) if text.lstrip().startswith(("{", "[")) else text
        except ValueError:
            value = text
        return {"role": "tool", "content": value, **{k: m[k] for k in ("tool_call_id", "name") if k in m}}

    def lark(self, tools, names=None, parallel=True):
        fns = chosen_functions(tools, names)
        rules = [start_rule(parallel, lit(self.separator)), f'call: {" | ".join(f"tool_{i}" for i in range(len(fns)))}']
        return json_call_rules(rules, fns, "parameters")

    def parser(self, tools=None):
        names = {t["function"]["name"] for t in check_tools(tools)} if tools else None
        return JsonCallParser(lambda body: _parse_llama(body, names))


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
        args = args_object(args)
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
