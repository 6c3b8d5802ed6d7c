"""The Chat API: a request rendered with the model's chat template, generated
in a worker thread, tokens streamed back as they become final, then the
Generation stats. A client that goes away, or a daemon that is stopping,
ends the generation at the next token."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc

from duck_proto import duck_pb2 as pb
from duckd.fleet import State
from duckd.server import ApiError

log = logging.getLogger("duckd.chat")


class Cancelled(Exception):
    pass


def _check_fleet(daemon) -> None:
    if not daemon.ready:
        raise ApiError(grpc.StatusCode.UNAVAILABLE, "duckd is starting: the fleet or the model is not ready yet")
    if daemon.cfg.model.backend != "fleet":
        return
    for d in daemon.fleet.ducks:
        if d.state != State.SERVING:
            why = f": {d.reason}" if d.reason else ""
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           f"duck {d.id} is {d.state.name}{why}; a chat needs every duck SERVING, retry shortly")


def _stats_event(stats, finish: str) -> pb.ChatEvent:
    return pb.ChatEvent(stats=pb.GenerationStats(
        time_s=stats.time, input_len=stats.input_len, output_len=stats.output_len, ttft_s=stats.ttft,
        tpot_s=stats.tpot, prefill_tok_s=stats.prefill_tps, decode_tok_s=stats.decode_tps,
        finish_reason=finish, line=str(stats)))


async def run_chat(daemon, request: pb.ChatRequest):
    from engine.generate import GenerationStats, SamplingParams, generate
    from native.transport import DuckError

    _check_fleet(daemon)
    loaded = daemon.model.loaded
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    try:
        prompt = loaded.tokenizer.encode_chat(messages)
    except Exception as e:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot render the chat template: {e}") from None
    limit = daemon.cfg.model.max_model_len
    max_tokens = request.max_tokens or daemon.cfg.model.max_tokens
    if len(prompt) + 1 > limit:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"the conversation is {len(prompt)} tokens; max_model_len is {limit}")
    max_tokens = min(max_tokens, limit - len(prompt))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=request.temperature, top_k=request.top_k,
                                top_p=request.top_p or 1.0, seed=request.seed or None, stop=tuple(request.stop))
    except ValueError as e:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
    emitted = {"n": 0, "t0": time.perf_counter(), "ttft": 0.0}

    def on_text(text: str) -> None:
        if cancel.is_set() or daemon.stopping.is_set():
            raise Cancelled()
        if not emitted["n"]:
            emitted["ttft"] = time.perf_counter() - emitted["t0"]
        emitted["n"] += 1
        put(("token", text))

    def work() -> None:
        with daemon.model.lock:
            emitted["t0"] = time.perf_counter()
            try:
                result = generate(loaded.model, loaded.tokenizer, prompt, params, on_text=on_text,
                                  max_model_len=len(prompt) + max_tokens)
                put(("done", result))
            except Cancelled:
                put(("cancelled", None))
            except DuckError as e:
                put(("unavailable", str(e)))
            except Exception as e:       # reported to the caller, the daemon goes on
                log.exception("generation failed")
                put(("error", f"{type(e).__name__}: {e}"))

    daemon.active_chats += 1
    worker = loop.run_in_executor(None, work)
    try:
        while True:
            kind, value = await queue.get()
            if kind == "token":
                yield pb.ChatEvent(token=value)
            elif kind == "done":
                daemon.model.last_decode_tps = value.stats.decode_tps
                yield _stats_event(value.stats, value.finish_reason)
                return
            elif kind == "cancelled":
                stats = GenerationStats(len(prompt), emitted["n"], time.perf_counter() - emitted["t0"],
                                        emitted["ttft"])
                log.info("chat cancelled after %d tokens (%s)", emitted["n"],
                         "daemon stopping" if daemon.stopping.is_set() else "client gone")
                yield _stats_event(stats, "cancelled")
                return
            elif kind == "unavailable":
                raise ApiError(grpc.StatusCode.UNAVAILABLE, f"the fleet failed during the chat: {value}")
            else:
                raise ApiError(grpc.StatusCode.INTERNAL, f"generation failed: {value}")
    finally:
        cancel.set()
        daemon.active_chats -= 1
        if not worker.done():
            worker.add_done_callback(lambda f: f.exception())
