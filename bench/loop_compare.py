"""`python -m bench.loop_compare --synthetic qwen3-30b-a3b --json out.json`: the request loop
against the one-request path, in one run, on a synthetic model at real widths (bench.synthetic)
whose experts a fleet of local ducks holds (on a GPU host as duckd runs there; on the CPU too):

  one_request   one request through the path duckd takes where batching is off
                (engine.generate.generate; engine.mtp.generate_mtp where the model has an MTP
                head): TTFT, decode tok/s
  batch_of_one  the same request alone in the batch loop (engine.batch.BatchDecoder on the torch
                path: CUDA graphs per batch-size bucket where the family has them): TTFT, decode
                tok/s, and its ratio to one_request
  users         N requests at once in the loop (--users): tok/s while all of them decode, over
                batch_of_one's
  prefix        a chat of two turns in the loop: the first on --turn-tokens prompt tokens, the
                second its answer and --more new tokens, with the prefix cache on and then off:
                TTFTs, the tokens found cached, the ratio of the second TTFT to the first, and
                whether both second turns gave the same tokens

--parts picks some of them (e.g. --parts prefix: the prefix cache alone, a cheaper device call).
Both paths prefill long prompts with the model's streamed prefill (engine.gpu.hybrid_prefill:
the experts over PCIe, the ducks beside), as duckd installs it on a CUDA host with a fleet.
Tokens are random ids, every request greedy with ignore_eos (so lengths are fixed).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch

log = logging.getLogger("bench.loop_compare")


def word_tokenizer(vocab: int):
    """An engine Tokenizer over words 'w0' .. 'w<vocab-1>' (the ids are what matter here)."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from engine.tokenizer import Tokenizer
    hf = HfTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.decoder = decoders.WordPiece(prefix="##")
    return Tokenizer(hf, eos_token_ids=(1,), source="<words>")


class Loop:
    """The model, its tokenizer and one batch decoder; random prompts from one generator."""

    def __init__(self, model, slots: int, max_model_len: int, step_tokens: int, seed: int, prefill_chunk: int = 0):
        from engine.batch import BatchDecoder
        self.model, self.vocab = model, model.config.vocab_size
        self.tokenizer = word_tokenizer(self.vocab)
        self.mtp = bool(getattr(model, "mtp_layers", None))
        self.max_model_len = max_model_len
        self.batch = BatchDecoder(model, self.tokenizer, slots, max_model_len, step_tokens, path="torch",
                                  mtp=self.mtp, prefill_chunk=prefill_chunk)
        self.gen = torch.Generator().manual_seed(seed)

    def prompt(self, n: int) -> list[int]:
        return torch.randint(2, self.vocab, (n,), generator=self.gen).tolist()

    def one_request(self, prompt: list[int], tokens: int):
        """The one-request path (duckd's where batching is off) -> GenerationResult."""
        from engine.generate import generate
        from engine.tokens import SamplingParams
        from engine.mtp import generate_mtp
        run = generate_mtp if self.mtp else generate
        return run(self.model, self.tokenizer, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                   max_model_len=len(prompt) + tokens + 2)

    def in_loop(self, prompts: list[list[int]], tokens: int) -> tuple[list, float]:
        """prompts at once through the batch -> (their results, tok/s while all of them decoded)."""
        from engine.tokens import SamplingParams
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        seqs = [self.batch.add(p, params) for p in prompts]
        if any(s is None for s in seqs):
            raise ValueError(f"{len(prompts)} requests, {self.batch.slots} slots")
        while not all(s.decoding and s.out.out_ids for s in seqs):
            self.batch.step()
        out0, t0 = sum(len(s.out.out_ids) for s in seqs), time.perf_counter()
        while all(s.result is None for s in seqs):
            self.batch.step()
        rate = (sum(len(s.out.out_ids) for s in seqs) - out0) / (time.perf_counter() - t0)
        while self.batch.active:
            self.batch.step()
        return [s.result for s in seqs], rate


def _stats(result) -> dict:
    s = result.stats
    return {"ttft_s": round(s.ttft, 4), "decode_tok_s": round(s.decode_tps, 2), "prompt_tokens": s.input_len,
            "cached_tokens": s.cached, "tokens": s.output_len,
            **({"mtp_accepted": s.mtp[0], "mtp_verified": s.mtp[1]} if s.mtp else {})}


