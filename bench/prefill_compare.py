"""`python -m bench.prefill_compare --synthetic qwen3-30b-a3b --json out.json`: duck's side of the
prefill comparison with llama.cpp, in one run on a GPU host (scripts/device_compare.sh runs
llama.cpp beside it and merges both into bench/results/<date>-compare-<shape>-<machine>.json).

A synthetic model at its published widths (random fp9 experts the local ducks generate, the
host's copy generated from the same seeds), and per prompt length:
  duck_fleet_only  the ducks alone, chunked as duckd does (model.prefill_chunk, two chunks in flight)
  duck_gpu_only    every expert streamed from pinned host memory to the GPU, the whole prompt one pass
  duck             what the engine does (engine.gpu.hybrid_prefill.StreamedPrefill): the ducks alone
                   where one pass over PCIe is estimated slower than they are (the fleet's rate timed
                   on the runs above), else both at once, the split from measured rates and timed
                   against the GPU alone per length (its "plan": fleet, split or gpu)
with TTFT, tok/s, the GPU's share of the experts, the bytes each pass moved over PCIe and the
distinct experts per layer (a random model whose routing collapsed would stream fewer).
Beside: the ducks' read bandwidth, the pinned host-to-GPU copy rate, decode tok/s (CUDA graphs),
the bytes the ducks read per decoded token, and each length's PCIe limit (tokens / (bytes of
one pass / copy rate)). Then decode at each GPU placement budget (--gpu-budgets: engine.placement)
with the ducks' GB per token, beside llama.cpp's from the CPU under -ot exps=CPU.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time

import torch

log = logging.getLogger("bench.prefill_compare")


@torch.inference_mode()
def measure_streamed(runner, stream, split, prompt_len: int, room: int) -> dict:
    """One prefill of prompt_len random tokens as one chunk, its FFN calls shared by HybridPrefill."""
    from bench.e2e_prefill import _sync
    from engine.gpu.hybrid_prefill import HybridPrefill

    model, device = runner.model, runner.device
    cache = model.make_cache(prompt_len + room)
    ids, positions = runner._ids(prompt_len), torch.arange(prompt_len, device=device)
    hook = HybridPrefill(stream, runner.timed, split, tokens=prompt_len, count_experts=True)
    _sync(device)
    t0 = time.perf_counter()
    with hook:
        hidden = model(ids, positions, cache)[-1:]
    int(model.compute_logits(hidden).argmax())
    ttft = time.perf_counter() - t0
    layers = hook.layers
    moe = [r for r in layers if r["experts"] > 1] or layers
    rates = split.moe_rates()
    pcie_bytes = sum(r["gpu_experts"] * stream.expert_bytes(r["layer"]) for r in layers)
    return {"prompt_len": prompt_len, "ttft_s": ttft, "prefill_tok_s": prompt_len / ttft, "plan": hook.plan,
            "gpu_experts_per_moe_layer": statistics.mean(r["gpu_experts"] for r in moe),
            "experts": moe[0]["experts"], "pcie_bytes_per_pass": pcie_bytes,
            "duck_s_per_layer": statistics.mean(r["duck_s"] for r in layers),
            "call_s_per_layer": statistics.mean(r["call_s"] for r in layers),
            "split": {"pcie_gbps": 1e-9 / split.pcie_s_per_byte if split.pcie_s_per_byte else None,
                      "duck_kernel_us_per_expert_token": rates.duck_s * 1e6 if rates and rates.duck_s else None,
                      "duck_call_us_per_token": rates.duck_call_s * 1e6 if rates else None,
                      "gpu_us_per_expert_token": rates.gpu_s * 1e6 if rates and rates.gpu_s else None,
                      "other_ms": split.other_s * 1e3},
            "distinct_experts_per_layer_pass": statistics.mean(r["distinct"] for r in moe),
            "cache": cache}


def _best(runs: list[dict]) -> dict:
    best = max(runs, key=lambda r: r["prefill_tok_s"])
    return {**best, "prefill_tok_s_all": [round(r["prefill_tok_s"], 1) for r in runs]}


def _profile(runner, stream, split, prompt_len: int, room: int, path: str) -> None:
    """One GPU-only pass of prompt_len under torch.profiler: its operators by GPU time, to path."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = measure_streamed(runner, stream, split, prompt_len, room)
    r.pop("cache")
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    with open(path, "w") as f:
        f.write(f"{prompt_len} tokens, GPU only, {r['prefill_tok_s']:.0f} tok/s under the profiler\n")
        f.write(events.table(sort_by=key, row_limit=40))
    log.info("profile of %d tokens -> %s", prompt_len, path)


