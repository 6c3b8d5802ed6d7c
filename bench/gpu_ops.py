"""GPU stage time per decoder layer of a Qwen3-30B-A3B-shaped model (or another --synthetic
shape; synthetic weights, bench.synthetic) with the fused Triton ops (engine.ops) and with their torch references
(DUCK_TRITON_OPS=0): eager and replayed from CUDA graphs (bench.gpu_stage.stage_times:
CUDA events around the GPU work between two FFN calls, FFN calls answered with zeros),
and the CUDA kernels one layer launches (torch.profiler).

    python bench/gpu_ops.py [--synthetic qwen3.5-35b-a3b] [--layers 4] [--tokens 1,2] [--max-model-len 2048]
                            [--json out.json]
    python bench/gpu_ops.py --smoke    # CPU, TRITON_INTERPRET=1, a tiny model: checks the script runs

--smoke times eager forwards by the wall clock (the Triton kernels interpreted: slow) and
counts no kernels; its numbers say nothing about a GPU.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runs from a checkout, installed or not

SWITCH = "DUCK_TRITON_OPS"
SETTINGS = [("reference", "0"), ("triton", "1")]
# a qwen3_moe small enough for the interpreter, with Qwen3-30B-A3B's proportions
SMOKE_CONFIG = {"model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
                "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
                "norm_topk_prob": True, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic", default="qwen3-30b-a3b", help="the model's shape (bench.synthetic's names)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (>= 3: a middle one is counted)")
    p.add_argument("--tokens", default="1,2", help="comma-separated tokens per step (1: decode, 2: MTP pair)")
    p.add_argument("--max-model-len", type=int, default=2048, help="static KV cache length the graphs attend")
    p.add_argument("--position", type=int, help="first position of the step (default: half the cache)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, a tiny model")
    return p.parse_args(argv)


class _FixedFfn:
    """Answers every FFN call with one preallocated tensor: no kernel between two layers'
    GPU parts but the marker that kernel counting splits on."""

    def __init__(self, marker: bool = False):
        self.y, self.marker = None, marker

    def forward(self, layer, x, ids, weights):
        import torch

        if self.y is None or self.y.shape != x.shape:
            self.y = torch.zeros_like(x)
        if self.marker:
            torch.cuda._sleep(1)   # a "spin_kernel": where one layer's GPU part ends
        return self.y


def kernels_per_layer(torch, model, tokens: int, max_model_len: int, position: int) -> dict:
    """The CUDA kernels of one middle layer's GPU part in an eager static-decode step
    (the graphs replay the same kernels), by name, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from engine.layers import static_decode

    device = model.model.embed_tokens.weight.device
    ffn = _FixedFfn(marker=True)
    model.set_ffn(ffn)
    cache = model.make_cache(max_model_len)
    ids = torch.full((tokens,), 2, dtype=torch.int64, device=device)
    positions = torch.arange(position, position + tokens, device=device)
    with torch.inference_mode(), static_decode():
        model(ids, positions, cache)                     # compiles, warms the allocator
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids, positions, cache)
            torch.cuda.synchronize(device)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "memcpy" not in e.name.lower()), key=lambda e: e.time_range.start)
    segments, current = [], []
    for e in kernels:
        if "spin_kernel" in e.name:
            segments.append(current)
            current = []
        else:
            current.append((e.name, e.time_range.elapsed_us()))
    segments.append(current)
    middle = segments[1] if len(segments) > 2 else segments[0]
    return {"count": len(middle), "names": [n for n, _ in middle], "us": [us for _, us in middle],
            "per_segment": [len(s) for s in segments]}


