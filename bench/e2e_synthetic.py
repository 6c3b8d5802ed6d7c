"""Decode-step measurements of a synthetic model at real shapes (bench.synthetic):
the product path (host model + fleet of local ducks) and, in the same run, the
baselines a user would compare with: every FFN on the GPU (the upper bound) and
the FFNs on the host CPU through plain torch bf16 (the naive offload).

Per configuration: TTFT and prefill tok/s at each prompt length (in chunks of
--prefill-chunk, bench/e2e_prefill.py: per-layer split, distinct experts per
layer and chunk, the requests of a call), decode tok/s
(median step), the per-layer split of a decode step (host stage, transport,
duck kernel), the fleet's aggregate read bandwidth with all ducks reading at
once and the roofline it implies; for the MTP pair: single step, the pair as
one 2-token forward ("batch") and as two lanes ("lanes"), serial = 2 single
steps, overlap ratio = (serial - pair) / serial as the seeds report it.
Run by `duckctl bench e2e --synthetic NAME`.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time

import torch

from engine.ffn import FfnBackend
from engine.prefill import DEFAULT_CHUNK
from engine.lanes import (
    EagerLane,
    FfnWorker,
    StepTrace,
    run_lane,
    run_two_lanes,
)
from bench.e2e_prefill import _sync, measure_prefill
from bench.e2e_synthetic_table import format_table
from bench.synthetic_ducks import PINNED_DUCK_SPIN_US, duck_cpus, duck_share, duck_spin_us, measure_fleet_read
from bench.timed_ffn import TimedFfn, routing_spread
from bench.synthetic import (
    NOTE,
    SHAPES,
    build_host_model,
    ffn_bytes_per_token,
    ffn_shapes,
    install_random_torch_experts,
    install_synthetic_fleet,
    synthetic_config,
)

log = logging.getLogger(__name__)


class Runner:
    """Prefill and decode steps of one model on one backend, timed. On CUDA the decode
    steps replay CUDA graphs (engine.gpu.graphs) unless graphs are off; a host-side
    backend then gets its inputs in pinned buffers the graphs fill (engine.host_ffn)."""

    def __init__(self, model, backend: FfnBackend, device, use_graphs: bool):
        self.model, self.device = model, torch.device(device)
        self.timed = TimedFfn(backend)
        self.cuda = self.device.type == "cuda"
        model.set_ffn(self.timed)
        self.vocab = model.config.vocab_size
        self.gen = torch.Generator().manual_seed(7)
        self.use_graphs = use_graphs and self.cuda
        self.n_layers = sum(1 for m in model.ffn_modules() if m.layer_idx < model.config.num_hidden_layers)

    @property
    def bytes_streamed(self) -> int:
        """fp9 bytes the ducks report having streamed (0 for the torch backends)."""
        return self.timed.bytes_streamed

    def _ids(self, n: int) -> torch.Tensor:
        return torch.randint(2, self.vocab, (n,), generator=self.gen).to(self.device)

    def prefill(self, prompt_len: int, steps: int, chunk: int = DEFAULT_CHUNK, overlap: bool = False) -> dict:
        """overlap: two chunks in flight where the backend computes elsewhere (the fleet), as duckd does."""
        return measure_prefill(self, prompt_len, chunk, steps + 4, overlap and self.timed.overlaps_host)

    def _lanes(self, cache, mode: str, tokens: int, drive_from_c: bool = True):
        """What runs the steps: None (the model's forward), a lane, or (lane, lane, worker)."""
        if mode == "lanes":
            if self.use_graphs:
                from engine.gpu.graphs import GraphLane
                a, b = GraphLane(self.model, cache, 1, name="lane-a"), GraphLane(self.model, cache, 1, name="lane-b")
            else:
                a, b = EagerLane(self.model, cache, "lane-a"), EagerLane(self.model, cache, "lane-b")
            return (a, b, FfnWorker(self.timed))
        if self.use_graphs:
            from engine.gpu.graphs import GraphLane
            return GraphLane(self.model, cache, tokens, name=f"decode-{tokens}", drive_from_c=drive_from_c)
        return None

    @torch.inference_mode()
    def decode(self, cache, start: int, steps: int, tokens: int = 1, mode: str = "forward",
               python_driver: bool = False) -> dict:
        """steps decode steps of `tokens` tokens from position start; mode "forward" (one
        forward per step: CUDA graphs on the GPU) or "lanes" (the dual lane, 2 tokens).
        A graph lane over the fleet is driven from C (engine.gpu.graphs.GraphLane.native_step)
        unless python_driver. Medians per step."""
        runner = self._lanes(cache, mode, tokens, drive_from_c=not python_driver)
        try:
            out = self._decode(runner, cache, start, steps, tokens, mode)
            native = runner is not None and not isinstance(runner, tuple) and getattr(runner, "driven_from_c", False)
            out["driver"] = "c" if native else "python"
            return out
        finally:
            for part in (runner if isinstance(runner, tuple) else (runner,)):
                if part is not None:
                    part.close()

    def _decode(self, runner, cache, start, steps, tokens, mode) -> dict:
        walls, hosts, ffns, kerns, calls_per, heads, routes = [], [], [], [], [], [], []
        streamed0 = self.bytes_streamed
        pos = start
        for _ in range(steps):
            ids, positions = self._ids(tokens), torch.arange(pos, pos + tokens, device=self.device)
            self.timed.calls.clear()
            self.timed.routes.clear()
            trace = StepTrace()
            _sync(self.device)
            t0 = time.perf_counter()
            if isinstance(runner, tuple):
                hidden = run_two_lanes(*runner, ids, positions, trace)
            elif runner is not None:
                hidden = run_lane(runner, self.timed, ids.cpu(), positions.cpu(), trace)
            else:
                hidden = self.model(ids, positions, cache)
            _sync(self.device)
            t1 = time.perf_counter()
            self.model.compute_logits(hidden).argmax(-1).tolist()
            wall = time.perf_counter() - t0
            heads.append(wall - (t1 - t0))
            if runner is not None:
                ffn, kern, n = trace.ffn, trace.kernel, trace.calls
            else:
                ffn = sum(c[1] for c in self.timed.calls)
                kern = sum(c[2] for c in self.timed.calls)
                n = len(self.timed.calls)
            walls.append(wall)
            hosts.append(wall - heads[-1] - ffn if not isinstance(runner, tuple) else trace.host)
            ffns.append(ffn)
            kerns.append(kern)
            calls_per.append(n)
            routes.append(list(self.timed.routes))
            pos += tokens
        med = statistics.median
        n_layers = self.n_layers   # FFN calls may be fewer: a GPU backend's stay inside the CUDA graph
        step = med(walls)
        streamed = (self.bytes_streamed - streamed0) / steps
        return {"tokens": tokens, "steps": steps, "mode": mode, "cuda_graphs": self.use_graphs,
                "step_ms": step * 1e3, "tok_s": tokens / step,
                "ffn_bytes_streamed_per_step": streamed or None,
                "step_ms_all": [round(w * 1e3, 3) for w in walls],
                "head_ms": med(heads) * 1e3,
                "per_layer_ms": {"host": med(hosts) * 1e3 / n_layers,
                                 "transport": (med(ffns) - med(kerns)) * 1e3 / n_layers if med(kerns) else None,
                                 "duck_kernel": med(kerns) * 1e3 / n_layers if med(kerns) else None,
                                 "ffn_call": med(ffns) * 1e3 / n_layers},
                "ffn_calls_per_step": calls_per[0],
                "routing": routing_spread(routes, self.model.config.num_experts or 1)}


    @torch.inference_mode()
    def batched(self, sizes: list[int], prompt_len: int, steps: int, graphs: bool | None = None) -> list[dict]:
        """Continuous batching on the torch path (engine.batch_torch, every request's on a
        GPU host): for each B in sizes, B sequences of prompt_len random tokens,
        each prefilled into its own slot, then decode steps of one token per slot in one
        forward (from the batch-size buckets' CUDA graphs on CUDA unless graphs is False).
        Per B: the median step, aggregate tok/s, its ratio to B = 1, the FFN call per layer
        and the fp9 bytes the ducks streamed per step."""
        from engine.batch_torch import TorchSlotDecoder
        out = []
        for b in sizes:
            cache = self.model.make_slot_cache(b, prompt_len + steps + 1)
            dec = TorchSlotDecoder(self.model, cache, max_tokens=max(b, prompt_len), graphs=graphs)
            for slot in range(b):
                dec.layers(self._ids(prompt_len).cpu(), torch.arange(prompt_len), torch.full((prompt_len,), slot))
            walls, ffns, streamed0 = [], [], self.bytes_streamed
            slots = torch.arange(b)
            for i in range(steps):
                self.timed.calls.clear()
                _sync(self.device)
                t0 = time.perf_counter()
                y = dec.layers(self._ids(b).cpu(), torch.full((b,), prompt_len + i), slots)
                dec.logits(y).argmax(-1).tolist()
                walls.append(time.perf_counter() - t0)
                ffns.append(sum(c[1] for c in self.timed.calls))
            step = statistics.median(walls)
            out.append({"sequences": b, "prompt_len": prompt_len, "steps": steps, "step_ms": step * 1e3,
                        "graphs": dec.graphs is not None, "graph_steps": dec.graph_steps,
                        "tok_s": b / step, "step_ms_all": [round(w * 1e3, 3) for w in walls],
                        "ffn_call_per_layer_ms": statistics.median(ffns) * 1e3 / self.n_layers,
                        "ffn_bytes_streamed_per_step": (self.bytes_streamed - streamed0) / steps or None})
            if dec.graphs is not None:
                dec.graphs.close()
            del dec, cache
        one = next((r for r in out if r["sequences"] == 1), None)   # of the same mode (graphs or eager)
        for r in out:
            r["over_one_sequence"] = r["tok_s"] / one["tok_s"] if one else None
        return out


def _graph_stage_times(model, backend, device, steps: int) -> dict | None:
    """Per-layer GPU stage time, eager vs CUDA graphs (engine.gpu.graphs), when CUDA is here."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from bench.gpu_stage import stage_times
    except ImportError as e:  # the GPU path is optional on a CPU build
        log.warning("no CUDA-graph stage timing: %s", e)
        return None
    return stage_times(model, backend, steps=steps)


def run_config(args, kind: str, device, dtype) -> dict:
    """One backend kind ('fleet', 'gpu', 'cpu-torch') on a fresh host model."""
    config = synthetic_config(args.synthetic, args.layers, args.experts, args.dense_layers)
    model = build_host_model(config, device, dtype, seed=args.seed)
    top_k = config.num_experts_per_tok or 1
    out: dict = {"backend": kind}
    local = None
    if kind == "fleet":
        from engine.fleet_ffn import FleetFfn, LocalDucks

        per_duck = sum(duck_share(n, h, i, args.ducks, args.multiple_of) for _, n, h, i in ffn_shapes(model))
        cpus = duck_cpus(args)
        if cpus:
            out["duck_cpus"] = cpus
        args.duck_spin_us = duck_spin_us(args)
        local = LocalDucks(args.ducks, threads=args.duck_threads, cpus=cpus, spin_us=args.duck_spin_us,
                           cache_capacity=f"{(per_duck * 1.05 + (64 << 20)) // (1 << 20):.0f}M")
        backend = FleetFfn(addresses=local.addresses, key=local.key, multiple_of=args.multiple_of,
                           spin_us=args.spin_us, deadline_ms=60000)
        install_synthetic_fleet(model, backend, seed=args.seed)
        if args.request_tokens:   # a chunk cut into requests in flight together: transfer beside compute
            backend.session.request_tokens = args.request_tokens
            out["request_tokens"] = args.request_tokens
        if args.no_hold:          # each request of a cut chunk its own kernel pass (WIRE_FWD_HOLD unused)
            backend.session.group_tokens = 0
        out["held_passes"] = not args.no_hold
        out["ducks"], out["duck_threads"], out["duck_spin_us"] = args.ducks, args.duck_threads, args.duck_spin_us
    elif kind == "gpu":
        backend = install_random_torch_experts(model, device)
    elif kind == "cpu-torch":
        backend = install_random_torch_experts(model, "cpu")
        out["cpu_threads"] = torch.get_num_threads()
    else:
        raise ValueError(f"unknown backend kind {kind!r}")
    try:
        runner = Runner(model, backend, device, use_graphs=not args.no_graphs)
        runner.decode(runner.prefill(8, 4)["cache"], 8, 2)   # warm-up: allocations, first touches
        # ... and a whole chunk's: the ducks' workspace for one grows to its size (page faults) once
        runner.prefill(min(args.prefill_chunk, max(args.prompts)), 4, args.prefill_chunk)
        out["prompts"] = []
        for p in args.prompts:
            before = None
            if args.prefill_overlap == "both":   # the chunk-by-chunk prefill first, beside the overlapped one
                before = runner.prefill(p, 4, args.prefill_chunk, False)
                before.pop("cache")
            pre = runner.prefill(p, 6 * args.steps + 4, args.prefill_chunk, args.prefill_overlap != "off")
            cache = pre.pop("cache")
            single = runner.decode(cache, p, args.steps)
            entry = {**pre, "decode": single}
            if before is not None and pre["overlap"]:
                entry["prefill_chunk_by_chunk"] = before
            out["prompts"].append(entry)
            if p == args.prompts[0] and args.pairs:
                pair = runner.decode(cache, p + args.steps, args.steps, tokens=2)
                dual = runner.decode(cache, p + 3 * args.steps, args.steps, tokens=2, mode="lanes")
                serial = 2 * single["step_ms"]
                out["mtp_pair"] = {
                    "single_step_ms": single["step_ms"], "serial_ms": serial,
                    "pair_batch_ms": pair["step_ms"], "pair_lanes_ms": dual["step_ms"],
                    "overlap_ratio_batch": (serial - pair["step_ms"]) / serial,
                    "overlap_ratio_lanes": (serial - dual["step_ms"]) / serial,
                    "pair_over_single_batch": pair["step_ms"] / single["step_ms"],
                    "pair_over_single_lanes": dual["step_ms"] / single["step_ms"],
                    "batch": pair, "lanes": dual}
            if single.get("driver") == "c" and p == args.prompts[0]:   # the same steps driven from Python, beside:
                after = p + (5 if args.pairs else 1) * args.steps   # where the steps before ended: a linear
                entry["decode_python_driver"] = runner.decode(cache, after, args.steps,  # state continues there only
                                                              python_driver=True)
        if args.batch:
            modes = {"on": [None], "off": [False], "both": [False, None]}[args.batch_graphs]
            out["batched"] = [row for g in modes for row in runner.batched(args.batch, args.prompts[0], args.steps, g)]
        out["decode_tok_s"] = out["prompts"][0]["decode"]["tok_s"]
        out["decode_tok_s_median"] = statistics.median(e["decode"]["tok_s"] for e in out["prompts"])
        out["ffn_bytes_per_token"] = ffn_bytes_per_token(model, top_k)
        if kind == "fleet":
            out["graph_stage"] = _graph_stage_times(model, None, device, args.steps)
    finally:
        if hasattr(backend, "close"):
            backend.close()
        if local is not None:
            local.stop()
        del model
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="duckctl bench e2e --synthetic",
                                 description="Decode of a synthetic model at real shapes: fleet vs baselines.")
    ap.add_argument("--synthetic", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the published one)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (default: published)")
    ap.add_argument("--dense-layers", type=int, default=None, help="DeepSeek: leading dense layers")
    ap.add_argument("--ducks", type=int, default=4)
    ap.add_argument("--duck-threads", type=int, default=4)
    ap.add_argument("--multiple-of", type=int, default=64)
    ap.add_argument("--pin-ducks", action="store_true",
                    help="give each duck its own block of CPUs, one worker pinned per CPU (dedicated hardware)")
    ap.add_argument("--duck-spin-us", type=int, default=None,
                    help="ducks spin this long for requests before blocking (default: "
                         f"{PINNED_DUCK_SPIN_US} with --pin-ducks, whose ducks have their own CPUs, else 0)")
    ap.add_argument("--spin-us", type=int, default=0, help="host polls this long for replies (0: blocks)")
    ap.add_argument("--prompts", default="16,512,1024,4096",
                    help="prompt lengths, comma separated (4096 takes minutes on a small CPU host)")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_CHUNK,
                    help="prompt tokens per prefill forward (duckd's model.prefill_chunk)")
    ap.add_argument("--prefill-overlap", choices=("on", "off", "both"), default="on",
                    help="fleet: prompts of two chunks or more with two chunks in flight, one's host work beside "
                         "the other's FFN calls, as duckd does (on); chunk by chunk (off); both, one after the other")
    ap.add_argument("--request-tokens", type=int, default=0,
                    help="fleet: most tokens per request (0: as many as the ducks take); a chunk of more goes as "
                         "requests in flight together, one's transfer beside another's compute")
    ap.add_argument("--no-hold", action="store_true",
                    help="fleet: a chunk cut into requests runs a kernel pass per request, not one per group of "
                         "requests held on the ducks (docs/wire.md, Long forwards)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured per configuration")
    ap.add_argument("--backends", default="fleet,gpu,cpu-torch",
                    help="fleet, gpu (every FFN on the GPU), cpu-torch (naive offload); gpu is skipped without CUDA")
    ap.add_argument("--no-pairs", dest="pairs", action="store_false", help="skip the MTP pair measurements")
    ap.add_argument("--gpu", choices=("auto", "on", "off"), default="auto", help="host device")
    ap.add_argument("--no-graphs", action="store_true", help="no CUDA-graph stage timing")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="host dtype (default bf16 on the GPU, fp32 on the CPU)")
    ap.add_argument("--batch-graphs", choices=("on", "off", "both"), default="on",
                    help="--batch's decode steps from CUDA graphs per batch-size bucket (on CUDA; off: eager; "
                         "both: eager, then graphs)")
    ap.add_argument("--batch", default="",
                    help="also decode B sequences at once on the torch batching path (a GPU host's), "
                         "e.g. 1,8,32: aggregate tok/s per B after the first prompt length")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.batch = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        ap.error(f"--batch {args.batch!r}: expected sequence counts, e.g. 1,8,32")
    if any(b <= 0 for b in args.batch):
        ap.error(f"--batch {args.batch}: sequence counts must be positive")
    if not logging.getLogger().handlers:   # progress of the long phases on stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    args.prompts = [int(p) for p in args.prompts.split(",") if p]
    if not args.prompts or min(args.prompts) <= 0:
        ap.error("--prompts needs positive lengths")
    cuda = torch.cuda.is_available()
    if args.gpu == "on" and not cuda:
        ap.error("--gpu on: CUDA is not available on this host")
    device = torch.device("cuda" if cuda and args.gpu != "off" else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    kinds = [k for k in args.backends.split(",") if k]
    if device.type != "cuda" and "gpu" in kinds:
        kinds.remove("gpu")
        log.warning("no CUDA here: the GPU-only baseline is skipped")
    config = synthetic_config(args.synthetic, args.layers, args.experts, args.dense_layers)
    result = {"note": NOTE, "model": args.synthetic, "date": time.strftime("%Y-%m-%d"),
              "machine": {"host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
                          "gpu": torch.cuda.get_device_name() if cuda else None},
              "host_device": device.type, "host_dtype": str(dtype).removeprefix("torch."),
              "shape": {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
                        "experts": config.num_experts, "experts_per_token": config.num_experts_per_tok,
                        "moe_intermediate": config.moe_intermediate_size,
                        "ffn_layers": [list(s) for s in _shapes_of(config)]},
              "argv": argv}
    if "fleet" in kinds:
        result["fleet_read_gbps"] = measure_fleet_read(args.ducks, args.duck_threads)
        if config.num_experts:   # every duck's decode kernel at once on its slice: the planner's kernel_read_ratio
            from bench.kernel_probe import measure_fleet_kernel
            from native.transport import slice_width
            result["fleet_kernel"] = measure_fleet_kernel(
                args.ducks, args.duck_threads, config.num_experts, config.hidden_size,
                slice_width(config.moe_intermediate_size, args.ducks, args.multiple_of), cpus=duck_cpus(args))
    for kind in kinds:
        log.info("measuring %s", kind)
        result[kind] = run_config(args, kind, device, dtype)
    fleet = result.get("fleet")
    if fleet:
        # the read bandwidth again after the runs: on a shared host it drifts; the roofline takes the mean
        result["fleet_read_gbps_end"] = measure_fleet_read(args.ducks, args.duck_threads)
        read = (result["fleet_read_gbps"] + result["fleet_read_gbps_end"]) / 2
        fleet["roofline_tok_s"] = read * 1e9 / fleet["ffn_bytes_per_token"]
        fleet["ratio_to_roofline"] = fleet["decode_tok_s"] / fleet["roofline_tok_s"]
        fleet["ratio_to_roofline_median"] = fleet["decode_tok_s_median"] / fleet["roofline_tok_s"]
        if "cpu-torch" in result:
            fleet["speedup_over_cpu_torch"] = fleet["decode_tok_s"] / result["cpu-torch"]["decode_tok_s"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def _shapes_of(config):
    with torch.device("meta"):
        from engine.models import model_class
        model = model_class(config)(config)
    return ffn_shapes(model)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
