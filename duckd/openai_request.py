"""What an OpenAI chat or completions request body asks duckd for (duckd.http_api's requests):
the chat service's ChatRequest, with the choices, streaming and usage options beside it. Every
field of the OpenAI requests is either read here (HONOURED) or accepted only where it asks for
nothing (OFF_ONLY); anything else is an InvalidArgument naming the field, never silently ignored."""
from __future__ import annotations

import dataclasses
import json

from duckd import errors
from duckd.chat_service import ChatMessage, ChatRequest

# the sampling settings not given take the daemon's defaults (duckd.chat_service.ChatRequest)

# Every field of OpenAI's chat and completions requests, and what duckd does with it: HONOURED
# (read by parse_request; "user", "safety_identifier" and "prompt_cache_key" are the caller's tags,
# with no effect on the output at OpenAI either),
# or OFF_ONLY: accepted only at the value that asks for nothing (absent, null, or the value
# named), anything else a 400 naming the field. A client that asks for something not served
# must hear so, not get prose it fails to parse later. A field in
# neither table is a 400 naming it too (duckd's extensions top_k and repetition_penalty are in
# HONOURED).
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
            "stop", "stream", "stream_options", "n", "frequency_penalty", "presence_penalty", "top_k",
            "repetition_penalty", "logprobs", "top_logprobs", "user", "safety_identifier", "prompt_cache_key",
            "chat_template_kwargs", "response_format", "tools", "tool_choice", "parallel_tool_calls"}


def _off(*values):
    return lambda v: v in values


OFF_ONLY = {   # field -> (is this value "nothing asked"?, what is accepted, in words)
    "functions": (_off([]), "an empty list: the legacy functions field is not served; send tools"),
    "function_call": (_off("none", "auto"), '"none" or "auto": the legacy function_call is not served; send '
                                            "tool_choice"),
    "logit_bias": (_off({}), "{}: logit_bias is not supported"),
    "modalities": (_off(["text"]), '["text"]: duckd answers in text'),
    "audio": (_off(), "null: duckd answers in text"),
    "prediction": (_off(), "null: predicted outputs are not supported"),
    "reasoning_effort": (_off(), "null: reasoning effort is not supported"),
    "web_search_options": (_off(), "null: duckd does not search the web"),
    "verbosity": (_off(), "null: verbosity is not supported"),
    "moderation": (_off(), "null: duckd does not moderate"),
    "prompt_cache_retention": (_off(), "null: the prefix cache is the daemon's (model.prefix_cache), not a request's"),
    "prompt_cache_options": (_off(), "null: the prefix cache is the daemon's (model.prefix_cache), not a request's"),
    "store": (_off(False), "false: duckd stores no completions"),
    "metadata": (_off({}), "{}: duckd stores no completions to tag"),
    "service_tier": (_off("auto", "default"), '"auto" or "default": duckd has one tier'),
    "echo": (_off(False), "false: the prompt is not echoed"),
    "best_of": (_off(1), "1: one completion per request"),
    "suffix": (_off(""), "null: insertion is not supported"),
}
MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}
# response_format: OpenAI's text, json_object and json_schema, and duckd's extensions regex
# ({"type": "regex", "regex": "..."}) and grammar ({"type": "grammar", "grammar": "<Lark>"}, in
# llguidance's Lark dialect): engine.grammar's kinds
FORMATS = {"json_object": "json_object", "json_schema": "json_schema", "regex": "regex", "grammar": "lark"}
ROLE_ALIASES = {"developer": "system"}    # OpenAI's newer name for the system message


def check_fields(body: dict) -> None:
    """InvalidArgument naming the first field that duckd would otherwise ignore (see OFF_ONLY)."""
    for name, value in body.items():
        if name in HONOURED:
            continue
        if name not in OFF_ONLY:
            raise errors.InvalidArgument(name, f"{name}: not a request field duckd knows; it is refused rather "
                                               "than ignored")
        nothing, accepted = OFF_ONLY[name]
        if value is not None and not nothing(value):
            raise errors.InvalidArgument(name, f"{name} = {json.dumps(value)[:80]}: accepted only as {accepted}")


# -- request parsing ----------------------------------------------------------------------
def _get(body: dict, name: str, kinds, default=None, check=None, what: str = ""):
    """body[name] if present and of the given JSON types (and check(value)), else InvalidArgument naming it."""
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise errors.InvalidArgument(name, f"{name} = {value!r}: expected {what or kinds}")
    if not isinstance(value, kinds) or (check is not None and not check(value)):
        raise errors.InvalidArgument(name, f"{name} = {value!r}: expected {what}")
    return value


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise errors.InvalidArgument(where, f"{where}: expected a string or a list of text parts")


MAX_CHOICES = 8   # n: choices of one request, each a sequence of the batch; they share the prompt's
                  # cache entries (the first reads the prompt, the others copy it: engine.prefix_cache)


