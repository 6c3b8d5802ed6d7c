"""The chat service: a plain service that takes a ChatRequest (a chat rendered with
the model's template, or a raw prompt) and yields TokenEvents as text becomes final,
then one DoneEvent with the generation's stats. Errors are duckd.errors; the gRPC
(duckd.server) and OpenAI HTTP (duckd.http_api) adapters translate both ways.

Requests wait in a bounded queue on the event loop (one generation at a time
today, in a thread of the service's own, so waiting requests hold no thread); a
full queue is Busy. A waiting request whose caller goes away leaves the queue at
once; one whose turn comes while the fleet cannot serve fails then (Unavailable);
a running one ends at its next token when its caller goes away or the daemon
stops, held-back text (a stop string's prefix) or not."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from duckd.errors import Busy, InvalidArgument, Unavailable
from duckd.fleet import State

log = logging.getLogger("duckd.chat")

ROLES = ("system", "user", "assistant")


@dataclass(slots=True, frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(slots=True)
class ChatRequest:
    """messages (a chat) or prompt (a plain completion). Sampling settings None take the
    defaults: the daemon's [model] config, else the checkpoint's generation_config.json,
    else greedy."""
    messages: list[ChatMessage] = field(default_factory=list)
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None   # 0: greedy
    top_p: float | None = None
    top_k: int | None = None           # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float | None = None   # 1: off


@dataclass(slots=True, frozen=True)
class TokenEvent:
    text: str


@dataclass(slots=True, frozen=True)
class DoneEvent:
    stats: object            # engine.generate.GenerationStats
    finish_reason: str       # eos, stop, length, cancelled

    @property
    def prompt_tokens(self) -> int:
        return self.stats.input_len

    @property
    def completion_tokens(self) -> int:
        return self.stats.output_len


class Cancelled(Exception):
    """Raised inside a generation to stop it (caller gone, daemon stopping)."""


@dataclass(slots=True)
class ActiveRequest:
    """A request the service holds now (what the console's requests panel shows)."""
    id: int
    prompt_tokens: int
    arrived: float                 # time.monotonic()
    state: str = "queued"          # queued, running
    generated: int = 0
    first_token: float = 0.0

    def tok_s(self, now: float) -> float:
        dt = now - self.first_token
        return (self.generated - 1) / dt if self.generated > 1 and dt > 0 else 0.0


def validate(r: ChatRequest) -> None:
    """Raises InvalidArgument naming the first field that is wrong."""
    if r.prompt is None:
        if not r.messages:
            raise InvalidArgument("messages", "messages is empty: send at least one user message")
        for i, m in enumerate(r.messages):
            if m.role not in ROLES:
                raise InvalidArgument(f"messages[{i}].role",
                                      f"messages[{i}].role = {m.role!r}: expected system, user or assistant")
        if r.messages[-1].role != "user":
            raise InvalidArgument(f"messages[{len(r.messages) - 1}].role",
                                  f"messages[{len(r.messages) - 1}].role = {r.messages[-1].role!r}: "
                                  "the last message must be the user's")
    elif not r.prompt:
        raise InvalidArgument("prompt", "prompt is empty")
    if r.max_tokens is not None and r.max_tokens <= 0:
        raise InvalidArgument("max_tokens", f"max_tokens = {r.max_tokens}: expected a positive count")
    if r.temperature is not None and not 0.0 <= r.temperature <= 10.0:
        raise InvalidArgument("temperature", f"temperature = {r.temperature}: expected 0 (greedy) .. 10")
    if r.top_p is not None and not 0.0 < r.top_p <= 1.0:
        raise InvalidArgument("top_p", f"top_p = {r.top_p}: expected 0 < top_p <= 1")
    if r.top_k is not None and r.top_k < 0:
        raise InvalidArgument("top_k", f"top_k = {r.top_k}: expected >= 0 (0: off)")
    if r.repetition_penalty is not None and not 0.0 < r.repetition_penalty <= 10.0:
        raise InvalidArgument("repetition_penalty",
                              f"repetition_penalty = {r.repetition_penalty}: expected 0 < value <= 10 (1: off)")
    if any(not s for s in r.stop):
        raise InvalidArgument("stop", "stop strings must not be empty")


class ChatService:
    """Generations on the daemon's model (see the module docstring)."""

    def __init__(self, daemon, max_queued: int):
        self.daemon = daemon
        self.max_queued = max_queued
        self.queued = 0            # waiting for the model
        self.running = 0           # generating
        self.observers: list = []  # callables (DoneEvent) -> None, e.g. the metrics
        self.active: dict[int, ActiveRequest] = {}
        self._ids = itertools.count(1)
        self._turn = asyncio.Lock()       # FIFO: the waiting requests, in order of arrival
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duck-generate")
        self._count = threading.Lock()   # the counters move on the loop and in worker threads

    def _add(self, queued: int = 0, running: int = 0) -> None:
        with self._count:
            self.queued += queued
            self.running += running

    def _check_ready(self) -> None:
        d = self.daemon
        if not d.ready:
            raise Unavailable("duckd is starting: the fleet or the model is not ready yet")
        if d.cfg.model.backend != "fleet":
            return
        for duck in d.fleet.ducks:
            if duck.state != State.SERVING:
                why = f": {duck.reason}" if duck.reason else ""
                raise Unavailable(f"duck {duck.id} is {duck.state.name}{why}; a chat needs every duck SERVING, "
                                  "retry shortly")

    def _prompt_ids(self, r: ChatRequest) -> list[int]:
        tok = self.daemon.model.loaded.tokenizer
        if r.prompt is not None:
            return tok.encode(r.prompt, add_special_tokens=True)
        try:
            return tok.encode_chat([{"role": m.role, "content": m.content} for m in r.messages],
                                   special_in_content=self.daemon.cfg.model.special_tokens_in_content)
        except Exception as e:
            raise InvalidArgument("messages", f"cannot render the chat template: {e}") from None

    def _params(self, r: ChatRequest, prompt_len: int):
        from engine.generate import SamplingParams
        cfg = self.daemon.cfg.model
        if prompt_len + 1 > cfg.max_model_len:
            raise InvalidArgument("messages" if r.prompt is None else "prompt",
                                  f"the request is {prompt_len} tokens; max_model_len is {cfg.max_model_len}")
        max_tokens = min(r.max_tokens or cfg.max_tokens, cfg.max_model_len - prompt_len)
        d = self.sampling_defaults()
        pick = lambda name, off: getattr(r, name) if getattr(r, name) is not None else d.get(name, off)  # noqa: E731
        return SamplingParams(max_tokens=max_tokens, temperature=pick("temperature", 0.0), top_k=pick("top_k", 0),
                              top_p=pick("top_p", 1.0), seed=r.seed, stop=tuple(r.stop),
                              repetition_penalty=pick("repetition_penalty", 1.0))

    def sampling_defaults(self) -> dict:
        """What a request that names no sampling settings gets: [model] settings of the
        daemon's config over the checkpoint's generation_config.json (empty: greedy)."""
        cfg = self.daemon.cfg.model
        mine = {k: getattr(cfg, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")
                if getattr(cfg, k) is not None}
        return {**self.daemon.model.loaded.sampling, **mine}

    async def stream(self, r: ChatRequest):
        """Async iterator of TokenEvent ... DoneEvent; raises duckd.errors."""
        from engine.generate import GenerationStats, generate
        from engine.mtp import generate_mtp
        from native.transport import DuckError

        validate(r)
        self._check_ready()
        if self.queued >= self.max_queued:
            raise Busy(f"{self.queued} requests are queued (model.max_queued = {self.max_queued}); retry shortly")
        loaded = self.daemon.model.loaded
        prompt = self._prompt_ids(r)
        params = self._params(r, len(prompt))
        mtp = self.daemon.cfg.model.mtp and getattr(loaded.model, "mtp_layers", None)
        run = generate_mtp if mtp and params.repetition_penalty == 1.0 else generate   # MTP1 drafts know no penalty

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
        emitted = {"n": 0, "t0": time.perf_counter(), "ttft": 0.0}
        stopping = self.daemon.stopping
        record = ActiveRequest(next(self._ids), len(prompt), time.monotonic())

        def on_text(text: str) -> None:
            if cancel.is_set() or stopping.is_set():
                raise Cancelled()
            if not emitted["n"]:
                emitted["ttft"] = time.perf_counter() - emitted["t0"]
                record.first_token = time.monotonic()
            emitted["n"] += 1
            record.generated = emitted["n"]
            put(("token", text))

        def work() -> None:
            with self.daemon.model.lock:
                self._add(running=1)
                emitted["t0"] = time.perf_counter()
                try:
                    result = run(loaded.model, loaded.tokenizer, prompt, params, on_text=on_text,
                                 max_model_len=len(prompt) + params.max_tokens,
                                 prefill_chunk=self.daemon.cfg.model.prefill_chunk,
                                 should_stop=lambda: cancel.is_set() or stopping.is_set())
                    put(("done", result))
                except Cancelled:
                    put(("cancelled", None))
                except DuckError as e:
                    put(("unavailable", str(e)))
                except Exception as e:       # reported to the caller, the daemon goes on
                    log.exception("generation failed")
                    put(("error", f"{type(e).__name__}: {e}"))
                finally:
                    self._add(running=-1)

        self._add(queued=1)
        self.active[record.id] = record
        self.daemon.active_chats += 1
        waiting = True
        try:
            async with self._turn:       # a caller that goes away while waiting leaves the queue here
                waiting = False
                self._add(queued=-1)
                if stopping.is_set():
                    raise Unavailable("duckd is stopping")
                self._check_ready()      # the fleet may have failed while this request waited
                record.state = "running"
                loop.run_in_executor(self._worker, work)
                async for event in self._events(queue, prompt, emitted, stopping):
                    if isinstance(event, DoneEvent):
                        done = event
                        break
                    yield event
            yield done                   # the next request's turn does not wait for this caller
        finally:
            if waiting:
                self._add(queued=-1)
            cancel.set()
            self.active.pop(record.id, None)
            self.daemon.active_chats -= 1

    async def _events(self, queue: asyncio.Queue, prompt: list[int], emitted: dict, stopping):
        """What the generation thread reports, as events, until it is done."""
        from engine.generate import GenerationStats
        while True:
            kind, value = await queue.get()
            if kind == "token":
                yield TokenEvent(value)
            elif kind == "done":
                self.daemon.model.last_decode_tps = value.stats.decode_tps
                yield self._finish(DoneEvent(value.stats, value.finish_reason))
                return
            elif kind == "cancelled":
                stats = GenerationStats(len(prompt), emitted["n"], time.perf_counter() - emitted["t0"],
                                        emitted["ttft"])
                log.info("chat cancelled after %d tokens (%s)", emitted["n"],
                         "daemon stopping" if stopping.is_set() else "client gone")
                yield self._finish(DoneEvent(stats, "cancelled"))
                return
            elif kind == "unavailable":
                raise Unavailable(f"the fleet failed during the chat: {value}")
            else:
                raise RuntimeError(f"generation failed: {value}")

    def _finish(self, done: DoneEvent) -> DoneEvent:
        for observe in self.observers:
            observe(done)
        return done