def run_cuda(args, torch) -> list[dict]:
    from bench.gpu_stage import stage_times
    from bench.synthetic import build_host_model, synthetic_config

    device = torch.device("cuda")
    config = synthetic_config(args.synthetic, layers=args.layers)
    model = build_host_model(config, device, torch.bfloat16)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        position = args.max_model_len // 2 if args.position is None else args.position
        for name, value in SETTINGS:
            os.environ[SWITCH] = value
            times = stage_times(model, None, steps=args.steps, tokens=tokens, max_model_len=args.max_model_len,
                                position=position)
            count = kernels_per_layer(torch, model, tokens, args.max_model_len, position)
            rows.append(dict(ops=name, synthetic=args.synthetic, tokens=tokens, max_model_len=args.max_model_len,
                             position=position,
                             per_layer_eager_ms=times["per_layer_eager_ms"],
                             per_layer_graph_ms=times["per_layer_graph_ms"],
                             kernels_per_layer=count["count"], kernels=count["names"], kernel_us=count["us"],
                             kernels_per_segment=count["per_segment"], stage_times=times))
            torch.cuda.empty_cache()
    return rows


def run_smoke(args, torch) -> list[dict]:
    from engine.config import ModelConfig
    from engine.layers import static_decode
    from bench.synthetic import build_host_model

    config = ModelConfig.from_dict(SMOKE_CONFIG, source="bench smoke")
    model = build_host_model(config, "cpu", torch.float32)
    model.set_ffn(_FixedFfn())
    layers = config.num_hidden_layers
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        length = min(args.max_model_len, config.max_position_embeddings)
        position = length // 2 if args.position is None else args.position
        ids, positions = torch.full((tokens,), 2), torch.arange(position, position + tokens)
        for name, value in SETTINGS:
            os.environ[SWITCH] = value
            cache = model.make_cache(length)
            times = []
            with torch.inference_mode(), static_decode():
                for _ in range(args.steps + 1):
                    t0 = time.perf_counter()
                    model(ids, positions, cache)
                    times.append(time.perf_counter() - t0)
            rows.append(dict(ops=name, tokens=tokens, max_model_len=length, position=position,
                             per_layer_eager_ms=statistics.median(times[1:]) / layers * 1e3,
                             per_layer_graph_ms=None, kernels_per_layer=None))
    return rows


def print_table(rows) -> None:
    print(f"{'ops':<10}{'T':>3}{'cache':>7}{'pos':>6} | {'eager ms/layer':>14}{'graph ms/layer':>15} | kernels/layer")
    for r in rows:
        graph = "-" if r["per_layer_graph_ms"] is None else f"{r['per_layer_graph_ms']:.4f}"
        kernels = "-" if r["kernels_per_layer"] is None else str(r["kernels_per_layer"])
        print(f"{r['ops']:<10}{r['tokens']:>3}{r['max_model_len']:>7}{r['position']:>6} | "
              f"{r['per_layer_eager_ms']:>14.4f}{graph:>15} | {kernels}")
    for r in rows:
        if r.get("kernels"):
            print(f"  {r['ops']} T={r['tokens']}, eager kernel us: " + ", ".join(
                f"{n[:32]} {us:.1f}" for n, us in zip(r["kernels"], r["kernel_us"])))


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and engine.gpu are imported
        args.steps = min(args.steps, 2)
    if args.layers < 3 and not args.smoke:
        print("--layers must be >= 3: kernels are counted on a middle layer", file=sys.stderr)
        return 2
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke (CPU, Triton interpreter, a tiny model)", file=sys.stderr)
        return 2
    before = os.environ.get(SWITCH)
    try:
        rows = run_smoke(args, torch) if args.smoke else run_cuda(args, torch)
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before
    name = torch.cuda.get_device_name() if not args.smoke else f"cpu (interpreter) {platform.processor()}"
    import triton

    print(f"{name}: torch {torch.__version__}, triton {triton.__version__}; {args.synthetic} shapes, bf16"
          if not args.smoke else f"{name}: tiny qwen3_moe, fp32, wall clock")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, torch=torch.__version__, triton=triton.__version__,
                                                   smoke=args.smoke, cases=rows), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
