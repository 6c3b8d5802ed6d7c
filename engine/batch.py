"""Many requests at once: continuous batching over the native CPU decoder
(engine.cpu.decode), or the model's torch modules (engine.batch_torch: a GPU host,
DUCK_CPU_NATIVE=0), and a cache with one slot per sequence.

    batch = BatchDecoder(model, tokenizer, slots=32, max_model_len=2048)
    seq = batch.add(prompt_ids, params, on_text=...)   # None: no free slot
    while batch.active:
        for seq in batch.step():                        # one forward for every sequence
            seq.result                                  # a finished one: engine.tokens.GenerationResult

Every step is one forward of the model over the tokens of all sequences: the
next token of each decoding sequence, then prefill chunks of sequences still
reading their prompt, oldest first, up to step_tokens in all. Each token is
written into its sequence's slot and attends to that slot only
(duck_host_begin_slots), so the linear layers, and above all the FFNs on the
ducks, run once per step for the whole batch: a duck streams each expert (or
dense MLP) once for the union of the sequences' tokens. The logits are made
only for the tokens that need them (each sequence's last token of the step).

With mtp (a model with an MTP head, DeepSeek-V3/V3.2, on the torch path), each step
first drafts the next token of every decoding sequence with the MTP layer (one forward
over all of them: the positions each has accepted since its last draft), then feeds
each the pair (its last token, its draft) at two positions and verifies the draft as
engine.mtp does (engine.tokens.verify_draft): greedy output is token-identical to plain
decoding, sampled output keeps its distribution. A sequence with a repetition penalty
takes no drafts (they know no penalty), nor does one that asks for log-probabilities.

Each sequence keeps its own sampling generator, stop strings and text stream
(engine.tokens.TokenStream), so its output is the one it would get alone as
long as the per-token arithmetic does not depend on the batch (tests hold that).
A sequence ends at EOS, a stop string, max_tokens, its slot's max_model_len, or
when its should_stop says so (cancel); its slot is free for the next step.

The prefix cache (prefix_cache, on where the slot cache has only per-position entries:
no per_sequence() state; not Qwen3.5, whose DeltaNet state is one per sequence): a free slot keeps
what its last sequence wrote (prompt and output but the last token) until it is taken
again, and a new sequence prefills only what no slot already holds. It takes
    - the free slot whose tokens it continues (the next turn of that chat: all but fewer
      than PREFIX_COPY_MIN of the tokens the slot holds begin the new prompt), reading the
      rest from there;
    - else the least recently freed slot, into which the longest prefix any slot holds
      (free or decoding: a shared system prompt, an agent's tool list) is copied first
      when it is PREFIX_COPY_MIN tokens or more.
    - a sequence whose prompt shares PREFIX_COPY_MIN tokens more with one still reading its
      own (requests arriving together with one system prompt, the n choices of one request)
      waits for that one to have read them, then copies them (not with MTP drafts).
At least the prompt's last token is always read (its logits give the first new token).
With MTP drafts, a slot's prefix counts only as far as the MTP layer has read it too.
The memory is the slots' own: nothing is allocated for the cache, and a sequence that
needs a slot evicts the least recently freed one.

A long prompt on a GPU host with a fleet (the model's streamed_prefill,
engine.gpu.hybrid_prefill, on the torch path): a sequence whose unread prompt the
streamed prefill judges long enough (worth()) reads it alone, in a step of up to the
streamed prefill's chunk (each expert crosses PCIe once per such step, the ducks computing
their share beside the GPU), again while the unread rest is worth a pass, and the rest in
the batch's own steps; the other sequences wait for such a step as they would for any
prompt chunk. A prompt the prefix cache mostly holds is judged by its unread rest; the
steps that read prompt chunks on the ducks are timed for that judgement (a short rest
that touches most experts costs the ducks nearly a full read of them).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.tokens import GenerationResult, GenerationStats, SamplingParams, TokenStream, sampling_probs, verify_draft

log = logging.getLogger(__name__)

DEFAULT_STEP_TOKENS = 256   # tokens per step: decode tokens first, prefill chunks fill the rest
PREFIX_COPY_MIN = 16        # the shortest prefix copied from another slot (a chat template's first tokens are fewer)


@dataclass(eq=False)
class Sequence:
    """One request in the batch."""
    prompt: list[int]
    params: SamplingParams
    slot: int
    out: TokenStream
    should_stop: Callable[[], bool] | None = None
    prefilled: int = 0                  # prompt tokens in the cache
    start: float = field(default_factory=time.perf_counter)
    ttft: float = 0.0
    result: GenerationResult | None = None
    speculate: bool = False             # MTP drafts (BatchDecoder with mtp, no repetition penalty)
    draft: int | None = None            # this step's draft of the token after the last one
    q: torch.Tensor | None = None       # the distribution it was drawn from (sampling)
    mtp_hidden: list[torch.Tensor] = field(default_factory=list)   # main hidden states the MTP layer has not read
    mtp_from: int = 0                   # ... from this position on, one per token of mtp_follow
    mtp_follow: list[int] = field(default_factory=list)            # the token after each of those positions
    accepted: int = 0
    verified: int = 0
    cached: int = 0                     # prompt tokens found in the prefix cache (not prefilled)
    waits: "Sequence | None" = None     # a sequence still reading the prompt tokens this one shares ...
    waits_for: int = 0                  # ... this many of them: this one waits, then copies them
    mtp_done: int = 0                   # positions the MTP layer has read (its cache entries 0..mtp_done-1)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def position(self) -> int:
        """The position of the next token this sequence feeds."""
        return self.prefilled if not self.decoding else len(self.prompt) + len(self.out.out_ids) - 1


class BatchDecoder:
    """Continuous batching on the native or the torch path (see the module docstring)."""

    def __init__(self, model, tokenizer, slots: int, max_model_len: int, step_tokens: int = DEFAULT_STEP_TOKENS,
                 path: str = "native", mtp: bool = False, prefix_cache: bool = True):
        if slots < 1 or max_model_len < 2:
            raise ValueError(f"a batch needs slots >= 1 and max_model_len >= 2, got {slots} and {max_model_len}")
        if not 1 <= step_tokens:
            raise ValueError(f"step_tokens must be positive, got {step_tokens}")
        if path not in ("native", "torch"):
            raise ValueError(f"path must be 'native' (engine.cpu.decode) or 'torch' (engine.batch_torch), got {path!r}")
        if path == "native":
            from engine.cpu.decode import CpuDecoder as decoder   # an fp32 model and cache on the CPU
        else:
            from engine.batch_torch import TorchSlotDecoder as decoder
        self.model, self.tokenizer, self.max_model_len, self.path = model, tokenizer, max_model_len, path
        self.mtp = mtp
        if mtp:
            if path != "torch" or not getattr(model, "mtp_layers", None):
                raise ValueError(f"MTP drafts in a batch need the torch path and a model with an MTP layer "
                                 f"({type(model).__name__}, path {path!r})")
            if step_tokens < 2 * slots:
                raise ValueError(f"MTP drafts: {slots} sequences feed 2 tokens each per step, steps of "
                                 f"{step_tokens} tokens are too few (model.step_tokens >= 2 x model.max_seqs)")
        from engine.cpu.host_model import FAMILIES, UnsupportedModel
        if not (type(model) in FAMILIES if path == "native" else getattr(type(model), "slot_batching", False)):
            # refused before a cache of every slot is allocated (batch_decoder then tries the next path)
            raise UnsupportedModel(f"{type(model).__name__} ({model.config.model_type}) has no batched {path} path")
        # the family's own slot cache: k/v, latents (and the MTP layer's), or k/v and DeltaNet states
        if path == "native":   # its own cache (engine.cpu.decode.native_cache: float16, heads outer)
            from engine.cpu.decode import native_cache
            self.cache = native_cache(model, max_model_len, slots)
        else:
            self.cache = model.make_slot_cache(slots, max_model_len, mtp=True) if mtp else \
                model.make_slot_cache(slots, max_model_len)
        self.decoder = decoder(model, self.cache, max_tokens=step_tokens)   # raises UnsupportedModel
        self.step_tokens = min(step_tokens, self.decoder.max_tokens)
        if self.step_tokens < slots:
            raise ValueError(f"{slots} sequences need steps of at least {slots} tokens, this decoder takes "
                             f"{self.step_tokens}")
        self.free = list(range(slots))               # least recently freed first
        self.active: list[Sequence] = []             # in order of arrival
        self.steps = 0
        self.prefix_cache = prefix_cache and not self.cache.per_sequence()
        self.held: list[list[int]] = [[] for _ in range(slots)]   # a free slot's tokens, from position 0
        self.cached_tokens = 0                       # prompt tokens read from the prefix cache, all sequences
        # long prompts' experts streamed to the GPU (a CUDA host with a fleet): engine.gpu.hybrid_prefill
        self.streamed = getattr(model, "streamed_prefill", None) if path == "torch" else None
        from engine.batch_torch import cache_tensors
        cache_mb = sum(t.numel() * t.element_size() for t in cache_tensors(self.cache)) / 1e6
        log.info("batch decoder (%s path): %d slots of %d positions (%.0f MB of cache), steps of up to %d tokens",
                 path, slots, max_model_len, cache_mb, self.step_tokens)

    @property
    def slots(self) -> int:
        return self.cache.slots

    def add(self, prompt: list[int], params: SamplingParams, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Sequence | None:
        """A new sequence, prefilled by the next steps; None when every slot is taken."""
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len={self.max_model_len}")
        if not self.free:
            return None
        device = self.model.model.embed_tokens.weight.device
        emit = (lambda *delta: _report(on_text, *delta)) if on_text is not None else None   # an error stays its caller's
        slot, cached = self._take_slot(prompt)
        seq = Sequence(prompt, params, slot, TokenStream(self.tokenizer, prompt, params, device, emit),
                       should_stop, speculate=self.mtp and params.drafts_apply,
                       prefilled=cached, cached=cached, mtp_done=cached)
        seq.waits, seq.waits_for = self._reading_source(prompt, cached)
        self.cached_tokens += cached
        self.active.append(seq)
        return seq

    def _written(self, seq: Sequence) -> list[int]:
        """The tokens whose cache entries seq's slot holds now, from position 0: the prompt
        read so far, then every output token but the last (not fed yet); with MTP drafts
        only as far as the MTP layer has read them too."""
        tokens = seq.prompt + seq.out.out_ids[:-1] if seq.decoding else seq.prompt[:seq.prefilled]
        return tokens[:seq.mtp_done] if self.mtp else tokens

    def _reading_source(self, prompt: list[int], have: int) -> tuple[Sequence | None, int]:
        """(a sequence still reading a prompt that shares PREFIX_COPY_MIN tokens more than have
        with this one, how many), or (None, 0)."""
        if not self.prefix_cache or self.mtp:
            return None, 0
        best, src = 0, None
        for seq in self.active:
            if not seq.decoding and seq.waits is None:
                n = min(common_prefix(seq.prompt, prompt), len(prompt) - 1)
                if n > best:
                    best, src = n, seq
        return (src, best) if src is not None and best - have >= PREFIX_COPY_MIN else (None, 0)

    def _resolve_wait(self, seq: Sequence) -> None:
        """A waiting sequence whose source has read what it waits for (or has ended): the shared
        tokens copied into its slot, and it reads the rest from the next step on."""
        src = seq.waits
        if src in self.active and not src.decoding and src.prefilled < seq.waits_for:
            return
        tokens = self._written(src) if src in self.active else self.held[src.slot] if src.slot in self.free else []
        reuse = min(common_prefix(tokens, seq.prompt), len(seq.prompt) - 1)
        seq.waits, seq.waits_for = None, 0
        if reuse > seq.prefilled:
            for t in self.cache.per_position():     # [layers, slots, S, ...]
                t[:, seq.slot, seq.prefilled:reuse].copy_(t[:, src.slot, seq.prefilled:reuse])
            self.cached_tokens += reuse - seq.prefilled
            seq.prefilled = seq.cached = seq.mtp_done = reuse

    def _take_slot(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for prompt and how many of its first tokens are in it already (see the
        module docstring's prefix cache)."""
        if not self.prefix_cache:
            return self.free.pop(0), 0
        best, src = 0, None
        for slot in self.free:
            n = common_prefix(self.held[slot], prompt)
            if n > best:
                best, src = n, slot
        for seq in self.active:
            n = common_prefix(self._written(seq), prompt)
            if n > best:
                best, src = n, seq.slot
        # an MTP entry at position i read token i+1 too: with drafts, one position less is sure
        reuse = min(best - self.mtp, len(prompt) - 1)
        # the slot it continues (its chat's next turn: all but a few of the tokens held), or the one
        # to be evicted anyway: taken as it is; else the prefix goes into the least recently freed
        if src in self.free and reuse > 0 and (src == self.free[0] or len(self.held[src]) - best < PREFIX_COPY_MIN):
            self.free.remove(src)
            return src, reuse
        slot = self.free.pop(0)
        if reuse < PREFIX_COPY_MIN:
            return slot, 0
        for t in self.cache.per_position():     # [layers, slots, S, ...]
            t[:, slot, :reuse].copy_(t[:, src, :reuse])
        return slot, reuse

    def _plan(self, alone: Sequence | None = None, budget: int = 0):
        """The step's ids, positions, slots; (sequence, first row, rows) of the rows that get
        logits (a decoding sequence's last token, and its draft; a prompt's last token); and
        (sequence, first row, tokens, first position) of the prefill chunks. alone: only that
        sequence's next prompt chunk, of up to budget tokens (a streamed prefill's step)."""
        ids, positions, slots, wants, chunks = [], [], [], [], []
        for seq in self.active if alone is None else ():
            if seq.decoding:
                pair = [seq.draft] if seq.draft is not None else []
                wants.append((seq, len(ids), 1 + len(pair)))
                ids += [seq.out.out_ids[-1]] + pair
                positions += range(seq.position, seq.position + 1 + len(pair))
                slots += [seq.slot] * (1 + len(pair))
        budget = (budget or self.step_tokens) - len(ids)
        for seq in self.active if alone is None else [alone]:
            if budget <= 0:
                break
            if seq.decoding or seq.waits is not None:
                continue
            n = min(budget, len(seq.prompt) - seq.prefilled)
            chunks.append((seq, len(ids), n, seq.prefilled))
            ids += seq.prompt[seq.prefilled:seq.prefilled + n]
            positions += range(seq.prefilled, seq.prefilled + n)
            slots += [seq.slot] * n
            seq.prefilled += n
            budget -= n
            if seq.decoding:   # the prompt is in: its last token's logits give the first new token
                wants.append((seq, len(ids) - 1, 1))
        return ids, positions, slots, wants, chunks

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One forward for every active sequence; returns those that finished (result set)."""
        finished = [s for s in self.active if s.should_stop is not None and s.should_stop()]
        for seq in finished:
            self._end(seq, "cancelled")
        if not self.active:
            return finished
        for seq in self.active:
            if seq.waits is not None:
                self._resolve_wait(seq)
        long = self._long_prompt()
        if long is not None:    # this step: its next chunk alone, the experts streamed to the GPU
            ids, positions, slots, wants, chunks = self._plan(long, self.streamed.chunk)
            with self.streamed.hook(len(ids)):
                y = self.decoder.layers(torch.tensor(ids), torch.tensor(positions),
                                        torch.tensor(slots, dtype=torch.int32), limit=len(ids))
        else:
            if self.mtp:
                self._drafts()
            ids, positions, slots, wants, chunks = self._plan()
            t0 = time.perf_counter()
            y = self.decoder.layers(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots, dtype=torch.int32))
        wants.sort(key=lambda w: w[1])
        rows = [r for _, first, n in wants for r in range(first, first + n)]
        logits, greedy = self._logits(y, rows, wants)
        if long is None and chunks and self.streamed is not None:   # the ducks' prefill rate, for worth()
            self.streamed.fleet_timed(sum(n for _, _, n, _ in chunks), time.perf_counter() - t0)
        self.steps += 1
        now = time.perf_counter()
        at, ended = 0, []
        for seq, first, n in wants:
            decoded = bool(seq.out.out_ids)   # a decode row (not a prompt's last token)
            if n == 2:
                done = self._verify(seq, logits[at], logits[at + 1], y, first)
            else:
                done = seq.out.add(greedy[at]) if at in greedy else seq.out.push(logits[at])
                if seq.speculate and decoded:
                    self._unread(seq, y[first:first + 1], positions[first], seq.out.out_ids[-1:])
            at += n
            if not seq.ttft:
                seq.ttft = now - seq.start
            if done or seq.position >= self.max_model_len:
                ended.append(seq)
        for seq, first, n, pos in chunks:   # the MTP layer reads the prompt too: token i+1 beside state i
            if seq.speculate and seq not in ended:
                follow = seq.prompt[pos + 1:pos + 1 + n]
                self._unread(seq, y[first:first + n], pos, follow + seq.out.out_ids[:n - len(follow)])
        for seq in ended:
            self._end(seq)
            finished.append(seq)
        return finished

    def _long_prompt(self) -> Sequence | None:
        """The oldest sequence still reading a prompt whose unread rest the streamed prefill
        takes (None: no such sequence, or no streamed prefill here)."""
        if self.streamed is None:
            return None
        return next((s for s in self.active if not s.decoding and s.waits is None
                     and self.streamed.worth(len(s.prompt) - s.prefilled)), None)

    def _logits(self, y: torch.Tensor, rows: list[int], wants) -> tuple[torch.Tensor | None, dict[int, int]]:
        """The logits of rows, and {logits row: its argmax} of the greedy ones: one argmax per
        row where the decoder computes the logits (the native decoder's in C), not a call per
        sequence (the first of equal maxima either way, so the tokens are push()'s)."""
        if not rows:
            return None, {}
        greedy = _greedy_rows(wants)
        if not greedy:
            return self.decoder.logits(y, rows), {}
        logits, top = self.decoder.logits_argmax(y, rows)
        return logits, {r: top[r] for r in greedy}

    def _unread(self, seq: Sequence, hidden: torch.Tensor, pos: int, follow: list[int]) -> None:
        """Main hidden states at pos.. and the tokens after them: the MTP layer's next input."""
        if not seq.mtp_follow:
            seq.mtp_from = pos
        seq.mtp_hidden.append(hidden)
        seq.mtp_follow += follow

    def _drafts(self) -> None:
        """One MTP forward over every decoding sequence that can feed a pair this step: it reads
        what each has accepted since its last draft, its last row drafts the next token."""
        seqs = [s for s in self.active if s.speculate and s.decoding and s.mtp_follow
                and s.position + 1 < self.max_model_len]
        if not seqs:
            return
        ids, positions, slots, last = [], [], [], []
        for seq in seqs:
            ids += seq.mtp_follow
            positions += range(seq.mtp_from, seq.mtp_from + len(seq.mtp_follow))
            slots += [seq.slot] * len(seq.mtp_follow)
            last.append(len(ids) - 1)
        hidden = torch.cat([h for seq in seqs for h in seq.mtp_hidden])
        logits = self.decoder.draft(torch.tensor(ids), hidden, torch.tensor(positions), torch.tensor(slots))
        for seq, row in zip(seqs, last):
            seq.mtp_done = seq.mtp_from + len(seq.mtp_follow)
            seq.mtp_hidden, seq.mtp_follow = [], []
            if seq.params.temperature == 0.0:
                seq.draft, seq.q = int(logits[row].argmax()), None
            else:
                seq.q = sampling_probs(logits[row], seq.params)
                seq.draft = int(torch.multinomial(seq.q, 1, generator=seq.out.generator))

    def _verify(self, seq: Sequence, first: torch.Tensor, second: torch.Tensor, y: torch.Tensor, row: int) -> bool:
        """The pair (last token, draft): the draft verified against the main model's logits at
        its position (first), and when accepted the next token from the draft's row (second)
        for free. -> whether the sequence is done."""
        gen = seq.out.generator
        p = first.float() if gen is None else sampling_probs(first, seq.params)
        ok, token = verify_draft(p, seq.q, seq.draft, gen)
        pos, seq.draft, seq.q = seq.position, None, None
        seq.verified += 1
        done = seq.out.add(token)
        if ok:
            seq.accepted += 1
            if not done:
                done = seq.out.push(second)
                self._unread(seq, y[row:row + 2], pos, seq.out.out_ids[-2:])
        elif not done:
            self._unread(seq, y[row:row + 1], pos, [token])
        return done

    def _end(self, seq: Sequence, finish: str | None = None) -> None:
        text = seq.out.close(finish)
        stats = GenerationStats(len(seq.prompt), len(seq.out.out_ids), time.perf_counter() - seq.start, seq.ttft,
                                mtp=(seq.accepted, seq.verified) if seq.speculate else None, cached=seq.cached)
        seq.result = GenerationResult(seq.out.out_ids, text, seq.out.finish, stats, logprobs=seq.out.logprobs)
        self.active.remove(seq)
        # a failed step may have left the slot half written: it keeps nothing
        self.held[seq.slot] = self._written(seq) if self.prefix_cache and finish != "error" else []
        self.free.append(seq.slot)

    def fail_all(self) -> list[Sequence]:
        """Ends every active sequence (the step failed); returns them, their slots free."""
        ended = list(self.active)
        for seq in ended:
            self._end(seq, "error")
        return ended


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens a and b share (list slices compare in C: a bisection of them)."""
    n = min(len(a), len(b))
    if not n or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n   # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _greedy_rows(wants) -> list[int]:
    """The logits rows of the one-row sequences whose next token is their argmax and nothing
    else (TokenStream.plain_greedy): the decoder finds those tokens with the logits."""
    rows, at = [], 0
    for seq, _, n in wants:
        if n == 1 and seq.out.plain_greedy:
            rows.append(at)
        at += n
    return rows


def batch_decoder(model, tokenizer, slots: int, max_model_len: int, step_tokens: int = DEFAULT_STEP_TOKENS,
                  gpu: bool = False, mtp: bool = False, prefix_cache: bool = True):
    """A BatchDecoder where one applies, None otherwise (with why at info level): on the
    CPU host the native decoder's (Llama, Qwen3, Qwen3-MoE), else the torch path's (other
    families with slot_batching, or any with DUCK_CPU_NATIVE=0); on a GPU host the torch path's only when gpu is set (duckd's
    model.gpu_batching; decode steps from CUDA graphs per batch-size bucket, engine.gpu.batch_graphs). mtp: the batch drafts with the model's MTP layer (the torch path), or
    without MTP where it cannot (says why)."""
    from engine.cpu.decode import native_mode
    from engine.cpu.host_model import UnsupportedModel

    on_cpu = model.model.embed_tokens.weight.device.type == "cpu"
    if not on_cpu and not gpu:
        log.info("no continuous batching on the GPU host (model.gpu_batching is off): one request at a time")
        return None
    if mtp and getattr(model, "mtp_layers", None):
        try:
            return BatchDecoder(model, tokenizer, slots, max_model_len, step_tokens, path="torch", mtp=True,
                                prefix_cache=prefix_cache)
        except (UnsupportedModel, ValueError) as e:
            log.warning("continuous batching without MTP drafts: %s", e)
    paths = ["native", "torch"] if on_cpu and native_mode() != "off" else ["torch"]
    why = []
    for path in paths:   # on the CPU host: the native decoder, else the torch path (a family it lacks)
        try:
            return BatchDecoder(model, tokenizer, slots, max_model_len, step_tokens, path=path,
                                prefix_cache=prefix_cache)
        except UnsupportedModel as e:
            why.append(f"{path} path: {e}")
    log.info("no continuous batching: %s", "; ".join(why))
    return None


@dataclass(eq=False)
class Job:
    """A request handed to a BatchRunner, and how it reports back (called on the runner's thread)."""
    prompt: list[int]
    params: SamplingParams
    on_text: Callable[[str], None] | None = None
    should_stop: Callable[[], bool] | None = None    # true: the caller is gone (queued: dropped unread)
    on_start: Callable[[], None] | None = None        # it got a slot
    on_done: Callable[[GenerationResult], None] | None = None
    on_error: Callable[[BaseException], None] | None = None   # the step failed, or admission refused it


class BatchRunner:
    """A BatchDecoder on a thread of its own: jobs queue (FIFO) until a slot is free, then
    ride every step until they end. admit(job) may raise to refuse a job when its turn
    comes (e.g. the fleet is down); lock, when given, is held during each step."""

    def __init__(self, batch: BatchDecoder, lock=None, admit: Callable[[Job], None] | None = None,
                 name: str = "duck-batch"):
        import threading
        from collections import deque

        self.batch, self.lock, self.admit = batch, lock, admit
        self.waiting: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}             # id(sequence) -> its job
        self._wake = threading.Condition()
        self._stop = False
        self.failures = 0
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            self.waiting.append(job)
            self._wake.notify()

    @property
    def running(self) -> int:
        return len(self.batch.active)

    @property
    def free_slots(self) -> int:
        """Slots the next step gives to waiting jobs (read from another thread: an estimate)."""
        return len(self.batch.free)

    def close(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)

    def _take(self) -> list[Job]:
        """Waits for work; returns the jobs that get a slot now (and drops abandoned ones)."""
        with self._wake:
            while not self._stop and not self.waiting and not self.batch.active:
                self._wake.wait()
            taken = []
            while self.waiting and len(taken) < len(self.batch.free):
                taken.append(self.waiting.popleft())
            return taken

    def _main(self) -> None:
        while True:
            taken = self._take()
            if self._stop:
                break
            for job in taken:
                self._start(job)
            if self.batch.active:
                self._step()
        for job in list(self.waiting) + list(self._jobs.values()):
            _report(job.on_error, RuntimeError("the batch runner stopped"))

    def _start(self, job: Job) -> None:
        if job.should_stop is not None and job.should_stop():
            return                                   # the caller left while it waited: no prefill
        try:
            if self.admit is not None:
                self.admit(job)
            seq = self.batch.add(job.prompt, job.params, job.on_text, job.should_stop)
        except BaseException as e:  # noqa: BLE001 - the job's caller gets it
            _report(job.on_error, e)
            return
        self._jobs[id(seq)] = job
        _report(job.on_start)

    def _step(self) -> None:
        try:
            if self.lock is not None:
                with self.lock:
                    finished = self.batch.step()
            else:
                finished = self.batch.step()
        except BaseException as e:  # noqa: BLE001 - every sequence of the step fails with it
            self.failures += 1
            log.warning("a batch step failed (%s): %d sequences end with the error", e, len(self.batch.active))
            for seq in self.batch.fail_all():
                job = self._jobs.pop(id(seq), None)
                if job is not None:
                    _report(job.on_error, e)
            return
        for seq in finished:
            job = self._jobs.pop(id(seq), None)
            if job is not None:
                _report(job.on_done, seq.result)


def _report(fn, *args) -> None:
    if fn is None:
        return
    try:
        fn(*args)
    except Exception:   # a caller's callback must not stop the runner
        log.exception("a batch job's callback failed")
