"""`python -m bench long_context` (`duckctl bench long_context`): DeepSeek-V3.2 at long contexts.

A synthetic DeepSeek model at real widths (bench.synthetic: random host weights, the expert FFNs
on a fleet of local ducks as bench/e2e_synthetic.py runs them, or every expert on the GPU with
--backend gpu), and:

  decode      tok/s of one sequence at each context of --contexts (default 1k, 32k, 128k), each
              over the first: past index_topk (2048) tokens a query scores every earlier token
              with the lightning indexer and attends to its best index_topk (engine.models.
              deepseek_dsa), so a step's cost should barely grow with the context (the bar:
              32k and 128k >= 0.7 x 1k). No prompt of 128k tokens is prefilled for it: the cache
              (context + steps + slack positions) has positions [0, context) filled with random
              values of the right scale (latents and rotary keys N(0, 1), the indexer's keys
              random fp8 with their scales, as deepseek_dsa.quantize makes them), a block at a
              time, and the steps run from position `context` (CUDA graphs on CUDA, as
              bench.e2e_synthetic.Runner replays them). Every context is random-filled alike;
              contexts up to --real-prefill-max are also decoded after a real prefill.
  prefill     TTFT and tok/s of a --prefill token prompt (default 32768): on CUDA with a fleet
              the streamed GPU prefill duckd installs (engine.gpu.hybrid_prefill.StreamedPrefill:
              the experts over PCIe, the ducks beside; --gpu-prefill auto), else the fleet's
              chunks (engine.prefill, two in flight); "method" says which. Then a few decode
              steps on the prompt's real cache.

The result goes to --out (default bench/results/<date>-deepseek-long-<machine>.json, printed):
commit, machine, shape, layers, decode_tok_s {context: tok/s}, decode_ratio_to_first,
prefill_tok_s_<N>, ttft_s_<N>, index_topk, bytes_cache_per_token and the detail (per context:
step ms median / p90, steps, how the cache was filled). --tiny shrinks every width (tests, CI).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.prefill import DEFAULT_CHUNK

log = logging.getLogger("bench.long_context")

BAR = 0.7                  # each context's decode tok/s over the first context's, at least
SLACK = 8                  # cache positions past the last step (a CUDA graph's capture writes the last ones)
FILL_BLOCK = 8192          # positions per layer filled at once (the random keys' fp32 temporaries stay small)
RESULTS = Path(__file__).resolve().parent / "results"

# --tiny: every width shrunk, the structure kept (MLA with q_lora, grouped routing, the indexer, YaRN)
TINY = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 16, "num_experts_per_tok": 4}
TINY_EXTRA = {"kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
              "v_head_dim": 32, "n_group": 4, "topk_group": 2, "index_n_heads": 4, "index_head_dim": 32}


class OutOfMemory(RuntimeError):
    """A measurement that did not fit the device, with what it was measuring."""


def long_config(args):
    """The synthetic config (bench.synthetic.synthetic_config) with --tiny's widths and --index-topk."""
    from bench.synthetic import synthetic_config
    config = synthetic_config(args.synthetic, args.layers, args.experts, args.dense_layers)
    if "kv_lora_rank" not in config.extra:
        raise ValueError(f"--synthetic {args.synthetic}: not a DeepSeek (MLA) shape")
    fields, extra = {}, dict(config.extra)
    if args.tiny:
        fields = {**TINY, "head_dim": 0}
        if args.experts is not None:
            fields["num_experts"] = args.experts
        extra.update(TINY_EXTRA)
    if args.index_topk is not None:
        if "index_topk" not in extra:
            raise ValueError(f"--index-topk: {args.synthetic} has no lightning indexer")
        extra["index_topk"] = args.index_topk
    return dataclasses.replace(config, **fields, extra=extra) if fields or extra != config.extra else config


