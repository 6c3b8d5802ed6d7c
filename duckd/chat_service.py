"""The chat service: a plain service that takes a ChatRequest (a chat rendered with
the model's template, or a raw prompt) and yields TokenEvents as text becomes final,
then one DoneEvent with the generation's stats. Errors are duckd.errors; the gRPC
(duckd.server) and OpenAI HTTP (duckd.http_api) adapters translate both ways.

Every request is one sequence of the model's batch (engine.batch: continuous batching,
model.max_seqs at once, one forward per step for all of them, on a thread of the batch
runner's own; a single request is a batch of one), on any host and family; a request waits
for a free slot in FIFO order. More than model.max_queued waiting is Busy. A waiting request
whose caller goes away leaves the queue at once; one whose turn comes while the fleet cannot
serve fails then (Unavailable); a running one ends at its next token when its caller goes
away or the daemon
stops, held-back text (a stop string's prefix) or not."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from duckd.errors import Busy, InvalidArgument, Unavailable
from duckd.fleet_manager import State

log = logging.getLogger("duckd.chat")

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_OWN = ("messages", "add_generation_prompt", "special_in_content", "tools", "bos_token", "eos_token")
COVER_HINT = " (fleet.host_cover_mb sets that budget)"
THINKING_SWITCHES = ("enable_thinking", "thinking")   # Qwen3's and DeepSeek-V3.1's templates
TOKENIZE_OFF_LOOP_CHARS = 16 << 10


@dataclass(slots=True, frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[tuple[str, str, str], ...] = ()   # an assistant's calls: (id, name, arguments JSON text)
    tool_call_id: str = ""                              # a tool message: the call it answers

    def as_dict(self) -> dict:
        """The message as OpenAI writes it (what duckd.tool_calls converts for a template)."""
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


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
    template_kwargs: dict = field(default_factory=dict)   # the chat template's switches (enable_thinking)
    split_reasoning: bool = False      # a reasoning model's <think> text as TokenEvent.reasoning
    frequency_penalty: float = 0.0     # OpenAI's, on the tokens generated so far (0: off)
    presence_penalty: float = 0.0
    logprobs: int | None = None        # each token's log-probability and this many likeliest (None: none)
    grammar: tuple[str, str] | None = None   # the output's grammar: (engine.grammar kind, its text)
    tools: list[dict] = field(default_factory=list)   # OpenAI's tools (duckd.tool_calls.check_tools)
    tool_choice: str = "none"          # none, auto, required, function (the one named tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True

    @property
    def forced_tools(self) -> list[str] | None:
        """The tools a call must be made to (their names; None: no call is forced)."""
        if self.tool_choice == "required":
            return [t["function"]["name"] for t in self.tools]
        return [self.tool_name] if self.tool_choice == "function" else None


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A generated token's text, log-probability and the likeliest tokens' ((text, log-probability), ...)."""
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True, frozen=True)
class TokenEvent:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()   # the tokens read since the last event, when asked for
    reasoning: str = ""                       # the model's thinking (ChatRequest.split_reasoning)
    tool_calls: tuple = ()                    # duckd.tool_calls.ToolCalls completed since the last event


@dataclass(slots=True, frozen=True)
class DoneEvent:
    stats: object            # engine.tokens.GenerationStats
    finish_reason: str       # eos, stop, length, cancelled

    @property
    def prompt_tokens(self) -> int:
        return self.stats.input_len

    @property
    def completion_tokens(self) -> int:
        return self.stats.output_len


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


class _Call:
    """One request's plumbing between the generation thread and the event loop: the event
    queue, cancel, the text counters and its ActiveRequest record."""

    def __init__(self, service: "ChatService", prompt: list[int], shape: "_Shape"):
        loop = asyncio.get_running_loop()
        self.service = service
        self.shape = shape
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.put = lambda item: loop.call_soon_threadsafe(self.queue.put_nowait, item)
        self.record = ActiveRequest(next(service._ids), len(prompt), time.monotonic())

    def text(self, text: str, logprobs=None) -> None:
        """A text delta (on the generation thread), with engine.tokens.TokenLogprobs when asked for."""
        reasoning, content, calls = self.shape.feed(text)
        entries = ()
        if logprobs is not None:
            piece = self.service.daemon.model.loaded.tokenizer.decode
            word = lambda t: piece([t], skip_special_tokens=False)  # noqa: E731
            entries = tuple(TokenLogprob(word(e.token), e.logprob, tuple((word(t), lp) for t, lp in e.top))
                            for e in logprobs)
        if reasoning or content or entries or calls:
            self.put(("token", (content, entries, reasoning, calls)))
        if not text:
            return
        if not self.record.generated:
            self.record.first_token = time.monotonic()
        self.record.generated += 1
        self.service.tokens_out += 1


