"""Transport benchmark: per-layer round trip through the Python API with real
duckfw processes on loopback (becomes `duckctl bench transport`).

  python -m bench.transport [--ducks 8] [--iters 2000] [--mtu 1500]

Prints one JSON object:
  overhead_{N}_ducks / overhead_1_duck: one token, an empty expert list, a
    64-wide activation: pure protocol and scheduling cost (a datagram out
    and a zero partial back per duck), median and p99 in microseconds;
  ..._hidden7168: the same with DeepSeek's 28 KB fp32 activation, which is
    21 fragments per duck at MTU 1500;
  deepseek_slice_{1,N}_duck(s): hidden 7168, 64 units per duck, top-8 of 8
    experts, one token: round trip, GB/s of fp9 weights streamed per duck
    (kernel time and end to end), against the local kernel on one thread.
Ducks run one worker thread each and block when idle, as on a shared host.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from native.kernels import MoeSlice
from native.transport import Fleet, duckfw_path, split_experts, write_key_file

log = logging.getLogger("duck.bench_transport")

HIDDEN = 7168


def start_ducks(n: int, workdir: Path, threads: int, mtu: int) -> tuple[bytes, list[subprocess.Popen]]:
    key_file = workdir / "key"
    key = write_key_file(key_file)
    procs = []
    for i in range(n):
        port_file = workdir / f"port{i}"
        procs.append(subprocess.Popen(
            [str(duckfw_path()), "--port-file", str(port_file), "--id", str(i), "--cache-dir", str(workdir / f"c{i}"),
             "--key-file", str(key_file), "--threads", str(threads), "--mtu", str(mtu), "--log-level", "warn"]))
    return key, procs


def wait_ports(n: int, workdir: Path, timeout: float = 20.0) -> list[tuple[str, int]]:
    deadline = time.monotonic() + timeout
    out = []
    for i in range(n):
        p = workdir / f"port{i}"
        while not p.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"duck {i} did not start within {timeout} s")
            time.sleep(0.01)
        out.append(("127.0.0.1", int(p.read_text())))
    return out


def timed(fn, iters: int, warmup: int = 50) -> dict:
    for _ in range(warmup):
        fn()
    t = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        t[i] = time.perf_counter_ns() - t0
    t /= 1000.0
    return {"median_us": round(float(np.median(t)), 1), "p99_us": round(float(np.percentile(t, 99)), 1),
            "min_us": round(float(t.min()), 1), "iters": iters}


def overhead(n: int, iters: int, mtu: int, threads: int, hidden: int = HIDDEN, spin_us: int = 0) -> dict:
    with tempfile.TemporaryDirectory(prefix="duck-bench-") as tmp:
        key, procs = start_ducks(n, Path(tmp), threads, mtu)
        try:
            fleet = Fleet(wait_ports(n, Path(tmp)), key, mtu=mtu, spin_us=spin_us)
            fleet.hello()
            session = fleet.open_session({0: [[] for _ in range(n)]}, hidden)
            x = np.ones((1, hidden), np.float32)
            ids, w = np.full((1, 8), -1, np.int32), np.zeros((1, 8), np.float32)
            out = np.empty((1, hidden), np.float32)
            r = timed(lambda: session.forward(0, x, ids, w, out=out), iters)
            r.update(ducks=n, hidden=hidden, mtu=mtu, retransmits=fleet.transport_stats()["retransmits"])
            fleet.shutdown()
            fleet.close()
            return r
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                p.wait(10)


def deepseek_slice(n: int, iters: int, mtu: int, threads: int, spin_us: int = 0) -> dict:
    rng = np.random.default_rng(0)
    n_experts, topk = 8, 8
    experts = [tuple((rng.standard_normal(s) * 0.02).astype(np.float32) for s in
                     ((64 * n, HIDDEN), (64 * n, HIDDEN), (HIDDEN, 64 * n))) for _ in range(n_experts)]
    per_duck = split_experts(experts, tp=n)
    x = (rng.standard_normal((1, HIDDEN)) * 0.1).astype(np.float32)
    ids = np.arange(topk, dtype=np.int32).reshape(1, topk)
    w = np.full((1, topk), 1.0 / topk, np.float32)
    local = MoeSlice(per_duck[0], HIDDEN)
    ref = timed(lambda: local.forward(x, ids, w), max(iters // 4, 20), warmup=5)
    bytes_per_duck = sum(e.weight_bytes for e in per_duck[0])
    with tempfile.TemporaryDirectory(prefix="duck-bench-") as tmp:
        key, procs = start_ducks(n, Path(tmp), threads, mtu)
        try:
            fleet = Fleet(wait_ports(n, Path(tmp)), key, mtu=mtu, deadline_ms=5000, spin_us=spin_us)
            fleet.upload([[t for e in s for t in (e.gate_up, e.down)] for s in per_duck])
            session = fleet.open_session({0: per_duck}, HIDDEN)
            r = timed(lambda: session.forward(0, x, ids, w), iters, warmup=20)
            before = fleet.stats()
            timed(lambda: session.forward(0, x, ids, w), iters, warmup=0)
            after = fleet.stats()
            kern_s = np.mean([(a["kernel_ns"] - b["kernel_ns"]) / 1e9 / iters for a, b in zip(after, before)])
            fleet.shutdown()
            fleet.close()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                p.wait(10)
    r.update(ducks=n, mtu=mtu, experts=n_experts, topk=topk, bytes_per_duck=bytes_per_duck,
             kernel_gbps_per_duck=round(bytes_per_duck / kern_s / 1e9, 2),
             end_to_end_gbps_per_duck=round(bytes_per_duck / (r["median_us"] * 1e-6) / 1e9, 2),
             local_kernel_gbps_1_thread=round(bytes_per_duck / (ref["median_us"] * 1e-6) / 1e9, 2))
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="duck transport benchmark (loopback)")
    p.add_argument("--ducks", type=int, default=8)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--threads", type=int, default=1, help="worker threads per duck")
    p.add_argument("--skip-deepseek", action="store_true")
    p.add_argument("--cpus", help="run the host and every duck on these CPUs only (e.g. 0): on a VM whose idle "
                   "vCPUs take 30-40 us to wake, co-located processes show the software's own overhead")
    p.add_argument("--spin-us", type=int, default=0,
                   help="the host polls its socket this long before blocking (a dedicated host; ducks still block)")
    args = p.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})   # the ducks inherit it
    logging.basicConfig(level=logging.WARNING)
    result = {"cpus": len(os.sched_getaffinity(0)), "affinity": sorted(os.sched_getaffinity(0)),
              "host_spin_us": args.spin_us,
              "command": " ".join(["python -m bench.transport", *(argv if argv is not None else sys.argv[1:])])}
    for n in (args.ducks, 1):
        name = f"overhead_{n}_duck{'s' if n > 1 else ''}"
        result[name] = overhead(n, args.iters, args.mtu, args.threads, hidden=64, spin_us=args.spin_us)
        result[f"{name}_hidden{HIDDEN}"] = overhead(n, args.iters, args.mtu, args.threads, spin_us=args.spin_us)
    if not args.skip_deepseek:
        iters = max(args.iters // 10, 50)
        result["deepseek_slice_1_duck"] = deepseek_slice(1, iters, args.mtu, args.threads, args.spin_us)
        result[f"deepseek_slice_{args.ducks}_ducks"] = deepseek_slice(args.ducks, iters, args.mtu, args.threads,
                                                                     args.spin_us)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