def _oom(e: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, oom) or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def fill_cache(cache, context: int, ue8m0: bool, seed: int, block: int = FILL_BLOCK) -> float:
    """Positions [0, context) of every layer of cache (an MlaCache) random, a block at a time:
    latents and rotary keys N(0, 1) in the cache's dtype, the indexer's keys N(0, 1) rounded
    to fp8 with a scale per key (deepseek_dsa.quantize: what the indexer writes); unrounded
    keys with scale 1 where the cache keeps them exact. Returns the seconds it took."""
    from engine.models.deepseek_dsa import FP8, quantize
    device = cache.latent.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    t0 = time.perf_counter()
    for layer in range(cache.latent.shape[0]):
        for a in range(0, context, block):
            b = min(context, a + block)
            cache.latent[layer, a:b].normal_(generator=gen)
            cache.k_rope[layer, a:b].normal_(generator=gen)
            if cache.index_k is None:
                continue
            keys = cache.index_k[layer, a:b]
            if keys.dtype == FP8:
                values, scales = quantize(torch.randn(b - a, keys.shape[-1], generator=gen, device=device), ue8m0)
                keys.view(torch.uint8).copy_(values.view(torch.uint8))
                cache.index_scale[layer, a:b].copy_(scales)
            else:
                keys.normal_(generator=gen)
                cache.index_scale[layer, a:b].fill_(1.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _steps(decode: dict, warmup: int) -> dict:
    """Runner.decode's result, its first warmup steps left out of the figures."""
    walls = decode["step_ms_all"][warmup:] or decode["step_ms_all"]
    med = statistics.median(walls)
    p90 = sorted(walls)[min(len(walls) - 1, round(0.9 * (len(walls) - 1)))]
    keep = ("driver", "cuda_graphs", "head_ms", "per_layer_ms", "ffn_bytes_streamed_per_step", "routing")
    return {"steps": len(walls), "warmup_steps": len(decode["step_ms_all"]) - len(walls),
            "step_ms_median": med, "step_ms_p90": p90, "tok_s": 1e3 / med,
            "step_ms_all": decode["step_ms_all"], **{k: decode.get(k) for k in keep}}


class LongContext:
    """The measurements on one model and backend (a bench.e2e_synthetic.Runner)."""

    def __init__(self, runner, args):
        self.runner, self.args = runner, args
        self.model, self.device = runner.model, runner.device
        self.index_topk = self.model.args.index_topk

    def _attention(self, cache_len: int, position: int) -> str:
        """The path a decode step at position takes (engine.models.deepseek_v3): under a CUDA graph
        a step reads the whole cache (static_decode), eager steps up to their position."""
        end = cache_len if self.runner.use_graphs else position + 1
        return "sparse" if self.index_topk and end > self.index_topk else "dense"

    def decode_random(self, context: int) -> dict:
        """steps decode steps from position context over a cache whose first context positions are random."""
        a = self.args
        size = context + a.warmup + a.steps + SLACK
        log.info("context %d: cache of %d positions (%.1f MB), filling [0, %d) at random", context, size,
                 size * self.model.cache_bytes_per_token(mtp=True) / 1e6, context)
        cache = None
        try:
            cache = self.model.make_cache(size)
            fill_s = fill_cache(cache, context, self.model.args.index_ue8m0, a.seed + context)
            decode = self.runner.decode(cache, context, a.warmup + a.steps)
        except Exception as e:
            if _oom(e):
                raise OutOfMemory(f"out of memory decoding at context {context} (a cache of {size} positions, "
                                  f"{size * self.model.cache_bytes_per_token(mtp=True) / 1e9:.2f} GB): {e}") from e
            raise
        finally:
            del cache
            _free(self.device)
        out = {"context": context, "filled": "random", "fill_s": round(fill_s, 3), "cache_positions": size,
               "attention": self._attention(size, context), **_steps(decode, a.warmup)}
        log.info("context %d (%s attention, random cache): %.2f ms median step, %.2f tok/s", context,
                 out["attention"], out["step_ms_median"], out["tok_s"])
        return out

    def decode_prefilled(self, context: int) -> dict:
        """The same steps after a real prefill of context random tokens (the fleet's chunks)."""
        a = self.args
        room = a.warmup + a.steps + SLACK
        try:
            pre = self.runner.prefill(context, room, a.prefill_chunk, overlap=True)
            cache = pre.pop("cache")
            decode = self.runner.decode(cache, context, a.warmup + a.steps)
            del cache
        except Exception as e:
            if _oom(e):
                raise OutOfMemory(f"out of memory prefilling and decoding at context {context}: {e}") from e
            raise
        finally:
            _free(self.device)
        out = {"context": context, "filled": "prefill", "prefill_ttft_s": pre["ttft_s"],
               "prefill_tok_s": pre["prefill_tok_s"], "cache_positions": context + room,
               "attention": self._attention(context + room, context), **_steps(decode, a.warmup)}
        log.info("context %d after a real prefill (TTFT %.3f s): %.2f ms median step, %.2f tok/s", context,
                 pre["ttft_s"], out["step_ms_median"], out["tok_s"])
        return out

    @torch.inference_mode()
    def prefill(self, n: int) -> dict:
        """TTFT of an n-token prompt (--prefill-repeats times, the best kept: a streamed prefill tries
        both its plans, then runs the faster) and decode steps on the best one's cache."""
        a = self.args
        room = a.warmup + a.steps + SLACK
        streamed, method = None, "chunks"
        try:
            streamed = self._streamed()
            if streamed is not None:
                method = "streamed"
                warm = min(n, 2048)    # the split's rates, the kernels' first compiles, the stream's buffers
                for _ in range(2):
                    self._streamed_once(streamed, warm, room).pop("cache")
            runs = []
            for _ in range(a.prefill_repeats):    # one cache at a time: the best one's is kept
                r = (self._streamed_once(streamed, n, room) if streamed is not None
                     else self.runner.prefill(n, room, a.prefill_chunk, overlap=True))
                if runs and r["ttft_s"] >= min(x["ttft_s"] for x in runs):
                    r.pop("cache")
                else:
                    for x in runs:
                        x.pop("cache", None)
                runs.append(r)
                _free(self.device)
            best = min(runs, key=lambda r: r["ttft_s"])
            cache = best.pop("cache")
            decode = self.runner.decode(cache, n, a.warmup + a.steps)
            del cache
        except Exception as e:
            if _oom(e):
                raise OutOfMemory(f"out of memory in the prefill of {n} tokens ({method}): {e}") from e
            raise
        finally:
            if streamed is not None:
                self.model.streamed_prefill = None
                streamed.close()
            _free(self.device)
        out = {"prompt_len": n, "method": method, "ttft_s": best["ttft_s"], "prefill_tok_s": best["prefill_tok_s"],
               "ttft_s_all": [round(r["ttft_s"], 4) for r in runs],
               **{k: best[k] for k in ("chunk", "chunks", "overlap", "plan", "per_layer_chunk_ms") if k in best}}
        if streamed is not None:
            out["plans"] = [r["plan"] for r in runs]
            out["pcie_gbps"] = streamed.split.pcie_s_per_byte and 1e-9 / streamed.split.pcie_s_per_byte
        out["decode_after"] = {"context": n, "filled": "prefill", "attention": self._attention(n + room, n),
                               **_steps(decode, a.warmup)}
        log.info("prefill of %d tokens (%s): TTFT %.3f s, %.1f tok/s; decode after it %.2f tok/s", n, method,
                 out["ttft_s"], out["prefill_tok_s"], out["decode_after"]["tok_s"])
        return out

    def _streamed(self):
        """engine.gpu.hybrid_prefill.StreamedPrefill as duckd installs it on a CUDA host with a fleet
        (duckd.model_host), or None (--gpu-prefill off, no CUDA, or the experts already on the GPU)."""
        a = self.args
        if a.gpu_prefill == "off" or a.backend != "fleet" or (a.gpu_prefill == "auto" and self.device.type != "cuda"):
            return None
        from engine.gpu.expert_stream import ExpertStream, pinned_copy_gbps
        from engine.gpu.hybrid_prefill import StreamedPrefill
        backend = self.runner.timed.backend
        stream = ExpertStream(backend.layers, backend.hidden, self.device, threads=len(os.sched_getaffinity(0)))
        streamed = StreamedPrefill(stream, backend, "hybrid", pinned_copy_gbps(self.device), chunk=a.gpu_prefill_chunk)
        streamed.placed(self.model.__dict__.get("resident"))    # no placement here: every layer is streamed
        self.model.streamed_prefill = streamed
        return streamed

    def _streamed_once(self, streamed, n: int, room: int) -> dict:
        """One prefill of n random tokens as engine.generate runs a long prompt with a streamed prefill."""
        from bench.e2e_prefill import _sync
        from engine.prefill import prefill_chunks, prefill_hidden
        model, device = self.model, self.device
        cache = model.make_cache(n + room)
        ids, positions = self.runner._ids(n), torch.arange(n, device=device)
        _sync(device)
        t0 = time.perf_counter()
        hook = streamed.hook(n)
        with hook:
            hidden = prefill_hidden(lambda i, p: model(i, p, cache), ids, positions, streamed.chunk, last_only=True)
        int(model.compute_logits(hidden).argmax())
        ttft = time.perf_counter() - t0
        log.info("streamed prefill of %d tokens (plan %s): TTFT %.3f s", n, hook.plan, ttft)
        return {"ttft_s": ttft, "prefill_tok_s": n / ttft, "plan": hook.plan, "chunk": streamed.chunk,
                "chunks": len(prefill_chunks(n, streamed.chunk)), "cache": cache}


def build(args, config, device, dtype):
    """(model, backend, closer) for --backend: the fleet of local ducks or every expert on the device."""
    from bench.synthetic import build_host_model, install_random_torch_experts
    if args.backend == "fleet":
        from bench.synthetic_ducks import SyntheticFleet
        fleet = SyntheticFleet(args, config, device, dtype).__enter__()
        return fleet.model, fleet.backend, fleet.__exit__
    model = build_host_model(config, device, dtype, seed=args.seed)
    backend = install_random_torch_experts(model, device)
    return model, backend, (lambda: None)


def machine_name(device) -> str:
    """The machine in a file name: the GPU's model (h100, h200, ...) or cpu."""
    if torch.device(device).type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]\d{2,4})\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def run(args) -> tuple[dict, list[str]]:
    """The result and the errors (contexts or the prefill that ran out of memory)."""
    from bench.e2e_synthetic import Runner
    from bench.synthetic import NOTE
    from bench.synthetic_ducks import commit

    cuda = torch.cuda.is_available() and args.gpu != "off"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = long_config(args)
    c = commit()
    result: dict = {
        "note": NOTE, "commit": None if c == "unknown" else c, "date": time.strftime("%Y-%m-%d"),
        "machine": torch.cuda.get_device_name(device) if cuda else "cpu", "cpus": len(os.sched_getaffinity(0)),
        "host_device": device.type, "host_dtype": str(dtype).removeprefix("torch."), "backend": args.backend,
        "layers": config.num_hidden_layers, "argv": args.argv}
    if args.backend == "fleet":
        result["fleet"] = {"ducks": args.ducks, "duck_threads": args.duck_threads, "pin_ducks": args.pin_ducks}
    model, backend, close = build(args, config, device, dtype)
    errors: list[str] = []
    try:
        a = model.args
        result["shape"] = {"name": args.synthetic, "tiny": args.tiny, "hidden": config.hidden_size,
                           "heads": config.num_attention_heads, "experts": config.num_experts,
                           "experts_per_token": config.num_experts_per_tok, "dense_layers": len(a.dense_layers),
                           "moe_intermediate": config.moe_intermediate_size, "kv_lora_rank": a.kv_lora_rank,
                           "qk_rope_head_dim": a.qk_rope_head_dim, "index_n_heads": a.index_n_heads,
                           "index_head_dim": a.index_head_dim}
        result["index_topk"] = a.index_topk
        result["bytes_cache_per_token"] = model.cache_bytes_per_token()
        runner = Runner(model, backend, device, use_graphs=not args.no_graphs)
        bench = LongContext(runner, args)
        result["cuda_graphs"] = runner.use_graphs
        log.info("warm-up")
        runner.decode(runner.prefill(8, 4)["cache"], 8, 2)   # allocations, first touches
        if args.prefill or any(ctx <= args.real_prefill_max for ctx in args.contexts):
            runner.prefill(min(args.prefill_chunk, max(args.contexts + [args.prefill])), 4, args.prefill_chunk)
        decode, detail = {}, {"decode": {}}
        for ctx in args.contexts:
            entry = {}
            try:
                entry["random"] = bench.decode_random(ctx)
                decode[str(ctx)] = entry["random"]["tok_s"]
                if ctx <= args.real_prefill_max:
                    entry["prefill"] = bench.decode_prefilled(ctx)
            except OutOfMemory as e:
                log.error("%s", e)
                errors.append(str(e))
                entry["error"] = str(e)
                decode.setdefault(str(ctx), None)
            detail["decode"][str(ctx)] = entry
        result["decode_tok_s"] = decode
        first = decode.get(str(args.contexts[0]))
        result["decode_ratio_to_first"] = {k: (v / first if v and first else None) for k, v in decode.items()}
        later = [r for k, r in result["decode_ratio_to_first"].items() if k != str(args.contexts[0])]
        result["bar"] = {"min_ratio_to_first": BAR,   # met: None where one context leaves nothing to compare
                         "met": all(r is not None and r >= BAR for r in later) if later else None}
        if args.prefill:
            n = args.prefill
            try:
                detail["prefill"] = bench.prefill(n)
                result[f"prefill_tok_s_{n}"] = detail["prefill"]["prefill_tok_s"]
                result[f"ttft_s_{n}"] = detail["prefill"]["ttft_s"]
                result["prefill_method"] = detail["prefill"]["method"]
            except OutOfMemory as e:
                log.error("%s", e)
                errors.append(str(e))
                detail["prefill"] = {"prompt_len": n, "error": str(e)}
                result[f"prefill_tok_s_{n}"] = result[f"ttft_s_{n}"] = None
        result["detail"] = detail
    finally:
        if hasattr(backend, "close") and args.backend != "fleet":
            backend.close()
        close()
        del model
        _free(device)
    if errors:
        result["errors"] = errors
    return result, errors