@dataclass(slots=True)
class _Shape:
    """What a completion's text is made into: a reasoning model's thinking apart from the answer
    (duckd.reasoning.ReasoningSplit), then the answer's tool calls apart from its content
    (duckd.tool_calls' parser of the model family's format); either may be None."""
    split: object = None
    tools: object = None

    def feed(self, text: str) -> tuple[str, str, tuple]:
        """A delta -> its (reasoning, content, completed tool calls)."""
        reasoning, content = self.split.feed(text) if self.split is not None else ("", text)
        if self.tools is None:
            return reasoning, content, ()
        content, calls = self.tools.feed(content)
        return reasoning, content, tuple(calls)

    def flush(self) -> tuple[str, str, tuple]:
        """At the end: what a partial tag or call held back."""
        reasoning, content = self.split.flush() if self.split is not None else ("", "")
        if self.tools is None:
            return reasoning, content, ()
        content, calls = self.tools.feed(content)
        rest, more = self.tools.flush()
        return reasoning, content + rest, tuple(calls) + tuple(more)


def validate(r: ChatRequest) -> None:
    """Raises InvalidArgument naming the first field that is wrong."""
    if r.prompt is None:
        if not r.messages:
            raise InvalidArgument("messages", "messages is empty: send at least one user message")
        for i, m in enumerate(r.messages):
            if m.role not in ROLES:
                raise InvalidArgument(f"messages[{i}].role",
                                      f"messages[{i}].role = {m.role!r}: expected system, user, assistant "
                                      "or tool")
        if r.messages[-1].role not in ("user", "tool"):
            raise InvalidArgument(f"messages[{len(r.messages) - 1}].role",
                                  f"messages[{len(r.messages) - 1}].role = {r.messages[-1].role!r}: "
                                  "the last message must be the user's (or a tool's result)")
        for i, m in enumerate(r.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise InvalidArgument(f"messages[{i}].tool_call_id",
                                      f"messages[{i}].tool_call_id: a tool message names the call it answers")
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
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(r, name) <= 2.0:
            raise InvalidArgument(name, f"{name} = {getattr(r, name)}: expected -2 .. 2 (0: off)")
    from engine.tokens import MAX_LOGPROBS   # the engine, and torch, load with the model, not before
    if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument("logprobs", f"logprobs = {r.logprobs}: expected 0 .. {MAX_LOGPROBS} alternatives")
    if any(not s for s in r.stop):
        raise InvalidArgument("stop", "stop strings must not be empty")
    for key, value in r.template_kwargs.items():
        if key in TEMPLATE_OWN or not isinstance(value, (str, int, float, bool)) or value is None:
            raise InvalidArgument(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key}: expected a switch of "
                                  f"the template (a string, number or boolean), not {', '.join(TEMPLATE_OWN)}")


