"""Continuous batching on the CPU host, step by step: N sequences decoding together
(engine.batch.BatchDecoder, what duckd runs for many users) against one sequence
alone, on the default model with its FFNs on local ducks, in one run with the two
interleaved round by round (this machine's speed drifts; the ratio is what holds).
Per decode step while every sequence of the batch decodes, medians:

    step      the whole step (tok/s = sequences x 1000 / step ms)
    host      the host's layers less the FFN calls (norms, projections, attention)
    ffn       the FFN calls as the host waits for them
    kernel    the slowest duck's kernel within them (summed over the layers)
    logits    final norm + lm_head of each sequence's row
    tokens    the rest: sampling, stop strings, text of every sequence (Python)

    python bench/cpu_batch.py [--sequences 32] [--steps 32] [--rounds 3] [--ducks 4[,2]] [--json out.json]

aggregate/one = N x (one sequence's step) / (the batch's step): what `duckctl bench
e2e --streams N` reports as its all-decoding ratio, without the daemon, gRPC and
the clients. --ducks 4,2 compares fleets of local ducks in one run, each round
going through them in turn (the way to tell fleet sizes apart on a machine
whose speed drifts by a quarter within minutes)."""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # runs from a checkout, installed or not

log = logging.getLogger("duck.bench.cpu_batch")

PARTS = ("step", "host", "ffn", "kernel", "logits", "tokens")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=32, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round and batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ducks", default=None,
                   help="local ducks of the fleet (default: duckd's, 4 or this host's CPUs where fewer); "
                        "several (4,2): fleets compared round by round")
    p.add_argument("--max-model-len", type=int, default=2048, help="positions per slot (duckd's model.max_model_len)")
    p.add_argument("--one-decoder", action="store_true",
                   help="the single sequence in the batch's decoder (as in duckd: one of its slots), not its own")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.ducks is None:
        from duckd.config import FleetConfig
        args.ducks = str(FleetConfig().ducks)
    try:
        args.ducks = [int(d) for d in args.ducks.split(",")]
    except ValueError:
        p.error(f"--ducks {args.ducks!r}: expected a number of ducks, or several separated by commas")
    if args.sequences < 2 or args.steps < 1 or args.rounds < 1 or min(args.ducks) < 1 or \
            len(set(args.ducks)) != len(args.ducks):
        p.error("--sequences >= 2, --steps, --rounds and --ducks >= 1 (each fleet size once)")
    return args


class Timed:
    """A BatchDecoder whose decoder's layers and logits are timed, step by step."""

    def __init__(self, lm, timed_ffn, slots: int, max_model_len: int):
        from engine.batch import BatchDecoder

        self.lm, self.ffn = lm, timed_ffn
        self.batch = BatchDecoder(lm.model, lm.tokenizer, slots=slots, max_model_len=max_model_len)
        dec, self.t = self.batch.decoder, {"layers": 0.0, "logits": 0.0}
        for name, part in (("layers", "layers"), ("logits", "logits"), ("logits_argmax", "logits")):
            setattr(dec, name, self._timed(getattr(dec, name), part))

    def _timed(self, fn, name):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] += time.perf_counter() - t0
        return call

    def run(self, prompts: list[list[int]], steps: int) -> list[dict]:
        """prefill every prompt, then time `steps` steps in which all of them decode."""
        from engine.tokens import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        seqs = [self.batch.add(p, params) for p in prompts]
        rows = []
        while self.batch.active:
            timed = all(s.decoding and s.out.out_ids for s in seqs) and len(rows) < steps
            self.t.update(layers=0.0, logits=0.0)
            self.ffn.calls.clear()
            t0 = time.perf_counter()
            self.batch.step()
            step = time.perf_counter() - t0
            if timed:
                ffn = sum(c[1] for c in self.ffn.calls)
                rows.append({"step": step, "host": self.t["layers"] - ffn, "ffn": ffn,
                             "kernel": sum(c[2] for c in self.ffn.calls), "logits": self.t["logits"],
                             "tokens": step - self.t["layers"] - self.t["logits"]})
        return rows


