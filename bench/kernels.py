"""Kernel benchmark: fp9 GEMV and the MoE slice forward against the machine's
streaming read bandwidth and an int8 GEMV peer, all measured in ONE run,
interleaved round by round, reported as medians.

    duck-bench-kernels [--threads 1,2] [--rounds 5] [--kernels avx2-blend,avx512] [--json]
    duck-bench-kernels --synth [--threads 1,2]   # synthetic fp9 generation only

(`duckctl bench kernels` runs the same code.) Weights are random fp9 made
directly in packed form: the kernels' speed does not depend on the values,
only on the bytes streamed.

The fp9 GEMV runs with every fast kernel set of this CPU (the AVX2 variant
for its vendor, AVX-512), each against an int8 GEMV peer of the same vector
width (int8 weights widened to fp32 against the same fp32 activations; the
case names the peer's instruction set). The MoE slice forward runs with the
best set at what one duck holds of a DeepSeek-V3 layer (256 experts, H 7168,
S 64) and of a Qwen3-30B-A3B layer on four ducks (128 experts, H 2048, S 192;
1 token and an MTP pair). fp9_gemm is what prefill does with one expert of
that Qwen3 slice: gate/up and down over 8, 32 and 128 tokens, in GFLOP/s
and as a share of fma_peak, the FMA peak of the same instruction set and
thread count measured in the same run (per core: divided by the threads;
the share is the median of the rounds' shares).
pool_wake is the worker pool's wake-up. All
weights, the int8 ones too, sit in huge pages where the kernel allows
(native.fp9.memory; machine.huge_pages says; DUCK_HUGE_PAGES=0 turns them off).
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

from bench import kernels_gemm
from bench.kernel_cases import ISA_NAMES, ISA_OF_KERNELS, Case, rotating
from native._native import ffi, lib
from native.fp9 import BLOCK_BYTES, GROUP, HEADER_BYTES, Fp9Tensor, SynthTensor, _aligned_bytes
from native.fp9.memory import huge_pages_mode
from native.kernels import (
    KERNEL_SETS,
    ExpertSlice,
    MoeSlice,
    Pool,
    Workspace,
    kernels,
    kernels_available,
    kernels_name,
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


def _int8_matrix(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random int8 weights in the same kind of memory as the fp9 ones (huge pages)."""
    w = _aligned_bytes(rows * cols).view(np.int8)
    w[:] = rng.integers(-127, 128, size=rows * cols, dtype=np.int8)
    return w


# What one duck holds of a layer: (name, experts, hidden, slice width S, tokens)
MOE_SHAPES = (("deepseek-v3", None, 7168, None, 1),     # 256 experts of 2048 over tp 32 (--moe-width 64)
              ("qwen3-30b-a3b", 128, 2048, 192, 1),     # 128 experts of 768 over 4 ducks
              ("qwen3-30b-a3b", 128, 2048, 192, 2))     # an MTP pair


def kernel_sets_to_compare() -> list[str]:
    """The best set and every other fast set this CPU runs: the AVX2 variant
    for its vendor, AVX-512."""
    best = kernels_name(kernels())
    fast = [kernels_name(kernels("avx2"))] if "avx2" in kernels_available() else []
    fast += ["avx512"] if "avx512" in kernels_available() else []
    return [best] + [k for k in fast if k != best]


