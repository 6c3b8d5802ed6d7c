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
# named), anything else a 400 naming the field. A client that asks for JSON, tools or logprobs
# must hear that they are not served here, not get prose it fails to parse later. A field in
# neither table is a 400 naming it too (duckd's extensions top_k and repetition_penalty are in
# HONOURED).
HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
            "stop", "stream", "stream_options", "n", "frequency_penalty", "presence_penalty", "top_k",
            "repetition_penalty", "logprobs", "top_logprobs", "user", "safety_identifier", "prompt_cache_key",
            "chat_template_kwargs"}


def _off(*values):
    return lambda v: v in values


OFF_ONLY = {   # field -> (is this value "nothing asked"?, what is accepted, in words)
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}: JSON and schema-constrained output '
                                                          "are not served yet"),
    "tools": (_off([]), "an empty list: tool calls are not served yet"),
    "functions": (_off([]), "an empty list: function calls are not served yet"),
    "tool_choice": (_off("none", "auto"), '"none" (tool calls are not served yet)'),
    "function_call": (_off("none", "auto"), '"none" (function calls are not served yet)'),
    "parallel_tool_calls": (_off(True, False), "true or false (no tools are served)"),
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
MESSAGE_KEYS = {"role", "content"}
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
                                             f"messages[{i}].{extra[0]}: not served yet (a message is a role and "
                                             "its text content)")
            role = ROLE_ALIASES.get(m["role"], m["role"])
            req.messages.append(ChatMessage(role, _text(m.get("content", ""), f"messages[{i}].content")))
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
    return OpenAIRequest(req, n, stream, bool(options.get("include_usage")))


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
