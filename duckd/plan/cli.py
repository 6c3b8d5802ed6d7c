"""`duckctl plan`: the planner (duckd/plan/model.py) from the command line, calibrated
out of the benchmarks' JSON files, and its validation against measured runs.

  duckctl plan MODEL [--ducks N] [fleet options] [--kernels F] [--transport F] [--e2e F] [--json]
  duckctl plan --validate [--json]      predicted vs measured: the seeds, bench/results, --transport F

MODEL: a synthetic name (deepseek-v32, qwen3-30b-a3b, qwen3-235b-a22b, qwen3.5-35b-a3b), a
checkpoint folder or its config.json. Calibration files override the defaults
(the seeds' N100 fleet), and options given on the command line override both.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import statistics
import sys
from pathlib import Path

from duckd.plan.model import Fleet, ModelShape, PlanError, load_model, plan, slice_width, transport_us
from duckd.plan.prefill import streamed_prefill

log = logging.getLogger("duck.plan")

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"   # the measured runs, in the source tree
STREAMED_PROMPTS = (1024, 8192, 32768)
HIDDEN = 7168


def _read(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read a benchmark JSON: {e}") from None


def slice_read_ratio(d: dict, m: ModelShape, ducks: int, cores: int, multiple_of: int = 64) -> float | None:
    """`bench kernels --json`: the decode kernel (moe_slice, one token) on the slice of m that each of
    `ducks` ducks holds (experts x 3 x width x hidden, `bench kernels --moe-width`), over the read
    probe at the same threads; None where the file has no such case at `cores` threads."""
    width = slice_width(m.moe_intermediate, ducks, multiple_of) if m.experts else 0
    for c in d.get("cases", []):
        if (c.get("name") == "moe_slice" and c.get("tokens") == 1 and c.get("threads") == cores
                and c.get("shape") == [m.experts, 3, width, m.hidden] and c.get("ratio_to_read")):
            return c["ratio_to_read"]
    return None


def from_kernels(d: dict, cores: int, model: ModelShape | None = None, ducks: int = 0) -> dict:
    """`bench kernels --json`: the fp9 GEMV per core (at the fewest threads measured), the read bandwidth at `cores` threads,
    the pool's run of one job on blocked workers (the per-call cost of a duck's kernel) and, given the
    model and the fleet's size, the decode kernel's rate on its slice over the read (kernel_read_ratio)."""
    gemv = [c for c in d.get("cases", []) if c.get("name") == "fp9_gemv" and c.get("threads")]
    reads = {int(k): v for k, v in (d.get("read_gbps") or {}).items()}
    if not gemv or not reads:
        raise PlanError("kernels file: no fp9_gemv case or no read_gbps (is it `bench kernels --json`?)")
    fewest = min(c["threads"] for c in gemv)   # one thread where measured: the rate of a core alone
    near = min(reads, key=lambda t: (abs(t - cores), -t))
    out = {"kernel_gparams_per_core": max(c["gparams"] for c in gemv if c["threads"] == fewest) / fewest,
           "read_gbps": reads[near]}
    gemm = [c for c in d.get("cases", []) if c.get("name") == "fp9_gemm" and c.get("threads") == 1]
    if gemm:   # prefill: param x token products per second = FLOP/s / 2, at the most tokens per expert
        most = max(c["tokens"] for c in gemm)
        out["gemm_gparams_per_core"] = max(c["gflops_per_core"] for c in gemm if c["tokens"] == most) / 2
    if model is not None and ducks:
        ratio = slice_read_ratio(d, model, ducks, cores)
        if ratio is not None:
            out["kernel_read_ratio"] = ratio
    wakes = [w for w in d.get("pool_wake") or [] if w.get("blocked")]
    if wakes:   # the ducks block between layers by default: one FFN call's pool job on woken workers
        w = min(wakes, key=lambda w: (abs(w["threads"] - cores), -w["threads"]))
        out["kernel_call_us"] = w["blocked"]["run_us"]
    return out


# fp9 GEMV per core on the H200 host's Xeon, by the kernel code of the day: 4 threads on [7168, 2048] / 4 in
# 2026-11-30-kernels-h200-host-16core.json (avx2-xor, 14.87 Gparam/s) and 2026-12-01-kernels-h200-host-16core.txt
# (avx512, 30.68 Gparam/s; that run's JSON did not come back, its printed table did)
H200_GPARAMS_PER_CORE = {"2026-11-30": 14.87 / 4, "2026-12-01": 30.68 / 4}
# One FFN call's pool job on a duck of 4 threads of the H200 host, us: blocked workers woken
# (the ducks' default, --idle block) and spinning ones (bench/results/2026-12-02-kernels-h200-amx.json,
# pool_wake run_us). A decode layer's kernel is a few hundred us, so this is 10-15 % of Qwen3's.
H200_POOL_RUN_US = {"blocked": 42.96, "spinning": 2.76}


# e2e runs with `bench kernels` taken on the same machine in the same lease (moe_slice at the run's slice
# width and duck threads): their kernel_read_ratio is measured, not assumed 1 (docs/plan.md, Known misses)
SAME_LEASE_KERNELS = {
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-8x2-kernels.json": "2026-12-04-kernels-h200-w256.json",
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-kernels.json": "2026-12-04-kernels-h200-w512.json",
    "2026-12-04-e2e-synthetic-qwen3-30b-a3b-h200-kernels.json": "2026-12-04-kernels-h200-w512.json",
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-16x1-kernels.json": "2026-12-04-kernels-h200-w128.json",
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-8x2-kernels-run2.json": "2026-12-04-kernels-h200-w256-run2.json",
}


def from_e2e(d: dict, day: str = "2026-12-01", name_of_file: str = "") -> tuple[dict, ModelShape, float]:
    """`bench e2e --synthetic --json`: the fleet and host of the run, its model, its measured decode tok/s.
    The host stage, head and transport are the run's own per-layer measurements (inputs of the plan);
    the kernel is predicted from the read bandwidth measured at the run's start and end, at the rate
    the ducks' kernel reads their slice (kernel_read_ratio: the run's probe of every duck at once,
    its rounds of all ducks together or else its slowest duck, for a layer waits for the slowest,
    over the start's read probe, taken beside it; else `bench kernels` in the same lease; else 1)."""
    from duckd.plan.shapes import SHAPES
    fl, shape = d["fleet"], d["shape"]
    dec = fl["prompts"][0]["decode"]
    name = d.get("model", "").replace("synthetic ", "")
    base = SHAPES.get(name)
    if base is None:
        raise PlanError(f"e2e file: unknown synthetic model {d.get('model')!r}")
    m = ModelShape.from_config(base, name)
    dense = sum(1 for row in shape["ffn_layers"] if row[1] == 0) if "ffn_layers" in shape else m.dense_layers
    m = dataclasses.replace(m, layers=shape["layers"], dense_layers=dense, experts=shape.get("experts", m.experts),
                            mtp_layers=0)
    reads = [v for v in (d.get("fleet_read_gbps"), d.get("fleet_read_gbps_end")) if v]
    pl = dec["per_layer_ms"]
    ducks, cores = fl["ducks"], fl["duck_threads"]
    per_core = H200_GPARAMS_PER_CORE[max(k for k in H200_GPARAMS_PER_CORE if k <= day)]
    # ducks spinning between layers (a decode layer's gap is ~0.1 ms) pay no wake-up; files made before
    # the e2e JSON recorded duck_spin_us say so in their name (bench/results/README.md: duckspin300)
    spin = fl.get("duck_spin_us", 300 if "duckspin" in name_of_file else 0)
    # the decode kernel's rate on this run's slice over the read: the run's own probe of every duck's
    # kernel at once (bench/kernel_probe.py), else `bench kernels` of one duck in the same lease
    ratio = None
    probe = d.get("fleet_kernel")
    if probe and d.get("fleet_read_gbps"):
        # its rounds of every duck at once where it has them (a layer lasts its slowest duck's call),
        # else the slowest duck's free-running rate, over the read probe taken beside it (before the
        # runs): the machine's memory drifts during a run (by up to 29 % between the start's read
        # probe and the end's), and the kernel's rate with it; the ratio holds, and the plan applies
        # it to the mean of the two reads as it does the read share
        ratio = probe.get("gbps_per_duck_in_step", probe["gbps_slowest_duck"]) / (d["fleet_read_gbps"] / ducks)
    elif name_of_file in SAME_LEASE_KERNELS:
        ratio = slice_read_ratio(_read(str(RESULTS / SAME_LEASE_KERNELS[name_of_file])), m, ducks, cores)
        if ratio is None:
            raise PlanError(f"{SAME_LEASE_KERNELS[name_of_file]}: no moe_slice case for {name_of_file}'s slice")
    fleet = {"ducks": ducks, "subnets": 1, "cores": cores, "read_gbps": sum(reads) / len(reads) / ducks,
             "kernel_gparams_per_core": per_core, "kernel_read_ratio": ratio or 1.0,
             "kernel_call_us": H200_POOL_RUN_US["spinning" if spin else "blocked"],
             "host_ms": pl["host"], "head_ms": dec.get("head_ms", 0.5), "call_us": pl["transport"] * 1e3,
             "duck_link_gbit": 1e4, "port_gbit": 1e4, "latency_us": 0.0, "mtp_acceptance": 0.0}
    # the median of the run's decodes where it has several (the first is one sample: bench/results/README.md)
    return fleet, m, fl.get("decode_tok_s_median", fl["decode_tok_s"])


