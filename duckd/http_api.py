"""The OpenAI-compatible HTTP API and /metrics: an adapter at the edge (Starlette
on uvicorn, in the daemon's event loop). It turns OpenAI's JSON into the chat
service's ChatRequest, its events into completions (whole, or streamed as
server-sent events), and duckd.errors into HTTP statuses with OpenAI's error JSON.
Every path but /health needs the daemon's bearer token.

    POST /v1/chat/completions   messages, max_tokens (max_completion_tokens), temperature,
                                top_p, seed, stop, frequency_penalty, presence_penalty,
                                logprobs + top_logprobs, n, stream (+ stream_options.include_usage),
                                chat_template_kwargs (the template's switches: enable_thinking); a
                                reasoning model's <think> text comes as reasoning_content
    POST /v1/completions        prompt, and the same settings
    GET  /v1/models             the served model
    GET  /metrics               Prometheus text format
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import secrets
import socket
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from duckd import errors
from duckd.chat_service import ChatMessage, ChatRequest, DoneEvent

log = logging.getLogger("duckd.http")

STATUS = {errors.InvalidArgument: (400, "invalid_request_error"), errors.NotFound: (404, "invalid_request_error"),
          errors.FailedPrecondition: (409, "invalid_request_error"), errors.Unavailable: (503, "server_error"),
          errors.Busy: (429, "rate_limit_error"), errors.TooLarge: (413, "invalid_request_error")}
PARSE_OFF_LOOP_BYTES = 256 << 10   # a body this large is parsed in a thread: the loop serves the others meanwhile
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}
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


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: Exception) -> JSONResponse:
    status, kind = STATUS.get(type(e), (500, "server_error"))
    if status == 500:
        log.error("internal error: %s: %s", type(e).__name__, e)
    return JSONResponse(error_body(str(e), kind, getattr(e, "field", None)), status_code=status)


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


MAX_CHOICES = 8   # n: choices of one request, each a sequence of the batch


def parse_request(body, chat: bool, served: str) -> tuple[ChatRequest, bool, bool]:
    """(request, stream, include_usage) from an OpenAI request body (its n: choices())."""
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
    return req, stream, bool(options.get("include_usage"))


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with (None: none asked for): chat's
    logprobs (true/false) and top_logprobs (0 .. 20, needs logprobs), completions' logprobs (0 .. 5)."""
    if not chat:
        return _get(body, "logprobs", int, None, lambda v: 0 <= v <= 5, "0 .. 5 (the likeliest tokens listed)")
    wanted = _get(body, "logprobs", bool, False, what="true or false")
    top = _get(body, "top_logprobs", int, None, lambda v: 0 <= v <= 20, "0 .. 20")
    if top is not None and not wanted:
        raise errors.InvalidArgument("top_logprobs", "top_logprobs needs logprobs = true")
    return (top or 0) if wanted else None


