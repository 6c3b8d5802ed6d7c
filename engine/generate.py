"""Generation as plain functions: prefill, then one token at a time over a
static KV cache; greedy or temperature / top-k / top-p sampling with a seed;
stops on EOS, stop strings or max_tokens; streams text deltas."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.prefill import DEFAULT_CHUNK, check_chunk, prefill_hidden_overlapped, prefill_logits
from engine.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] -> a token id."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


class TokenStream:
    """What happens to each new token of one request, whoever computed its logits (generate()
    one request at a time, engine.batch many at once): the repetition penalty, sampling with
    the request's own generator, EOS, stop strings (text that might begin one held back),
    text deltas to on_text, and the final text."""

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
        self.text, self.emitted, self.finish = "", 0, "length"

    @property
    def plain_greedy(self) -> bool:
        """Its next token is the argmax of the logits and nothing else (greedy, no penalty, no logits
        kept): a caller with many such streams may take the argmax of all their rows at once and add() it."""
        p = self.params
        return p.temperature == 0.0 and p.repetition_penalty == 1.0 and not self.keep_logits

    def push(self, logits: torch.Tensor) -> bool:
        """logits [V] of the next token -> whether the request is done (eos, stop or max_tokens);
        self.out_ids[-1] is the token."""
        params = self.params
        logits = penalize(logits, self.prompt_ids + self.out_ids, params.repetition_penalty)
        if self.keep_logits:
            self.logits_kept.append(logits.float().cpu())
        return self.add(sample(logits, params, self.generator))

    def add(self, token: int) -> bool:
        """A token chosen by the caller -> whether the request is done (eos, stop or max_tokens)."""
        params = self.params
        self.out_ids.append(token)
        if token in self.eos:
            self.finish = "eos"
            return True
        self.text += self.stream.push(token)
        cut = min((i for i in (self.text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish = self.text[:cut], "stop"
            return True
        if self.on_text and len(self.text) - self.hold > self.emitted:
            self.on_text(self.text[self.emitted:len(self.text) - self.hold])
            self.emitted = len(self.text) - self.hold
        return len(self.out_ids) >= params.max_tokens

    def close(self, finish: str | None = None) -> str:
        """The request's final text (the last deltas go to on_text); finish overrides the reason."""
        self.finish = finish or self.finish
        if self.finish != "stop":
            body = self.out_ids[:-1] if self.finish == "eos" else self.out_ids
            self.text = self.tokenizer.decode(body, skip_special_tokens=True)
        if self.on_text and len(self.text) > self.emitted:
            self.on_text(self.text[self.emitted:])
            self.emitted = len(self.text)
        return self.text