def netns_cases(d: dict, dtype: str = "fp32") -> list[tuple[int, float]]:
    """(ducks, median us) of the netns partials cases of a `bench transport --netns` file
    (of several runs merged by merge_netns_runs: the median of the runs' medians)."""
    out = []
    for k, v in d.items():
        if k.startswith("netns_partials_") and k.endswith(f"_{dtype}"):
            out.append((v["ducks"], v["median_us"]))
    return sorted(out)


def merge_netns_runs(paths: list[str]) -> dict:
    """Several `bench transport --netns --json` runs of the same links as one: each case's
    median_us the median over the runs (a shared machine moves one run by 15 % or more)."""
    runs = [_read(p) for p in paths]
    first = runs[0]
    for p, d in zip(paths[1:], runs[1:]):
        if d.get("links") != first.get("links") or d.get("cpus") != first.get("cpus"):
            raise PlanError(f"{p}: other links or CPUs than {paths[0]}: runs to merge must repeat one setup")
    merged = dict(first)
    for k, v in first.items():
        if k.startswith("netns_partials_") and isinstance(v, dict):
            medians = [d[k]["median_us"] for d in runs if k in d]
            merged[k] = {**v, "median_us": statistics.median(medians), "runs_median_us": medians}
    return merged


def netns_fleet(d: dict, ducks: int, dtype: str, calibrate_at: int | None) -> Fleet:
    """The emulated fleet of a `bench transport --netns` file. Its ducks share the machine's CPUs, so each
    call costs them CPU time; that cost per duck is calibrated at the smallest size (calibrate_at)."""
    links, cpus = d["links"], d["cpus"]
    delay = links["duck_delay_us"] + links["port_delay_us"]
    f = Fleet(ducks=ducks, subnets=links["subnets"], duck_link_gbit=links["duck_rate_mbit"] / 1e3 or 1e4,
              port_gbit=links["port_rate_mbit"] / 1e3 or 1e4, latency_us=delay, call_us=0.0,
              act_bytes=4, partial_bytes=4 if dtype == "fp32" else 2, colocated_cores=cpus,
              emulated_link_mtu=links.get("link_mtu", 1500))
    if calibrate_at:   # what the calibration point took beyond its wire, as CPU per duck
        rt = dict(netns_cases(d, dtype))[calibrate_at]
        wire = transport_us(dataclasses.replace(f, ducks=calibrate_at, colocated_cores=0), HIDDEN)["total_us"]
        f.colocated_cpu_us_per_duck = max(0.0, rt - wire) * cpus / calibrate_at
    return f