def measure(loop: Loop, args) -> dict:
    out: dict = {}
    loop.one_request(loop.prompt(16), 4)                         # warm-up: graphs, kernels, the ducks' workspace
    loop.in_loop([loop.prompt(16)], 4)
    if "decode" in args.parts:
        one, alone = [], []
        loop.batch.trace = []
        for _ in range(args.repeats):   # interleaved: a drift of the ducks' speed favours neither path
            one.append(loop.one_request(loop.prompt(args.prompt), args.tokens))
            alone.append(loop.in_loop([loop.prompt(args.prompt)], args.tokens)[0][0])
        decode = [s for s in loop.batch.trace if not s["prefill"]]
        loop.batch.trace = None
        if args.profile:   # where a decode step's time goes on each path
            with _profiled(True, "one request (the one-request path)", rows=15):
                loop.one_request(loop.prompt(args.prompt), args.tokens)
            with _profiled(True, "a batch of one (the loop)", rows=15):
                loop.in_loop([loop.prompt(args.prompt)], args.tokens)
        out["one_request"] = {"runs": [_stats(r) for r in one],
                              "decode_tok_s": statistics.median(r.stats.decode_tps for r in one)}
        out["batch_of_one"] = {"runs": [_stats(r) for r in alone],
                               "decode_tok_s": statistics.median(r.stats.decode_tps for r in alone),
                               # a decode step's time in BatchDecoder.step, and of it the forward and logits
                               "step_ms_median": statistics.median(s["ms"] for s in decode),
                               "forward_ms_median": statistics.median(s["forward_ms"] for s in decode)}
        out["batch_of_one_over_one_request"] = out["batch_of_one"]["decode_tok_s"] / out["one_request"]["decode_tok_s"]
        log.info("decode: one request %.2f tok/s, batch of one %.2f tok/s (%.3fx)", out["one_request"]["decode_tok_s"],
                 out["batch_of_one"]["decode_tok_s"], out["batch_of_one_over_one_request"])
    if "users" in args.parts:
        out["users"] = {}
        alone_rate = out.get("batch_of_one", {}).get("decode_tok_s")   # with --parts decode
        for n in args.users:
            _, rate = loop.in_loop([loop.prompt(args.prompt) for _ in range(n)], args.tokens)
            ratio = rate / alone_rate if alone_rate else None
            out["users"][str(n)] = {"tok_s": round(rate, 2), "over_batch_of_one": ratio}
            log.info("%d users: %.1f tok/s while all decode%s", n, rate, f" ({ratio:.2f}x one)" if ratio else "")
    if args.turn_tokens and "prefix" in args.parts:
        runs = [prefix_turns(loop, args) for _ in range(args.turn_repeats)]   # each a chat of its own
        out["prefix"] = runs[0] if len(runs) == 1 else {
            "runs": runs, "ttft_ratio_median": statistics.median(r["ttft_ratio"] for r in runs),
            "ttft_ratio_uncached_median": statistics.median(r["ttft_ratio_uncached"] for r in runs)}
    return out


def prefix_turns(loop: Loop, args) -> dict:
    """Two turns of one chat, the second with the prefix cache on, then off."""
    first_prompt = loop.prompt(args.turn_tokens)
    one_alone = loop.one_request(first_prompt, args.turn_out)        # the one-request path's TTFT at this length
    (first,), _ = loop.in_loop([first_prompt], args.turn_out)
    second_prompt = first_prompt + first.token_ids + loop.prompt(args.more)
    loop.batch.trace = []
    with _profiled(args.profile, "the second turn, prefix cache on"):
        (on,), _ = loop.in_loop([second_prompt], args.turn_out)
    steps, loop.batch.trace = loop.batch.trace, None
    loop.batch.prefix_cache = False
    try:
        (off,), _ = loop.in_loop([second_prompt], args.turn_out)
    finally:
        loop.batch.prefix_cache = True
    out = {"first": _stats(first), "second_cached": _stats(on), "second_uncached": _stats(off),
           "first_one_request_ttft_s": round(one_alone.stats.ttft, 4),
           "ttft_ratio": on.stats.ttft / first.stats.ttft,
           "ttft_ratio_uncached": off.stats.ttft / first.stats.ttft,
           "identical": on.token_ids == off.token_ids,
           "second_cached_first_steps": steps[:4]}   # the rest's prefill, then the first decode steps
    log.info("prefix: first turn %d tokens TTFT %.3f s (one-request path %.3f s); second %d tokens (%d cached) "
             "TTFT %.3f s = %.3fx, uncached %.3f s; identical %s", len(first_prompt), first.stats.ttft,
             one_alone.stats.ttft, len(second_prompt), on.stats.cached, on.stats.ttft, out["ttft_ratio"],
             off.stats.ttft, out["identical"])
    return out


