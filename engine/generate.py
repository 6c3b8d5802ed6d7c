"""Generation as plain functions: prefill, then one token at a time over a
static KV cache; greedy or temperature / top-k / top-p sampling with a seed;
stops on EOS, stop strings or max_tokens; streams text deltas."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.prefill import DEFAULT_CHUNK, check_chunk, prefill_hidden_overlapped, prefill_logits
from engine.tokenizer import Tokenizer
from engine.tokens import GenerationResult, GenerationStats, SamplingParams, TokenStream

log = logging.getLogger(__name__)


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
    return GenerationResult(out.out_ids, text, out.finish, stats, out.logits_kept, out.logprobs)


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