class Fleet:
    """The default model on n local ducks, with a batch of N slots and (unless one_decoder) one of 1."""

    def __init__(self, n: int, args):
        from engine.loader import load_model   # first: engine sets torch's OpenMP wait policy before torch loads
        from bench.timed_ffn import TimedFfn

        self.n, self.args = n, args
        self.lm = load_model("default", device="cpu", backend="fleet", backend_options={"local_ducks": n})
        try:
            timed = TimedFfn(self.lm.ffn)
            self.lm.model.set_ffn(timed)
            chat = self.lm.tokenizer.encode_chat
            self.prompts = [chat([{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
                            for i in range(args.sequences)]
            self.together = Timed(self.lm, timed, args.sequences, args.max_model_len)
            self.alone = self.together if args.one_decoder else Timed(self.lm, timed, 1, args.max_model_len)
            self.alone.run(self.prompts[:1], 4)   # warm-up: first touches of weights, threads and ducks
        except BaseException:
            self.close()
            raise
        self.rows: dict[str, list] = {"one": [], "batch": []}
        self.ratios: list[float] = []

    def round(self) -> None:
        args = self.args
        one = self.alone.run(self.prompts[:1], args.steps)
        batch = self.together.run(self.prompts, args.steps)
        self.rows["one"] += one
        self.rows["batch"] += batch
        self.ratios.append(args.sequences * statistics.median(x["step"] for x in one)
                           / statistics.median(x["step"] for x in batch))

    def result(self) -> dict:
        args = self.args
        med = {k: {p: statistics.median(x[p] for x in v) * 1e3 for p in PARTS} for k, v in self.rows.items()}
        return {"sequences": args.sequences, "steps": args.steps, "rounds": args.rounds, "ducks": self.n,
                "median_ms": med, "tok_s": {"one": 1e3 / med["one"]["step"],
                                            "batch": args.sequences * 1e3 / med["batch"]["step"]},
                "aggregate_over_one_by_round": [round(x, 2) for x in self.ratios],
                "aggregate_over_one": statistics.median(self.ratios)}

    def close(self) -> None:
        self.lm.ffn.close()


def measure(args) -> dict:
    """One fleet: its result; several (args.ducks): {"fleets": [each one's result]}, measured round
    by round in turn."""
    import torch

    # the native path computes nothing in torch, but its small ops (tensors of ids, the argmax) wake
    # torch's OpenMP workers, which then spin and take a core from the ducks and the host's pool: on
    # the 2-core VM one sequence's step took 24 ms with them, 16.6 without (duckd's: 16-20)
    torch.set_num_threads(1)
    fleets: list[Fleet] = []
    try:
        for n in args.ducks:
            fleets.append(Fleet(n, args))
        for r in range(args.rounds):
            for f in fleets:
                log.info("round %d/%d, %d ducks: one sequence, then %d together", r + 1, args.rounds, f.n,
                         args.sequences)
                f.round()
        results = [f.result() for f in fleets]
        return results[0] if len(results) == 1 else {"fleets": results}
    finally:
        for f in fleets:
            f.close()


def format_table(r: dict) -> str:
    lines = [f"{'':<12}" + "".join(f"{p + ' ms':>11}" for p in PARTS) + f"{'tok/s':>10}"]
    for k, label in (("one", "1 sequence"), ("batch", f"{r['sequences']} together")):
        m = r["median_ms"][k]
        lines.append(f"{label:<12}" + "".join(f"{m[p]:>11.2f}" for p in PARTS) + f"{r['tok_s'][k]:>10.1f}")
    lines.append(f"aggregate / one sequence: {r['aggregate_over_one']:.2f}x (rounds "
                 f"{r['aggregate_over_one_by_round']}; {r['ducks']} local ducks, {r['steps']} steps per round)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write("\n".join(format_table(r) for r in result.get("fleets", [result])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
