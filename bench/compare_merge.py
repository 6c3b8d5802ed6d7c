"""`python -m bench.compare_merge --duck duck.json --llama llama.jsonl --shape qwen3 --machine h100`:
one comparison file from duck's side (bench.prefill_compare) and llama.cpp's (llama-bench's JSON
lines, -ot exps=CPU, several -ub) of the same device call (scripts/device_compare.sh).

Keys: commit, machine, read_gbps, pcie_gbps, duck_gb_per_token; for each of duck,
duck_gpu_only, duck_fleet_only, llama_cpp (its best micro-batch at each length) and
llama_cpp_ub512: decode_tok_s and prefill_tok_s {"512": .., "2048": .., "8192": ..}; duck also
ttft_s_1024 and pcie_limit_tok_s; llama_cpp_pcie_limit_tok_s (estimated, see llama_pcie_limit) and
the lengths where llama.cpp is above it; ratios of duck to llama.cpp at each length; the placement
keys (placement_side: duck_budget_<name>, llama_cpp_gpu_quarter, llama_cpp_gb_per_token). Decode runs on the
fleet in every duck mode (the modes differ in prefill only)."""
from __future__ import annotations

import argparse
import json
import sys


def llama_rows(lines) -> list[dict]:
    return [json.loads(line) for line in lines if line.strip().startswith("{")]


Q8_0_OVER_FP9 = 1.0625 / 1.125


def llama_side(rows: list[dict], ub: int | None = None) -> dict:
    """decode (tg at depth 0) and prefill per prompt length: at micro-batch ub, or the best of all."""
    pick = [r for r in rows if ub is None or r["n_ubatch"] == ub]
    prefill: dict[str, float] = {}
    best_ub: dict[str, int] = {}
    for r in pick:
        if r["n_gen"] == 0 and r.get("n_depth", 0) == 0:
            p = str(r["n_prompt"])
            if r["avg_ts"] > prefill.get(p, 0.0):
                prefill[p], best_ub[p] = round(r["avg_ts"], 1), r["n_ubatch"]
    decode = [r["avg_ts"] for r in pick if r["n_prompt"] == 0 and r.get("n_depth", 0) == 0]
    out = {"decode_tok_s": round(max(decode), 2) if decode else None, "prefill_tok_s": prefill}
    if ub is None:
        out["best_ubatch"] = best_ub
    return out


def llama_pcie_limit(duck: dict, pcie_gbps: float | None) -> dict:
    """llama.cpp's PCIe limit per prompt length, estimated: every expert of the model crossing
    once per micro-batch of the whole prompt (its best case) in Q8_0 (1.0625 bytes a weight
    against fp9's 1.125), the bytes from duck's GPU-only pass of the same shape (which streams
    every expert; the dense layers' share, which llama.cpp keeps on the GPU, is counted too, so
    the estimate is a little low). A llama.cpp figure above it means its random model's routing
    left experts unused (a collapsed router), not a faster copy."""
    if not pcie_gbps:
        return {}
    return {p: round(int(p) / (r["pcie_bytes_per_pass"] * Q8_0_OVER_FP9 / (pcie_gbps * 1e9)), 1)
            for p, r in duck["duck_gpu_only"]["detail"].items() if r.get("pcie_bytes_per_pass")}


def placement_side(duck: dict, llama_gpu: list[dict] | None, decode0: float, ll_decode: float | None) -> dict:
    """The placement issue's keys: duck_budget_<name> (decode at each GPU budget, bench.prefill_compare
    --gpu-budgets), llama_cpp_gpu_quarter (its -ot keeping a quarter of the layers' experts on the GPU),
    the GB per token each reads from its CPUs, and the ratios the bars name."""
    out = {k: v for k, v in duck.items() if k.startswith("duck_budget_")}
    if not out:
        return {}
    if "llama_cpp_gb_per_token" in duck:
        out["llama_cpp_gb_per_token"] = round(duck["llama_cpp_gb_per_token"], 4)
    if llama_gpu:
        out["llama_cpp_gpu_quarter"] = llama_side(llama_gpu)
    ratios = {}
    for name, row in out.items():
        if not name.startswith("duck_budget_"):
            continue
        d = row["decode_tok_s"]
        ratios[name] = {"over_llama_cpp": round(d / ll_decode, 3) if ll_decode else None,
                        "over_duck_budget_0": round(d / out["duck_budget_0"]["decode_tok_s"], 3)
                        if "duck_budget_0" in out else None}
    q, lq = out.get("duck_budget_quarter"), out.get("llama_cpp_gpu_quarter", {}).get("decode_tok_s")
    if q and lq:
        ratios["duck_budget_quarter"]["over_llama_cpp_gpu_quarter"] = round(q["decode_tok_s"] / lq, 3)
    out["placement_ratios"] = ratios
    return out


