"""Kernel benchmark: fp9 GEMV and the MoE slice forward against the machine's
streaming read bandwidth and an int8 GEMV peer, all measured in ONE run,
interleaved round by round, reported as medians.

    duck-bench-kernels [--threads 1,2] [--rounds 5] [--json]
    duck-bench-kernels --synth [--threads 1,2]   # synthetic fp9 generation only

(`duckctl bench kernels` runs the same code.) Weights are random fp9 made
directly in packed form: the kernels' speed does not depend on the values,
only on the bytes streamed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

import numpy as np

from native._native import ffi, lib
from native.fp9 import BLOCK_BYTES, GROUP, HEADER_BYTES, Fp9Tensor, SynthTensor, _aligned_bytes
from native.kernels import (
    ExpertSlice,
    MoeSlice,
    Pool,
    Workspace,
    kernels,
    kernels_name,
    matmul,
    measure_read_gbps,
    timed_call,
)

log = logging.getLogger("duck.bench.kernels")

MiB = 1 << 20


def random_fp9(rows: int, cols: int, rng: np.random.Generator, name: str) -> Fp9Tensor:
    """A packed fp9 tensor with random codes around 1.0 and random signs."""
    pairs, groups = -(-rows // 2), -(-cols // GROUP)
    blocks = rng.integers(0, 256, size=(pairs * groups, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 16:] = rng.integers(100, 128, size=(pairs * groups, BLOCK_BYTES - 16), dtype=np.uint8)
    buf = _aligned_bytes(HEADER_BYTES + blocks.size)
    header = np.zeros(16, dtype=np.uint32)
    header[0] = 0x54395046
    header[1] = 1  # version 1, flags 0
    header[2], header[3] = rows, cols
    header[4] = np.float32(2.0 ** -10).view(np.uint32)
    buf[:HEADER_BYTES] = header.view(np.uint8)
    buf[HEADER_BYTES:] = blocks.reshape(-1)
    return Fp9Tensor(buf, name)


class Case:
    """One measured thing: a callable doing `work_bytes` of streaming per call."""

    def __init__(self, name: str, fn, work_bytes: int, params: int, **info):
        self.name, self.fn, self.work_bytes, self.params, self.info = name, fn, work_bytes, params, info
        self.gbps: list[float] = []

    def run(self, min_seconds: float) -> None:
        self.gbps.append(self.work_bytes / timed_call(self.fn, min_seconds) / 1e9)


def _rotating(items):
    """A callable cycling over items, calling each with no arguments."""
    state = {"i": 0}

    def call():
        items[state["i"] % len(items)]()
        state["i"] += 1
    return call


def build_cases(threads: int, rng: np.random.Generator, cold_bytes: int, moe_experts: int,
                read_buf: np.ndarray, shared: dict) -> list[Case]:
    pool = Pool(threads)
    ws = Workspace()
    cases = [Case("read", lambda: lib.duck_bench_read(pool.ptr, ffi.from_buffer(read_buf), read_buf.size),
                  read_buf.size, 0, threads=threads)]
    for rows, cols in ((2048, 7168), (7168, 2048)):
        key = (rows, cols)
        if key not in shared:
            count = max(4, cold_bytes // (rows * cols))
            log.info("making %d cold %dx%d fp9 and int8 matrices", count, rows, cols)
            shared[key] = (
                [random_fp9(rows, cols, rng, f"w{i}") for i in range(count)],
                [rng.integers(-127, 128, size=(rows, cols), dtype=np.int8) for _ in range(count)],
                rng.standard_normal((1, cols)).astype(np.float32),
            )
        fp9s, int8s, x = shared[key]
        y = np.empty(rows, dtype=np.float32)
        xptr, yptr = ffi.cast("const float *", ffi.from_buffer(x)), ffi.cast("float *", ffi.from_buffer(y))
        int8_calls = [
            (lambda w=w, rows=rows, cols=cols, xptr=xptr, yptr=yptr, y=y: lib.duck_bench_int8_gemv(
                pool.ptr, ffi.cast("const int8_t *", ffi.from_buffer(w)), rows, cols, xptr, yptr)) for w in int8s]
        cases.append(Case("int8_gemv", _rotating(int8_calls), rows * cols, rows * cols,
                          shape=[rows, cols], threads=threads))
        fp9_calls = [(lambda w=w, x=x: matmul(w, x, pool, ws)) for w in fp9s]
        cases.append(Case("fp9_gemv", _rotating(fp9_calls), fp9s[0].weight_bytes, rows * cols,
                          shape=[rows, cols], threads=threads, kernels=kernels_name(kernels())))
    if "moe" not in shared:
        log.info("making a DeepSeek-V3 layer slice: %d experts x (gate_up 128x7168 + down 7168x64)", moe_experts)
        experts = [ExpertSlice(random_fp9(128, 7168, rng, f"e{i}.gate_up"), random_fp9(7168, 64, rng, f"e{i}.down"))
                   for i in range(moe_experts)]
        layer = MoeSlice(experts, 7168, "deepseek-v3 layer slice")
        shared["moe"] = (layer, rng.standard_normal((1, 7168)).astype(np.float32))
        log.info("layer slice: %.0f MiB of fp9", sum(e.weight_bytes for e in experts) / MiB)
    layer, xm = shared["moe"]
    per_call = layer.experts[0].weight_bytes * 8

    routes = [rng.choice(len(layer.experts), size=(1, 8), replace=False).astype(np.int32) for _ in range(1024)]
    weights = np.full((1, 8), 0.125, dtype=np.float32)
    moe_call = _rotating([(lambda ids=ids: layer.forward(xm, ids, weights, pool, ws)) for ids in routes])
    cases.append(Case("moe_slice", moe_call, per_call, per_call * 8 // 9,
                      shape=[len(layer.experts), 3, 64, 7168], threads=threads, experts_per_call=8))
    return cases


def run(threads_list: list[int], rounds: int, min_seconds: float, read_mib: int, cold_mib: int,
        moe_experts: int) -> dict:
    rng = np.random.default_rng(1234)
    log.info("allocating a %d MiB read buffer", read_mib)
    read_buf = _aligned_bytes(read_mib * MiB)
    read_buf[:] = 1
    shared: dict = {}
    by_threads = {t: build_cases(t, rng, cold_mib * MiB, moe_experts, read_buf, shared) for t in threads_list}
    for r in range(rounds):
        log.info("round %d/%d", r + 1, rounds)
        for t in threads_list:
            for case in by_threads[t]:
                case.run(min_seconds)
    result = {"machine": {"cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()},
              "kernels": kernels_name(kernels()), "rounds": rounds, "read_gbps": {}, "cases": []}
    for t in threads_list:
        med = {(c.name, str(c.info.get("shape"))): statistics.median(c.gbps) for c in by_threads[t]}
        read = med[("read", "None")]
        result["read_gbps"][str(t)] = round(read, 3)
        for c in by_threads[t]:
            if c.name == "read":
                continue
            gbps = med[(c.name, str(c.info.get("shape")))]
            entry = {"name": c.name, **c.info, "gbps": round(gbps, 3),
                     "gparams": round(gbps * c.params / c.work_bytes, 3), "ratio_to_read": round(gbps / read, 3)}
            if c.name == "fp9_gemv":
                peer = med[("int8_gemv", str(c.info["shape"]))]
                entry["ratio_to_int8"] = round(gbps / peer, 3)
                entry["ratio_to_int8_params"] = round(entry["gparams"] / peer, 3)
            result["cases"].append(entry)
    return result


def synth_bench(threads_list: list[int], rounds: int, min_seconds: float, rows: int = 2048,
                cols: int = 7168) -> dict:
    """GB/s of synthetic fp9 generation (what a duck does for a SYNTH request), a
    DeepSeek-V3 expert matrix at a time: into memory already touched, and into a
    fresh allocation (page faults included, as on a duck). Medians of rounds."""
    t = SynthTensor(rows, cols, seed=1, name="synth bench")
    warm = _aligned_bytes(t.nbytes)
    out = {"shape": [rows, cols], "bytes": t.nbytes, "warm_gbps": {}, "fresh_gbps": {}}
    for threads in threads_list:
        pool = Pool(threads) if threads > 1 else None
        ptr = pool.ptr if pool else ffi.NULL

        def into_warm():
            lib.fp9_synth_generate(t.desc, ffi.from_buffer(warm), warm.size, ptr)

        def into_fresh():
            buf = _aligned_bytes(t.nbytes)
            lib.fp9_synth_generate(t.desc, ffi.from_buffer(buf), buf.size, ptr)

        for key, fn in (("warm_gbps", into_warm), ("fresh_gbps", into_fresh)):
            gbps = [t.nbytes / timed_call(fn, min_seconds) / 1e9 for _ in range(rounds)]
            out[key][str(threads)] = round(statistics.median(gbps), 3)
    return out


def format_synth(result: dict) -> str:
    return "\n".join(f"synth fp9 {result['shape'][0]}x{result['shape'][1]} ({result['bytes'] / 1e6:.1f} MB), "
                     f"{threads} thread(s): {warm:.2f} GB/s into touched memory, "
                     f"{result['fresh_gbps'][threads]:.2f} GB/s into a fresh allocation"
                     for threads, warm in result["warm_gbps"].items())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def format_table(result: dict) -> str:
    lines = [f"kernels={result['kernels']}  read GB/s by threads: {result['read_gbps']}"]
    for c in result["cases"]:
        extra = f"  ratio_to_int8 {c['ratio_to_int8']:.3f}" if "ratio_to_int8" in c else ""
        lines.append(f"{c['name']:10s} {str(c['shape']):22s} threads {c['threads']:2d}  {c['gbps']:7.2f} GB/s  "
                     f"{c['gparams']:6.2f} Gparam/s  ratio_to_read {c['ratio_to_read']:.3f}{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="duck-bench-kernels", description=__doc__.split("\n\n")[0])
    cores = len(os.sched_getaffinity(0))
    ap.add_argument("--threads", default=f"1,{cores}" if cores > 1 else "1",
                    help="comma-separated thread counts (default: 1 and all cores)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.5, help="minimum time per measurement")
    ap.add_argument("--read-mib", type=int, default=1024)
    ap.add_argument("--cold-mib", type=int, default=512, help="working set per GEMV shape")
    ap.add_argument("--moe-experts", type=int, default=256)
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument("--synth", action="store_true", help="measure synthetic fp9 generation only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    threads = sorted({int(t) for t in args.threads.split(",")})
    if args.synth:
        result = synth_bench(threads, args.rounds, args.seconds)
        sys.stdout.write((json.dumps(result, indent=2) if args.json else format_synth(result)) + "\n")
        return 0
    result = run(threads, args.rounds, args.seconds, args.read_mib, args.cold_mib, args.moe_experts)
    sys.stdout.write((json.dumps(result, indent=2) if args.json else format_table(result)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
