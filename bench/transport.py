"""Transport benchmark: per-layer round trip through the Python API with real
duckfw processes on loopback (`duckctl bench transport`).

  duckctl bench transport [--json] [--ducks 8] [--iters 2000] [--mtu 0] [--poll-us 200]

Cases (a table, or one JSON object with --json):
  overhead_{N}_ducks / overhead_1_duck: one token, an empty expert list, a
    64-wide activation: pure protocol and scheduling cost (a datagram out
    and a zero partial back per duck), median and p99 in microseconds;
  ..._hidden7168: the same with DeepSeek's activation (28 KB in fp32) out,
    still a zero partial back;
  ..._host_polling: the host polls its socket --poll-us before blocking
    (otherwise --spin-us, 0: it blocks at once);
  partials_{N}_ducks_hidden7168_{fp32,bf16}: every duck computes and sends
    back a real partial of hidden 7168 (one expert of 64 units, top-1), in
    fp32 or in bf16 (what a bf16 host model asks for); kernel_us_slowest is
    the slowest duck's kernel per call, the rest is the transport's;
  deepseek_slice_{1,N}_duck(s): hidden 7168, 64 units per duck, top-8 of 8
    experts, one token: round trip, GB/s of fp9 weights streamed per duck
    (kernel time and end to end), against the local kernel on one thread.
Every case names the datagram size agreed with its ducks (datagram_bytes;
--mtu caps it, 1500 gives the old fragments), its partials' type, the host's
wait (blocking or polling), the retransmits (of the measured calls; the
warm-up's apart), and the ducks' wake-up: from a
request's arrival at a duck (kernel timestamp) to the start of its kernel,
for the slowest duck of each call (median, p99) and the mean over all.
Ducks run one worker thread each and block when idle, as on a shared host
(--duck-spin-us N: spin-then-block, yielding, for N us).

--chunk TxH (e.g. 512x2048): a prefill chunk's FFN call besides, T tokens of
hidden H in bf16 to every duck and a bf16 partial of the same size back from
each (one small expert per duck, every token routed to it: the kernel is
short, the bytes are a real chunk's): chunk_{N}_ducks_{T}x{H}_host_1_thread
with the host sealing, checking and summing on its calling thread alone,
..._host_threads with its helper threads (Fleet workers, 0: as many as it
may run on, at most 8); transport_us = round trip - the slowest duck's kernel;
host_cpu_us_per_call is this process's CPU time. Ducks run --threads each.

--netns N: the same per-layer cases on an emulated LAN instead of loopback:
N ducks in namespaces behind duckd's netns driver (--subnets, round-robin),
with tc link limits (--duck-rate-mbit 2500 --duck-delay-us 50
--port-rate-mbit 25000 by default: the seeds' 2.5GbE ducks behind 25GbE host
ports). netns_{overhead,partials}_{n}_ducks_hidden7168 for each n of
--netns-sizes (the first n ducks: as many per subnet); "links" says what was
emulated and how. Needs root and iproute2 (bench/netns_fleet.py).

The data MAC (docs/wire.md, Authentication): every case runs with it (the
default: forwards and partials carry the link MAC, Poly1305) and says so
(data_mac); ..._no_data_mac repeat the hidden-7168 cases without it (the ducks
run --no-data-mac, which takes both). data_mac_cost: the MAC alone in C over a
layer's activation and partial (Poly1305 with its one-time key, and the fleet
MAC's BLAKE2b for comparison), what one layer costs the host and a duck for it,
and the difference the end-to-end cases show.
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
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from duckd.config import TWICE
from native.kernels import MoeSlice
from native.transport import Fleet, duckfw_path, split_experts, write_key_file

log = logging.getLogger("duck.bench_transport")

HIDDEN = 7168


def start_ducks(n: int, workdir: Path, threads: int, mtu: int, spin_us: int = 0) -> tuple[bytes, list]:
    key_file = workdir / "key"
    key = write_key_file(key_file)
    idle = ["--idle", "spin", "--spin-us", str(spin_us)] if spin_us else ["--idle", "block"]
    procs = []
    for i in range(n):
        port_file = workdir / f"port{i}"
        procs.append(subprocess.Popen(
            [str(duckfw_path()), "--port-file", str(port_file), "--id", str(i), "--cache-dir", str(workdir / f"c{i}"),
             "--key-file", str(key_file), "--threads", str(threads), "--mtu", str(mtu or "auto"), *idle,
             "--no-data-mac", "--log-level", "warn"], stderr=subprocess.DEVNULL))
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


@contextmanager
def local_ducks(n: int, args):
    """n duckfw processes on loopback: (addresses, key); stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix="duck-bench-") as tmp:
        key, procs = start_ducks(n, Path(tmp), args.threads, args.mtu, args.duck_spin_us)
        try:
            yield wait_ports(n, Path(tmp)), key
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    log.warning("duck pid %d ignored SIGTERM for 10 s; killing it", p.pid)
                    p.kill()
                    p.wait()