def validate(transport_file: str | None = None) -> dict:
    """Predicted vs measured: the seeds (inputs documented in docs/plan.md), the H200 e2e files, and the
    emulated fleet's round trips (calibrated at its smallest size, predicted at the others)."""
    from duckd.plan.seeds import SEED_CASES
    rows = []
    for case in SEED_CASES:
        p = plan(load_model(case["model"]), Fleet(**case["fleet"]))
        rows.append({"case": case["name"], "source": "seeds", "measured": case["measured_tok_s"],
                     "predicted": round(p["decode"]["tok_s"], 2), "tolerance": 0.20, "inputs": case["why"]})
    for path in sorted(glob.glob(str(RESULTS / "*e2e-synthetic*h200*.json"))):
        d = _read(path)
        if "prompts" not in d.get("fleet", {}):
            continue
        fleet, m, measured = from_e2e(d, Path(path).name[:10], Path(path).name)
        p = plan(m, Fleet(**fleet))
        noisy = "noisy" in path   # bench/results/README.md: "the host was noisy ... not used for the figure"
        rows.append({"case": Path(path).name, "source": "H200 noisy" if noisy else "H200 e2e",
                     "measured": round(measured, 2), "predicted": round(p["decode"]["tok_s"], 2),
                     "tolerance": None if noisy else 0.15,
                     "inputs": f"{fleet['ducks']} ducks x {fleet['cores']} threads, read "
                               f"{fleet['read_gbps']:.1f} GB/s per duck, host {fleet['host_ms']:.3f} + "
                               f"transport {fleet['call_us'] / 1e3:.3f} ms per layer (measured), head "
                               f"{fleet['head_ms']:.2f} ms"})
    if transport_file:
        paths = [p for p in transport_file.split(",") if p]
        d = merge_netns_runs(paths)
        for dtype in ("fp32", "bf16"):
            cases = netns_cases(d, dtype)
            if not cases:
                continue
            n0 = cases[0][0]
            for n, measured in cases:
                f = netns_fleet(d, n, dtype, n0)
                t = transport_us(f, HIDDEN)
                runs = d[f"netns_partials_{n}_ducks_hidden{HIDDEN}_{dtype}"].get("runs_median_us", [measured])
                rows.append({"case": f"netns {n} ducks hidden {HIDDEN} {dtype} partials"
                                     + (f" (median of {len(runs)} runs)" if len(runs) > 1 else ""),
                             "source": "emulated LAN",
                             "measured": measured, "predicted": round(t["total_us"], 1), "tolerance": 0.15,
                             "inputs": f"wire {t['wire_us']:.0f} us at {f.duck_link_gbit:g}/{f.port_gbit:g} Gbit/s; "
                                       f"shared CPUs {t.get('colocated_cpu_us', 0):.0f} us "
                                       f"(calibrated at {n0} ducks)" + (" = the calibration point" if n == n0 else "")})
    for r in rows:
        r["error"] = round(r["predicted"] / r["measured"] - 1, 3)
        r["ok"] = r["tolerance"] is None or abs(r["error"]) <= r["tolerance"]
    return {"rows": rows, "all_ok": all(r["ok"] for r in rows)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duckctl plan", description="predict a fleet's decode and prefill tok/s")
    p.add_argument("model", nargs="?", help="a synthetic name, a checkpoint folder or its config.json")
    p.add_argument("--json", action="store_true")
    p.add_argument("--validate", action="store_true", help="predicted vs measured runs (docs/plan.md)")
    p.add_argument("--kernels", help="a `bench kernels --json` file of the duck's hardware")
    p.add_argument("--transport", help="a `bench transport --json` file (with --validate: --netns runs, "
                                       "comma-separated: each case's median over them)")
    p.add_argument("--e2e", help="a `bench e2e --synthetic --json` file: the host stage, head and transport")
    for f in dataclasses.fields(Fleet):
        if f.name == "notes":
            continue
        kind = type(f.default)
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes", "on"), default=None,
                           metavar="BOOL", help=f"(default {f.default})")
        else:
            p.add_argument(flag, type=kind, default=None, help=f"(default {f.default})")
    p.add_argument("--sizes", default="", help="also plan these duck counts, e.g. 32,64,128")
    return p