def logprobs_json(entries, chat: bool) -> dict | None:
    """OpenAI's logprobs object of chat (content: token, logprob, bytes, top_logprobs) or of
    completions (tokens, token_logprobs, top_logprobs, text_offset) for duckd.chat_service.TokenLogprobs."""
    if entries is None:
        return None
    if chat:
        word = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode())}  # noqa: E731
        return {"content": [word(e.token, e.logprob) | {"top_logprobs": [word(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": offsets}


def choices(body: dict) -> int:
    """n: how many choices (1 .. MAX_CHOICES), each a sequence of its own; they share the prompt's
    cache entries (the first reads the prompt, the others copy it: engine.batch's prefix cache)."""
    return _get(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"1 .. {MAX_CHOICES} choices")


def choice_requests(req: ChatRequest, n: int) -> list[ChatRequest]:
    """The n choices' requests: the same but for the seed, seed + i where one is given."""
    return [req] + [dataclasses.replace(req, seed=None if req.seed is None else req.seed + i) for i in range(1, n)]


# -- responses ------------------------------------------------------------------------------
def _usage(done: list[DoneEvent]) -> dict:
    """Usage of a request's choices: the prompt counted once, the completions summed."""
    out = sum(d.completion_tokens for d in done)
    return {"prompt_tokens": done[0].prompt_tokens, "completion_tokens": out,
            "total_tokens": done[0].prompt_tokens + out,
            "prompt_tokens_details": {"cached_tokens": done[0].stats.cached}}


class _Completion:
    """The shape of one response: chat or plain completion, whole or chunked."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def whole(self, answers: list[tuple[str, DoneEvent, list | None, str]]) -> dict:
        """answers: each choice's (text, DoneEvent, logprobs or None, reasoning)."""
        out = []
        for i, (text, done, logprobs, reasoning) in enumerate(answers):
            finish, lp = FINISH.get(done.finish_reason, "stop"), logprobs_json(logprobs, self.chat)
            message = {"role": "assistant", "content": text} | ({"reasoning_content": reasoning} if reasoning else {})
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish} if self.chat else
                       {"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        return self._envelope("chat.completion" if self.chat else "text_completion", out,
                              _usage([answer[1] for answer in answers]))

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, logprobs=None,
              index: int = 0, reasoning: str = "") -> dict:
        lp = logprobs_json(logprobs, self.chat)
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {}) \
                | ({"reasoning_content": reasoning} if reasoning else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish} | ({"logprobs": lp} if lp else {})
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": index, "text": text or "", "logprobs": lp,
                                                   "finish_reason": finish}])

    def usage_chunk(self, done: list[DoneEvent]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], _usage(done))


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class HttpApi:
    def __init__(self, daemon, token: str, metrics, max_body_bytes: int = 4 << 20):
        self.daemon, self.metrics = daemon, metrics
        self.max_body_bytes = max_body_bytes
        self._expected = f"Bearer {token}".encode()
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    def _authorized(self, request: Request) -> bool:
        return hmac.compare_digest(request.headers.get("authorization", "").encode(), self._expected)

    def _denied(self) -> JSONResponse:
        return JSONResponse(error_body("missing or wrong bearer token (header 'Authorization: Bearer <token>'; "
                                       "the token is duckd's, in its state folder)", "invalid_request_error",
                                       code="invalid_api_key"), status_code=401)

    @property
    def model_name(self) -> str:
        return self.daemon.model.name or "default"

    async def health(self, request: Request) -> Response:
        d = self.daemon
        body = {"ready": d.serving} if d.health.ok else {"ready": False, "stalled": d.health.stalled}
        return JSONResponse(body, status_code=200 if d.serving else 503)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._denied()
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "duck"}]})

    async def metrics_text(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._denied()
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        if not self._authorized(request):
            return self._denied()
        try:
            raw = await self._read_body(request)
            body = await asyncio.to_thread(json.loads, raw) if len(raw) > PARSE_OFF_LOOP_BYTES else json.loads(raw)
        except errors.TooLarge as e:
            return error_response(e)
        except ValueError as e:
            return error_response(errors.InvalidArgument("body", f"the request body is not JSON: {e}"))
        try:
            req, stream, include_usage = parse_request(body, chat, self.model_name)
            streams = [self.daemon.chat.stream(r) for r in choice_requests(req, choices(body))]
        except (errors.ServiceError, RuntimeError) as e:
            return error_response(e)
        # errors before the first token become the response's status
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        failed = next((e for e in firsts if isinstance(e, BaseException)), None)
        if failed is not None:
            for s in streams:
                await s.aclose()
            if isinstance(failed, (errors.ServiceError, RuntimeError)):
                return error_response(failed)
            raise failed
        shape = _Completion(chat, self.model_name)
        if stream:
            return StreamingResponse(self._stream(shape, streams, firsts, include_usage, req.logprobs is not None),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            answers = await asyncio.gather(*(_answer(s, f, req.logprobs is not None) for s, f in zip(streams, firsts)))
        except (errors.ServiceError, RuntimeError) as e:
            return error_response(e)
        finally:
            for s in streams:
                await s.aclose()
        return JSONResponse(shape.whole(answers))

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (TooLarge) past max_body_bytes before more of it is read: at once when its
        Content-Length says so, else as soon as the bytes received pass the bound."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_large = lambda n: errors.TooLarge(  # noqa: E731
            f"the request body is {n} bytes, more than daemon.max_request_mb allows ({limit} bytes)")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(int(declared))
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"more than {size}")
            parts.append(chunk)
        return b"".join(parts) or b"null"

    async def _stream(self, shape: _Completion, streams, firsts, include_usage: bool, logprobs: bool):
        """The choices' events as chunks, in the order they come, each with its choice's index."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, events, event) -> None:
            try:
                while True:
                    await merged.put((i, event))
                    if isinstance(event, DoneEvent):
                        return
                    event = await events.__anext__()
            except Exception as e:  # noqa: BLE001 - handed to the response
                await merged.put((i, e))

        pumps = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
        try:
            if shape.chat:
                for i in range(len(streams)):
                    yield _sse(shape.chunk(None, first=True, index=i))
            done: dict[int, DoneEvent] = {}
            while len(done) < len(streams):
                i, event = await merged.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, DoneEvent):
                    done[i] = event
                    yield _sse(shape.chunk(None, FINISH.get(event.finish_reason, "stop"), index=i))
                else:
                    yield _sse(shape.chunk(event.text, logprobs=event.logprobs if logprobs else None, index=i,
                                           reasoning=event.reasoning))
            if include_usage:
                yield _sse(shape.usage_chunk([done[i] for i in range(len(streams))]))
            yield b"data: [DONE]\n\n"
        except (errors.ServiceError, RuntimeError) as e:     # after the headers: the error as the last event
            status, kind = STATUS.get(type(e), (500, "server_error"))
            yield _sse(error_body(str(e), kind, getattr(e, "field", None)))
        finally:
            for task in pumps:
                task.cancel()
            for s in streams:
                await s.aclose()    # a client that went away cancels its generations


async def _answer(events, event, logprobs: bool) -> tuple[str, DoneEvent, list | None, str]:
    """One choice's whole text, its DoneEvent, (asked for) its logprobs and its reasoning, from its
    first event on."""
    text, entries, reasoning = [], [] if logprobs else None, []
    while not isinstance(event, DoneEvent):
        text.append(event.text)
        reasoning.append(event.reasoning)
        if entries is not None:
            entries += event.logprobs
        event = await events.__anext__()
    return "".join(text), event, entries, "".join(reasoning)


class _Server(uvicorn.Server):
    """uvicorn inside the daemon's loop: the daemon owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The bound HTTP server; start() returns once it listens."""

    def __init__(self, api: HttpApi, listen: str, tls=None):
        """tls: a duckd.tls.ServerCert to serve (None: plaintext HTTP)."""
        host, _, port = listen.rpartition(":")
        # bound here, so that a port in use is an error of ours (uvicorn would exit the process)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host.strip("[]"), int(port)))
        except OSError as e:
            self.sock.close()
            raise OSError(f"cannot bind the HTTP API to {listen}: {e.strerror}") from None
        self.sock.listen(128)
        self.address = "%s:%d" % self.sock.getsockname()[:2]
        self.scheme = "https" if tls else "http"
        ssl_files = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)} if tls else {}
        self.server = _Server(uvicorn.Config(api.app, log_config=None, access_log=False, lifespan="off",
                                             timeout_graceful_shutdown=1, **ssl_files))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="http-api")
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError("the HTTP server stopped before it listened")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API listening on %s://%s/v1", self.scheme, self.address)

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
