"""duckd's gRPC server: the servicers of proto/duck.proto, bearer-token auth
for everything but the standard health service, and server start/stop.

The servicers only translate: protobuf to the services' dataclasses and back,
duckd.errors to gRPC status codes. The work is the daemon's and its services'
(duckd.daemon.Daemon, duckd.chat_service.ChatService, duckd.cache.CacheService).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from duckd import errors
from duckd.chat_service import ChatMessage, ChatRequest, DoneEvent
from duckd.openai_request import chat_calls, read_output_shape

log = logging.getLogger("duckd.server")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
WATCH_MIN_INTERVAL_S = 0.05


STATUS = {errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, errors.NotFound: grpc.StatusCode.NOT_FOUND,
          errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
          errors.Unavailable: grpc.StatusCode.UNAVAILABLE, errors.Busy: grpc.StatusCode.RESOURCE_EXHAUSTED}


class Core(Protocol):
    chat: object     # duckd.chat_service.ChatService
    cache: object    # duckd.cache.CacheService

    def snapshot(self) -> pb.FleetSnapshot: ...
    def events_since(self, cursor: int) -> tuple[list[pb.FleetEvent], int]: ...
    async def restart_duck(self, duck_id: int) -> pb.DuckStatus: ...
    def model_info(self) -> pb.ModelInfo: ...
    async def place(self, budget: str, by_routing: bool) -> pb.ModelInfo: ...


class TokenAuth(grpc.aio.ServerInterceptor):
    """Requires "authorization: Bearer <token>" on every call but health checks."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"
        self.refused = 0

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if hmac.compare_digest(metadata.get("authorization", "").encode(), self._expected.encode()):
            return _checked(await continuation(details), details.method)
        handler = await continuation(details)
        self.refused += 1
        n = self.refused
        if n <= 10 or n & (n - 1) == 0:   # a flood of bad calls must not become a flood of log lines
            log.warning("refused %s: missing or wrong bearer token (%d so far)", details.method, n)
        return _denied(handler, "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")


def _denied(handler, message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return None
    kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler, "unary_stream": grpc.unary_stream_rpc_method_handler}
    if handler.response_streaming:
        return kinds["unary_stream"](stream, request_deserializer=handler.request_deserializer,
                                     response_serializer=handler.response_serializer)
    return kinds["unary_unary"](unary, request_deserializer=handler.request_deserializer,
                                response_serializer=handler.response_serializer)


class _Malformed:
    """What a request that does not parse deserializes to: the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception):
        self.error = error


def _checked(handler, method: str):
    """handler with a deserializer that cannot fail: a malformed request is INVALID_ARGUMENT
    naming the method (gRPC itself would answer UNKNOWN or INTERNAL)."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:    # a protobuf DecodeError, whatever its type in this build
            return _Malformed(e)

    def refuse(request, context):
        return context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{method}: the request is not a valid protobuf message ({request.error})")

    if handler.response_streaming:
        inner = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Malformed):
                await refuse(request, context)
            async for item in inner(request, context):
                yield item
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=deserialize,
                                                    response_serializer=handler.response_serializer)
    inner = handler.unary_unary

    async def unary(request, context):
        if isinstance(request, _Malformed):
            await refuse(request, context)
        return await inner(request, context)
    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserialize,
                                               response_serializer=handler.response_serializer)


async def _abort(context, e: Exception):
    """A service error as its status code; anything else is INTERNAL (and logged)."""
    code = STATUS.get(type(e))
    if code is None:
        log.error("internal error: %s: %s", type(e).__name__, e)
        code = grpc.StatusCode.INTERNAL
    await context.abort(code, str(e))


class FleetServicer(rpc.FleetServicer):
    def __init__(self, core: Core, interval_s: float):
        self.core, self.interval_s = core, interval_s

    async def List(self, request, context):
        return pb.ListDucksResponse(ducks=self.core.snapshot().ducks)

    async def Watch(self, request, context):
        if request.interval_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"interval_s = {request.interval_s}: must be >= 0")
        # at least WATCH_MIN_INTERVAL_S: a watcher asking for less must not slow the chats down
        interval = max(WATCH_MIN_INTERVAL_S, min(request.interval_s or self.interval_s, self.interval_s))
        cursor = 0 if request.with_history else self.core.events_since(1 << 62)[1]
        while True:
            snap = self.core.snapshot()
            events, cursor = self.core.events_since(cursor)
            snap.events.extend(events)
            yield snap
            await asyncio.sleep(interval)

    async def Restart(self, request, context):
        try:
            return pb.RestartDuckResponse(duck=await self.core.restart_duck(request.id))
        except errors.ServiceError as e:
            await _abort(context, e)


class CacheServicer(rpc.CacheServicer):
    def __init__(self, core: Core):
        self.core = core

    async def List(self, request, context):
        try:
            listing = self.core.cache.list(None if request.all_ducks else request.duck_id)
        except errors.ServiceError as e:
            await _abort(context, e)
        return pb.CacheListResponse(
            entries=[pb.CacheEntry(digest=e.digest, name=e.name, bytes=e.bytes, ducks=e.ducks, model=e.model)
                     for e in listing.entries], host_cache_bytes=listing.host_cache_bytes)

    async def Invalidate(self, request, context):
        target = request.WhichOneof("target")
        if target is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "invalidate needs a target: duck_id, model or all")
        cache = self.core.cache
        try:
            done = await (cache.invalidate_duck(request.duck_id) if target == "duck_id" else
                          cache.invalidate_model(request.model) if target == "model" else cache.invalidate_all())
        except errors.ServiceError as e:
            await _abort(context, e)
        return pb.InvalidateResponse(entries_removed=done.entries_removed, message=done.message)