def make_fleet(args) -> tuple[Fleet, list[str]]:
    values, notes = {}, []
    if args.e2e:
        e2e, _, _ = from_e2e(_read(args.e2e))
        values.update({k: e2e[k] for k in ("host_ms", "head_ms")})
        notes.append(f"host stage and head from {args.e2e}")
    if args.kernels:
        values.update(from_kernels(_read(args.kernels), args.cores or Fleet().cores,
                                   load_model(args.model) if args.model else None, args.ducks or Fleet().ducks))
        notes.append(f"kernels (GEMV, GEMM where measured) and read bandwidth from {args.kernels}")
    if args.transport:
        d = _read(args.transport)
        case = d.get("overhead_1_duck_hidden7168") or d.get("overhead_1_duck")
        if not case:
            raise PlanError(f"{args.transport}: no overhead_1_duck case (is it `bench transport --json`?)")
        values["call_us"] = case["median_us"]
        notes.append(f"call cost {case['median_us']} us from {args.transport} (one duck, loopback)")
    for f in dataclasses.fields(Fleet):
        v = getattr(args, f.name, None)
        if v is not None and f.name != "notes":
            values[f.name] = v
    return Fleet(**values, notes=notes), notes


def format_plan(p: dict) -> str:
    m, f, dec, pre, mem = p["model"], p["fleet"], p["decode"], p["prefill"], p["memory"]
    pl = dec["per_layer_ms"]
    lines = [f"{m['name']}: {m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts top-{m['topk']}; "
             f"{f['ducks']} ducks x {f['cores']} cores in {f['subnets']} subnets",
             f"  decode   {dec['tok_s']:7.1f} tok/s  ({dec['mode']}, step {dec['step_ms']:.1f} ms)",
             f"  per layer host {pl['host']:.3f} + kernel {pl['kernel']:.3f} + transport {pl['transport']:.3f} ms",
             *([f"  placement {dec['placement']['gpu_gb']:.1f} GB of FFN weights on the GPU "
                f"({dec['placement']['gpu_layers_whole']} layers whole, {dec['placement']['filling']}): "
                f"{dec['placement']['duck_gb_per_token']:.2f} GB per token from the ducks in "
                f"{dec['placement']['duck_calls_per_token']} calls"] if "placement" in dec else []),
             f"  prefill  {pre['tok_s']:7.1f} tok/s  (chunks of {pre['chunk_tokens']}, {pre['bound']})",
             *(f"  prefill  {s['tok_s']:7.1f} tok/s  at {s['tokens']} tokens, experts streamed from {s['host_copy']}: "
               f"GPU share {s['gpu_share']:.2f}, {s['bound']}" for s in p.get("streamed_prefill", [])),
             f"  memory   {mem['weights_gb_per_duck']:.2f} GB of fp9 weights per duck, headroom "
             f"{mem['headroom_gb_per_duck']:.1f} GB",
             f"  roofline {p['roofline_tok_s']:.1f} tok/s; bottleneck: {p['bottleneck']}"]
    lines += [f"  ({n})" for n in p["notes"]]
    return "\n".join(lines)


