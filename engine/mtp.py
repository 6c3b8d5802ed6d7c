"""MTP1 speculative decoding with DeepSeek's nextn layer.

Each step feeds the main model the last token and the MTP draft of the next one
at two consecutive positions, in one forward (so every FFN layer goes to the
backend once, with both tokens). A draft d drawn from the MTP head's
distribution q is accepted when u * q(d) <= p(d), p the main model's (no
division, as the seeds do it); a rejected draft is replaced by a draw from
max(0, p - q), which keeps the output distribution exactly p. Greedy is the
case d = argmax q, accepted iff d = argmax p. After an accepted draft the
main model's next token comes for free. A rejected draft's cache entry is
simply overwritten by the next step (the caches are static, indexed by position).
The MTP layer reads (main hidden state at i, embedding of token i+1) and drafts
token i+2; it keeps its own layer of the cache.

overlap="lanes" runs the verification pair as two lanes (engine.lanes): the
host computes the draft's attention while the ducks compute the token's FFN,
layer by layer; same result, the FFNs streamed per token instead of once.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.generate import cuda_decoder
from engine.lanes import (
    EagerLane,
    FfnWorker,
    StepTrace,
    run_two_lanes,
)
from engine.prefill import DEFAULT_CHUNK, check_chunk, prefill_hidden
from engine.tokenizer import Tokenizer
from engine.tokens import GenerationResult, GenerationStats, SamplingParams, TokenStream, sampling_probs, verify_draft

log = logging.getLogger(__name__)


class _Output(TokenStream):
    """Token bookkeeping of one request (engine.tokens.TokenStream: EOS, stop strings,
    max_tokens, streamed text), the tokens chosen here; push() says whether to go on."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, on_text, should_stop=None):
        super().__init__(tokenizer, [], params, None, on_text)
        self.should_stop = should_stop
        self.finish = None

    @property
    def ids(self) -> list[int]:
        return self.out_ids

    def push(self, token: int) -> bool:
        """Adds a token; False once the request is finished."""
        if self.add(token):
            self.finish = self.finish or "length"
            return False
        if self.should_stop is not None and self.should_stop():
            self.finish = "cancelled"
            return False
        return True


@torch.inference_mode()
def generate_mtp(model, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams | None = None,
                 on_text: Callable[[str], None] | None = None, max_model_len: int | None = None,
                 overlap: str = "batch", trace: StepTrace | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 prefill_chunk: int = DEFAULT_CHUNK) -> GenerationResult:
    """generate() with MTP1 drafts: token-identical to generate() when greedy, the same
    distribution when sampling; fewer main-model steps either way. overlap: "batch"
    (the pair in one forward) or "lanes" (the dual lane); trace collects the pair steps' times;
    prefill_chunk: prompt tokens per prefill forward (engine.prefill)."""
    params = params or SamplingParams()
    check_chunk(prefill_chunk)
    if overlap not in ("batch", "lanes"):
        raise ValueError(f"overlap must be 'batch' or 'lanes', got {overlap!r}")
    layers = getattr(model, "mtp_layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MTP layer (num_nextn_predict_layers=0, or the checkpoint "
                         f"lacks model.layers.<num_hidden_layers>.*); use engine.generate.generate")
    if not prompt_ids:
        raise ValueError("empty prompt")
    mtp = layers[0]
    n = len(prompt_ids)
    max_model_len = max_model_len or min(n + params.max_tokens, model.config.max_position_embeddings)
    if n >= max_model_len:
        raise ValueError(f"prompt of {n} tokens does not fit max_model_len={max_model_len}")
    device = model.model.embed_tokens.weight.device
    embed = model.model.embed_tokens
    decoder = cuda_decoder(model, max_model_len, steps=(2,) if overlap == "batch" else ())
    cache = decoder.cache if decoder is not None else model.make_cache(max_model_len)
    forward = decoder if decoder is not None else (lambda ids, positions: model(ids, positions, cache))
    out = _Output(tokenizer, params, on_text, should_stop)
    lanes = None
    try:
        if overlap == "lanes":
            backend = model.ffn_backend()
            pair = ((decoder.lane(1, "a"), decoder.lane(1, "b")) if decoder is not None
                    else (EagerLane(model, cache, "lane-a"), EagerLane(model, cache, "lane-b")))
            lanes = (*pair, FfnWorker(backend))
        eager = lambda ids, positions: model(ids, positions, cache)  # noqa: E731  (ids on the model's device)
        prefill = lambda ids, positions: prefill_hidden(eager, ids, positions, prefill_chunk)  # noqa: E731
        return _run(model, mtp, embed, cache, out, prompt_ids, params, max_model_len, device, lanes, trace, forward,
                    prefill)
    finally:
        for part in lanes or ():
            if isinstance(part, (EagerLane, FfnWorker)):   # the decoder keeps its graph lanes
                part.close()
        if decoder is not None:
            decoder.release()


def _run(model, mtp, embed, cache, out, prompt_ids, params, max_model_len, device, lanes, trace, forward, prefill):
    n = len(prompt_ids)
    accepted = verified = 0
    greedy = params.temperature == 0.0
    gen = None if greedy else torch.Generator(device=device)
    if gen is not None:
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())

    def draw(probs: torch.Tensor) -> int:
        return int(probs.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=gen))

    def dist(logits: torch.Tensor) -> torch.Tensor:   # at the output's next position: its grammar applies
        logits = out.constrain(logits)
        return torch.softmax(logits.float(), -1) if greedy else sampling_probs(logits, params)

    start = time.perf_counter()
    positions = torch.arange(n, device=device)
    hidden = prefill(torch.tensor(prompt_ids, device=device), positions)            # [n, H], in chunks
    token = draw(dist(model.compute_logits(hidden[-1:])[0]))
    ttft = time.perf_counter() - start
    going = out.push(token)
    follow = prompt_ids[1:] + [token]                                                # tokens i+1 for the MTP layer
    pos = n                                                                          # where `token` goes
    while going and pos < max_model_len:
        q = dist(mtp.draft(embed(torch.tensor(follow, device=device)), hidden, positions, cache)[-1])
        draft = draw(q)
        pair = pos + 1 < max_model_len
        ids = [token, draft] if pair else [token]
        positions = torch.arange(pos, pos + len(ids), device=device)
        step_ids = torch.tensor(ids, device=device)
        if pair and lanes is not None:
            hidden = run_two_lanes(lanes[0], lanes[1], lanes[2], step_ids, positions, trace)   # [2, H]
        elif pair and trace is not None:
            t0 = time.perf_counter()
            hidden = forward(step_ids, positions)
            trace.wall += time.perf_counter() - t0
        else:
            hidden = forward(step_ids, positions)                                    # [1 or 2, H]
        logits = model.compute_logits(hidden)                                        # [1 or 2, V]
        p = dist(logits[0])
        ok, token = verify_draft(p, q, draft, gen) if pair else (False, draw(p))
        going = out.push(token)
        if pair:
            verified += 1
            if ok:
                accepted += 1
                if going:
                    token = draw(dist(logits[1]))
                    going = out.push(token)
            else:
                hidden, positions = hidden[:1], positions[:1]
        follow = ids[1:len(positions)] + [token]
        pos += len(positions)
    elapsed = time.perf_counter() - start
    out.finish = out.finish or "length"
    text = out.close()
    stats = GenerationStats(n, len(out.ids), elapsed, ttft, mtp=(accepted, verified))
    log.info("%s", stats)
    return GenerationResult(out.ids, text, out.finish, stats)
