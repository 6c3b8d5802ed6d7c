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

The prefix cache (engine.prefix_cache): a sequence prefills only the prompt tokens that
no slot of the cache holds yet.

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

from engine.prefix_cache import SlotPrefixes
from engine.tokens import GenerationResult, GenerationStats, SamplingParams, TokenStream, sampling_probs, verify_draft

log = logging.getLogger(__name__)

DEFAULT_STEP_TOKENS = 256   # tokens per step: decode tokens first, prefill chunks fill the rest


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
                 path: str = "native", mtp: bool = False, prefix_cache: bool = True, prefill_chunk: int = 0):
        if slots < 1 or max_model_len < 2:
            raise ValueError(f"a batch needs slots >= 1 and max_model_len >= 2, got {slots} and {max_model_len}")
        if not 1 <= step_tokens:
            raise ValueError(f"step_tokens must be positive, got {step_tokens}")
        if path not in ("native", "torch"):
            raise ValueError(f"path must be 'native' (engine.cpu.decode) or 'torch' (engine.batch_torch), got {path!r}")
        if path == "native":
            from engine.cpu.decode import MAX_STEP_TOKENS
            from engine.cpu.decode import CpuDecoder as decoder   # an fp32 model and cache on the CPU
            prefill_chunk = min(prefill_chunk, MAX_STEP_TOKENS)
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
        # a step holds step_tokens while a sequence decodes, prefill_chunk while none does (a lone prompt)
        self.decoder = decoder(model, self.cache, max_tokens=max(step_tokens, prefill_chunk))   # raises UnsupportedModel
        self.step_tokens = min(step_tokens, self.decoder.max_tokens)
        self.prefill_chunk = min(max(step_tokens, prefill_chunk), self.decoder.max_tokens)
        if self.step_tokens < slots:
            raise ValueError(f"{slots} sequences need steps of at least {slots} tokens, this decoder takes "
                             f"{self.step_tokens}")
        self.active: list[Sequence] = []             # in order of arrival
        self.steps = 0
        self.trace: list[dict] | None = None         # a list: each step's tokens, prefill rows, path and time
        self.prefixes = SlotPrefixes(self.cache, prefix_cache, mtp, self.active)   # the free slots, and what they hold
        # long prompts' experts streamed to the GPU (a CUDA host with a fleet): engine.gpu.hybrid_prefill
        self.streamed = getattr(model, "streamed_prefill", None) if path == "torch" else None
        from engine.batch_torch import cache_tensors
        cache_mb = sum(t.numel() * t.element_size() for t in cache_tensors(self.cache)) / 1e6
        log.info("batch decoder (%s path): %d slots of %d positions (%.0f MB of cache), steps of up to %d tokens",
                 path, slots, max_model_len, cache_mb, self.step_tokens)

    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def free(self) -> list[int]:
        """The free slots, least recently freed first."""
        return self.prefixes.free

    @property
    def prefix_cache(self) -> bool:
        return self.prefixes.enabled

    @prefix_cache.setter
    def prefix_cache(self, on: bool) -> None:
        self.prefixes.enabled = on and not self.cache.per_sequence()

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
        emit = (lambda *delta: report(on_text, *delta)) if on_text is not None else None   # an error stays its caller's
        slot, cached = self.prefixes.take(prompt)
        seq = Sequence(prompt, params, slot, TokenStream(self.tokenizer, prompt, params, device, emit),
                       should_stop, speculate=self.mtp and params.drafts_apply,
                       prefilled=cached, cached=cached, mtp_done=cached)
        seq.waits, seq.waits_for = self.prefixes.source(prompt, cached)
        self.active.append(seq)
        return seq

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
        budget = (budget or (self.step_tokens if ids else self.prefill_chunk)) - len(ids)
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
        began = time.perf_counter()
        finished = [s for s in self.active if s.should_stop is not None and s.should_stop()]
        for seq in finished:
            self._end(seq, "cancelled")
        if not self.active:
            return finished
        for seq in self.active:
            if seq.waits is not None:
                self.prefixes.resolve(seq)
        long = self._long_prompt()
        if long is not None:    # this step: its next chunk alone, the experts streamed to the GPU
            ids, positions, slots, wants, chunks = self._plan(long, self.streamed.chunk)
            t0 = time.perf_counter()
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
        forward = time.perf_counter() - t0   # the step's forward and logits
        if long is None and chunks and self.streamed is not None:   # the ducks' rate, for worth(): per token
            # of the step, decode rows included (a step of 31 decode rows and 10 prompt tokens is no
            # measure of 10 prompt tokens)
            self.streamed.fleet_timed(len(ids), forward)
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
        if self.trace is not None:
            self.trace.append({"tokens": len(ids), "prefill": sum(n for _, _, n, _ in chunks),
                               "streamed": long is not None,
                               "graph": getattr(self.decoder, "last_batch", True) is None,   # the torch path's replay
                               "ms": round((time.perf_counter() - began) * 1e3, 2),
                               "forward_ms": round(forward * 1e3, 2)})
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
            drafted = seq.out.constrain(logits[row])    # a draft the grammar forbids is never proposed
            if seq.params.temperature == 0.0:
                seq.draft, seq.q = int(drafted.argmax()), None
            else:
                seq.q = sampling_probs(drafted, seq.params)
                seq.draft = int(torch.multinomial(seq.q, 1, generator=seq.out.generator))

    def _verify(self, seq: Sequence, first: torch.Tensor, second: torch.Tensor, y: torch.Tensor, row: int) -> bool:
        """The pair (last token, draft): the draft verified against the main model's logits at
        its position (first), and when accepted the next token from the draft's row (second)
        for free. -> whether the sequence is done."""
        gen = seq.out.generator
        first = seq.out.constrain(first)
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
        self.prefixes.release(seq, keep=finish != "error")   # a failed step may have left the slot half written

    def fail_all(self) -> list[Sequence]:
        """Ends every active sequence (the step failed); returns them, their slots free."""
        ended = list(self.active)
        for seq in ended:
            self._end(seq, "error")
        return ended


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
                  mtp: bool = False, prefix_cache: bool = True, prefill_chunk: int = 0) -> BatchDecoder:
    """The BatchDecoder a model takes: on the CPU host the native decoder's (Llama, Qwen3,
    Qwen3-MoE), else the torch path's (other families with slot_batching, any with
    DUCK_CPU_NATIVE=0, and every family on a GPU host: decode steps from CUDA graphs per
    batch-size bucket, engine.gpu.batch_graphs). mtp: the batch drafts with the model's MTP
    layer (the torch path), or without MTP where it cannot (says why). prefill_chunk: the prompt
    tokens of a step while no sequence decodes (BatchDecoder). Raises UnsupportedModel
    (each path's reason) for a model no path takes."""
    from engine.cpu.decode import native_mode
    from engine.cpu.host_model import UnsupportedModel

    on_cpu = model.model.embed_tokens.weight.device.type == "cpu"
    if mtp and getattr(model, "mtp_layers", None):
        try:
            return BatchDecoder(model, tokenizer, slots, max_model_len, step_tokens, path="torch", mtp=True,
                                prefix_cache=prefix_cache, prefill_chunk=prefill_chunk)
        except (UnsupportedModel, ValueError) as e:
            log.warning("continuous batching without MTP drafts: %s", e)
    paths = ["native", "torch"] if on_cpu and native_mode() != "off" else ["torch"]
    why = []
    for path in paths:   # on the CPU host: the native decoder, else the torch path (a family it lacks)
        try:
            return BatchDecoder(model, tokenizer, slots, max_model_len, step_tokens, path=path,
                                prefix_cache=prefix_cache, prefill_chunk=prefill_chunk)
        except UnsupportedModel as e:
            why.append(f"{path} path: {e}")
    raise UnsupportedModel(f"no batched path for {type(model).__name__}: {'; '.join(why)}")


def report(fn, *args) -> None:
    """fn(*args) unless fn is None; an exception of it is logged, not raised (a caller's callback
    must not stop the batch or its runner)."""
    if fn is None:
        return
    try:
        fn(*args)
    except Exception:   # a caller's callback must not stop the runner
        log.exception("a batch job's callback failed")