def _gemv_cases(pool, ws, rows: int, cols: int, threads: int, sets: list[str], shared: dict, rng,
                cold_bytes: int) -> list[Case]:
    key = (rows, cols)
    if key not in shared:
        count = max(4, cold_bytes // (rows * cols))
        log.info("making %d cold %dx%d fp9 and int8 matrices", count, rows, cols)
        shared[key] = (
            [random_fp9(rows, cols, rng, f"w{i}") for i in range(count)],
            [_int8_matrix(rows, cols, rng) for _ in range(count)],
            rng.standard_normal((1, cols)).astype(np.float32),
            np.empty(rows, dtype=np.float32),
        )
    fp9s, int8s, x, y = shared[key]
    xptr, yptr = ffi.cast("const float *", ffi.from_buffer(x)), ffi.cast("float *", ffi.from_buffer(y))
    cases = []
    for isa in sorted({lib.duck_bench_isa(ISA_OF_KERNELS[k]) for k in sets}, reverse=True):
        ptrs = [ffi.cast("const int8_t *", ffi.from_buffer(w)) for w in int8s]
        calls = [(lambda p=p, isa=isa: lib.duck_bench_int8_gemv(pool.ptr, isa, p, rows, cols, xptr, yptr))
                 for p in ptrs]
        cases.append(Case("int8_gemv", rotating(calls), rows * cols, rows * cols, shape=[rows, cols],
                          threads=threads, isa=ISA_NAMES[isa]))
    for name in sets:
        k = kernels(name)
        calls = [(lambda m=w.matrix, k=k: lib.duck_fp9_matmul(pool.ptr, k, ws.ptr, m, 1, xptr, yptr)) for w in fp9s]
        cases.append(Case("fp9_gemv", rotating(calls), fp9s[0].weight_bytes, rows * cols, shape=[rows, cols],
                          threads=threads, kernels=name))
    return cases


def _moe_layer(model: str, n_experts: int, hidden: int, width: int, rng, shared: dict) -> MoeSlice:
    key = ("moe", model, n_experts, hidden, width)
    if key not in shared:
        log.info("making a %s layer slice: %d experts x (gate_up %dx%d + down %dx%d)", model, n_experts,
                 2 * width, hidden, hidden, width)
        experts = [ExpertSlice(random_fp9(2 * width, hidden, rng, f"e{i}.gate_up"),
                               random_fp9(hidden, width, rng, f"e{i}.down")) for i in range(n_experts)]
        shared[key] = MoeSlice(experts, hidden, f"{model} layer slice")
        log.info("layer slice: %.0f MiB of fp9", sum(e.weight_bytes for e in experts) / MiB)
    return shared[key]


def _moe_case(layer: MoeSlice, model: str, ntok: int, pool, ws, threads: int, rng) -> Case:
    """The C forward called directly (no Python per call), routes rotating over
    1024 top-8 draws without repeats per token."""
    n, hidden = len(layer.experts), layer.hidden
    routes = np.stack([np.stack([rng.choice(n, size=8, replace=False) for _ in range(ntok)])
                       for _ in range(1024)]).astype(np.int32)                      # [1024, T, 8]
    weights = np.full((ntok, 8), 0.125, dtype=np.float32)
    x = rng.standard_normal((ntok, hidden)).astype(np.float32)
    y = np.empty((ntok, hidden), dtype=np.float32)
    args = ffi.new("duck_moe_args *")
    args.experts, args.n_experts, args.hidden = layer._table, n, hidden
    args.ntok, args.topk = ntok, 8
    args.expert_weights = ffi.from_buffer("float[]", weights)
    args.x, args.x_dtype = ffi.from_buffer(x), lib.DUCK_DT_F32
    args.y, args.y_dtype = ffi.from_buffer(y, require_writable=True), lib.DUCK_DT_F32
    ids = ffi.cast("const int32_t *", ffi.from_buffer(routes))
    k, nbytes, state = kernels(), ffi.new("uint64_t *"), {"i": 0, "keep": (routes, weights, x, y)}

    def call():
        args.expert_ids = ids + (state["i"] % 1024) * ntok * 8
        state["i"] += 1
        rc = lib.duck_moe_forward(pool.ptr, k, ws.ptr, args, nbytes)
        if rc != 0:
            raise RuntimeError(f"moe forward failed: {rc}")

    e0 = layer.experts[0]
    # every expert routed is read once per call: 8, or for two tokens 8..16 (the mean over the
    # routes, which the calls cycle through)
    distinct = float(np.mean([len(np.unique(r)) for r in routes]))
    per_call = round(e0.weight_bytes * distinct)
    case = Case("moe_slice", call, per_call, per_call * 8 // 9, model=model,
                shape=[n, 3, e0.down.shape[1], hidden], tokens=ntok, threads=threads,
                experts_per_call=round(distinct, 2), kernels=kernels_name(k))
    case.keep = (args, routes, weights, x, y)
    return case


# the prefill GEMM runs on the experts of one layer slice over 4 ducks: (experts made, hidden, width);
# 32 of DeepSeek's 256 are 400 MB, beyond the caches as the rotation needs
GEMM_LAYERS = {"qwen3-30b-a3b": (128, 2048, 192), "deepseek-v3": (32, 7168, 512)}


def build_cases(threads: int, rng: np.random.Generator, cold_bytes: int, moe_experts: int,
                read_buf: np.ndarray, shared: dict, sets: list[str], gemm: dict, moe_width: int = 64) -> list[Case]:
    pool = Pool(threads)
    ws = Workspace()
    cases = [Case("read", lambda: lib.duck_bench_read(pool.ptr, ffi.from_buffer(read_buf), read_buf.size),
                  read_buf.size, 0, threads=threads)]
    if not gemm["only"]:
        for rows, cols in ((2048, 7168), (7168, 2048)):
            cases += _gemv_cases(pool, ws, rows, cols, threads, sets, shared, rng, cold_bytes)
        for model, n_experts, hidden, width, ntok in MOE_SHAPES:
            layer = _moe_layer(model, n_experts or moe_experts, hidden, width or moe_width, rng, shared)
            cases.append(_moe_case(layer, model, ntok, pool, ws, threads, rng))
    cases += kernels_gemm.fma_peak_cases(pool, threads, sets)
    cases += kernels_gemm.amx_peak_cases(pool, threads, sets)
    for model in gemm["models"]:
        n_experts, hidden, width = GEMM_LAYERS[model]
        layer = _moe_layer(model, n_experts, hidden, width, rng, shared)
        cases += kernels_gemm.gemm_cases(layer, model, pool, threads, sets, rng, gemm["tokens"], gemm["parts"],
                                         gemm["activations"])
        cases += kernels_gemm.moe_prefill_cases(layer, model, pool, ws, threads, sets, rng, gemm["tokens"],
                                                gemm["parts"])
    return cases


def pool_wake(threads: int, runs: int = 200, gap_us: int = 300, spin_us: int = 1000) -> dict:
    """Median microseconds until the last worker of an empty run starts, and of
    the whole run: workers asleep (spin_us 0, the default for shared machines),
    spinning (they spin spin_us after a run; the gap is shorter), and a shared
    run (what the MoE forward uses: the caller never waits for a sleeper)."""
    out = {}
    wake, run_ = ffi.new("double *"), ffi.new("double *")
    for label, spin, shared_run in (("blocked", 0, 0), ("spinning", spin_us, 0), ("shared_blocked", 0, 1)):
        pool = Pool(threads, spin_us=spin)
        lib.duck_bench_pool_wake(pool.ptr, runs, gap_us, shared_run, wake, run_)
        # an empty shared run is over before a sleeping worker wakes: only its cost means something
        out[label] = {"run_us": round(run_[0], 2)} if shared_run else {"wake_us": round(wake[0], 2),
                                                                       "run_us": round(run_[0], 2)}
        del pool
    return {"threads": threads, "gap_us": gap_us, "spin_us": spin_us, **out}


def run(threads_list: list[int], rounds: int, min_seconds: float, read_mib: int, cold_mib: int,
        moe_experts: int, sets: list[str] | None = None, gemm: dict | None = None, moe_width: int = 64) -> dict:
    """gemm: the prefill GEMM's cases: models (GEMM_LAYERS' names), tokens per expert,
    parts (the amx GEMM's parts timed too), only (no GEMV and MoE cases), activations
    (bf16: a GPU host's; fp32: a CPU host's)."""
    gemm = {"models": ["qwen3-30b-a3b"], "tokens": kernels_gemm.GEMM_TOKENS, "parts": False, "only": False,
            "activations": ("bf16",), **(gemm or {})}
    rng = np.random.default_rng(1234)
    sets = sets or kernel_sets_to_compare()
    log.info("allocating a %d MiB read buffer", read_mib)
    read_buf = _aligned_bytes(read_mib * MiB)
    read_buf[:] = 1
    shared: dict = {}
    by_threads = {t: build_cases(t, rng, cold_mib * MiB, moe_experts, read_buf, shared, sets, gemm, moe_width)
                  for t in threads_list}
    for r in range(rounds):
        log.info("round %d/%d", r + 1, rounds)
        for t in threads_list:
            for case in by_threads[t]:
                case.run(min_seconds)
    result = {"machine": {"cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                          "huge_pages": huge_pages_mode() if os.environ.get("DUCK_HUGE_PAGES") != "0" else "off"},
              "kernels": kernels_name(kernels()), "kernel_sets": sets, "rounds": rounds, "read_gbps": {},
              "cases": [], "pool_wake": [pool_wake(t) for t in threads_list if t > 1]}
    for t in threads_list:
        med = {c.key: statistics.median(c.seconds) for c in by_threads[t]}
        gbps_of = {c.key: c.work_bytes / med[c.key] / 1e9 for c in by_threads[t]}
        read = gbps_of[("read", "None", None, None, None, None)]
        result["read_gbps"][str(t)] = round(read, 3)
        compute = kernels_gemm.entries(by_threads[t], med, t)
        if gemm["parts"]:
            result["cases"] += kernels_gemm.moe_profiles(by_threads[t], t)
        for c in by_threads[t]:
            if c.name == "read":
                continue
            if c.name in ("fma_peak", "amx_peak", "amx_part", "moe_part"):
                result["cases"].append(compute[c.key])
                continue
            gbps = gbps_of[c.key]
            entry = {"name": c.name, **c.info, "gbps": round(gbps, 3),
                     "gparams": round(gbps * c.params / c.work_bytes, 3), "ratio_to_read": round(gbps / read, 3)}
            entry.update(compute.get(c.key, {}))   # fp9_gemm: GFLOP/s, share of the FMA peak
            if c.name == "fp9_gemv":
                isa = ISA_NAMES[lib.duck_bench_isa(ISA_OF_KERNELS[c.info["kernels"]])]
                peer = gbps_of[("int8_gemv", str(c.info["shape"]), isa, None, None, None)]
                entry["int8_peer_isa"] = isa
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
    lines = [f"kernels={result['kernels']} (compared: {', '.join(result['kernel_sets'])})  "
             f"read GB/s by threads: {result['read_gbps']}"]
    for c in result["cases"]:
        label = c.get("kernels") or c.get("isa")
        compute = kernels_gemm.format_line(c)
        if compute:
            lines.append(compute)
            continue
        if c["name"] == "moe_slice":
            label = f"{c['model']} T{c['tokens']} {label}"
        extra = f"  ratio_to_int8 {c['ratio_to_int8']:.3f} (int8 {c['int8_peer_isa']})" if "ratio_to_int8" in c else ""
        lines.append(f"{c['name']:10s} {str(c['shape']):22s} {label:28s} threads {c['threads']:2d}  "
                     f"{c['gbps']:7.2f} GB/s  {c['gparams']:6.2f} Gparam/s  ratio_to_read {c['ratio_to_read']:.3f}{extra}")
    for w in result["pool_wake"]:
        lines.append(f"pool wake-up, {w['threads']} threads, {w['gap_us']} us apart: " + ", ".join(
            (f"{k} {v['wake_us']:.1f} us to the last worker ({v['run_us']:.1f} us a run)" if "wake_us" in v
             else f"{k} {v['run_us']:.1f} us a run") for k, v in w.items() if isinstance(v, dict)))
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
    ap.add_argument("--moe-experts", type=int, default=256, help="experts of the DeepSeek-V3 slice")
    ap.add_argument("--moe-width", type=int, default=64,
                    help="the DeepSeek-V3 slice's width per expert (2048 / tp: 64 for 32 ducks, 256 for 8, 512 for 4)")
    ap.add_argument("--kernels", default=None,
                    help="comma-separated fp9 kernel sets to compare (default: the best and every fast set "
                         f"this CPU runs; known: {', '.join(KERNEL_SETS[1:])})")
    ap.add_argument("--gemm-models", default="qwen3-30b-a3b",
                    help=f"layer slices of the prefill GEMM cases (of: {', '.join(GEMM_LAYERS)})")
    ap.add_argument("--gemm-tokens", default=",".join(map(str, kernels_gemm.GEMM_TOKENS)),
                    help="tokens per expert of the prefill GEMM cases")
    ap.add_argument("--gemm-activations", default="bf16",
                    help="activations of the prefill GEMM cases: bf16 (a GPU host's), fp32 (a CPU host's), or both "
                         "comma-separated")
    ap.add_argument("--gemm-only", action="store_true", help="only the read, the peaks and the prefill GEMM")
    ap.add_argument("--amx-parts", action="store_true",
                    help="time the amx GEMM with each of its parts left out, against the whole")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument("--synth", action="store_true", help="measure synthetic fp9 generation only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    threads = sorted({int(t) for t in args.threads.split(",")})
    if args.synth:
        result = synth_bench(threads, args.rounds, args.seconds)
        sys.stdout.write((json.dumps(result, indent=2) if args.json else format_synth(result)) + "\n")
        return 0
    sets = None
    if args.kernels:
        sets = [k.strip() for k in args.kernels.split(",") if k.strip()]
        unknown = [k for k in sets if k not in KERNEL_SETS[1:]]
        if unknown:
            ap.error(f"--kernels {args.kernels}: unknown {', '.join(unknown)} (known: {', '.join(KERNEL_SETS[1:])})")
        missing = [k for k in sets if k not in kernels_available()]
        if missing:
            ap.error(f"--kernels {args.kernels}: this CPU or build lacks {', '.join(missing)} "
                     f"(available: {', '.join(kernels_available())})")
    models = [m.strip() for m in args.gemm_models.split(",") if m.strip()]
    if not models or any(m not in GEMM_LAYERS for m in models):
        ap.error(f"--gemm-models {args.gemm_models}: known are {', '.join(GEMM_LAYERS)}")
    try:
        tokens = tuple(int(t) for t in args.gemm_tokens.split(","))
    except ValueError:
        tokens = ()
    if not tokens or any(t < 1 or t > 1024 for t in tokens):
        ap.error(f"--gemm-tokens {args.gemm_tokens}: comma-separated token counts from 1 to 1024")
    activations = tuple(a.strip() for a in args.gemm_activations.split(",") if a.strip())
    if not activations or any(a not in ("bf16", "fp32") for a in activations):
        ap.error(f"--gemm-activations {args.gemm_activations}: bf16, fp32 or both comma-separated")
    gemm = {"models": models, "tokens": tokens, "parts": args.amx_parts, "only": args.gemm_only,
            "activations": activations}
    if args.moe_width < 64 or args.moe_width % 64 or args.moe_width > 2048:
        ap.error(f"--moe-width {args.moe_width}: a multiple of 64 from 64 to 2048")
    result = run(threads, args.rounds, args.seconds, args.read_mib, args.cold_mib, args.moe_experts, sets, gemm,
                 args.moe_width)
    sys.stdout.write((json.dumps(result, indent=2) if args.json else format_table(result)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