@dataclasses.dataclass(slots=True, frozen=True)
class OpenAIRequest:
    request: ChatRequest
    n: int                   # choices, each a sequence of the batch (choice_requests)
    stream: bool
    include_usage: bool


def parse_request(body, chat: bool, served: str) -> OpenAIRequest:
    """What an OpenAI request body asks for."""
    if not isinstance(body, dict):
        raise errors.InvalidArgument("body", "the request body must be a JSON object")
    check_fields(body)
    model = _get(body, "model", str, what="a model name")
    if model is not None and model not in (served, "default"):
        raise errors.NotFound(f"model {model!r} is not served here (serving {served!r}); see /v1/models")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise errors.InvalidArgument("stop", "stop: expected a string or a list of at most 4 strings")
    max_tokens = _get(body, "max_completion_tokens", int, None, lambda v: v > 0, "a positive count")
    max_tokens = _get(body, "max_tokens", int, max_tokens, lambda v: v > 0, "a positive count")
    req = ChatRequest(max_tokens=max_tokens,
                      temperature=_get(body, "temperature", (int, float), None, lambda v: 0 <= v <= 2, "0 .. 2"),
                      top_p=_get(body, "top_p", (int, float), None, lambda v: 0 < v <= 1, "0 < top_p <= 1"),
                      seed=_get(body, "seed", int, None, lambda v: v >= 0, "a non-negative integer"), stop=stop,
                      top_k=_get(body, "top_k", int, None, lambda v: v >= 0, "a count >= 0 (0: off)"),
                      repetition_penalty=_get(body, "repetition_penalty", (int, float), None,
                                              lambda v: 0 < v <= 10, "0 < value <= 10 (1: off)"),
                      frequency_penalty=_get(body, "frequency_penalty", (int, float), 0, lambda v: -2 <= v <= 2,
                                             "-2 .. 2"),
                      presence_penalty=_get(body, "presence_penalty", (int, float), 0, lambda v: -2 <= v <= 2,
                                            "-2 .. 2"),
                      logprobs=_logprobs(body, chat))
    if chat:
        req.template_kwargs = _get(body, "chat_template_kwargs", dict, {}, what="an object of the template's "
                                   "switches, e.g. {\"enable_thinking\": false}")
        req.split_reasoning = True
        messages = _get(body, "messages", list, None, lambda v: len(v) > 0, "a non-empty list of messages")
        if messages is None:
            raise errors.InvalidArgument("messages", "messages is required")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise errors.InvalidArgument(f"messages[{i}]", f"messages[{i}]: expected an object with a role")
            extra = sorted(k for k, v in m.items() if k not in MESSAGE_KEYS and v not in (None, [], ""))
            if extra:
                raise errors.InvalidArgument(f"messages[{i}].{extra[0]}",
                                             f"messages[{i}].{extra[0]}: not served (a message is a role, its text "
                                             "content, an assistant's tool_calls or a tool's tool_call_id)")
            role = ROLE_ALIASES.get(m["role"], m["role"])
            req.messages.append(ChatMessage(role, _text(m.get("content") or "", f"messages[{i}].content"),
                                            message_calls(m, i), _get(m, "tool_call_id", str, "", what="a string")))
    elif body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise errors.InvalidArgument("tools", "tools: tool calls are a chat's (/v1/chat/completions)")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise errors.InvalidArgument("prompt", "prompt: expected one string")
        req.prompt = prompt
    stream = _get(body, "stream", bool, False, what="true or false")
    options = _get(body, "stream_options", dict, {}, what="an object")
    for key in options:
        if key != "include_usage":
            raise errors.InvalidArgument(f"stream_options.{key}", f"stream_options.{key}: not served (only "
                                                                  "include_usage)")
    n = _get(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"1 .. {MAX_CHOICES} choices")
    read_output_shape(body, req, chat)
    return OpenAIRequest(req, n, stream, bool(options.get("include_usage")))


def read_output_shape(body: dict, req: ChatRequest, chat: bool = True) -> None:
    """response_format, and for a chat tools, tool_choice and parallel_tool_calls, onto req (the
    gRPC adapter reads its JSON fields with it too, so both APIs take and refuse the same)."""
    if chat:
        _tools(body, req)
    req.grammar = _response_format(body)
    if req.grammar is not None and req.forced_tools is not None:
        raise errors.InvalidArgument("response_format", "response_format and a forced tool call (tool_choice "
                                     "required or a function) each set the output's grammar: send one")


