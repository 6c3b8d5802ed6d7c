"""`python -m bench.gpu_placement --synthetic qwen3-30b-a3b`: the GPU's share of a placed layer
(engine.placement) in one decode step, fp9 bytes through the fused GEMV (engine.gpu.fp9_gemv)
against decoded bf16 copies through the grouped GEMV (engine.gpu.moe), on one layer of the
shape's routed experts (held whole, synthetic fp9 slices of 4 ducks): microseconds per call of
k pairs (one token), the bytes each reads, and GB/s over the GPU's own copy rate measured in the
same run. With --tokens (steps of many tokens: a prefill, a cached prompt's rest, a batch's decode
step), the share of T tokens x k pairs through the grouped GEMMs from fp9 (engine.gpu.fp9_moe)
against every expert decoded to bf16 and torch's grouped GEMMs (fp9_experts_forward, the path before
it) and, for few pairs, the per-pair GEMV: microseconds per layer and the results' difference.
Prints JSON."""
from __future__ import annotations

import argparse
import json
import sys

import torch


def _time(fn, rounds: int) -> float:
    """Median microseconds of fn() (CUDA events)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return sorted(out)[len(out) // 2]


def copy_gbps(device, mib: int = 1024) -> float:
    """The GPU's device-to-device copy rate (read + write counted once each, as GB/s of reads)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = _time(lambda: dst.copy_(src), 10)
    return src.numel() / (us * 1e-6) / 1e9


def main(argv: list[str] | None = None) -> int:
    from bench.synthetic import synthetic_config
    from engine.gpu.expert_stream import decode_experts, held_experts
    from engine.gpu.fp9_gemv import fp9_down, fp9_gate_up
    from engine.gpu.moe import grouped_gemv
    from native.transport import synth_experts, synth_seed

    ap = argparse.ArgumentParser(prog="python -m bench.gpu_placement", description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", default="qwen3-30b-a3b")
    ap.add_argument("--experts", type=int, default=None, help="experts held (default: the shape's)")
    ap.add_argument("--ducks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--tokens", default="", help="comma-separated step sizes for the many-pair comparison")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_placement needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    c = synthetic_config(args.synthetic)
    n, k, h, i = args.experts or c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    per_duck = synth_experts(n, h, i, args.ducks, 64, seed=synth_seed(1, 0), name="bench")
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(16) as workers:
        lay, src = held_experts(per_duck, list(range(n)), device, workers)
    gu, dn = decode_experts(per_duck, list(range(n)), device, threads=16)
    x = torch.randn(1, h, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(n, device=device)[:k].to(torch.int32)

    def fp9():
        hh = fp9_gate_up(lay, src, slots, x, k)
        a = (torch.nn.functional.silu(hh[:, 0::2]) * hh[:, 1::2]).to(torch.bfloat16)
        return fp9_down(lay, src, slots, a)

    def bf16():
        hh = grouped_gemv(x, slots, gu, k)
        a = (torch.nn.functional.silu(hh[:, 0::2]) * hh[:, 1::2]).to(torch.bfloat16)
        return grouped_gemv(a, slots, dn, 1)

    y9, y16 = fp9(), bf16()
    rel = float((y9 - y16).norm() / y16.norm())
    read = copy_gbps(device)
    out = {"shape": args.synthetic, "experts_held": n, "pairs": k, "gpu": torch.cuda.get_device_name(),
           "copy_read_gbps": round(read, 1), "fp9_vs_bf16_rel_err": rel}
    for name, fn, per_expert in (("fp9", fp9, lay.expert_bytes), ("bf16", bf16, (gu[0].nbytes + dn[0].nbytes))):
        us = _time(fn, args.rounds)
        gbps = k * per_expert / (us * 1e-6) / 1e9
        out[name] = {"us_per_call": round(us, 1), "bytes_per_call": k * per_expert, "gbps": round(gbps, 1),
                     "ratio_to_copy_read": round(gbps / read, 3)}
    out["fp9_speedup_over_bf16"] = round(out["bf16"]["us_per_call"] / out["fp9"]["us_per_call"], 3)
    if args.tokens:
        out["steps"] = steps(lay, src, gu, dn, k, [int(t) for t in args.tokens.split(",")], args.rounds, device)
    print(json.dumps(out, indent=1))
    return 0


def steps(lay, src, gu, dn, k: int, sizes: list[int], rounds: int, device) -> list[dict]:
    """Per step size T: the held share of T x k pairs by each way (module docstring), from fp9 bytes
    and from the decoded bf16 copies gu, dn."""
    from engine.gpu.fp9_moe import block_rows, copies_moe_forward, fp9_experts_forward, fp9_moe_forward
    from engine.placement import _grouped_share

    n, h = gu.shape[0], gu.shape[2]
    rows = []
    for t in sizes:
        g = torch.Generator(device=device).manual_seed(t)
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16, generator=g)
        ids = torch.stack([torch.randperm(n, device=device, generator=g)[:k] for _ in range(t)]).to(torch.int32)
        w = torch.rand(t, k, device=device, generator=g)
        ways = {"fused": lambda: fp9_moe_forward(lay, src, x, ids, w),
                "decoded": lambda: fp9_experts_forward(lay, src, n, x, ids, w),
                "copies_fused": lambda: copies_moe_forward(gu, dn, x, ids, w),
                "copies_torch": lambda: _grouped_share(gu, dn, x, ids, w)}
        for bm in (16, 32, 64, 128):
            if bm != block_rows(t * k, n):
                ways[f"fused_bm{bm}"] = lambda bm=bm: fp9_moe_forward(lay, src, x, ids, w, bm=bm)
                ways[f"copies_fused_bm{bm}"] = lambda bm=bm: copies_moe_forward(gu, dn, x, ids, w, bm=bm)
        row = {"tokens": t, "pairs": t * k, "bm": block_rows(t * k, n)}
        ref = ways["decoded"]()
        row["fused_rel_err"] = float((ways["fused"]() - ref).norm() / ref.norm())
        row["copies_fused_rel_err"] = float((ways["copies_fused"]() - ref).norm() / ref.norm())
        for name, fn in ways.items():
            row[f"{name}_us"] = round(_time(fn, max(3, rounds // 5) if t > 512 else rounds), 1)
        row["fused_speedup"] = round(row["decoded_us"] / row["fused_us"], 3)
        row["copies_fused_speedup"] = round(row["copies_torch_us"] / row["copies_fused_us"], 3)
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
