"""The lost-duck bars measured against the real daemon and real ducks (the
embedded default model on 4 local ducks): kill -9 of one duck at token 20 of
a 200-token greedy chat, SIGSTOP of one for 10 s, two ducks killed one after
the other, 5 % datagram loss on every duck, and replicas = 2 with one duck
killed; each `--reps` times. Prints one line per run and a summary.

    .venv/bin/python -m bench.lost_duck --reps 5

The streams and the daemon come from tests/duckd/test_lost_duck.py (the same
cases with margins for a loaded machine)."""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from duck_proto import duck_pb2 as pb
from bench.live_daemon import all_serving, max_gap
from tests.duckd.test_lost_duck import AT_TOKEN, rate, start, stream


def _kill(daemon, i):
    return lambda: daemon.kill_duck(i)


def _sigstop(daemon, i, seconds=10.0):
    pid = daemon.duck_pid(i)

    def act():
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return act


def _two(daemon):
    def act():
        daemon.kill_duck(0)
        time.sleep(1.0)
        daemon.kill_duck(3)
    return act


def _serving_again(daemon) -> float:
    t0 = time.monotonic()
    all_serving(daemon, timeout=120)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="kill9,sigstop10s,two_kills,loss5,replicas_kill",
                    help="comma-separated; the undisturbed runs always come first")
    ap.add_argument("--netns", action="store_true",
                    help="every daemon's ducks in network namespaces of their own (fleet.driver netns, two subnets "
                         "over veth links; needs root), as boxes on a network are")
    ap.add_argument("--send-twice", choices=("auto", "always", "never"), default="auto",
                    help="fleet.send_twice of every daemon (docs/wire.md, Reliability): auto sends a lossy link's "
                         "decode forwards twice")
    args = ap.parse_args()
    netns = {"driver": "netns", "netns": {"name": "lost", "prefix": "10.78", "subnets": 2}} if args.netns else {}

    def launch(root, name, **fleet):
        return start(root, name, **netns, send_twice=args.send_twice, **fleet)

    cases = set(args.cases.split(","))
    root = Path(tempfile.mkdtemp(prefix="duck-lost-"))
    rows: dict[str, list[dict]] = {}

    def record(case, ref, tokens, times, stats, **extra):
        row = {"same": tokens == ref, "gap_s": max_gap(times), "decode": stats.decode_tok_s, **extra}
        rows.setdefault(case, []).append(row)
        print(case, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)

    daemon = launch(root, "main")
    try:
        ref, _, _ = stream(daemon)
        for _ in range(args.reps):
            tokens, times, stats = stream(daemon)
            record("undisturbed", ref, tokens, times, stats)
        for case, action in (("kill9", lambda: _kill(daemon, 2)), ("sigstop10s", lambda: _sigstop(daemon, 1)),
                             ("two_kills", lambda: _two(daemon))):
            for _ in range(args.reps if case in cases else 0):
                tokens, times, stats = stream(daemon, AT_TOKEN, action())
                back = _serving_again(daemon)
                record(case, ref, tokens, times, stats, serving_again_s=back,
                       restarts=sum(d.restarts for d in daemon.ducks()))
    finally:
        daemon.stop()
    lossy = launch(root, "lossy", fault_drop_rate=0.05) if "loss5" in cases else None
    try:
        for _ in range(args.reps if lossy else 0):
            tokens, times, stats = stream(lossy)
            record("loss5", ref, tokens, times, stats, drops=sum(d.drops for d in lossy.ducks()))
    finally:
        if lossy:
            lossy.stop()
    replicas = launch(root, "replicas", replicas=2, host_cover_mb=0) if "replicas_kill" in cases else None
    try:
        for i in range(args.reps if replicas else 0):
            all_serving(replicas, timeout=120)
            tokens, times, stats = stream(replicas, AT_TOKEN, _kill(replicas, i % 4))
            record("replicas_kill", ref, tokens, times, stats,
                   after_over_before=rate(times, AT_TOKEN + 5) / rate(times, 2, AT_TOKEN))
    finally:
        if replicas:
            replicas.stop()
    base = statistics.mean(r["decode"] for r in rows["undisturbed"])
    print(f"\nsummary over {args.reps} runs each (undisturbed decode {base:.1f} tok/s):")
    for case, rs in rows.items():
        line = (f"  {case:14s} identical {sum(r['same'] for r in rs)}/{len(rs)}; longest gap "
                f"{min(r['gap_s'] for r in rs):.3f}..{max(r['gap_s'] for r in rs):.3f} s; decode "
                f"{statistics.mean(r['decode'] for r in rs):.1f} tok/s ({statistics.mean(r['decode'] for r in rs) / base:.2f}x)")
        if "after_over_before" in rs[0]:
            line += f"; after/before the kill {min(r['after_over_before'] for r in rs):.2f}..{max(r['after_over_before'] for r in rs):.2f}x"
        if "serving_again_s" in rs[0]:
            line += f"; all serving again {max(r['serving_again_s'] for r in rs):.1f} s after the stream at most"
        print(line)


if __name__ == "__main__":
    main()
