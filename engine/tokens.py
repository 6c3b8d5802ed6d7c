"""Token logic, in a room of its own: what happens to each new token of a request, whoever
computed its logits (engine.batch's loop, engine.generate and engine.mtp one request at a time),
and what the daemon reads back.

    SamplingParams     a request's sampling: temperature, top-k, top-p, seed, stop strings,
                       max_tokens, repetition penalty, frequency and presence penalties, logprobs,
                       the grammar its output must match (engine.grammar)
    TokenStream        one request's tokens: penalty, the grammar's mask, sampling with its own
                       generator, EOS, stop strings (text that might begin one held back), text
                       deltas, final text
    verify_draft       an MTP draft kept or replaced so that the output keeps its distribution
    GenerationStats    TTFT, decode rate, prompt tokens found in the prefix cache, MTP acceptance
    GenerationResult   the tokens, the text, why it ended, the stats

A per-request feature (logprobs, a grammar's mask) belongs here, once: every loop calls
TokenStream.push or add for every token, and constrain() on the logits it draws a token or an MTP
draft from itself.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.grammar import Grammar
from engine.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20   # the likeliest alternatives a token's log-probability comes with, at most (OpenAI's bound)


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A chosen token, its log-probability and the likeliest tokens' ((id, log-probability), ...),
    from the distribution it was drawn from before temperature, top-k and top-p (the penalties
    applied, a grammar's mask not: the model's own belief)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0      # 0: greedy
    top_k: int = 0                # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0   # > 1: tokens already in the sequence are less likely (transformers' rule)
    frequency_penalty: float = 0.0    # OpenAI's: each generated token's logit less this times its count so far
    presence_penalty: float = 0.0     # ... and less this once it has been generated at all
    logprobs: int | None = None       # each chosen token's log-probability and this many likeliest (None: none)
    grammar: Grammar | None = None    # the output must match it (engine.grammar); drafts are masked by it too

    @property
    def drafts_apply(self) -> bool:
        """MTP drafts may decode it: a draft knows no penalty and brings no log-probabilities."""
        return (self.repetition_penalty == 1.0 and not self.frequency_penalty and not self.presence_penalty
                and self.logprobs is None)

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be 0 .. {MAX_LOGPROBS} alternatives, got {self.logprobs}")
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(slots=True)
class GenerationStats:
    input_len: int
    output_len: int
    time: float   # seconds, request start to last token
    ttft: float   # seconds, request start to first token
    mtp: tuple[int, int] | None = None   # MTP1 drafts (accepted, verified), when speculative decoding ran
    cached: int = 0                      # prompt tokens found in the prefix cache (engine.batch), not prefilled

    @property
    def tpot(self) -> float:
        return (self.time - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def prefill_tps(self) -> float:
        return (self.input_len - self.cached) / self.ttft if self.ttft > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return (self.output_len - 1) / (self.time - self.ttft) if self.output_len > 1 and self.time > self.ttft else 0.0

    def __str__(self) -> str:
        return (f"Generation stats: time {self.time:.3f}s, input_len {self.input_len}, "
                f"output_len {self.output_len}, ttft {self.ttft:.3f}s, tpot {self.tpot:.3f}s, "
                f"prefill {self.prefill_tps:.3f} tok/s, decode {self.decode_tps:.3f} tok/s"
                + (f", accept=1 {self.mtp[0]}/{self.mtp[1]}" if self.mtp is not None else "")
                + (f", cached {self.cached}" if self.cached else ""))


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str   # "eos", "stop" or "length"
    stats: GenerationStats
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when asked for
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token of the text, when asked for


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> the distribution sampling draws from (temperature, top-k, top-p applied)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def penalize(logits: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """logits [V] with the tokens in seen made less likely, as transformers' repetition
    penalty does: a positive logit divided by penalty, a negative one multiplied."""
    if penalty == 1.0 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), device=logits.device)
    picked = logits[ids]
    return logits.index_copy(0, ids, torch.where(picked > 0, picked / penalty, picked * penalty))


def penalize_counts(logits: torch.Tensor, generated: list[int], frequency: float, presence: float) -> torch.Tensor:
    """logits [V] less frequency x each token's count in generated and presence for each token in
    it (OpenAI's frequency and presence penalties: negative values make repeats likelier)."""
    if not generated or (not frequency and not presence):
        return logits
    ids, counts = torch.tensor(generated, device=logits.device).unique(return_counts=True)
    return logits.index_add(0, ids, -(frequency * counts.to(logits.dtype) + presence))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] -> a token id."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