def _us(a) -> dict:
    return {"median": round(float(np.median(a)), 1), "p99": round(float(np.percentile(a, 99)), 1)}


def timed(fn, iters: int, warmup: int = 50, session=None) -> dict:
    """Median/p99/min of fn in microseconds; with a session, also the slowest duck's
    wake-up and kernel time per call."""
    for _ in range(warmup):
        fn()
    t, wake, kernel = np.empty(iters), np.empty(iters), np.empty(iters)
    for i in range(iters):
        k0 = session.kernel_us_total if session is not None else 0
        t0 = time.perf_counter_ns()
        fn()
        t[i] = time.perf_counter_ns() - t0
        if session is not None:
            wake[i], kernel[i] = session.wake_ns_max, session.kernel_us_total - k0
    t /= 1000.0
    r = {"median_us": round(float(np.median(t)), 1), "p99_us": round(float(np.percentile(t, 99)), 1),
         "min_us": round(float(t.min()), 1), "max_us": round(float(t.max()), 1), "iters": iters}
    if session is not None:
        r["duck_wake_us_slowest"] = _us(wake / 1000.0)
        if kernel.any():
            r["kernel_us_slowest"] = _us(kernel)
    return r


def _sizes(fleet: Fleet):
    sizes = fleet.datagram_sizes()
    return sizes[0] if len(set(sizes)) == 1 else sizes


