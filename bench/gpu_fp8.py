"""GPU benchmark of the fp8 block-scale linear (engine.gpu.fp8) on DeepSeek-V3.2's
host projections: the Triton kernel against torch's bf16 matmul of the dequantized
weight and against the reference (dequantize + fp32 matmul), with the device's copy
bandwidth measured in the same run.

    python bench/gpu_fp8.py [--json out.json] [--tokens 1,2,16,1024] [--shapes q_a,o_proj] [--sweep]
    python bench/gpu_fp8.py --smoke      # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script runs

Two timings per kernel, both medians:
  bench  triton.testing.do_bench (L2 flushed before each call): what an eager forward
         pays, Python and launch overhead included (it dominates the small decode GEMVs);
  graph  one CUDA graph replaying the call over enough copies of the weight (>= 256 MiB)
         that none is in L2: the GPU time a CUDA-graph decode step pays. GB/s and
         "of copy" (against the device copy bandwidth, read + write) come from it.
--sweep also times a grid of tilings per case with graph timing and reports the
fastest (to tune engine.gpu.fp8.choose_config). Weights are random e4m3 codes with
ue8m0 block scales: the kernels' speed does not depend on the values.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runs from a checkout, installed or not

# (name, N = out features, K = in features) of DeepSeek-V3.2 (hidden 7168, q_lora 1536,
# 128 heads x 192 qk, kv_lora 512 + rope 64, 128 heads x 128 v, shared expert 2048)
SHAPES = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168), ("o_proj", 7168, 16384),
          ("shared_gate_up", 2048, 7168), ("shared_down", 7168, 2048)]
SMOKE_SHAPES = [("q_a", 48, 224), ("q_b", 200, 48), ("kv_a", 18, 224), ("o_proj", 224, 300)]
TOKENS = [1, 2, 16, 1024]
SMOKE_TOKENS = [1, 2, 16, 40]
COPY_BYTES = 1 << 30
COLD_BYTES = 256 << 20    # fp8 weight copies cycled through in a graph: several times the H200's 50 MB L2
MAX_ERR = 1e-2            # triton vs the fp32 reference, max err / max |y|: bf16 output rounding is ~4e-3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--tokens", help="comma-separated token counts T (default 1,2,16,1024)")
    p.add_argument("--shapes", help=f"comma-separated subset of {','.join(s[0] for s in SHAPES)}")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tilings per case")
    p.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1 at tiny shapes")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    return p.parse_args(argv)


class Timer:
    """bench(fn) and graph(calls) -> median seconds per call; wall clock on the CPU (smoke)."""

    def __init__(self, torch, device, warmup_ms: int, rep_ms: int, graph_reps: int = 20):
        self.torch, self.cuda = torch, device.type == "cuda"
        self.warmup_ms, self.rep_ms, self.graph_reps = warmup_ms, rep_ms, graph_reps

    def bench(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench
            return do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median") / 1e3
        return self._wall([fn])

    def graph(self, calls) -> float:
        """calls (callables) captured in order into one CUDA graph, replayed graph_reps times."""
        if not self.cuda:
            return self._wall(calls)
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):      # warm-up outside the capture: compiles, allocator pools
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        times = []
        for _ in range(self.graph_reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / len(calls))
        return statistics.median(times)

    @staticmethod
    def _wall(calls, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - t0) / len(calls))
        return statistics.median(times)


def copy_gbps(torch, device, timer: Timer, nbytes: int) -> float:
    """Device-to-device copy: bytes read + bytes written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer.bench(lambda: dst.copy_(src)) / 1e9


