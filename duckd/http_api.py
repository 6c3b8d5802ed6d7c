"""The OpenAI-compatible HTTP API and /metrics: an adapter at the edge (Starlette
on uvicorn, in the daemon's event loop). It turns OpenAI's JSON into the chat
service's ChatRequest (duckd.openai_request), its events into completions (whole, or streamed as
server-sent events), and duckd.errors into HTTP statuses with OpenAI's error JSON.
Every path but /health needs the daemon's bearer token.

    POST /v1/chat/completions   messages, max_tokens (max_completion_tokens), temperature,
                                top_p, seed, stop, frequency_penalty, presence_penalty,
                                logprobs + top_logprobs, n, stream (+ stream_options.include_usage),
                                chat_template_kwargs (the template's switches: enable_thinking); a
                                reasoning model's <think> text comes as reasoning_content;
                                response_format (json_object, json_schema, and duckd's regex and
                                grammar); tools, tool_choice, parallel_tool_calls (message.tool_calls,
                                delta.tool_calls; role tool messages fed back)
    POST /v1/completions        prompt, and the same settings
    GET  /v1/models             the served model
    GET  /metrics               Prometheus text format
"""
from __future__ import annotations

import asyncio
import contextlib
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
from duckd.chat_service import DoneEvent
from duckd.openai_request import choice_requests, parse_request

log = logging.getLogger("duckd.http")

STATUS = {errors.InvalidArgument: (400, "invalid_request_error"), errors.NotFound: (404, "invalid_request_error"),
          errors.FailedPrecondition: (409, "invalid_request_error"), errors.Unavailable: (503, "server_error"),
          errors.Busy: (429, "rate_limit_error"), errors.TooLarge: (413, "invalid_request_error")}
PARSE_OFF_LOOP_BYTES = 256 << 10   # a body this large is parsed in a thread: the loop serves the others meanwhile
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}
def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: Exception) -> JSONResponse:
    status, kind = STATUS.get(type(e), (500, "server_error"))
    if status == 500:
        log.error("internal error: %s: %s", type(e).__name__, e)
    return JSONResponse(error_body(str(e), kind, getattr(e, "field", None)), status_code=status)


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

    def whole(self, answers: list[tuple[str, DoneEvent, list | None, str, list]]) -> dict:
        """answers: each choice's (text, DoneEvent, logprobs or None, reasoning, tool calls)."""
        out = []
        for i, (text, done, logprobs, reasoning, calls) in enumerate(answers):
            finish, lp = _finish(done, bool(calls)), logprobs_json(logprobs, self.chat)
            message = {"role": "assistant", "content": text if text.strip() or not calls else None} \
                | ({"reasoning_content": reasoning} if reasoning else {}) \
                | ({"tool_calls": [tool_call_json(c) for c in calls]} if calls else {})
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish} if self.chat else
                       {"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        return self._envelope("chat.completion" if self.chat else "text_completion", out,
                              _usage([answer[1] for answer in answers]))

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, logprobs=None,
              index: int = 0, reasoning: str = "", calls=(), calls_before: int = 0) -> dict:
        """calls: tool calls completed here, whole (name and all the arguments in one delta), numbered
        from calls_before."""
        lp = logprobs_json(logprobs, self.chat)
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {}) \
                | ({"reasoning_content": reasoning} if reasoning else {}) \
                | ({"tool_calls": [{"index": calls_before + k} | tool_call_json(c) for k, c in enumerate(calls)]}
                   if calls else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish} | ({"logprobs": lp} if lp else {})
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": index, "text": text or "", "logprobs": lp,
                                                   "finish_reason": finish}])

    def usage_chunk(self, done: list[DoneEvent]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], _usage(done))


def tool_call_json(call) -> dict:
    """A duckd.tool_calls.ToolCall as OpenAI's tool_calls entry."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish(done: DoneEvent, called: bool) -> str:
    """OpenAI's finish_reason: tool_calls where the model ended after calling tools."""
    if called and done.finish_reason in ("eos", "stop"):
        return "tool_calls"
    return FINISH.get(done.finish_reason, "stop")


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
            asked = parse_request(body, chat, self.model_name)
            req = asked.request
            streams = [self.daemon.chat.stream(r) for r in choice_requests(req, asked.n)]
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
        if asked.stream:
            return StreamingResponse(self._stream(shape, streams, firsts, asked.include_usage,
                                                  req.logprobs is not None),
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
            called = [0] * len(streams)     # tool calls sent, per choice
            while len(done) < len(streams):
                i, event = await merged.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, DoneEvent):
                    done[i] = event
                    yield _sse(shape.chunk(None, _finish(event, called[i] > 0), index=i))
                else:
                    yield _sse(shape.chunk(event.text, logprobs=event.logprobs if logprobs else None, index=i,
                                           reasoning=event.reasoning, calls=event.tool_calls,
                                           calls_before=called[i]))
                    called[i] += len(event.tool_calls)
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


async def _answer(events, event, logprobs: bool) -> tuple[str, DoneEvent, list | None, str, list]:
    """One choice's whole text, its DoneEvent, (asked for) its logprobs, its reasoning and its tool
    calls, from its first event on."""
    text, entries, reasoning, calls = [], [] if logprobs else None, [], []
    while not isinstance(event, DoneEvent):
        text.append(event.text)
        reasoning.append(event.reasoning)
        calls += event.tool_calls
        if entries is not None:
            entries += event.logprobs
        event = await events.__anext__()
    return "".join(text), event, entries, "".join(reasoning), calls


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