class ChatService:
    """Generations on the daemon's model (see the module docstring)."""

    def __init__(self, daemon, max_queued: int):
        self.daemon = daemon
        self.max_queued = max_queued
        self.queued = 0            # waiting for the model
        self.running = 0           # generating
        self.tokens_out = 0        # text deltas sent to callers, all requests (duckd.health's progress)
        self.observers: list = []  # callables (DoneEvent) -> None, e.g. the metrics
        self.active: dict[int, ActiveRequest] = {}
        self._ids = itertools.count(1)
        self._count = threading.Lock()   # the counters move on the loop and in worker threads
        self._batch = None               # engine.batch_runner.BatchRunner, made at the first request

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
            if duck.state != State.SERVING and not d.lost.covers(duck.id):
                uncovered = d.lost.uncovered()
                if uncovered:    # the same words a chat under way gets (_events)
                    raise Unavailable(f"the fleet cannot serve: {uncovered}{COVER_HINT}")
                why = f": {duck.reason}" if duck.reason else ""
                raise Unavailable(f"duck {duck.id} is {duck.state.name}{why}; a chat needs every duck SERVING, "
                                  "retry shortly")

    def _prompt_ids(self, r: ChatRequest) -> list[int]:
        tok = self.daemon.model.loaded.tokenizer
        if r.prompt is not None:
            return tok.encode(r.prompt, add_special_tokens=True)
        messages, tools = [m.as_dict() for m in r.messages], None
        kwargs = dict(r.template_kwargs)
        if r.forced_tools is not None or r.grammar is not None:   # the grammar starts at the answer: no thinking
            for switch in THINKING_SWITCHES:
                if switch in (tok.chat_template or ""):
                    if kwargs.get(switch):
                        raise InvalidArgument(f"chat_template_kwargs.{switch}", f"chat_template_kwargs.{switch}: "
                                              "a grammar-constrained answer (response_format or a forced tool call) "
                                              "starts at its first token; thinking must be off")
                    kwargs[switch] = False
        if r.tools or any(m.tool_calls or m.role == "tool" for m in r.messages):
            from duckd.tool_calls import ToolFormatError
            fmt = self.daemon.model.tool_format
            try:
                messages = fmt.template_messages(messages)
            except ToolFormatError as e:
                raise InvalidArgument("messages", f"messages: {e}") from None
            if r.tools and r.tool_choice != "none":
                tools = r.tools if fmt.renders_tools else None
                if not fmt.renders_tools:   # the template knows no tools: described in the system message
                    messages = _with_system(messages, fmt.tools_prompt(r.tools))
        try:
            return tok.encode_chat(messages, special_in_content=self.daemon.cfg.model.special_tokens_in_content,
                                   **({"tools": tools} if tools else {}), **kwargs)
        except Exception as e:
            raise InvalidArgument("messages", f"cannot render the chat template: {e}") from None

    def _grammar(self, r: ChatRequest):
        """The engine.grammar.Grammar the output must match (None: free text): a forced tool call's,
        else response_format's. Compiled here, so that a bad schema is the request's error."""
        from engine.grammar import GrammarError, GrammarSpec
        if r.forced_tools is None and r.grammar is None:
            return None
        host = self.daemon.model
        field_name = "tools" if r.forced_tools is not None else "response_format"
        try:
            spec = GrammarSpec("lark", host.tool_format.lark(r.tools, r.forced_tools, r.parallel_tool_calls)) \
                if r.forced_tools is not None else GrammarSpec(*r.grammar)
            return host.grammars.compile(spec)
        except GrammarError as e:
            raise InvalidArgument(field_name, f"{field_name}: {e}") from None

    def _params(self, r: ChatRequest, prompt_len: int, grammar=None):
        from engine.tokens import SamplingParams
        cfg = self.daemon.cfg.model
        if prompt_len + 1 > cfg.max_model_len:
            raise InvalidArgument("messages" if r.prompt is None else "prompt",
                                  f"the request is {prompt_len} tokens; max_model_len is {cfg.max_model_len}")
        max_tokens = min(r.max_tokens or cfg.max_tokens, cfg.max_model_len - prompt_len)
        d = self.sampling_defaults()
        pick = lambda name, off: getattr(r, name) if getattr(r, name) is not None else d.get(name, off)  # noqa: E731
        return SamplingParams(max_tokens=max_tokens, temperature=pick("temperature", 0.0), top_k=pick("top_k", 0),
                              top_p=pick("top_p", 1.0), seed=r.seed, stop=tuple(r.stop),
                              repetition_penalty=pick("repetition_penalty", 1.0),
                              frequency_penalty=r.frequency_penalty, presence_penalty=r.presence_penalty,
                              logprobs=r.logprobs, grammar=grammar)

    def sampling_defaults(self) -> dict:
        """What a request that names no sampling settings gets: [model] settings of the
        daemon's config over the checkpoint's generation_config.json (empty: greedy)."""
        cfg = self.daemon.cfg.model
        mine = {k: getattr(cfg, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")
                if getattr(cfg, k) is not None}
        return {**self.daemon.model.loaded.sampling, **mine}

    def batch_runner(self):
        """The continuous-batching runner (engine.batch.batch_decoder: model.max_seqs slots; with
        model.mtp and an MTP head the batch drafts with it), made at the first request."""
        if self._batch is not None:
            return self._batch
        cfg, loaded = self.daemon.cfg.model, self.daemon.model.loaded
        from engine.batch import batch_decoder
        from engine.batch_runner import BatchRunner
        batch = batch_decoder(loaded.model, loaded.tokenizer, cfg.max_seqs, cfg.max_model_len, cfg.step_tokens,
                              mtp=cfg.mtp, prefix_cache=cfg.prefix_cache, prefill_chunk=cfg.prefill_chunk)
        self._batch = BatchRunner(batch, lock=self.daemon.model.lock, admit=self._admit)
        log.info("continuous batching (%s path%s%s): up to %d sequences per step", batch.path,
                 ", MTP drafts" if batch.mtp else "", ", prefix cache" if batch.prefix_cache else "", cfg.max_seqs)
        return self._batch

    def _admit(self, job) -> None:
        """A batched request's turn: refused (Unavailable) when the fleet cannot serve now."""
        if self.daemon.stopping.is_set():
            raise Unavailable("duckd is stopping")
        self._check_ready()

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()

    async def stream(self, r: ChatRequest):
        """Async iterator of TokenEvent ... DoneEvent; raises duckd.errors."""
        validate(r)
        self._check_ready()
        runner = self.batch_runner()
        # the runner's own queue, less the slots its next step gives them (self.queued would also count, for a
        # moment, a job the runner has taken and is starting: a spurious Busy under a flood)
        waiting = len(runner.waiting) - runner.free_slots
        if waiting >= self.max_queued:
            raise Busy(f"{waiting} requests are queued (model.max_queued = {self.max_queued}); "
                       f"retry shortly")
        text_len = len(r.prompt) if r.prompt is not None else sum(len(m.content) for m in r.messages)
        # a long text is tokenized in a thread (0.45 s per MB): the event loop serves the others meanwhile
        prompt = await asyncio.to_thread(self._prompt_ids, r) if text_len > TOKENIZE_OFF_LOOP_CHARS \
            else self._prompt_ids(r)
        grammar = await asyncio.to_thread(self._grammar, r) if r.forced_tools or r.grammar else None
        params = self._params(r, len(prompt), grammar)
        shape = _Shape(self._reasoning_split(r, prompt),
                       self.daemon.model.tool_format.parser(r.tools) if r.tools and r.tool_choice != "none" else None)
        async for event in self._batched(runner, prompt, params, shape):
            yield event

    def _reasoning_split(self, r: ChatRequest, prompt: list[int]):
        """A ReasoningSplit where the request asks for one and the model writes <think> blocks (its
        vocabulary has both tags), starting inside one where the rendered prompt opened it."""
        from duckd.reasoning import CLOSE, OPEN, ReasoningSplit, prompt_opens_thinking
        tok = self.daemon.model.loaded.tokenizer
        if not r.split_reasoning or r.prompt is not None or \
                any(tok.tokenizer.token_to_id(tag) is None for tag in (OPEN, CLOSE)):
            return None
        return ReasoningSplit(inside=prompt_opens_thinking(tok.decode(prompt[-16:], skip_special_tokens=False)))

    async def _batched(self, runner, prompt: list[int], params, shape: _Shape):
        """A request on the batch runner: queued until it gets a slot, then one of the batch."""
        from engine.batch_runner import Job
        from native.transport import DuckError

        call = _Call(self, prompt, shape)
        queue, cancel, put, record = call.queue, call.cancel, call.put, call.record
        stopping = self.daemon.stopping
        state = {"queued": True}

        def on_start() -> None:   # the runner's thread; the caller may be leaving at this moment
            with self._count:
                if state["queued"]:
                    state["queued"] = False
                    self.queued, self.running = self.queued - 1, self.running + 1
                    record.state = "running"

        def on_error(e: BaseException) -> None:
            if isinstance(e, DuckError):
                put(("unavailable", str(e)))
            elif isinstance(e, Unavailable):
                put(("refused", e))
            else:
                log.error("generation failed: %s: %s", type(e).__name__, e)
                put(("error", f"{type(e).__name__}: {e}"))

        def on_done(result) -> None:
            put(("cancelled", result) if result.finish_reason == "cancelled" else ("done", result))

        job = Job(prompt, params, call.text, lambda: cancel.is_set() or stopping.is_set(), on_start, on_done, on_error)
        self._add(queued=1)
        self.active[record.id] = record
        self.daemon.active_chats += 1
        try:
            runner.submit(job)
            async for event in self._events(queue, stopping, shape):
                yield event
        finally:
            cancel.set()
            with self._count:
                if state["queued"]:
                    state["queued"] = False
                    self.queued -= 1
                elif record.state == "running":
                    self.running -= 1
                    record.state = "done"
            self.active.pop(record.id, None)
            self.daemon.active_chats -= 1

    async def _events(self, queue: asyncio.Queue, stopping, shape: _Shape):
        """What the generation thread reports, as events, until it is done."""
        while True:
            kind, value = await queue.get()
            if kind in ("done", "cancelled"):   # the generation is over: a held tag's or call's text
                reasoning, content, calls = shape.flush()
                if reasoning or content or calls:
                    yield TokenEvent(content, (), reasoning, calls)
            if kind == "token":
                yield TokenEvent(*value)
            elif kind == "done":
                self.daemon.model.last_decode_tps = value.stats.decode_tps
                yield self._finish(DoneEvent(value.stats, value.finish_reason))
                return
            elif kind == "cancelled":       # value: the runner's result (its own token count)
                stats = value.stats
                log.info("chat cancelled after %d tokens (%s)", stats.output_len,
                         "daemon stopping" if stopping.is_set() else "client gone")
                yield self._finish(DoneEvent(stats, "cancelled"))
                return
            elif kind == "unavailable":
                hint = COVER_HINT if "cover budget" in value else ""
                raise Unavailable(f"the fleet failed during the chat: {value}{hint}")
            elif kind == "refused":
                raise value
            else:
                raise RuntimeError(f"generation failed: {value}")

    def _finish(self, done: DoneEvent) -> DoneEvent:
        for observe in self.observers:
            observe(done)
        return done


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """messages with text at the head of the system message (one made first where there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}".strip()}] + messages[1:]
    return [{"role": "system", "content": text}] + messages