class _profiled:
    """torch.profiler around a block where on: its top operators by self time (device, then host) logged."""

    def __init__(self, on: bool, what: str, rows: int = 25):
        self.on, self.what, self.rows, self.prof = on, what, rows, None

    def __enter__(self):
        if self.on:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is None:
            return False
        self.prof.__exit__(*exc)
        table = self.prof.key_averages()
        for key in (["self_cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]:
            log.info("profile of %s, by %s:\n%s", self.what, key, table.table(sort_by=key, row_limit=self.rows))
        return False


def _place(model, backend, text: str, streaming: bool):
    """The GPU's share of the experts within the budget text (duckd's model.gpu_ffn_budget: auto, bytes,
    a fraction of auto; streaming: a streamed prefill's buffers are kept free, as duckd does): the
    placement (None when it holds nothing) and its summary for the JSON."""
    from duckd.config import parse_budget
    from engine.placement import auto_budget, place

    budget = parse_budget(text, auto_budget(model, backend, streaming))
    resident = place(model, backend, budget, threads=max(1, len(os.sched_getaffinity(0)) - 1))
    summary = resident.plan.summary() if resident is not None else None
    log.info("placement %s: %s", text, summary)
    return resident, {"budget": text, "bytes": budget, **({k: v for k, v in summary.items()
                                                            if not isinstance(v, list)} if summary else {})}


def run(args) -> dict:
    from bench.synthetic_ducks import SyntheticFleet, synthetic_run
    from engine.gpu.expert_stream import ExpertStream, pinned_copy_gbps
    from engine.gpu.fp9_moe import fused_ready
    from engine.gpu.hybrid_prefill import StreamedPrefill

    device, dtype, config, out = synthetic_run(args)
    out.update(prompt_tokens=args.prompt, tokens=args.tokens)
    with SyntheticFleet(args, config, device, dtype) as synth:
        model, backend = synth.model, synth.backend
        stream = resident = None
        if args.budget != "0":       # as duckd's model.gpu_ffn_budget: the GPU computes its share beside
            resident, out["placement"] = _place(model, backend, args.budget, device.type == "cuda")
        # as duckd: long prompts' experts over PCIe, the ducks beside, for the layers the GPU does not hold whole
        layers = {i: v for i, v in backend.layers.items() if resident is None or not resident.whole(i)}
        if device.type == "cuda" and layers:
            stream = ExpertStream(layers, backend.hidden, device, threads=len(os.sched_getaffinity(0)))
            model.streamed_prefill = StreamedPrefill(stream, backend, "hybrid", pinned_copy_gbps(device))
        out["streamed_layers"] = len(layers) if stream is not None else 0
        try:
            longest = max(args.prompt + args.tokens, args.turn_tokens + args.more + 2 * args.turn_out) + 8
            loop = Loop(model, max(args.users + [1]) if "users" in args.parts else 1, longest, args.step_tokens, args.seed, args.prefill_chunk)
            out["mtp"] = loop.mtp
            out["graphs"] = getattr(loop.batch.decoder, "graphs", None) is not None
            out["fp9_grouped_gemms"] = fused_ready(device)    # steps of many pairs (engine.gpu.fp9_moe)
            out.update(measure(loop, args))
            del loop
        finally:
            model.streamed_prefill = None
            if stream is not None:
                stream.close()
            del model
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.synthetic_ducks import add_synthetic_arguments, run_and_write
    ap = argparse.ArgumentParser(prog="python -m bench.loop_compare", description=__doc__.split("\n\n")[0])
    add_synthetic_arguments(ap)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the decode runs")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each decode run generates")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--users", default="8,32", help="requests at once in the loop")
    ap.add_argument("--step-tokens", type=int, default=256, help="duckd's model.step_tokens")
    ap.add_argument("--prefill-chunk", type=int, default=1024, help="duckd's model.prefill_chunk")
    ap.add_argument("--turn-tokens", type=int, default=4000, help="the first turn's prompt (0: no prefix run)")
    ap.add_argument("--turn-out", type=int, default=32, help="tokens each turn generates")
    ap.add_argument("--more", type=int, default=40, help="the second turn's new prompt tokens")
    ap.add_argument("--turn-repeats", type=int, default=1, help="chats of two turns, each on a prompt of its own")
    ap.add_argument("--budget", default="0", help="the GPU's share of the experts, as duckd's model.gpu_ffn_budget "
                                                  "(0: none, the default; auto; bytes; a fraction of auto)")
    ap.add_argument("--profile", action="store_true", help="log torch.profiler's top operators of a decode run "
                                                             "on each path and of the cached second turn")
    ap.add_argument("--parts", default="decode,users,prefix", help="what to measure: any of decode (one request "
                                                                    "and a batch of one), users, prefix")
    ap.add_argument("--json", help="write the result here (default: stdout)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if not args.parts or set(args.parts) - {"decode", "users", "prefix"}:
        ap.error(f"--parts {','.join(args.parts)!r}: expected some of decode,users,prefix")
    try:
        args.users = [int(u) for u in args.users.split(",") if u]
    except ValueError:
        ap.error(f"--users {args.users!r}: expected counts, e.g. 8,32")
    if any(u <= 0 for u in args.users) or min(args.prompt, args.tokens, args.repeats) <= 1:
        ap.error("--users must be positive; --prompt, --tokens and --repeats at least 2")
    return run_and_write(run, args)


if __name__ == "__main__":
    sys.exit(main())