def random_weight(torch, n: int, k: int, device, gen):
    codes = (torch.randn(n, k, device=device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = 2.0 ** torch.randint(-12, -6, (-(-n // 128), -(-k // 128)), device=device, generator=gen).float()
    return codes, scale


def sweep_configs(fp8, t: int, n: int, k: int, sm_count: int):
    """Tilings around the default (10 to 25 per case): both kernels where T allows, a few
    tile widths, stages, and split-K none / about 4 / about 8 programs per SM."""
    auto = fp8.choose_config(t, n, k, sm_count=sm_count)
    shapes = []
    if t <= 8:
        bt = 1 if t <= 1 else 2 if t <= 2 else 4 if t <= 4 else 8
        shapes += [("gemv", bt, bn, 4, 3) for bn in (16, 32, 64)]
    for bt in sorted({16, min(128, max(16, 1 << (t - 1).bit_length()))}):
        shapes += [("gemm", bt, bn, warps, stages) for bn, warps in ((64, 4), (128, 8)) for stages in (3, 4)]
    out = [auto]
    k_tiles = -(-k // 128)
    for kind, bt, bn, warps, stages in shapes:
        tiles = -(-t // bt) * -(-n // bn)
        for split in sorted({1, *(max(1, min(k_tiles, per_sm * sm_count // tiles)) for per_sm in (4, 8))}):
            cfg = fp8.Fp8LinearConfig(kind, bt, bn, 128, split, warps, stages)
            if cfg not in out:
                out.append(cfg)
    return out


def bench_case(torch, fp8, timer: Timer, name, n, k, t, device, gen, copy_bw, sweep: bool, sm_count):
    """One shape at one T: the default tiling, the bf16 matmul and the reference."""
    import torch.nn.functional as F

    from engine.weights import dequantize_fp8_blocks

    copies = max(1, min(64, COLD_BYTES // (n * k))) if device.type == "cuda" else 1
    weights = [random_weight(torch, n, k, device, gen) for _ in range(copies)]
    dense = [dequantize_fp8_blocks(c, s).to(torch.bfloat16) for c, s in weights]       # [N, K] each
    codes, scale = weights[0]
    x = torch.randn(t, k, device=device, generator=gen).to(torch.bfloat16)
    want = fp8.fp8_linear_ref(x.float(), codes, scale)                                # fp32 [T, N]
    top = want.abs().max().item()

    def rel_err(y):
        return (y.float() - want).abs().max().item() / top

    def triton_calls(cfg):
        return [lambda c=c, s=s: fp8.fp8_linear_triton(x, c, s, config=cfg) for c, s in weights]

    auto = fp8.choose_config(t, n, k, sm_count=sm_count)
    row = dict(shape=name, n=n, k=k, t=t, config=_cfg_dict(auto), weight_copies=copies,
               triton_bench_us=timer.bench(lambda: fp8.fp8_linear_triton(x, codes, scale, config=auto)) * 1e6,
               triton_graph_us=timer.graph(triton_calls(auto)) * 1e6,
               bf16_bench_us=timer.bench(lambda: F.linear(x, dense[0])) * 1e6,
               bf16_graph_us=timer.graph([lambda w=w: F.linear(x, w) for w in dense]) * 1e6,
               ref_bench_us=timer.bench(lambda: fp8.fp8_linear_ref(x, codes, scale)) * 1e6,
               rel_err_triton=rel_err(fp8.fp8_linear_triton(x, codes, scale, config=auto)),
               rel_err_bf16=rel_err(F.linear(x, dense[0])))
    moved = codes.numel() + scale.numel() * 4 + x.numel() * 2 + t * n * 2            # bytes one call must move
    row["triton_gbps"] = moved / row["triton_graph_us"] / 1e3
    row["triton_of_copy_bw"] = row["triton_gbps"] / copy_bw
    row["bf16_gbps"] = (codes.numel() * 2 + x.numel() * 2 + t * n * 2) / row["bf16_graph_us"] / 1e3
    row["triton_tflops"] = 2 * t * n * k / row["triton_graph_us"] / 1e6
    if sweep:
        timed = []
        for cfg in sweep_configs(fp8, t, n, k, sm_count):
            try:
                err = rel_err(fp8.fp8_linear_triton(x, codes, scale, config=cfg))
                us = timer.graph(triton_calls(cfg)) * 1e6
            except Exception as e:   # a tiling the compiler refuses (shared memory, registers): reported, not fatal
                timed.append(dict(config=_cfg_dict(cfg), error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            timed.append(dict(config=_cfg_dict(cfg), graph_us=us, rel_err=err))
        row["sweep"] = timed
        ok = [s for s in timed if "graph_us" in s]
        if ok:
            best = min(ok, key=lambda s: s["graph_us"])
            row["best_graph_us"], row["best_config"] = best["graph_us"], best["config"]
    return row


def _cfg_dict(cfg) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__slots__}


def _cfg_short(c: dict) -> str:
    return f"{c['kind']} {c['block_t']}x{c['block_n']}x{c['block_k']} s{c['split_k']} w{c['num_warps']}"


def print_table(rows) -> None:
    print(f"{'shape':<15}{'N':>6}{'K':>6}{'T':>5} | {'triton us':>9} {'graph':>8} | {'bf16 us':>8}{'graph':>8} | "
          f"{'ref us':>8} | {'GB/s':>6}{'of copy':>8}{'TFLOP/s':>8} | {'err triton':>10}{'bf16':>8}  config")
    for r in rows:
        line = (f"{r['shape']:<15}{r['n']:>6}{r['k']:>6}{r['t']:>5} | {r['triton_bench_us']:>9.1f} "
                f"{r['triton_graph_us']:>8.1f} | {r['bf16_bench_us']:>8.1f}{r['bf16_graph_us']:>8.1f} | "
                f"{r['ref_bench_us']:>8.1f} | {r['triton_gbps']:>6.0f}{r['triton_of_copy_bw']:>8.2f}"
                f"{r['triton_tflops']:>8.1f} | {r['rel_err_triton']:>10.1e}{r['rel_err_bf16']:>8.1e}  "
                f"{_cfg_short(r['config'])}")
        if "best_graph_us" in r:
            line += f"  | best {r['best_graph_us']:.1f} us: {_cfg_short(r['best_config'])}"
        print(line)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and engine.gpu.fp8 are imported
    import torch
    import triton

    from engine.gpu import fp8

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not fp8.INTERPRETED:
        print("no CUDA device: run with --smoke (CPU, Triton interpreter, tiny shapes)", file=sys.stderr)
        return 2
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - {s[0] for s in shapes})
        if unknown:
            print(f"unknown shape(s) {unknown}: choose from {[s[0] for s in shapes]}", file=sys.stderr)
            return 2
        shapes = [s for s in shapes if s[0] in wanted]
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else SMOKE_TOKENS if args.smoke else TOKENS
    timer = Timer(torch, device, args.warmup_ms, args.rep_ms)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu (interpreter) {platform.processor()}"
    copy_bw = copy_gbps(torch, device, timer, COPY_BYTES if device.type == "cuda" else 1 << 24)
    print(f"{name}: {sm_count} SMs, device copy {copy_bw:.0f} GB/s (read + write); torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)

    gen = torch.Generator(device=device).manual_seed(1234)
    rows = []
    for (shape, n, k), t in itertools.product(shapes, tokens):
        print(f"  {shape} T={t} ...", file=sys.stderr, flush=True)
        rows.append(bench_case(torch, fp8, timer, shape, n, k, t, device, gen, copy_bw, args.sweep, sm_count))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    if args.json:
        result = dict(device=name, sm_count=sm_count, torch=torch.__version__, triton=triton.__version__,
                      interpreted=fp8.INTERPRETED, copy_gbps=copy_bw, cold_bytes=COLD_BYTES,
                      timing="bench: do_bench median; graph: CUDA graph replay median, cold L2" if device.type ==
                      "cuda" else "wall clock medians (interpreter)", cases=rows)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    errors = [(r["rel_err_triton"], r["shape"], r["t"], r["config"]) for r in rows]
    errors += [(s["rel_err"], r["shape"], r["t"], s["config"])
               for r in rows for s in r.get("sweep", []) if "rel_err" in s]
    worst = max(errors, key=lambda e: e[0])
    if worst[0] > MAX_ERR:
        print(f"triton vs reference: rel err {worst[0]:.1e} > {MAX_ERR:.0e} for {worst[1]} T={worst[2]} "
              f"{_cfg_short(worst[3])}: the kernel is wrong there", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
