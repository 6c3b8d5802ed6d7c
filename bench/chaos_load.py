"""The load of bench.chaos: N concurrent greedy chats against the daemon, each
re-issued as it finishes so the load stays constant, every token's arrival
recorded, and a watchdog that ends (and marks hung) a stream that gets no
token for longer than its deadline. The daemon behind it may be stopped and
started again (a new address): the workers wait while it is down."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc

log = logging.getLogger("duck.bench_chaos")

RETRY_AFTER_FAILURE_S = 0.5      # a worker whose chat failed waits this long before its next one


def prompts(n: int) -> list[str]:
    subjects = ("a duck who learns to fly", "a lighthouse keeper", "a lost umbrella", "the first snow",
                "a robot baker", "a river that runs uphill", "a clock that is always late", "two old friends")
    return [f"Tell story number {i} about {subjects[i % len(subjects)]} in three sentences." for i in range(n)]


@dataclass
class Stream:
    """One chat: its tokens with their arrival times and how it ended."""
    id: int
    prompt: int
    kind: str                                   # "load", or the fault that started it ("slowclient")
    start: float
    tokens: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    end: float | None = None
    finish_reason: str = ""                     # of a completed chat: length, eos, stop; "cancelled": ended by duckd
    error: str = ""                             # "CODE: message" of a failed chat
    hung: bool = False                          # ended by the watchdog: no token within the deadline
    call: object = None

    @property
    def last_progress(self) -> float:
        return self.times[-1] if self.times else self.start


class Target:
    """The daemon the load talks to; `up` is cleared while it is stopped and started again."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.up = threading.Event()
        self.channel: grpc.Channel | None = None
        self.attach()

    def attach(self) -> None:
        """After a (re)start: a channel to the daemon's current address; the workers go on."""
        old, self.channel = self.channel, self.daemon.channel()
        if old is not None:
            old.close()
        self.up.set()

    def detach(self) -> None:
        self.up.clear()


class Load:
    def __init__(self, target: Target, texts: list[str], max_tokens: int, deadline_s: float):
        self.target, self.texts, self.max_tokens, self.deadline_s = target, texts, max_tokens, deadline_s
        self.streams: list[Stream] = []
        self._ids = itertools.count()
        self._next_prompt = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watchdog = threading.Thread(target=self._watch, name="chaos-watchdog", daemon=True)
        self._watchdog.start()

    def chat(self, prompt: int, kind: str = "load", read_delay_s: float = 0.0) -> Stream:
        """One greedy chat to its end (or the watchdog's); read_delay_s: a slow client's pause per event."""
        s = Stream(next(self._ids), prompt, kind, time.monotonic())
        with self._lock:
            self.streams.append(s)
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=self.texts[prompt])],
                             max_tokens=self.max_tokens, temperature=0.0)
        try:
            s.call = rpc.ChatStub(self.target.channel).Chat(req, timeout=max(600.0, 20 * self.deadline_s))
            for ev in s.call:
                if ev.WhichOneof("event") == "token":
                    s.tokens.append(ev.token)
                    s.times.append(time.monotonic())
                else:
                    s.finish_reason = ev.stats.finish_reason or "done"
                if read_delay_s:
                    time.sleep(read_delay_s)
        except grpc.RpcError as e:
            if not s.hung:
                s.error = f"{e.code().name}: {e.details() or ''}".strip()
        s.end = time.monotonic()
        s.call = None
        return s

    def reference(self, concurrency: int) -> list[list[str]]:
        """Every prompt once, undisturbed, `concurrency` at a time: the tokens each must give."""
        pending = iter(range(len(self.texts)))
        out: list[Stream | None] = [None] * len(self.texts)

        def worker():
            for i in pending:           # an iterator shared by the threads: next() holds the GIL
                out[i] = self.chat(i, kind="reference")
        threads = [threading.Thread(target=worker) for _ in range(min(concurrency, len(self.texts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = [s for s in out if s.error or s.hung or s.finish_reason == "cancelled"]
        if bad:
            raise RuntimeError(f"the undisturbed run failed: prompt {bad[0].prompt}: "
                               f"{bad[0].error or ('hung' if bad[0].hung else 'cancelled')}")
        with self._lock:
            self.streams.clear()
        return [s.tokens for s in out]

    def start(self, concurrency: int) -> None:
        for n in range(concurrency):
            t = threading.Thread(target=self._worker, name=f"chaos-chat-{n}", daemon=True)
            t.start()
            self._threads.append(t)

    def _worker(self) -> None:
        while not self._stop.is_set():
            if not self.target.up.wait(0.2):
                continue
            s = self.chat(next(self._next_prompt) % len(self.texts))
            if (s.error or s.hung) and not self._stop.is_set():
                time.sleep(RETRY_AFTER_FAILURE_S)

    def spawn(self, prompt: int, kind: str, read_delay_s: float = 0.0) -> None:
        """One more chat beside the load (a fault's), in a thread of its own."""
        t = threading.Thread(target=self.chat, args=(prompt, kind, read_delay_s), daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout: float) -> None:
        """No new chats; the running ones finish (or the watchdog ends them)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                running = [(s, s.call) for s in self.streams if s.end is None and s.call is not None]
            for s, call in running:
                if not s.hung and now - s.last_progress > self.deadline_s:
                    s.hung = True
                    s.error = f"hung: no token for {self.deadline_s:.0f} s"
                    log.warning("chat %d (prompt %d) hung after %d tokens: cancelled", s.id, s.prompt, len(s.tokens))
                    call.cancel()