def summary(r: dict) -> str:
    lines = [f"DeepSeek long context: {r['shape']['name']}{' (tiny)' if r['shape']['tiny'] else ''}, "
             f"{r['layers']} layers, index_topk {r['index_topk']}, {r['bytes_cache_per_token']} cache bytes per "
             f"token, backend {r['backend']} on {r['machine']}"]
    for ctx, tok_s in r["decode_tok_s"].items():
        d = r["detail"]["decode"][ctx]
        if tok_s is None:
            lines.append(f"  decode at {ctx:>7}: {d.get('error')}")
            continue
        rnd = d["random"]
        line = (f"  decode at {ctx:>7}: {tok_s:8.2f} tok/s ({r['decode_ratio_to_first'][ctx]:.3f} x the first), "
                f"step {rnd['step_ms_median']:.2f} ms median / {rnd['step_ms_p90']:.2f} p90, {rnd['attention']}")
        if "prefill" in d:
            line += f"; after a real prefill {d['prefill']['tok_s']:.2f} tok/s"
        lines.append(line)
    met = r["bar"]["met"]
    lines.append(f"  bar (>= {r['bar']['min_ratio_to_first']} x the first): "
                 f"{'one context: nothing to compare' if met is None else 'met' if met else 'NOT met'}")
    p = r["detail"].get("prefill")
    if p:
        if "error" in p:
            lines.append(f"  prefill {p['prompt_len']}: {p['error']}")
        else:
            lines.append(f"  prefill {p['prompt_len']} ({p['method']}): TTFT {p['ttft_s']:.3f} s, "
                         f"{p['prefill_tok_s']:.1f} tok/s; decode after it {p['decode_after']['tok_s']:.2f} tok/s")
    return "\n".join(lines)


