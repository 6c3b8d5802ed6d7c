"""The compute side of the kernel benchmark: the FMA peak of each instruction
set (and where the amx set runs, the AMX tile rate: alone, with the GEMM's tile
loads, with its A tiles freshly stored) and the prefill GEMM (fp9_gemm) at 8, 32 and 128 tokens per expert, in
GFLOP/s and as a share of that peak, both measured in the run of
bench/kernels.py, round by round beside its other cases; and the duck's whole
forward of a prefill chunk at those tokens per expert (moe_prefill), whose
time over the GEMMs' alone is what the forward adds to them."""
from __future__ import annotations

import statistics

import numpy as np

from bench.kernel_cases import ISA_NAMES, ISA_OF_KERNELS, Case, rotating
from native._native import ffi, lib
from native.kernels import MoeSlice, kernels

# Tokens per expert of the prefill GEMM case: a chunk of 64 .. 1024 tokens
# over 128 experts, top-8, gives about 4 .. 64 per expert.
GEMM_TOKENS = (8, 32, 128)
GEMM_EXPERTS = 8             # experts per pool run
FMA_ROUNDS = 1 << 20


def _bf16(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (duck_f32_to_bf16, ties to even), kept in fp32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = np.empty(a.shape, dtype=np.uint16)
    lib.duck_f32_to_bf16(ffi.cast("const float *", ffi.from_buffer(a)), a.size,
                         ffi.cast("uint16_t *", ffi.from_buffer(bits, require_writable=True)))
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fma_peak_cases(pool, threads: int, sets: list[str]) -> list[Case]:
    """The FMA peak of every instruction set the compared kernel sets use."""
    cases = []
    for isa in sorted({lib.duck_bench_isa(ISA_OF_KERNELS[k]) for k in sets}, reverse=True):
        flops = lib.duck_bench_fma(pool.ptr, isa, 1)   # per round, on every thread
        cases.append(Case("fma_peak", lambda isa=isa: lib.duck_bench_fma(pool.ptr, isa, FMA_ROUNDS), 0, 0,
                          flops=flops * FMA_ROUNDS, threads=threads, isa=ISA_NAMES[isa]))
    return cases


AMX_ROUNDS = 1 << 16
AMX_MODES = ("tiles", "tile_loads", "stored_tile_loads")   # duck_kernels_amx_probe's modes 0, 1, 2


def amx_peak_cases(pool, threads: int, sets: list[str]) -> list[Case]:
    """Where the amx set is compared: the tile rate alone and with the GEMM's tile loads
    (duck_kernels_amx_probe), the reference of the amx GEMM's figure as fma_peak is of the others."""
    if "amx" not in sets or not lib.duck_kernels_amx_probe(pool.ptr, 0, 1):
        return []
    per_round = lib.duck_kernels_amx_probe(pool.ptr, 0, 1)
    return [Case("amx_peak", lambda m=m: lib.duck_kernels_amx_probe(pool.ptr, m, AMX_ROUNDS), 0, 0,
                 flops=per_round * AMX_ROUNDS, threads=threads, mode=AMX_MODES[m]) for m in range(3)]


# bench kernels --amx-parts: the amx GEMM with parts of it left out (duck_kernels_amx_parts),
# each timed against the whole GEMM in the same round
AMX_PARTS = {"serial": lib.DUCK_AMX_PART_SERIAL, "no_decode": lib.DUCK_AMX_PART_NO_DECODE,
             "no_tiles": lib.DUCK_AMX_PART_NO_TILES, "no_out": lib.DUCK_AMX_PART_NO_OUT,
             "no_prefetch": lib.DUCK_AMX_PART_NO_PREFETCH,
             "decode_only": lib.DUCK_AMX_PART_NO_TILES | lib.DUCK_AMX_PART_NO_OUT}


def _with_parts(fn, parts: int):
    def call():
        lib.duck_kernels_amx_parts(parts)
        try:
            fn()
        finally:
            lib.duck_kernels_amx_parts(0)
    return call


def gemm_cases(layer: MoeSlice, model: str, pool, threads: int, sets: list[str], rng,
               tokens: tuple[int, ...] = GEMM_TOKENS, parts: bool = False,
               activations: tuple[str, ...] = ("bf16",)) -> list[Case]:
    """What prefill does with the experts of a chunk: each one's gate/up and
    down slices streamed once over all of its tokens, rows split over the
    pool (duck_bench_gemm: GEMMs only, one pool run per GEMM_EXPERTS
    experts), rotating over the layer so that the weights come from memory.
    activations: bf16 values (a GPU host's fleet), fp32 (a CPU host's), or both."""
    hidden, width, n = layer.hidden, layer.experts[0].down.shape[1], len(layer.experts)
    groups = [layer._table + i for i in range(0, n - GEMM_EXPERTS + 1, GEMM_EXPERTS)]
    cases = []
    for act in activations:
        for ntok in tokens:
            # prepared activations (x 2^64, as fp9_prepare_x_* gives them): outputs stay normal floats. bf16:
            # both inputs are bf16 values, as a GPU host's fleet has them: gate/up's x as sent, down's
            # silu(gate) * up rounded to bf16 by the duck on bf16 activations (ffn.c); the avx512-bf16 and
            # amx sets' case. fp32: a CPU host's, the amx set's three-part case.
            x = (rng.standard_normal((ntok, hidden)) * 2.0 ** 64).astype(np.float32)
            h = (rng.standard_normal((ntok, width)) * 2.0 ** 64).astype(np.float32)
            if act == "bf16":
                x, h = _bf16(x), _bf16(h)
            gu, y = np.empty((ntok, 2 * width), dtype=np.float32), np.empty((ntok, hidden), dtype=np.float32)
            rows = [ffi.new("float *[]", [ffi.cast("float *", ffi.from_buffer(a[t], require_writable=True))
                                          for t in range(ntok)]) for a in (x, h, gu, y)]
            for name in sets:
                k = kernels(name)
                calls = [(lambda g=g, k=k, n=ntok: lib.duck_bench_gemm(pool.ptr, k, g, GEMM_EXPERTS, n, *rows))
                         for g in groups]
                per_call = GEMM_EXPERTS * layer.experts[0].weight_bytes
                case = Case("fp9_gemm", rotating(calls), per_call, GEMM_EXPERTS * 3 * width * hidden,
                            flops=GEMM_EXPERTS * 2 * ntok * 3 * width * hidden, model=model,
                            shape=[n, 3, width, hidden], tokens=ntok, threads=threads, kernels=name, activations=act)
                case.keep = (x, h, gu, y, rows)
                cases.append(case)
                if parts and act == "bf16" and name in ("amx", "amx-emu"):
                    cases += [Case("amx_part", _with_parts(case.fn, mask), per_call, 0, flops=case.flops,
                                   model=model, shape=case.info["shape"], tokens=ntok, threads=threads, kernels=name,
                                   part=label) for label, mask in AMX_PARTS.items()]
    return cases


def moe_prefill_cases(layer: MoeSlice, model: str, pool, ws, threads: int, sets: list[str], rng,
                      tokens: tuple[int, ...] = GEMM_TOKENS, parts: bool = False) -> list[Case]:
    """A duck's forward of one prefill chunk (duck_moe_forward, what a FORWARD
    runs): bf16 activations in and out, as a GPU host sends and takes them, each
    token routed top-8 to distinct experts of the layer, so that an expert gets
    the given tokens per expert on average (the chunk n_experts * tokens / 8
    tokens, at most DUCK_MAX_TOKENS). Its flops are the GEMMs'; what it adds to
    them (sorting the routes, the activations' conversions, SiLU, the weighted
    sum per token) shows as its rate under fp9_gemm's at the same tokens. With
    parts, the amx set's forward is timed with each part of its GEMMs left out
    too (moe_part), as fp9_gemm's are (amx_part)."""
    hidden, width, n = layer.hidden, layer.experts[0].down.shape[1], len(layer.experts)
    cases = []
    for per_expert in tokens:
        ntok = n * per_expert // 8
        if not 1 <= ntok <= lib.DUCK_MAX_TOKENS:
            continue
        ids = np.stack([rng.choice(n, size=8, replace=False) for _ in range(ntok)]).astype(np.int32)
        w = np.full((ntok, 8), 0.125, dtype=np.float32)
        x = (rng.standard_normal((ntok, hidden)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        y = np.empty((ntok, hidden), dtype=np.uint16)
        for name in sets:
            k = kernels(name)
            args = ffi.new("duck_moe_args *")
            args.experts, args.n_experts, args.hidden, args.ntok, args.topk = layer._table, n, hidden, ntok, 8
            args.expert_ids = ffi.cast("const int32_t *", ffi.from_buffer(ids))
            args.expert_weights = ffi.cast("const float *", ffi.from_buffer(w))
            args.x, args.x_dtype = ffi.from_buffer(x), lib.DUCK_DT_BF16
            args.y, args.y_dtype = ffi.from_buffer(y, require_writable=True), lib.DUCK_DT_BF16

            def call(args=args, k=k):
                rc = lib.duck_moe_forward(pool.ptr, k, ws.ptr, args, ffi.NULL)
                if rc != 0:
                    raise RuntimeError(f"moe forward of {ntok} tokens failed: {rc}")
            per_call = n * layer.experts[0].weight_bytes
            case = Case("moe_prefill", call, per_call, n * 3 * width * hidden,
                        flops=2 * ntok * 8 * 3 * width * hidden, model=model, shape=[n, 3, width, hidden],
                        tokens=per_expert, chunk=ntok, threads=threads, kernels=name)
            case.keep = (args, ids, w, x, y)
            cases.append(case)
            if parts and name in ("amx", "amx-emu"):
                cases += [Case("moe_part", _with_parts(call, mask), per_call, 0, flops=case.flops, model=model,
                               shape=case.info["shape"], tokens=per_expert, threads=threads, kernels=name, part=label)
                          for label, mask in AMX_PARTS.items()]
    return cases


PHASES = ("setup", "gate_up", "silu", "down_wait", "down", "reduce")   # duck_ffn_profile's, then the run's wall


def moe_profiles(cases: list[Case], threads: int, calls: int = 10) -> list[dict]:
    """Where each moe_prefill case's time goes (duck_ffn_profile): thread-ms per
    call and phase, the pool run's wall ms, and what of threads x that wall no
    phase holds (workers idle or between pieces)."""
    out = []
    for c in cases:
        if c.name != "moe_prefill":
            continue
        ns = ffi.new(f"uint64_t[{lib.DUCK_FFN_PHASES}]")
        lib.duck_ffn_profile(1, ffi.NULL)
        try:
            for _ in range(calls):
                c.fn()
        finally:
            lib.duck_ffn_profile(0, ns)
        ms = [ns[i] / calls / 1e6 for i in range(lib.DUCK_FFN_PHASES)]
        phases = dict(zip(PHASES, (round(v, 3) for v in ms)))
        run_ms = ms[len(PHASES)]
        out.append({"name": "moe_profile", **c.info, "thread_ms": phases, "run_wall_ms": round(run_ms, 3),
                    "unaccounted_thread_ms": round(threads * run_ms - sum(ms[1:len(PHASES)]), 3)})
    return out


def entries(cases: list[Case], med: dict, threads: int) -> dict:
    """The result entries of the FMA peaks and of the GEMMs (with their share
    of the peak of their own instruction set), by case key."""
    out = {}
    for c in cases:
        gflops = c.flops / med[c.key] / 1e9
        if c.name in ("fma_peak", "amx_peak"):
            out[c.key] = {"name": c.name, **c.info, "gflops": round(gflops, 2),
                          "gflops_per_core": round(gflops / threads, 2)}
        elif c.name in ("amx_part", "moe_part"):   # its time over the whole GEMM's (forward's), round by round
            of = "fp9_gemm" if c.name == "amx_part" else "moe_prefill"
            whole = next(p for p in cases if p.name == of and p.info["kernels"] == c.info["kernels"]
                         and p.info["tokens"] == c.info["tokens"] and p.info["shape"] == c.info["shape"]
                         and p.info.get("activations", "bf16") == "bf16")
            out[c.key] = {"name": c.name, **c.info, "seconds": round(med[c.key], 6), "time_ratio": round(
                statistics.median([s / w for s, w in zip(c.seconds, whole.seconds)]), 3)}
        elif c.name == "moe_prefill":   # and its rate over the GEMMs' alone, round by round
            gemm = next((p for p in cases if p.name == "fp9_gemm" and p.info["kernels"] == c.info["kernels"]
                         and p.info["tokens"] == c.info["tokens"] and p.info["shape"] == c.info["shape"]
                         and p.info["activations"] == "bf16"), None)
            out[c.key] = {"gflops": round(gflops, 2), "gflops_per_core": round(gflops / threads, 2),
                          "seconds": round(med[c.key], 6)}
            if gemm is not None:
                out[c.key]["ratio_to_gemm"] = round(statistics.median(
                    [(c.flops / s) / (gemm.flops / g) for s, g in zip(c.seconds, gemm.seconds)]), 3)
        elif c.name == "fp9_gemm":
            isa = ISA_NAMES[lib.duck_bench_isa(ISA_OF_KERNELS[c.info["kernels"]])]
            peak = next(p for p in cases if p.name == "fma_peak" and p.info["isa"] == isa)
            # round by round (the peak measured just before), so that a slow spell of a shared
            # machine moves both sides of a ratio
            ratios = [(c.flops / s) / (peak.flops / p) for s, p in zip(c.seconds, peak.seconds)]
            out[c.key] = {"gflops": round(gflops, 2), "gflops_per_core": round(gflops / threads, 2),
                          "fma_peak_isa": isa, "ratio_to_fma_peak": round(statistics.median(ratios), 3)}
            tiles = next((p for p in cases if p.name == "amx_peak" and p.info["mode"] == "tiles"), None)
            if c.info["kernels"] == "amx" and tiles is not None:   # and of the tiles' own rate
                out[c.key]["ratio_to_amx_peak"] = round(statistics.median(
                    [(c.flops / s) / (tiles.flops / p) for s, p in zip(c.seconds, tiles.seconds)]), 3)
    return out


def format_line(c: dict) -> str | None:
    """The table line of an FMA peak or a GEMM entry (None for the other cases)."""
    if c["name"] in ("fma_peak", "amx_peak"):
        return (f"{c['name']:10s} {'':22s} {c.get('isa') or c['mode']:28s} threads {c['threads']:2d}  "
                f"{c['gflops']:7.1f} GFLOP/s ({c['gflops_per_core']:.1f} per core)")
    if c["name"] == "moe_profile":
        phases = " ".join(f"{k} {v:.2f}" for k, v in c["thread_ms"].items())
        return (f"{c['name']:10s} {str(c['shape']):22s} {c['model'] + ' T' + str(c['tokens']) + ' ' + c['kernels']:28s} "
                f"threads {c['threads']:2d}  thread-ms {phases}; run {c['run_wall_ms']:.2f} ms wall, "
                f"{c['unaccounted_thread_ms']:.2f} thread-ms in none")
    if c["name"] in ("amx_part", "moe_part"):
        return (f"{c['name']:10s} {str(c['shape']):22s} {c['model'] + ' T' + str(c['tokens']) + ' ' + c['part']:28s} "
                f"threads {c['threads']:2d}  {c['seconds'] * 1e3:8.3f} ms  time_ratio {c['time_ratio']:.3f} "
                f"(of the whole amx {'GEMM' if c['name'] == 'amx_part' else 'forward'})")
    if c["name"] == "moe_prefill":
        label = f"{c['model']} T{c['tokens']} {c['kernels']} chunk {c['chunk']}"
        return (f"{c['name']:10s} {str(c['shape']):22s} {label:28s} threads {c['threads']:2d}  "
                f"{c['gflops']:7.1f} GFLOP/s ({c['gflops_per_core']:.1f} per core)  {c['seconds'] * 1e3:8.3f} ms"
                + (f"  ratio_to_gemm {c['ratio_to_gemm']:.3f}" if "ratio_to_gemm" in c else ""))
    if c["name"] == "fp9_gemm":
        label = f"{c['model']} T{c['tokens']} {c['kernels']}" + (" fp32" if c["activations"] == "fp32" else "")
        return (f"{c['name']:10s} {str(c['shape']):22s} {label:28s} threads {c['threads']:2d}  "
                f"{c['gflops']:7.1f} GFLOP/s ({c['gflops_per_core']:.1f} per core)  "
                f"ratio_to_fma_peak {c['ratio_to_fma_peak']:.3f} ({c['fma_peak_isa']})  {c['gbps']:.2f} GB/s"
                + (f"  ratio_to_amx_peak {c['ratio_to_amx_peak']:.3f}" if "ratio_to_amx_peak" in c else ""))
    return None
