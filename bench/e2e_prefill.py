"""The prefill phase of `duckctl bench e2e --synthetic` (bench/e2e_synthetic.py): a
prompt in chunks of `chunk` tokens (engine.prefill), each chunk one forward whose FFN
call per layer carries all its tokens. Reported per prompt: TTFT, prefill tok/s, the
per-layer split of one chunk (host stage, FFN call, duck kernel: the slowest duck's
time per request, summed, which may pass the call's wall time when requests are in
flight together; then no transport time is derived), the distinct experts
per layer per chunk (each is streamed once per request by every duck) and, on the
fleet, the requests a call was cut into (at most the ducks' announced max_tokens)."""
from __future__ import annotations

import statistics
import time

import torch

from engine.prefill import prefill_chunks, prefill_hidden, prefill_hidden_overlapped


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def measure_prefill(runner, prompt_len: int, chunk: int, room: int, overlap: bool = False) -> dict:
    """One prefill of prompt_len random tokens on runner (bench.e2e_synthetic.Runner);
    the cache is returned under "cache" with room positions left for decode steps.
    overlap: two chunks in flight (engine.prefill.prefill_hidden_overlapped) where the
    prompt has two or more."""
    model, timed, device = runner.model, runner.timed, runner.device
    cache = model.make_cache(prompt_len + room)
    ids, positions = runner._ids(prompt_len), torch.arange(prompt_len, device=device)
    timed.calls.clear()
    timed.routes.clear()
    timed.keep_device_routes = True      # one prefill: counting them afterwards costs nothing timed
    try:
        _sync(device)
        t0 = time.perf_counter()
        if overlap:
            hidden = prefill_hidden_overlapped(model, cache, ids, positions, chunk, last_only=True)
        else:
            hidden = prefill_hidden(lambda i, p: model(i, p, cache), ids, positions, chunk, last_only=True)
        int(model.compute_logits(hidden).argmax())
        ttft = time.perf_counter() - t0
    finally:
        timed.keep_device_routes = False
    chunks = len(prefill_chunks(prompt_len, chunk))
    ffn = sum(c[1] for c in timed.calls)
    kernel = sum(c[2] for c in timed.calls)
    per = chunks * runner.n_layers          # layer passes
    session = getattr(timed.backend, "session", None)
    pipelined = session is not None and getattr(session, "last_requests", 0) > 1
    distinct = [len(torch.unique(r[r >= 0])) for _, r in timed.routes]
    overlapped = overlap and chunks > 1
    out = {"prompt_len": prompt_len, "chunk": chunk, "chunks": chunks, "overlap": overlapped, "ttft_s": ttft,
           "prefill_tok_s": prompt_len / ttft,
           # overlapped, the FFN calls' wall time passes the share of the TTFT the host waited on them
           "per_layer_chunk_ms": {"host": None if overlapped else (ttft - ffn) * 1e3 / per,
                                  "ffn_call": ffn * 1e3 / per,
                                  "duck_kernel": kernel * 1e3 / per if kernel else None,
                                  # requests in flight overlap: the slowest duck of each, summed, is no wall time
                                  "transport": (ffn - kernel) * 1e3 / per if kernel and not pipelined else None},
           "distinct_experts_per_layer_chunk": statistics.mean(distinct) if distinct else None,
           "experts": model.config.num_experts or None,
           "cache": cache}
    if session is not None and getattr(session, "last_requests", 0):
        out["requests_per_call"] = {"requests": session.last_requests, "tokens": session.last_request_tokens,
                                    "in_flight": session.last_pipeline, "per_kernel_pass": session.last_group,
                                    "duck_max_tokens": session.duck_max_tokens}
    return out


def prefill_line(kind: str, p: dict) -> str:
    if "chunks" not in p:                # a result of before the chunked prefill: one forward
        return f"{kind:9s} prefill {p['prompt_len']:5d}: ttft {p['ttft_s']:.3f} s, {p['prefill_tok_s']:.1f} tok/s"
    split = p["per_layer_chunk_ms"]
    parts = ", ".join(f"{n} {v:.2f}" for n, v in split.items() if v is not None)
    line = (f"{kind:9s} prefill {p['prompt_len']:5d} in {p['chunks']} chunk(s) of <= {p['chunk']}"
            f"{', 2 in flight' if p.get('overlap') else ''}: ttft "
            f"{p['ttft_s']:.3f} s, {p['prefill_tok_s']:.1f} tok/s; per layer and chunk ms: {parts}")
    if p.get("distinct_experts_per_layer_chunk") is not None:
        line += f"; {p['distinct_experts_per_layer_chunk']:.1f} of {p['experts']} experts per layer and chunk"
    r = p.get("requests_per_call")
    if r:
        line += f"; {r['requests']} request(s) of <= {r['tokens']} tokens, {r['in_flight']} in flight"
    return line