def format_validation(v: dict) -> str:
    lines = [f"{'case':58s} {'source':12s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  ok"]
    for r in v["rows"]:
        lines.append(f"{r['case'][:58]:58s} {r['source']:12s} {r['measured']:9.2f} {r['predicted']:9.2f} "
                     f"{r['error'] * 100:+6.1f}%  " + ("(not gated: noisy host)" if r["tolerance"] is None else
                                                      f"{'yes' if r['ok'] else 'NO'} (±{r['tolerance'] * 100:.0f}%)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        if args.validate:
            v = validate(args.transport)
            sys.stdout.write((json.dumps(v, indent=2) if args.json else format_validation(v)) + "\n")
            return 0
        if not args.model:
            raise PlanError("name a model (deepseek-v32, qwen3-30b-a3b, qwen3-235b-a22b, qwen3.5-35b-a3b, or a checkpoint folder), "
                            "or --validate")
        m = load_model(args.model)
        fleet, _ = make_fleet(args)
        sizes = [int(s) for s in args.sizes.split(",") if s] or [fleet.ducks]
        plans = [plan(m, dataclasses.replace(fleet, ducks=n)) for n in sizes]
        for p, n in zip(plans, sizes):   # long prompts with the GPU streaming the experts (duckd/plan/prefill.py)
            p["streamed_prefill"] = [streamed_prefill(m, dataclasses.replace(fleet, ducks=n), t)
                                     for t in STREAMED_PROMPTS]
    except PlanError as e:
        print(f"duckctl plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(json.dumps(plans[0] if len(plans) == 1 else plans, indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(format_plan(p) for p in plans) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