def machine_busy_s() -> float:
    """CPU seconds this machine spent busy so far, all CPUs (every process: ours and anyone else's)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _run_case(fleet: Fleet, session, fn, iters: int, host_spin_us: int, partials: str, warmup: int = 50,
              cpu_probe=None) -> dict:
    start = fleet.transport_stats()
    for _ in range(warmup):                # first forwards: cold caches, the retransmit timer still learning
        fn()
    before_d = fleet.stats()
    before_t = fleet.transport_stats()     # after the STATS call: only the measured calls' datagrams count
    busy0, wall0, own0 = machine_busy_s(), time.monotonic(), cpu_probe() if cpu_probe else 0.0
    r = timed(fn, iters, 0, session)
    busy, wall = machine_busy_s() - busy0, time.monotonic() - wall0
    if cpu_probe:   # this process and its ducks alone (the machine's figure counts everyone's)
        r["own_cpu_us_per_call"] = round((cpu_probe() - own0) / iters * 1e6, 1)
    after_t, after_d = fleet.transport_stats(), fleet.stats()
    # where ducks share this machine's CPUs (loopback, --netns), a round trip can be CPU-bound, not wire-bound
    r["machine_cpu_us_per_call"] = round(busy / iters * 1e6, 1)
    r["machine_busy_fraction"] = round(busy / wall / len(os.sched_getaffinity(0)), 2)
    fwd = sum(a["forwards"] - b["forwards"] for a, b in zip(after_d, before_d))
    wake = sum(a["wake_ns"] - b["wake_ns"] for a, b in zip(after_d, before_d))
    r.update(ducks=fleet.n_ducks, datagram_bytes=_sizes(fleet), partials=partials,
             host="polling" if host_spin_us else "blocking", host_spin_us=host_spin_us,
             retransmits=after_t["retransmits"] - before_t["retransmits"],
             warmup_retransmits=before_t["retransmits"] - start["retransmits"], warmup_calls=warmup,
             mtu_fallbacks=after_t["mtu_fallbacks"] - before_t["mtu_fallbacks"],
             datagrams_per_call=round((after_t["datagrams_tx"] + after_t["datagrams_rx"] - before_t["datagrams_tx"]
                                       - before_t["datagrams_rx"]) / iters, 1),
             duck_wake_us_mean=round(wake / max(fwd, 1) / 1000.0, 1))
    return r


def overhead(addresses, key, args, hidden: int, host_spin_us: int, mac: bool = True) -> dict:
    """One token, no expert routed: the protocol and scheduling cost of a layer."""
    n = len(addresses)
    with Fleet(addresses, key, mtu=args.mtu, spin_us=host_spin_us, mac_data=mac, twice=TWICE[args.send_twice]) as fleet:
        session = fleet.open_session({0: [[] for _ in range(n)]}, hidden)
        x = np.ones((1, hidden), np.float32)
        ids, w = np.full((1, 8), -1, np.int32), np.zeros((1, 8), np.float32)
        out = np.empty((1, hidden), np.float32)
        r = _run_case(fleet, session, lambda: session.forward(0, x, ids, w, out=out), args.iters, host_spin_us,
                      "none", cpu_probe=getattr(args, "cpu_probe", None))
        r.update(hidden=hidden, data_mac=mac)
        return r


def partials(addresses, key, args, host_spin_us: int, bf16: bool, mac: bool = True) -> dict:
    """One token, one expert of 64 units per duck: a real partial of hidden 7168 back from every duck."""
    n = len(addresses)
    rng = np.random.default_rng(1)
    expert = tuple((rng.standard_normal(s) * 0.02).astype(np.float32)
                   for s in ((64 * n, HIDDEN), (64 * n, HIDDEN), (HIDDEN, 64 * n)))
    per_duck = split_experts([expert], tp=n)
    x = (rng.standard_normal((1, HIDDEN)) * 0.1).astype(np.float32)
    ids, w = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    with Fleet(addresses, key, mtu=args.mtu, deadline_ms=5000, spin_us=host_spin_us, mac_data=mac,
               twice=TWICE[args.send_twice]) as fleet:
        fleet.upload([[t for e in s for t in (e.gate_up, e.down)] for s in per_duck])
        session = fleet.open_session({0: per_duck}, HIDDEN)
        out = np.empty((1, HIDDEN), np.uint16 if bf16 else np.float32)
        r = _run_case(fleet, session, lambda: session.forward(0, x, ids, w, out=out), args.iters, host_spin_us,
                      "bf16" if bf16 else "fp32", cpu_probe=getattr(args, "cpu_probe", None))
        r.update(hidden=HIDDEN, partial_bytes_per_duck=HIDDEN * (2 if bf16 else 4), data_mac=mac)
        return r


def parse_chunk(text: str) -> tuple[int, int]:
    try:
        tokens, hidden = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--chunk {text!r}: expected TOKENSxHIDDEN, e.g. 512x2048") from None
    if not (1 <= tokens <= 4096 and 64 <= hidden <= 16384 and hidden % 64 == 0):
        raise SystemExit(f"--chunk {text!r}: tokens 1..4096, hidden 64..16384 and a multiple of 64")
    return tokens, hidden


def prefill_chunk(addresses, key, args, workers: int) -> dict:
    """A prefill chunk's FFN call: its bytes both ways, with a small kernel."""
    n = len(addresses)
    tokens, hidden = parse_chunk(args.chunk)
    rng = np.random.default_rng(3)
    expert = tuple((rng.standard_normal(s) * 0.02).astype(np.float32)
                   for s in ((64 * n, hidden), (64 * n, hidden), (hidden, 64 * n)))
    per_duck = split_experts([expert], tp=n)
    xf = (rng.standard_normal((tokens, hidden)) * 0.1).astype(np.float32)
    x = (xf.view(np.uint32) >> 16).astype(np.uint16)          # bf16 bits, as a GPU host sends them
    ids, w = np.zeros((tokens, 1), np.int32), np.ones((tokens, 1), np.float32)
    iters = max(args.iters // 50, 20)
    with Fleet(addresses, key, mtu=args.mtu, deadline_ms=10000, workers=workers, twice=TWICE[args.send_twice]) as fleet:
        fleet.upload([[t for e in s for t in (e.gate_up, e.down)] for s in per_duck])
        session = fleet.open_session({0: per_duck}, hidden)
        out = np.empty((tokens, hidden), np.uint16)
        call = lambda: session.forward(0, x, ids, w, out=out)   # noqa: E731
        cpu0 = time.process_time()
        r = _run_case(fleet, session, call, iters, args.spin_us, "bf16", warmup=5)
        cpu = time.process_time() - cpu0
        r.update(tokens=tokens, hidden=hidden, bytes_per_duck_each_way=tokens * hidden * 2,
                 host_workers=fleet.workers, requests=session.last_requests,
                 transport_us=round(r["median_us"] - r["kernel_us_slowest"]["median"], 1),
                 host_cpu_us_per_call=round(cpu / (iters + 5) * 1e6, 1))
        return r


def mac_us(fn, nbytes: int, iters: int = 400) -> float:
    """Median microseconds of one MAC over nbytes (the C call; cffi's own cost is below 1 us)."""
    from native._native import ffi
    data, out = ffi.new("uint8_t[]", nbytes), ffi.new("uint8_t[16]")
    hdr = bytes(32)
    t = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter_ns()
        fn(hdr, data, nbytes, out)
        t[i] = time.perf_counter_ns() - t0
    return round(float(np.median(t)) / 1000.0, 2)


def data_mac_cost(result: dict, n: int) -> dict:
    """The data MAC per layer: in C alone, and as the end-to-end cases show it."""
    from native._native import ffi, lib
    key = ffi.new("wire_key *")
    key.bytes[0:32], key.len = bytes(range(32)), 32
    lib.wire_link_set(key, bytes(16), bytes(16))
    x, y = HIDDEN * 4, HIDDEN * 2          # a token's activation in fp32 out, its partial in bf16 back
    link = {nb: mac_us(lambda h, d, k, o: lib.wire_link_mac(key, h, d, k, o), nb) for nb in (x, y)}
    blake = mac_us(lambda h, d, k, o: lib.wire_mac(key, h, d, k, o), x)
    out = {"link_mac_us_activation_fp32": link[x], "link_mac_us_partial_bf16": link[y],
           "blake2b_mac_us_activation_fp32": blake, "activation_bytes": x, "partial_bytes": y,
           # the host seals a request to and checks a reply from every duck; a duck checks one and seals one
           f"host_us_per_layer_{n}_ducks": round(n * (link[x] + link[y]), 1),
           "duck_us_per_layer": round(link[x] + link[y], 1)}
    for case in (f"overhead_{n}_ducks_hidden{HIDDEN}", f"partials_{n}_ducks_hidden{HIDDEN}_fp32"):
        if case in result and f"{case}_no_data_mac" in result:
            out[f"{case}_median_us_added"] = round(result[case]["median_us"] - result[f"{case}_no_data_mac"]["median_us"], 1)
    return out


def deepseek_slice(addresses, key, args, host_spin_us: int) -> dict:
    n = len(addresses)
    iters = max(args.iters // 10, 50)
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
    with Fleet(addresses, key, mtu=args.mtu, deadline_ms=5000, spin_us=host_spin_us,
               twice=TWICE[args.send_twice]) as fleet:
        fleet.upload([[t for e in s for t in (e.gate_up, e.down)] for s in per_duck])
        session = fleet.open_session({0: per_duck}, HIDDEN)
        out = np.empty((1, HIDDEN), np.float32)
        r = _run_case(fleet, session, lambda: session.forward(0, x, ids, w, out=out), iters, host_spin_us, "fp32",
                      warmup=20)
        before = fleet.stats()
        timed(lambda: session.forward(0, x, ids, w, out=out), iters, warmup=0)
        after = fleet.stats()
        kern_s = np.mean([(a["kernel_ns"] - b["kernel_ns"]) / 1e9 / iters for a, b in zip(after, before)])
        fleet.shutdown()
    r.update(experts=n_experts, topk=topk, bytes_per_duck=bytes_per_duck,
             kernel_gbps_per_duck=round(bytes_per_duck / kern_s / 1e9, 2),
             end_to_end_gbps_per_duck=round(bytes_per_duck / (r["median_us"] * 1e-6) / 1e9, 2),
             local_kernel_gbps_1_thread=round(bytes_per_duck / (ref["median_us"] * 1e-6) / 1e9, 2))
    return r


def run(args) -> dict:
    result = {"cpus": len(os.sched_getaffinity(0)), "affinity": sorted(os.sched_getaffinity(0)),
              "load_avg_1min": round(os.getloadavg()[0], 2), "host_spin_us": args.spin_us,
              "host_poll_us": args.poll_us, "mtu_ceiling": args.mtu, "duck_spin_us": args.duck_spin_us}
    for n in (args.ducks, 1):
        name = f"overhead_{n}_duck{'s' if n > 1 else ''}"
        with local_ducks(n, args) as (addresses, key):
            result[name] = overhead(addresses, key, args, 64, args.spin_us)
            result[f"{name}_host_polling"] = overhead(addresses, key, args, 64, args.poll_us)
            result[f"{name}_hidden{HIDDEN}"] = overhead(addresses, key, args, HIDDEN, args.spin_us)
            if n > 1:
                result[f"{name}_hidden{HIDDEN}_host_polling"] = overhead(addresses, key, args, HIDDEN, args.poll_us)
                result[f"{name}_hidden{HIDDEN}_no_data_mac"] = overhead(addresses, key, args, HIDDEN, args.spin_us,
                                                                        mac=False)
                for dt in ("fp32", "bf16"):
                    result[f"partials_{n}_ducks_hidden{HIDDEN}_{dt}"] = partials(addresses, key, args, args.spin_us,
                                                                                dt == "bf16")
                result[f"partials_{n}_ducks_hidden{HIDDEN}_fp32_no_data_mac"] = partials(
                    addresses, key, args, args.spin_us, False, mac=False)
    if args.chunk:
        tokens, hidden = parse_chunk(args.chunk)
        with local_ducks(args.ducks, args) as (addresses, key):
            for label, workers in (("host_1_thread", 1), ("host_threads", 0)):
                result[f"chunk_{args.ducks}_ducks_{tokens}x{hidden}_{label}"] = prefill_chunk(addresses, key, args,
                                                                                           workers)
    result["data_mac_cost"] = data_mac_cost(result, args.ducks)
    if not args.skip_deepseek:
        for n in (1, args.ducks):
            with local_ducks(n, args) as (addresses, key):
                result[f"deepseek_slice_{n}_duck{'s' if n > 1 else ''}"] = deepseek_slice(addresses, key, args,
                                                                                          args.spin_us)
    return result


def run_netns(args) -> dict:
    """The per-layer round trip at hidden 7168 on an emulated LAN, for each fleet size."""
    from bench.netns_fleet import link_limits, netns_ducks, own_cpu_s
    sizes = sorted({int(v) for v in args.netns_sizes.split(",")} | {args.netns})
    if sizes[0] < 1 or sizes[-1] > args.netns:
        raise SystemExit(f"--netns-sizes {args.netns_sizes}: expected sizes 1..{args.netns} (the ducks started)")
    result = {"cpus": len(os.sched_getaffinity(0)), "affinity": sorted(os.sched_getaffinity(0)),
              "load_avg_1min": round(os.getloadavg()[0], 2), "host_spin_us": args.spin_us,
              "mtu_ceiling": args.mtu, "duck_spin_us": args.duck_spin_us, "fleet": "netns"}
    with netns_ducks(args) as (addresses, key, subnets, driver, pids):
        result["links"] = link_limits(driver)

        args.cpu_probe = lambda: own_cpu_s(pids)
        for n in sizes:
            sub = addresses[:n]
            result[f"netns_overhead_{n}_ducks_hidden{HIDDEN}"] = overhead(sub, key, args, HIDDEN, args.spin_us)
            for dt in ("fp32", "bf16"):
                result[f"netns_partials_{n}_ducks_hidden{HIDDEN}_{dt}"] = partials(sub, key, args, args.spin_us,
                                                                                    dt == "bf16")
            for name in (f"netns_overhead_{n}_ducks_hidden{HIDDEN}", f"netns_partials_{n}_ducks_hidden{HIDDEN}_fp32",
                         f"netns_partials_{n}_ducks_hidden{HIDDEN}_bf16"):
                result[name]["subnets_used"] = len(set(subnets[:n]))
    result["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    return result


def format_table(result: dict) -> str:
    lines = [f"{result['cpus']} cpus (load {result['load_avg_1min']}), datagram sizes agreed at hello"
             f"{' (ceiling ' + str(result['mtu_ceiling']) + ')' if result['mtu_ceiling'] else ''}; "
             "wake = a request's arrival at a duck to its kernel's start, slowest duck per call",
             f"{'case':44s} {'median':>8s} {'p99':>8s}  {'datagram':>8s} {'dgrams':>6s} {'y':4s} {'host':8s} "
             f"{'retx':>4s} {'wake med':>8s} {'wake p99':>8s} {'kernel':>8s}"]
    for name, r in result.items():
        if not isinstance(r, dict) or name in ("data_mac_cost", "links"):
            continue
        wake = r.get("duck_wake_us_slowest", {})
        lines.append(f"{name:44s} {r['median_us']:8.1f} {r['p99_us']:8.1f}  {str(r['datagram_bytes']):>8s} "
                     f"{r['datagrams_per_call']:6.1f} {r['partials']:4s} {r['host']:8s} {r['retransmits']:4d} "
                     f"{wake.get('median', 0):8.1f} {wake.get('p99', 0):8.1f} "
                     f"{r.get('kernel_us_slowest', {}).get('median', 0):8.1f}")
        if "transport_us" in r:
            lines.append(f"{'':44s} transport {r['transport_us']} us (round trip - slowest kernel), host "
                         f"{r['host_workers']} thread(s), host CPU {r['host_cpu_us_per_call']} us per call")
        if "kernel_gbps_per_duck" in r:
            lines.append(f"{'':44s} kernel {r['kernel_gbps_per_duck']} GB/s per duck, end to end "
                         f"{r['end_to_end_gbps_per_duck']}, local 1 thread {r['local_kernel_gbps_1_thread']}")
    if "links" in result:
        lines.append("emulated links: " + ", ".join(f"{k} {v}" for k, v in result["links"].items()))
    cost = result.get("data_mac_cost")
    if cost:
        lines.append("data MAC (Poly1305, one-time key per datagram): " + ", ".join(f"{k} {v}" for k, v in cost.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duckctl bench transport", description="duck transport benchmark (loopback)")
    p.add_argument("--ducks", type=int, default=8)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--mtu", type=int, default=0,
                   help="ceiling on the datagram size, ducks and host (0: as agreed, 64 KiB on loopback; 1500: the "
                        "fragments of an Ethernet path)")
    p.add_argument("--threads", type=int, default=1, help="worker threads per duck")
    p.add_argument("--skip-deepseek", action="store_true")
    p.add_argument("--chunk", default="", metavar="TxH",
                   help="a prefill chunk's FFN call too: T tokens of hidden H in bf16 each way (e.g. 512x2048)")
    p.add_argument("--cpus", help="run the host and every duck on these CPUs only (e.g. 0): on a VM whose idle "
                   "vCPUs take 30-40 us to wake, co-located processes show the software's own overhead")
    p.add_argument("--spin-us", type=int, default=0,
                   help="the host polls its socket this long before blocking in the plain cases (0: it blocks)")
    p.add_argument("--poll-us", type=int, default=200, help="the host's polling in the _host_polling cases")
    p.add_argument("--duck-spin-us", type=int, default=0,
                   help="ducks spin-then-block (--idle spin) this long; 0: they block at once (a shared host)")
    p.add_argument("--send-twice", choices=sorted(TWICE), default="never",
                   help="the Fleet's send_twice (docs/wire.md, Reliability): never (the default here) counts a "
                        "clean link's datagrams; auto adds duckd's loss probes (a duck's first 64 forwards and one "
                        "in 16 after, twice)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    g = p.add_argument_group("emulated LAN (--netns N; root and iproute2)")
    g.add_argument("--netns", type=int, default=0, metavar="N",
                   help="run the hidden-7168 cases on N ducks in network namespaces behind tc link limits")
    g.add_argument("--netns-sizes", default="8,16,32", help="fleet sizes measured, each the first n ducks")
    g.add_argument("--subnets", type=int, default=4)
    g.add_argument("--duck-rate-mbit", type=float, default=2500.0)
    g.add_argument("--duck-delay-us", type=float, default=50.0)
    g.add_argument("--duck-jitter-us", type=float, default=0.0)
    g.add_argument("--duck-loss", type=float, default=0.0)
    g.add_argument("--port-rate-mbit", type=float, default=25000.0)
    g.add_argument("--port-delay-us", type=float, default=0.0)
    g.add_argument("--link-mtu", type=int, default=1500, help="the veths' MTU (9000: jumbo frames)")
    g.add_argument("--netns-prefix", default="10.78", help="subnet s is <prefix>.<s+1>.0/24")
    g.add_argument("--netns-name", default="bt", help="prefix of the namespaces, veths and bridges")
    args = p.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})   # the ducks inherit it
    logging.basicConfig(level=logging.WARNING)
    if args.netns:
        from duckd.config import ConfigError
        try:
            result = run_netns(args)
        except ConfigError as e:
            raise SystemExit(f"duckctl bench transport: {e}") from None
    else:
        result = run(args)
    result["command"] = " ".join(["duckctl bench transport", *(argv if argv is not None else sys.argv[1:])])
    sys.stdout.write((json.dumps(result, indent=2) if args.json else format_table(result)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