class ChatServicer(rpc.ChatServicer):
    def __init__(self, core: Core):
        self.core = core

    async def Chat(self, request, context):
        try:
            called = False        # tool calls sent: the finish reason is then "tool_calls"
            async for event in self.core.chat.stream(chat_request(request)):
                if isinstance(event, DoneEvent):
                    yield pb.ChatEvent(stats=stats_message(event, called))
                    continue
                if event.text or not (event.tool_calls or event.logprobs):
                    yield pb.ChatEvent(token=event.text)
                if event.logprobs:
                    yield pb.ChatEvent(logprobs=pb.TokenLogprobs(entries=[
                        pb.TokenLogprob(token=e.token, logprob=e.logprob,
                                        top=[pb.TokenAlternative(token=t, logprob=lp) for t, lp in e.top])
                        for e in event.logprobs]))
                for call in event.tool_calls:     # each whole, after the text that came with it
                    yield pb.ChatEvent(tool_call=pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments))
                    called = True
        except errors.ServiceError as e:
            await _abort(context, e)
        except RuntimeError as e:
            await _abort(context, e)


def chat_request(r: pb.ChatRequest) -> ChatRequest:
    """The protobuf request as the chat service's: sampling settings by presence, max_tokens
    and seed 0 mean "not set". response_format and tools are OpenAI's JSON, read by the OpenAI
    API's own parsers (duckd.openai_request), so both APIs take and refuse the same."""
    has = r.HasField
    messages = [ChatMessage(m.role, m.content, chat_calls(m.role, [(c.id, c.name, c.arguments or "{}")
                                                                   for c in m.tool_calls], i), m.tool_call_id)
                for i, m in enumerate(r.messages)]
    req = ChatRequest(messages=messages, max_tokens=r.max_tokens or None,
                      temperature=r.temperature if has("temperature") else None,
                      top_p=r.top_p if has("top_p") else None, top_k=r.top_k if has("top_k") else None,
                      seed=r.seed or None, stop=tuple(r.stop),
                      repetition_penalty=r.repetition_penalty if has("repetition_penalty") else None,
                      logprobs=r.logprobs if has("logprobs") else None)
    body = {"response_format": _json_field(r, "response_format"), "tools": _json_field(r, "tools")}
    if r.tool_choice:
        body["tool_choice"] = r.tool_choice if r.tool_choice in ("none", "auto", "required") else \
            {"type": "function", "function": {"name": r.tool_choice}}
    if has("parallel_tool_calls"):
        body["parallel_tool_calls"] = r.parallel_tool_calls
    read_output_shape(body, req)
    return req


def _json_field(r: pb.ChatRequest, name: str):
    """A field that carries OpenAI's JSON as text: its value (None when empty), else InvalidArgument."""
    text = getattr(r, name)
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise errors.InvalidArgument(name, f"{name}: not JSON text ({e})") from None


def stats_message(done: DoneEvent, called: bool = False) -> pb.GenerationStats:
    """called: tool calls were sent, so a generation that ended by itself (eos, a stop string)
    finishes with "tool_calls", as the OpenAI API's does."""
    s = done.stats
    accepted, verified = s.mtp or (0, 0)
    finish = "tool_calls" if called and done.finish_reason in ("eos", "stop") else done.finish_reason
    return pb.GenerationStats(time_s=s.time, input_len=s.input_len, output_len=s.output_len, ttft_s=s.ttft,
                              tpot_s=s.tpot, prefill_tok_s=s.prefill_tps, decode_tok_s=s.decode_tps,
                              finish_reason=finish, line=str(s), mtp_accepted=accepted,
                              mtp_verified=verified, cached_tokens=s.cached)


class ModelServicer(rpc.ModelServicer):
    def __init__(self, core: Core):
        self.core = core

    async def Info(self, request, context):
        try:
            return self.core.model_info()
        except errors.ServiceError as e:
            await _abort(context, e)

    async def Place(self, request, context):
        try:
            return await self.core.place(request.budget, request.by_routing)
        except errors.ServiceError as e:
            await _abort(context, e)


class ApiServer:
    """The bound server; health says SERVING only while the core is ready."""

    def __init__(self, core: Core, listen: str, token: str, watch_interval_s: float = 1.0,
                 max_message_bytes: int = 4 << 20, tls=None):
        """tls: a duckd.tls.ServerCert to serve (None: plaintext)."""
        # no SO_REUSEPORT: a second daemon on this port is refused, not served beside this one
        self.server = grpc.aio.server(interceptors=[TokenAuth(token)],
                                      options=[("grpc.so_reuseport", 0),
                                               ("grpc.max_receive_message_length", max_message_bytes)])
        rpc.add_FleetServicer_to_server(FleetServicer(core, watch_interval_s), self.server)
        rpc.add_CacheServicer_to_server(CacheServicer(core), self.server)
        rpc.add_ChatServicer_to_server(ChatServicer(core), self.server)
        rpc.add_ModelServicer_to_server(ModelServicer(core), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.tls = tls
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(listen)
            else:
                self.port = self.server.add_secure_port(
                    listen, grpc.ssl_server_credentials([(tls.key_pem, tls.chain_pem)]))
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC API to {listen}: the address is in use (another duckd?) or not "
                          "this host's; set daemon.listen")
        self.address = f"{listen.rpartition(':')[0]}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(False)
        log.info("gRPC API listening on %s (%s)", self.address, "TLS" if self.tls else "plaintext")

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set("duck.v1.Chat", status)

    async def stop(self, grace_s: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