def placement_budgets(model, names: list[str]) -> dict[str, int]:
    """GPU budgets by name: 0; dense (the dense FFN layers: what llama.cpp's -ot exps=CPU keeps on
    the GPU); quarter (that and a quarter of the routed experts); auto (what duckd takes by
    default: the GPU memory free now, less its margin)."""
    from engine.placement import bytes_per_weight, model_ffn_shapes

    shapes = model_ffn_shapes(model)
    weight = model.model.embed_tokens.weight
    per = bytes_per_weight(weight.device, weight.dtype)    # fp9 on CUDA (engine.gpu.fp9_gemv)
    dense = int(sum(s.expert_weights * per for s in shapes if s.dense))
    routed = int(sum(s.experts * s.expert_weights * per for s in shapes if not s.dense))
    known = {"0": 0, "dense": dense, "quarter": dense + routed // 4}
    out = {}
    for name in names:
        if name == "auto":
            from engine.placement import default_budget
            out[name] = default_budget(model.model.embed_tokens.weight.device)
        elif name in known:
            out[name] = known[name]
        else:
            raise ValueError(f"--gpu-budgets: {name!r} is not one of 0, dense, quarter, auto")
    return out


@torch.inference_mode()
def measure_placements(runner, backend, config, args) -> dict:
    """Decode at each budget of --gpu-budgets (engine.placement: the GPU computes its experts beside
    the ducks), after a prompt of the first length: tok/s, the ducks' GB per token, the plan; and
    llama.cpp's GB per token from the CPU under -ot exps=CPU (the routed experts, in Q8_0)."""
    from engine.placement import model_ffn_shapes, place

    model = runner.model
    shapes = model_ffn_shapes(model)
    k = config.num_experts_per_tok or 1
    out = {"llama_cpp_gb_per_token": sum(k * s.expert_weights for s in shapes if not s.dense) * 1.0625 / 1e9}
    threads = len(os.sched_getaffinity(0))
    for name, budget in placement_budgets(model, args.gpu_budgets).items():
        t0 = time.perf_counter()
        resident = place(model, backend, budget, threads=threads)
        placed_s = time.perf_counter() - t0
        try:
            cache = runner.prefill(args.prompts[0], args.steps, args.fleet_chunk, overlap=True)["cache"]
            decode = runner.decode(cache, args.prompts[0], args.steps)
            del cache
        finally:
            model.set_resident(None)
        plan = resident.plan.summary() if resident is not None else {"gpu_gb": 0.0}
        out[f"duck_budget_{name}"] = {"decode_tok_s": decode["tok_s"], "budget_gb": round(budget / 1e9, 3),
                                      "duck_gb_per_token": (decode["ffn_bytes_streamed_per_step"] or 0) / 1e9,
                                      "step_ms": decode["step_ms"], "driver": decode["driver"], "plan": plan,
                                      "placed_s": round(placed_s, 1)}
        log.info("placement %s (%.1f GB budget, %.1f GB on the GPU): decode %.1f tok/s, %.3f GB/token from the ducks",
                 name, budget / 1e9, plan["gpu_gb"], decode["tok_s"], out[f"duck_budget_{name}"]["duck_gb_per_token"])
        del resident
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def run(args) -> dict:
    from bench.synthetic_ducks import SyntheticFleet, measure_fleet_read, synthetic_run
    from engine.gpu.expert_stream import ExpertStream, pinned_copy_gbps

    device, dtype, config, out = synthetic_run(args)
    out["read_gbps"] = measure_fleet_read(args.ducks, args.duck_threads)
    out["pcie_gbps"] = pinned_copy_gbps(device)
    with SyntheticFleet(args, config, device, dtype) as synth:
        model, backend = synth.model, synth.backend
        stream = ExpertStream(backend.layers, backend.hidden, device, threads=len(os.sched_getaffinity(0)))
        try:
            _measure(args, config, device, model, backend, stream, out)
        finally:
            stream.close()
            del model
    gc.collect()
    return out


def _measure(args, config, device, model, backend, stream, out: dict) -> None:
    """run()'s measurements on the model and its fleet, into out (which holds the rates measured before)."""
    from bench.e2e_synthetic import Runner
    from bench.synthetic import ffn_bytes_per_token
    from bench.synthetic_ducks import measure_fleet_read
    from engine.gpu.hybrid_prefill import PrefillSplit, StreamedPrefill

    runner = Runner(model, backend, device, use_graphs=device.type == "cuda")
    engine = StreamedPrefill(stream, backend, "hybrid", out["pcie_gbps"])    # the engine's choices
    hybrid = engine.split
    gpu = PrefillSplit("gpu", out["pcie_gbps"])
    room = args.steps + 4
    # warm-up: allocations, the ducks' workspace at a whole chunk, the kernels' first compiles
    runner.decode(runner.prefill(8, 4)["cache"], 8, 2)
    runner.prefill(min(args.fleet_chunk, max(args.prompts)), 4, args.fleet_chunk)
    for split in (gpu, hybrid, hybrid):
        measure_streamed(runner, stream, split, min(args.prompts), room)
    table = {"duck": {}, "duck_gpu_only": {}, "duck_fleet_only": {}}
    for p in args.prompts:
        fleet = [runner.prefill(p, 4, args.fleet_chunk, overlap=True) for _ in range(args.repeats)]
        for r in fleet:
            r.pop("cache")
        table["duck_fleet_only"][str(p)] = _best(fleet)
        for r in fleet:
            engine.fleet_timed(p, r["ttft_s"])
        runs = [measure_streamed(runner, stream, gpu, p, room) for _ in range(args.repeats)]
        for r in runs:
            r.pop("cache")
        table["duck_gpu_only"][str(p)] = _best(runs)
        if engine.worth(p):
            runs = [measure_streamed(runner, stream, hybrid, p, room) for _ in range(args.repeats)]
        else:
            runs = [{**runner.prefill(p, args.steps, args.fleet_chunk, overlap=True), "plan": "fleet",
                     "gpu_experts_per_moe_layer": 0.0, "experts": stream.experts(stream.order[-1])}
                    for _ in range(args.repeats)]
        caches = [r.pop("cache") for r in runs]
        table["duck"][str(p)] = _best(runs)
        log.info("prefill %d: fleet %.0f, gpu %.0f, duck %.0f tok/s (plan %s, GPU takes %.1f of %d experts)", p,
                 table["duck_fleet_only"][str(p)]["prefill_tok_s"], table["duck_gpu_only"][str(p)]["prefill_tok_s"],
                 table["duck"][str(p)]["prefill_tok_s"], table["duck"][str(p)]["plan"],
                 table["duck"][str(p)]["gpu_experts_per_moe_layer"],
                 table["duck"][str(p)]["experts"])
        if p == args.prompts[0]:
            decode = runner.decode(caches[-1], p, args.steps)
        del caches
    if engine.worth(args.ttft_tokens):
        ttft = [measure_streamed(runner, stream, hybrid, args.ttft_tokens, room) for _ in range(args.repeats)]
    else:
        ttft = [runner.prefill(args.ttft_tokens, 4, args.fleet_chunk, overlap=True) for _ in range(args.repeats)]
    for r in ttft:
        r.pop("cache")
    out["ttft_1024_runs"] = [round(r["ttft_s"], 4) for r in ttft]
    for name, rows in table.items():
        out[name] = {"prefill_tok_s": {p: round(r["prefill_tok_s"], 1) for p, r in rows.items()},
                     "detail": rows}
    out["duck"]["ttft_s_1024"] = min(r["ttft_s"] for r in ttft)
    out["duck"]["decode_tok_s"] = decode["tok_s"]
    out["duck"]["decode"] = {k: decode[k] for k in ("step_ms", "tok_s", "step_ms_all", "per_layer_ms", "driver")}
    per_pass = {p: r["pcie_bytes_per_pass"] for p, r in table["duck_gpu_only"].items()}
    out["duck"]["pcie_limit_tok_s"] = {p: round(int(p) / (b / (out["pcie_gbps"] * 1e9)), 1) if b and
                                       out["pcie_gbps"] else None for p, b in per_pass.items()}
    out["duck_gb_per_token"] = (decode["ffn_bytes_streamed_per_step"] or 0) / 1e9
    out["ffn_bytes_per_token"] = ffn_bytes_per_token(model, config.num_experts_per_tok or 1)
    out.update(measure_placements(runner, backend, config, args))
    out["read_gbps_end"] = measure_fleet_read(args.ducks, args.duck_threads)
    if args.profile:
        _profile(runner, stream, gpu, max(args.prompts), room, args.profile)


def main(argv: list[str] | None = None) -> int:
    from bench.synthetic_ducks import add_synthetic_arguments, run_and_write
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_compare", description=__doc__.split("\n\n")[0])
    add_synthetic_arguments(ap)
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--ttft-tokens", type=int, default=1024)
    ap.add_argument("--fleet-chunk", type=int, default=1024, help="the fleet alone: duckd's model.prefill_chunk")
    ap.add_argument("--repeats", type=int, default=2, help="runs per length (the best is kept, all are listed)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps")
    ap.add_argument("--gpu-budgets", default="0,dense,quarter,auto",
                    help="decode measured at these GPU placement budgets (0, dense, quarter, auto; '' for none)")
    ap.add_argument("--json", help="write the result here (default: stdout)")
    ap.add_argument("--profile", help="after the runs, one GPU-only pass of the longest prompt under "
                                      "torch.profiler; its operator table to this file")
    args = ap.parse_args(argv)
    args.prompts = [int(p) for p in args.prompts.split(",") if p]
    args.gpu_budgets = [b for b in args.gpu_budgets.split(",") if b]
    return run_and_write(run, args)


if __name__ == "__main__":
    sys.exit(main())