class TokenStream:
    """What happens to each new token of one request, whoever computed its logits (generate()
    one request at a time, engine.batch many at once): the penalties, sampling with the
    request's own generator, the log-probabilities asked for, EOS, stop strings (text that might
    begin one held back), text deltas to on_text, and the final text. With logprobs asked for,
    on_text(text, entries) gets the TokenLogprobs of the tokens read since the last delta too
    (all but an ending EOS's)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams, device,
                 on_text: Callable[[str], None] | None = None, keep_logits: bool = False):
        self.tokenizer, self.prompt_ids, self.params, self.on_text = tokenizer, prompt_ids, params, on_text
        self.generator = None
        if params.temperature > 0 and device is not None:   # None: the caller samples (engine.mtp)
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.eos = set() if params.ignore_eos else set(tokenizer.eos_token_ids)
        self.stream = StreamDecoder(tokenizer)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.out_ids: list[int] = []
        self.logits_kept: list[torch.Tensor] = []
        self.keep_logits = keep_logits
        self.logprobs: list[TokenLogprob] = []
        self.logprobs_sent = 0
        self.text, self.emitted, self.finish = "", 0, "length"
        self.grammar = params.grammar.start() if params.grammar is not None else None

    @property
    def plain_greedy(self) -> bool:
        """Its next token is the argmax of the logits and nothing else (greedy, no penalty, no logits
        or log-probabilities kept): a caller with many such streams may take the argmax of all their
        rows at once and add() it."""
        p = self.params
        return p.temperature == 0.0 and p.drafts_apply and not self.keep_logits and self.grammar is None

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] of the next token with what the grammar forbids there at -inf (no grammar: as
        they are). For a caller that draws the token (or an MTP draft) itself and then add()s it."""
        return logits if self.grammar is None else self.grammar.constrain(logits)

    def push(self, logits: torch.Tensor) -> bool:
        """logits [V] of the next token -> whether the request is done (eos, stop or max_tokens);
        self.out_ids[-1] is the token."""
        params = self.params
        logits = penalize(logits, self.prompt_ids + self.out_ids, params.repetition_penalty)
        logits = penalize_counts(logits, self.out_ids, params.frequency_penalty, params.presence_penalty)
        if self.keep_logits:
            self.logits_kept.append(logits.float().cpu())
        token = sample(self.constrain(logits), params, self.generator)
        if params.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, params.logprobs))
        return self.add(token)

    def add(self, token: int) -> bool:
        """A token chosen by the caller -> whether the request is done (eos, stop or max_tokens)."""
        params = self.params
        self.out_ids.append(token)
        if token in self.eos:
            self.finish = "eos"
            return True
        if self.grammar is not None and not self.grammar.accept(token):
            # a caller that did not constrain(), or the grammar's own limits: the state is in error and
            # its masks leave only EOS, so this request ends; the batch's others go on
            log.warning("token %d is not allowed by the request's grammar (%s): the output ends here",
                        token, self.grammar.error.splitlines()[0][:200] if self.grammar.error else "")
        self.text += self.stream.push(token)
        cut = min((i for i in (self.text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish = self.text[:cut], "stop"
            return True
        if self.on_text and len(self.text) - self.hold > self.emitted:
            self._emit(self.text[self.emitted:len(self.text) - self.hold])
            self.emitted = len(self.text) - self.hold
        return len(self.out_ids) >= params.max_tokens

    def _emit(self, text: str) -> None:
        if self.params.logprobs is None:
            self.on_text(text)
            return
        entries = self.logprobs[self.logprobs_sent:]
        self.logprobs_sent = len(self.logprobs)
        self.on_text(text, entries)

    def close(self, finish: str | None = None) -> str:
        """The request's final text (the last deltas go to on_text); finish overrides the reason."""
        self.finish = finish or self.finish
        if self.finish != "stop":
            body = self.out_ids[:-1] if self.finish == "eos" else self.out_ids
            self.text = self.tokenizer.decode(body, skip_special_tokens=True)
        if self.finish == "eos" and len(self.logprobs) == len(self.out_ids):
            self.logprobs.pop()                    # the EOS is not in the text
        if self.on_text and (len(self.text) > self.emitted or self.logprobs_sent < len(self.logprobs)):
            self._emit(self.text[self.emitted:])
            self.emitted = len(self.text)
        return self.text


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """token's log-probability under softmax(logits [V]) and the top likeliest tokens'."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(lp, min(top, lp.numel())) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(lp[token]), pairs)


def verify_draft(p: torch.Tensor, q: torch.Tensor | None, draft: int,
                 gen: torch.Generator | None) -> tuple[bool, int]:
    """The main model's distribution p [V] at the draft's position, the MTP head's q [V] the
    draft was drawn from (gen None: greedy, q unused) -> (accepted, the token there): the draft
    when u * q(d) <= p(d) (greedy: d = argmax p), else a draw from max(0, p - q) (greedy:
    argmax p), which keeps the output distributed as p. Shared by generate_mtp and engine.batch."""
    if gen is None:
        best = int(p.argmax())
        return best == draft, best
    u = float(torch.rand((), generator=gen, device=p.device))
    if u * float(q[draft]) <= float(p[draft]):
        return True, draft
    residual = (p - q).clamp_min(0.0)
    probs = residual / residual.sum() if float(residual.sum()) > 0 else p
    return False, int(torch.multinomial(probs, 1, generator=gen))
