"""Decode-step benchmark of the CPU host part on the default model (SmolLM2-135M,
fp32, on this machine's CPU): the torch path (the model's eager forward and
lm_head) against the native decoder (engine.cpu), with the FFNs in torch and on
a fleet of local ducks. Per decode step, medians over every step of every round:

    step      the whole step, logits included (tok/s = 1000 / step ms)
    host      the host's attention part (norms, projections, rotary, cache, attention, residuals)
    ffn       the FFN calls (the backend's forward, as the host waits for it)
    lm_head   final norm (native path; the torch path's is inside host) + lm_head GEMV

    python bench/cpu_decode.py [--backends torch,fleet] [--steps 48] [--rounds 3] [--json out.json]

The native decoder's projections are float16 unless DUCK_CPU_WEIGHTS=float32 (docs/cpu.md).

Paths alternate round by round on one loaded model, so that other load on the
machine falls on both; each round prefills a fresh cache with torch and then
greedy-decodes --steps tokens, which must come out the same on both paths.
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

import engine  # noqa: E402,F401  (before torch: it sets torch's OpenMP wait policy, engine/__init__.py)
import torch  # noqa: E402

log = logging.getLogger("duck.bench.cpu_decode")

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PATHS = ("torch", "native")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="torch,fleet", help="comma-separated: torch, fleet (4 local ducks)")
    p.add_argument("--steps", type=int, default=48, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ducks", type=int, default=4, help="local ducks of the fleet backend")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


class Round:
    """One prefill + greedy decode of one path, timed per step."""

    def __init__(self, model, timed, path: str):
        self.model, self.timed, self.path = model, timed, path
        self.rows: list[dict] = []
        self.tokens: list[int] = []

    @torch.inference_mode()
    def run(self, prompt: list[int], steps: int) -> None:
        from engine.cpu.decode import CpuDecoder

        model = self.model
        cache = model.make_cache(len(prompt) + steps + 1)
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        token = int(model.compute_logits(hidden[-1:])[0].argmax())
        native = CpuDecoder(model, cache) if self.path == "native" else None
        for s in range(steps):
            ids, positions = torch.tensor([token]), torch.tensor([len(prompt) + s])
            self.timed.calls.clear()
            t0 = time.perf_counter()
            if native is not None:
                y = native.layers(ids, positions)
                t1 = time.perf_counter()
                logits = native.logits(y)[-1]
            else:
                hidden = model(ids, positions, cache)
                t1 = time.perf_counter()
                logits = model.compute_logits(hidden[-1:])[0]
            token = int(logits.argmax())
            t2 = time.perf_counter()
            ffn = sum(c[1] for c in self.timed.calls)
            self.rows.append({"step": t2 - t0, "host": t1 - t0 - ffn, "ffn": ffn, "lm_head": t2 - t1})
            self.tokens.append(token)


def measure(backend: str, args, prompt_text: str = PROMPT) -> dict:
    from engine.loader import load_model
    from bench.timed_ffn import TimedFfn

    options = {"local_ducks": args.ducks} if backend == "fleet" else {}
    lm = load_model("default", device="cpu", backend=backend, backend_options=options)
    try:
        timed = TimedFfn(lm.ffn)
        lm.model.set_ffn(timed)
        prompt = lm.tokenizer.encode_chat([{"role": "user", "content": prompt_text}])
        rows = {p: [] for p in PATHS}
        same = True
        Round(lm.model, timed, "native").run(prompt, 4)   # warm-up: first touches of weights and threads
        for r in range(args.rounds):
            done = {}
            for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                log.info("%s FFNs, round %d/%d: %s path", backend, r + 1, args.rounds, path)
                done[path] = Round(lm.model, timed, path)
                done[path].run(prompt, args.steps)
                rows[path] += done[path].rows
            same &= done["torch"].tokens == done["native"].tokens
        med = {p: {k: statistics.median(row[k] for row in rows[p]) * 1e3 for k in ("step", "host", "ffn", "lm_head")}
               for p in PATHS}
        for p in PATHS:
            med[p]["tok_s"] = 1e3 / med[p]["step"]
        return {"backend": backend, "prompt_tokens": len(prompt), "steps": args.steps, "rounds": args.rounds,
                "same_greedy_tokens": same, "median_ms": med}
    finally:
        lm.ffn.close()


def format_table(result: dict) -> str:
    lines = [f"{result['machine']}: {result['threads']} threads, host kernels {result['host_kernels']} "
             f"({result.get('host_weights', 'float32')} projections), "
             f"torch {result['torch']} ({result['torch_threads']} threads), load average before {result['load_before']}"
             f" after {result['load_after']}",
             f"{'FFNs':<8}{'path':<8}{'step ms':>9}{'tok/s':>8}{'host ms':>9}{'ffn ms':>8}{'lm_head ms':>11}"]
    for r in result["runs"]:
        for p in PATHS:
            m = r["median_ms"][p]
            lines.append(f"{r['backend']:<8}{p:<8}{m['step']:>9.2f}{m['tok_s']:>8.1f}{m['host']:>9.2f}{m['ffn']:>8.2f}"
                         f"{m['lm_head']:>11.2f}")
        lines.append(f"{'':<8}greedy tokens {'identical' if r['same_greedy_tokens'] else 'DIFFERENT'} on both paths "
                     f"({r['rounds']} rounds x {r['steps']} steps, prompt of {r['prompt_tokens']} tokens)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from engine.cpu.decode import weight_type
    from native.host.ops import host_kernels, kernels_name

    result = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}",
              "threads": len(os.sched_getaffinity(0)), "host_kernels": kernels_name(host_kernels()),
              "host_weights": weight_type(),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "load_before": [round(x, 2) for x in os.getloadavg()], "runs": []}
    for backend in args.backends.split(","):
        result["runs"].append(measure(backend.strip(), args))
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(format_table(result) + "\n")
    return 0 if all(r["same_greedy_tokens"] for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