def merge(duck: dict, llama: list[dict], shape: str, machine: str, llama_gpu: list[dict] | None = None) -> dict:
    lengths = list(duck["duck"]["prefill_tok_s"])
    out = {"commit": duck["commit"], "machine": machine, "shape": shape, "date": duck["date"],
           "gpu": duck["machine"]["gpu"], "read_gbps": round(duck["read_gbps"], 1),
           "read_gbps_end": round(duck.get("read_gbps_end", 0.0), 1),
           "pcie_gbps": round(duck["pcie_gbps"], 1) if duck["pcie_gbps"] else None,
           "duck_gb_per_token": round(duck["duck_gb_per_token"], 4)}
    decode = round(duck["duck"]["decode_tok_s"], 2)
    for name in ("duck", "duck_gpu_only", "duck_fleet_only"):
        out[name] = {"decode_tok_s": decode, "prefill_tok_s": duck[name]["prefill_tok_s"]}
    out["duck"]["ttft_s_1024"] = round(duck["duck"]["ttft_s_1024"], 4)
    out["duck"]["pcie_limit_tok_s"] = duck["duck"]["pcie_limit_tok_s"]
    out["duck"]["plan"] = {p: r.get("plan") for p, r in duck["duck"]["detail"].items()}
    out["duck"]["gpu_experts_per_moe_layer"] = {p: round(r["gpu_experts_per_moe_layer"], 1)
                                                for p, r in duck["duck"]["detail"].items()}
    out["distinct_experts_per_layer_pass"] = {p: round(r["distinct_experts_per_layer_pass"], 1)
                                              for p, r in duck["duck_gpu_only"]["detail"].items()}
    out["experts"] = duck["shape"]["experts"]
    out["llama_cpp"] = llama_side(llama)
    out["llama_cpp_ub512"] = llama_side(llama, 512)
    out["llama_cpp_pcie_limit_tok_s"] = llama_pcie_limit(duck, out["pcie_gbps"])
    out["llama_cpp_above_its_pcie_limit"] = [p for p, v in out["llama_cpp"]["prefill_tok_s"].items()
                                             if out["llama_cpp_pcie_limit_tok_s"].get(p) and
                                             v > out["llama_cpp_pcie_limit_tok_s"][p]]
    ratios = {}
    for p in lengths:
        ll = out["llama_cpp"]["prefill_tok_s"].get(p)
        d = out["duck"]["prefill_tok_s"][p]
        limit = out["duck"]["pcie_limit_tok_s"].get(p)
        ratios[p] = {"duck_over_llama_cpp_best": round(d / ll, 3) if ll else None,
                     "duck_over_own_pcie_limit": round(d / limit, 3) if limit else None,
                     "hybrid_over_best_alone": round(d / max(out["duck_gpu_only"]["prefill_tok_s"][p],
                                                             out["duck_fleet_only"]["prefill_tok_s"][p]), 3)}
    out["ratios"] = ratios
    ll_decode = out["llama_cpp"]["decode_tok_s"]
    out["ratios"]["decode_duck_over_llama_cpp"] = round(decode / ll_decode, 3) if ll_decode else None
    out.update(placement_side(duck, llama_gpu, decode, ll_decode))
    out["duck_detail"] = {k: duck[k]["detail"] for k in ("duck", "duck_gpu_only", "duck_fleet_only")}
    out["duck_detail"]["decode"] = duck["duck"]["decode"]
    out["duck_detail"]["ttft_1024_runs"] = duck["ttft_1024_runs"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare_merge", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duck", required=True, help="bench.prefill_compare's JSON")
    ap.add_argument("--llama", required=True, help="llama-bench's JSON lines")
    ap.add_argument("--llama-gpu", help="llama-bench's JSON lines with a quarter of the layers' experts on the GPU")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--machine", required=True)
    args = ap.parse_args(argv)
    with open(args.duck) as f:
        duck = json.load(f)
    with open(args.llama) as f:
        llama = llama_rows(f)
    llama_gpu = None
    if args.llama_gpu:
        with open(args.llama_gpu) as f:
            llama_gpu = llama_rows(f)
    print(json.dumps(merge(duck, llama, args.shape, args.machine, llama_gpu), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