def _response_format(body: dict) -> tuple[str, str] | None:
    """response_format as (engine.grammar kind, its text); None: plain text."""
    fmt = _get(body, "response_format", dict, None, what='an object such as {"type": "json_object"}')
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind not in FORMATS:
        raise errors.InvalidArgument("response_format.type", f"response_format.type = {kind!r}: expected text, "
                                     "json_object, json_schema, or duckd's regex or grammar")
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = _get(fmt, "json_schema", dict, None, what="an object with name and schema")
        if spec is None:
            raise errors.InvalidArgument("response_format.json_schema", "response_format.json_schema is required "
                                         "for type json_schema")
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if unknown:
            raise errors.InvalidArgument(f"response_format.json_schema.{unknown[0]}",
                                         f"response_format.json_schema.{unknown[0]}: not a field of json_schema")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise errors.InvalidArgument("response_format.json_schema.schema",
                                         "response_format.json_schema.schema: expected a JSON schema object")
        if _get(spec, "strict", bool, False, what="true or false"):   # the output follows the schema either way;
            from duckd.tool_calls import closed_schema                 # strict: no property it does not name
            schema = closed_schema(schema)
        return "json_schema", json.dumps(schema)
    text = fmt.get(kind)
    if not isinstance(text, str) or not text:
        raise errors.InvalidArgument(f"response_format.{kind}", f"response_format.{kind}: expected the "
                                     f"{'regular expression' if kind == 'regex' else 'Lark grammar'} as a string")
    return FORMATS[kind], text


def message_calls(m: dict, i: int) -> tuple[tuple[str, str, str], ...]:
    """An OpenAI message's tool_calls as (id, name, arguments JSON text): chat_calls of its calls."""
    calls = m.get("tool_calls") or []
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise errors.InvalidArgument(where, f"{where}: expected a list, on an assistant message")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", "{}"), str):
            raise errors.InvalidArgument(f"{where}[{k}]", f"{where}[{k}]: expected {{\"id\", \"type\": "
                                         "\"function\", \"function\": {\"name\", \"arguments\": a JSON string}}")
        out.append((call.get("id"), fn["name"], fn.get("arguments", "{}")))
    return chat_calls(m.get("role"), out, i)


def chat_calls(role: str | None, calls, i: int) -> tuple[tuple[str, str, str], ...]:
    """Message i's tool calls, (id, name, arguments JSON text) each, as the chat service's: only an
    assistant's; a call without an id gets call_{i}_{k}. Both APIs' messages come through here."""
    where = f"messages[{i}].tool_calls"
    if calls and role != "assistant":
        raise errors.InvalidArgument(where, f"{where}: expected a list, on an assistant message")
    return tuple((str(id_ or f"call_{i}_{k}"), name, arguments) for k, (id_, name, arguments) in enumerate(calls))


def _tools(body: dict, req: ChatRequest) -> None:
    """tools, tool_choice and parallel_tool_calls onto req."""
    from duckd.tool_calls import ToolFormatError, check_tools
    tools = body.get("tools") or []
    try:
        req.tools = check_tools(tools) if tools else []
    except ToolFormatError as e:
        raise errors.InvalidArgument(str(e).split(":", 1)[0], str(e)) from None
    choice = body.get("tool_choice")
    req.parallel_tool_calls = _get(body, "parallel_tool_calls", bool, True, what="true or false")
    names = [t["function"]["name"] for t in req.tools]
    if choice is None:
        req.tool_choice = "auto" if req.tools else "none"
    elif choice in ("none", "auto", "required"):
        req.tool_choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        req.tool_choice, req.tool_name = "function", choice["function"]["name"]
        if req.tool_name not in names:
            raise errors.InvalidArgument("tool_choice", f"tool_choice names {req.tool_name!r}, which is not "
                                         f"among the tools ({', '.join(names) or 'none given'})")
    else:
        raise errors.InvalidArgument("tool_choice", f"tool_choice = {json.dumps(choice)[:80]}: expected none, "
                                     'auto, required or {"type": "function", "function": {"name": ...}}')
    if req.tool_choice in ("auto", "required") and not req.tools:
        raise errors.InvalidArgument("tool_choice", f"tool_choice = {req.tool_choice!r} needs tools")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with (None: none asked for): chat's
    logprobs (true/false) and top_logprobs (0 .. 20, needs logprobs), completions' logprobs (0 .. 5)."""
    from engine.tokens import MAX_LOGPROBS
    if not chat:
        return _get(body, "logprobs", int, None, lambda v: 0 <= v <= 5, "0 .. 5 (the likeliest tokens listed)")
    wanted = _get(body, "logprobs", bool, False, what="true or false")
    top = _get(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, f"0 .. {MAX_LOGPROBS}")
    if top is not None and not wanted:
        raise errors.InvalidArgument("top_logprobs", "top_logprobs needs logprobs = true")
    return (top or 0) if wanted else None


def choice_requests(req: ChatRequest, n: int) -> list[ChatRequest]:
    """The n choices' requests: the same but for the seed, seed + i where one is given."""
    return [req] + [dataclasses.replace(req, seed=None if req.seed is None else req.seed + i) for i in range(1, n)]