def _ints(text: str, what: str, ap) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        ap.error(f"{what} {text!r}: expected integers, comma separated")
    if not values or min(values) <= 0:
        ap.error(f"{what} {text!r}: expected positive integers")
    return values


def main(argv: list[str] | None = None) -> int:
    from bench.synthetic import SHAPES
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m bench long_context", description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", default="deepseek-v32", choices=sorted(n for n in SHAPES if "deepseek" in n))
    ap.add_argument("--layers", type=int, default=4, help="depth")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (default: published)")
    ap.add_argument("--dense-layers", type=int, default=1,
                    help="leading dense layers (default 1, as the DeepSeek runs of bench/results; published: 3)")
    ap.add_argument("--index-topk", type=int, default=None, help="tokens each query attends to (default: published)")
    ap.add_argument("--tiny", action="store_true", help="every width shrunk (hidden 256, ...): tests, CI")
    ap.add_argument("--backend", choices=("fleet", "gpu"), default="fleet",
                    help="fleet: the experts on local ducks; gpu: every expert on the host device (torch)")
    ap.add_argument("--ducks", type=int, default=4)
    ap.add_argument("--duck-threads", type=int, default=4)
    ap.add_argument("--pin-ducks", action="store_true", help="each duck on CPUs of its own (as boxes are)")
    ap.add_argument("--duck-spin-us", type=int, default=None)
    ap.add_argument("--contexts", default="1024,32768,131072", help="decode contexts, comma separated")
    ap.add_argument("--steps", type=int, default=16, help="decode steps measured per context")
    ap.add_argument("--warmup", type=int, default=2, help="decode steps run before those measured")
    ap.add_argument("--real-prefill-max", type=int, default=4096,
                    help="contexts up to this are also decoded after a real prefill (0: none)")
    ap.add_argument("--prefill", type=int, default=32768, help="prompt tokens of the prefill measured (0: skip)")
    ap.add_argument("--prefill-repeats", type=int, default=2, help="prefills of --prefill tokens; the best is kept")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_CHUNK,
                    help="tokens per forward of the fleet's chunked prefill (duckd's model.prefill_chunk)")
    ap.add_argument("--gpu-prefill", choices=("auto", "on", "off"), default="auto",
                    help="auto: the streamed GPU prefill on a CUDA host with a fleet (duckd's model.gpu_prefill); "
                         "on: with a fleet on any host device (the CPU's: tests); off: the fleet's chunks")
    ap.add_argument("--gpu-prefill-chunk", type=int, default=16384, help="duckd's model.gpu_prefill_chunk")
    ap.add_argument("--gpu", choices=("auto", "off"), default="auto", help="host device: CUDA where there is one")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode steps on CUDA")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="the JSON file (default bench/results/<date>-deepseek-long-<machine>.json)")
    ap.add_argument("--json", action="store_true", help="also print the JSON on stdout")
    args = ap.parse_args(argv)
    args.argv = argv
    args.contexts = _ints(args.contexts, "--contexts", ap)
    if min(args.steps, args.layers, args.prefill_repeats) <= 0 or min(args.warmup, args.prefill) < 0:
        ap.error("--steps, --layers and --prefill-repeats must be positive, --warmup and --prefill >= 0")
    if args.gpu_prefill == "on" and args.backend != "fleet":
        ap.error("--gpu-prefill on: the streamed prefill shares the experts with a fleet (--backend fleet)")
    if not logging.getLogger().handlers:   # progress on stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        long_config(args)
    except ValueError as e:
        ap.error(str(e))
    result, errors = run(args)
    machine = machine_name(result["host_device"])
    out = Path(args.out) if args.out else RESULTS / f"{result['date']}-deepseek-long-{machine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print(summary(result))
    print(f"written to {out}", file=sys.stderr)
    for e in errors:
        print(f"bench long_context: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
