"""GPU benchmark of DeepSeek-V3.2's lightning-indexer scores (engine.gpu.dsa_index): the fused
Triton kernel (fp8 and bf16 inputs) against the torch reference (fp32 per-head logits, relu, head
sum), at the indexer's 64 heads of 128, for a decode step (T = 1) and a prefill chunk (T = 2048)
over caches of 32768 and 131072 keys, the queries at the cache's end (every key live).

    python -m bench.gpu_dsa [--tokens 1,2048] [--keys 32768,131072] [--sweep] [--json out.json]
    python -m bench.gpu_dsa --smoke      # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script runs

Timings are medians. A decode step (T <= 64) is timed in one CUDA graph of calls cycling over enough
copies of the key cache (>= 256 MiB) that none is in L2: what a decode step's graph pays, no launch
overhead; GB/s counts the keys and scales read and the scores written. Larger T: triton's do_bench.
TFLOP/s counts the live (query, key) pairs' 2 * H * D flops. --sweep also times a grid of tilings
per case (to tune engine.gpu.dsa_index.plan).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runs from a checkout, installed or not

H, D = 64, 128
TOKENS, KEYS = [1, 2048], [32768, 131072]
COLD_BYTES = 256 << 20
REF_MAX_PAIRS = 1 << 29      # the reference is timed only up to this many (query, key) pairs (else: skipped)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", help="comma-separated query counts T (default 1,2048)")
    p.add_argument("--keys", help="comma-separated cache lengths S (default 32768,131072)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tilings per case")
    p.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1 at tiny shapes")
    return p.parse_args(argv)


def _ints(text, default):
    return [int(x) for x in text.split(",")] if text else default


class Timer:
    """bench(fn): do_bench median seconds (wall clock on the CPU); graph(calls): one CUDA graph of the
    calls, replayed, median seconds per call."""

    def __init__(self, torch, cuda: bool, reps: int = 20):
        self.torch, self.cuda, self.reps = torch, cuda, reps

    def bench(self, fn, rep_ms: int = 100) -> float:
        if self.cuda:
            from triton.testing import do_bench
            return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") / 1e3
        return self._wall([fn])

    def graph(self, calls) -> float:
        if not self.cuda:
            return self._wall(calls)
        torch = self.torch
        for call in calls:          # compiles outside the capture
            call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for call in calls:
                call()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / len(calls))
        return statistics.median(times)

    def _wall(self, calls) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - t0) / len(calls))
        return statistics.median(times)


def make(torch, t, s, h, d, dtype, device, copies=1):
    g = torch.Generator(device="cpu").manual_seed(t + s)
    q = torch.randn(t, h, d, generator=g).to(dtype).to(device)
    ks = [torch.randn(s, d, generator=g).to(dtype).to(device)]
    ks += [ks[0].clone() for _ in range(copies - 1)]
    w = (torch.randn(t, h, generator=g) / h ** 0.5).to(device)
    k_scale = (torch.rand(s, generator=g) + 0.5).to(device)
    pos = torch.arange(s - t, s, device=device)
    return q, w, ks, k_scale, pos


def time_kernel(torch, timer, dsa, t, s, h, d, dtype, device, config=None):
    """(seconds per call, one call's scores) of the kernel on T queries over S keys."""
    elt = 1 if dtype == torch.float8_e4m3fn else dtype.itemsize
    cold = timer.cuda and t <= 64
    copies = max(1, -(-COLD_BYTES // (s * d * elt))) if cold else 1
    q, w, ks, k_scale, pos = make(torch, t, s, h, d, dtype, device, copies)
    out = torch.empty(t, s, device=device)
    if cold:
        sec = timer.graph([lambda k=k: dsa.index_scores(q, w, k, k_scale, pos, out=out, config=config) for k in ks])
    else:
        sec = timer.bench(lambda: dsa.index_scores(q, w, ks[0], k_scale, pos, out=out, config=config))
    return sec, out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from engine.gpu import dsa_index as dsa
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        print("bench gpu_dsa: no CUDA device (--smoke runs the script on the CPU)", file=sys.stderr)
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    h, d = (H, D) if cuda else (16, 32)
    tokens = _ints(args.tokens, TOKENS if cuda else [1, 40])
    keys = _ints(args.keys, KEYS if cuda else [300])
    timer = Timer(torch, cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    print(f"# lightning-indexer scores, H={h} D={d}, on {name}; queries at the cache's end")
    print(f"{'T':>5} {'S':>7} {'kernel fp8 us':>14} {'TFLOP/s':>8} {'GB/s':>7} {'kernel bf16 us':>15} "
          f"{'TFLOP/s':>8} {'torch ref us':>13} {'TFLOP/s':>8} {'fp8 err':>8}")
    rows = []
    fp8 = torch.float8_e4m3fn if cuda else torch.float32
    for t, s in itertools.product(tokens, keys):
        flops = 2 * h * d * sum(min(p + 1, s) for p in range(s - t, s))
        sec8, out = time_kernel(torch, timer, dsa, t, s, h, d, fp8, device)
        q, w, ks, k_scale, pos = make(torch, t, s, h, d, fp8, device)
        want = dsa.index_scores_ref(q, w, ks[0], k_scale, pos)
        live = torch.isfinite(want)
        err = float("inf") if not torch.equal(live, torch.isfinite(out)) else \
            ((out - want)[live].abs().max() / want[live].abs().max()).item()      # of the largest score
        del want, live
        sec16, _ = time_kernel(torch, timer, dsa, t, s, h, d, torch.bfloat16, device)
        ref = float("nan")
        if not args.no_ref and t * s <= REF_MAX_PAIRS:
            ref = timer.bench(lambda: dsa.index_scores_ref(q, w, ks[0], k_scale, pos), rep_ms=300)
        gbs = (s * d * (1 if cuda else 4) + 4 * s + 4 * t * s) / sec8 / 1e9
        row = dict(t=t, s=s, h=h, d=d, fp8_s=sec8, bf16_s=sec16, ref_s=ref, flops=flops, fp8_err=err,
                   fp8_tflops=flops / sec8 / 1e12, bf16_tflops=flops / sec16 / 1e12, ref_tflops=flops / ref / 1e12,
                   fp8_gbs=gbs, device=name)
        rows.append(row)
        print(f"{t:>5} {s:>7} {sec8 * 1e6:>14.1f} {row['fp8_tflops']:>8.1f} {gbs:>7.0f} {sec16 * 1e6:>15.1f} "
              f"{row['bf16_tflops']:>8.1f} {ref * 1e6:>13.1f} {row['ref_tflops']:>8.2f} {err:>8.1e}", flush=True)
        del q, w, ks, out
        if args.sweep:
            row["sweep"] = sweep(torch, timer, dsa, t, s, h, d, fp8, device)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def sweep(torch, timer, dsa, t, s, h, d, dtype, device) -> list:
    """Every tiling of a small grid on this case, fastest first (printed: the best 6 and plan's)."""
    chosen = dsa.plan(t, s, h, d)
    results = []
    grid = itertools.product((64, 128, 256), (4, 8), (2, 3), sorted({min(t, b) for b in (64, 128)}),
                             (1, 2) if t > 1 else (1,))
    for block_s, warps, stages, block_t, tpd in grid:
        cfg = dict(block_s=block_s, num_warps=warps, num_stages=stages, block_t=block_t, tpd=tpd)
        try:
            sec, _ = time_kernel(torch, timer, dsa, t, s, h, d, dtype, device, cfg)
        except Exception as e:   # a tiling that doesn't compile (shared memory, registers): noted, skipped
            print(f"    {cfg}: {type(e).__name__}: {str(e)[:80]}")
            continue
        results.append((sec, cfg))
    results.sort(key=lambda r: r[0])
    mine = {k: chosen[k] for k in ("block_s", "num_warps", "num_stages", "block_t", "tpd")}
    for sec, cfg in results[:6] + [r for r in results if r[1] == mine]:
        print(f"    {sec * 1e6:10.1f} us  {cfg}{'  <- plan' if cfg == mine else ''}")
    return [dict(sec=sec, **cfg) for sec, cfg in results]


if __name__ == "__main__":
    sys.exit(main())