@torch.inference_mode()
def generate(model, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
             on_text: Callable[[str], None] | None = None, max_model_len: int | None = None,
             keep_logits: bool = False, should_stop: Callable[[], bool] | None = None,
             prefill_chunk: int = DEFAULT_CHUNK) -> GenerationResult:
    """Runs one request. on_text receives text deltas as they become final
    (text that might begin a stop string is held back until it cannot);
    should_stop, asked after every token, ends the request ("cancelled") when true;
    prefill_chunk: prompt tokens per prefill forward (engine.prefill). A model with a
    streamed_prefill (engine.gpu.hybrid_prefill.StreamedPrefill, a CUDA host with a fleet)
    prefills a prompt it judges long enough in passes of its own chunk, the GPU and the ducks
    sharing each layer's experts."""
    params = params or SamplingParams()
    check_chunk(prefill_chunk)
    if not prompt_ids:
        raise ValueError("empty prompt")
    max_model_len = max_model_len or min(len(prompt_ids) + params.max_tokens, model.config.max_position_embeddings)
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len={max_model_len}")
    device = model.model.embed_tokens.weight.device
    out = TokenStream(tokenizer, prompt_ids, params, device, on_text, keep_logits)
    decoder = cuda_decoder(model, max_model_len)   # None on the CPU: a cache of this request, eager steps
    # on the CPU the prefill chunks and the decode steps in C (on its own cache), where the model is supported
    native, cache = (None, decoder.cache) if decoder is not None else \
        cpu_decoder(model, max_model_len, min(prefill_chunk, len(prompt_ids)))
    finish = None

    start = time.perf_counter()
    step_device = "cpu" if decoder is not None else device   # the decoder takes host ids and positions
    ids = torch.tensor(prompt_ids, dtype=torch.int64, device=step_device)
    positions = torch.arange(len(prompt_ids), device=step_device)
    ttft = 0.0
    forward = decoder if decoder is not None else (lambda i, p: model(i, p, cache))
    streamed = getattr(model, "streamed_prefill", None)   # engine.gpu.hybrid_prefill.StreamedPrefill
    try:
        while True:
            if native is not None:
                logits = native(ids, positions)[-1] if out.out_ids else native.prefill(ids, positions, prefill_chunk)
            elif out.out_ids:
                logits = model.compute_logits(forward(ids, positions)[-1:])[0]                     # [V]
            elif streamed is not None and streamed.worth(len(prompt_ids)):   # experts over PCIe, ducks beside
                with streamed.hook(len(prompt_ids)):
                    logits = prefill_logits(model, forward, ids, positions, streamed.chunk)
            elif len(prompt_ids) > prefill_chunk and _ffn_overlaps_host(model):   # two chunks in flight
                logits = model.compute_logits(prefill_hidden_overlapped(
                    model, cache, ids.to(device), positions.to(device), prefill_chunk, last_only=True))[0]
            else:
                logits = prefill_logits(model, forward, ids, positions, prefill_chunk)             # [V]
            done = out.push(logits)
            if len(out.out_ids) == 1:
                ttft = time.perf_counter() - start
                if streamed is not None and not streamed.worth(len(prompt_ids)):
                    streamed.fleet_timed(len(prompt_ids), ttft)
            if done:
                break
            pos = int(positions[-1]) + 1
            if pos >= max_model_len:
                break
            if should_stop is not None and should_stop():
                finish = "cancelled"
                break
            ids = torch.tensor([out.out_ids[-1]], dtype=torch.int64, device=step_device)
            positions = torch.tensor([pos], device=step_device)
    finally:
        if decoder is not None:
            decoder.release()
    elapsed = time.perf_counter() - start
    text = out.close(finish)
    stats = GenerationStats(len(prompt_ids), len(out.out_ids), elapsed, ttft)
    log.info("%s", stats)
    return GenerationResult(out.out_ids, text, out.finish, stats, out.logits_kept)


def _ffn_overlaps_host(model) -> bool:
    try:
        return model.ffn_backend().overlaps_host
    except (AttributeError, ValueError, RuntimeError):   # no FFN layers, or no single backend
        return False


def cuda_decoder(model, max_model_len: int, steps: tuple[int, ...] = (1,)):
    """engine.gpu.decode's decoder when the model is on CUDA: the cache reused across
    requests, steps of the sizes in `steps` replayed from CUDA graphs; None on the CPU,
    with graphs off (DUCK_CUDA_GRAPHS=0) or while another request holds it."""
    if model.model.embed_tokens.weight.device.type != "cuda":
        return None
    from engine.gpu.decode import cuda_decoder as decoder_for
    return decoder_for(model, max_model_len, steps)


def cpu_decoder(model, max_model_len: int, prefill_chunk: int = 0):
    """(engine.cpu.decode's native decoder, its cache of max_model_len positions) for the
    prefill (in chunks of prefill_chunk tokens, at most its limit) and the decode steps of
    a model on the CPU; (None, model.make_cache's) on CUDA, for a model it does not run
    (it says why at debug level) or with DUCK_CPU_NATIVE=0."""
    if model.model.embed_tokens.weight.device.type != "cpu":
        return None, model.make_cache(max_model_len)
    from engine.cpu.decode import MAX_STEP_TOKENS, MAX_TOKENS, decoder_on_own_cache
    return decoder_on_own_cache(model, max_model_len,
                                max_tokens=min(max(MAX_TOKENS, prefill_chunk), MAX_STEP_TOKENS))


@torch.inference_mode()
def forward_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, V] for every position of token_ids in one prefill (tests, scoring)."""
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(len(token_ids), device=device), model.make_cache(len(token_ids)))
    return model.compute_logits(hidden)
