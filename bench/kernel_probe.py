"""The ducks' decode kernel measured the way the fleet read probe measures memory: every duck of
a fleet that shares this host's memory (loopback, --netns ducks) running its kernel at once.

The planner takes a run's decode kernel as min(cores x kernel per core, read share x
kernel_read_ratio). A duck alone may not be read-bound (`bench kernels --moe-width 256`: the
DeepSeek-V3 slice of an 8-duck fleet at 0.77 of the read probe, 2 threads, H200 host), and ducks
that share one memory system do not share it evenly: at 16 x 1 on the H200 host they made 222 to
386 calls a second each, the median duck at 0.93 of its share of the all-at-once read probe and
the slowest at 0.69. Each layer waits for the slowest duck, so after a free-running second the
probe runs rounds as a fleet's layers run (every duck starts a call at once, a round lasts its
slowest duck's call), and the planner takes a duck's bytes per median round over the read share
as the run's ratio (duckd/plan/cli.py, from_e2e). Each duck's slices make 32 x the host's
last-level cache in all, a layer per call in turn: a run's ducks read every layer from memory.

    measure_fleet_kernel(ducks=8, threads=2, experts=256, hidden=7168, width=256, cpus=...)

Each duck is a thread of this process with its own pool (pinned to the CPUs the run gives that
duck), workspace and slice (synthetic fp9, docs/fp9.md section 8: no two ducks share a page), one
token routed to 8 experts per call, the routes rotating as in `bench kernels`' moe_slice."""
from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from native._native import ffi, lib
from native.fp9 import SynthTensor
from native.kernels import ExpertSlice, MoeSlice, Pool, Workspace, kernels, kernels_name

log = logging.getLogger("duck.bench.kernel_probe")

TOPK = 8
# The ducks' slices together make at least this many times the host's last-level cache: a run's
# ducks hold every layer, far more than the cache, and so must the probe (one layer of Qwen3-30B-A3B
# at 4 ducks, 680 MB in all, would be served partly from a ~100 MB cache and read faster than the
# run reads it). Where sysfs does not say the cache's size, FALLBACK_BYTES_PER_DUCK a duck.
LLC_MULTIPLE = 32
FALLBACK_BYTES_PER_DUCK = 1 << 30


def last_level_cache_bytes() -> int | None:
    """The largest cache of CPU 0 (sysfs), None where it is not readable."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit != 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


def probe_bytes_per_duck(ducks: int) -> int:
    llc = last_level_cache_bytes()
    return -(-LLC_MULTIPLE * llc // ducks) if llc else FALLBACK_BYTES_PER_DUCK


def _slice(experts: int, hidden: int, width: int, seed: int, pool) -> MoeSlice:
    return MoeSlice([ExpertSlice(SynthTensor(2 * width, hidden, seed + 2 * e, f"e{e}.gate_up").materialize(pool),
                                 SynthTensor(hidden, width, seed + 2 * e + 1, f"e{e}.down").materialize(pool))
                     for e in range(experts)], hidden, f"probe slice {seed}")


class _Duck:
    """One duck's kernel: its pool on its CPUs, and the calls it made in the timed window, each
    on the next of its layers (slices of the same shape) as a decode step goes through them."""

    def __init__(self, layers: list[MoeSlice], threads: int, cpus: list[int] | None, rng: np.random.Generator):
        self.layers, self.threads, self.cpus = layers, threads, cpus
        layer = layers[0]
        n = len(layer.experts)
        self.routes = np.stack([rng.choice(n, size=TOPK, replace=False) for _ in range(1024)]).astype(np.int32)
        self.weights = np.full((1, TOPK), 1.0 / TOPK, dtype=np.float32)
        self.x = rng.standard_normal((1, layer.hidden)).astype(np.float32)
        self.y = np.empty((1, layer.hidden), dtype=np.float32)
        self.calls, self.seconds, self.error = 0, 0.0, None
        self.round_s: list[float] = []   # the call of each synchronized round

    def run(self, start: threading.Barrier, seconds: float, rounds: threading.Barrier, plan: dict) -> None:
        try:
            if self.cpus:   # the pool's workers inherit this thread's CPUs and pin within them
                os.sched_setaffinity(0, self.cpus)
            pool, ws, k = Pool(self.threads, pin=bool(self.cpus)), Workspace(), kernels()
            a = ffi.new("duck_moe_args *")
            layer = self.layers[0]
            a.experts, a.n_experts, a.hidden = layer._table, len(layer.experts), layer.hidden
            a.ntok, a.topk = 1, TOPK
            a.expert_weights = ffi.from_buffer("float[]", self.weights)
            a.x, a.x_dtype = ffi.from_buffer(self.x), lib.DUCK_DT_F32
            a.y, a.y_dtype = ffi.from_buffer(self.y, require_writable=True), lib.DUCK_DT_F32
            ids, nbytes = ffi.cast("const int32_t *", ffi.from_buffer(self.routes)), ffi.new("uint64_t *")

            def call(i: int) -> None:
                a.experts = self.layers[i % len(self.layers)]._table
                a.expert_ids = ids + (i % 1024) * TOPK
                rc = lib.duck_moe_forward(pool.ptr, k, ws.ptr, a, nbytes)
                if rc != 0:
                    raise RuntimeError(f"moe forward failed: {rc}")
            for i in range(4):   # first touches of the pool, the workspace and the routes
                call(i)
            self.kernels = kernels_name(k)
        except BaseException as e:  # noqa: BLE001 - reported by measure_fleet_kernel
            self.error = e
            start.abort()
            return
        try:
            start.wait()
            t0, i = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                call(i)
                i += 1
            self.calls, self.seconds = i, time.perf_counter() - t0
            # then rounds as a fleet's layers run: every duck starts a call at once (a barrier), and
            # the round lasts as long as its slowest duck's call (plan["rounds"]: set by the barrier)
            rounds.wait()
            for r in range(plan["rounds"]):
                rounds.wait()
                t = time.perf_counter()
                call(i + r)
                self.round_s.append(time.perf_counter() - t)
        except threading.BrokenBarrierError:
            return                        # another duck failed: it reports why
        except BaseException as e:  # noqa: BLE001 - reported by measure_fleet_kernel
            self.error = e
            start.abort()
            rounds.abort()


def measure_fleet_kernel(ducks: int, threads: int, experts: int, hidden: int, width: int, seconds: float = 1.0,
                         cpus: list[list[int]] | None = None, seed: int = 11,
                         min_bytes_per_duck: int | None = None) -> dict:
    """Every duck's decode kernel at once: GB/s of fp9 each duck streamed (the median duck, and
    the slowest), one token top-8 per call on slices of experts x (gate_up 2w x hidden + down
    hidden x w) of its own, as many as make min_bytes_per_duck (a layer each, taken in turn; None:
    LLC_MULTIPLE x the last-level cache over the ducks). cpus: each duck's CPUs (None: unpinned)."""
    if ducks < 1 or threads < 1 or experts < TOPK:
        raise ValueError(f"a kernel probe needs ducks, threads >= 1 and experts >= {TOPK}, got "
                         f"{ducks}, {threads}, {experts}")
    maker = Pool(len(os.sched_getaffinity(0)), pin=False)
    t0 = time.perf_counter()
    first = _slice(experts, hidden, width, seed, maker)
    layer_bytes = sum(e.weight_bytes for e in first.experts)
    n_layers = max(1, -(-(min_bytes_per_duck or probe_bytes_per_duck(ducks)) // layer_bytes))
    slices = [[first if d == l == 0 else _slice(experts, hidden, width, seed + 2 * experts * (d * n_layers + l), maker)
               for l in range(n_layers)] for d in range(ducks)]
    log.info("kernel probe: %d ducks x %d layers of %d x 3 x %d x %d (%.1f GB of fp9) made in %.1f s", ducks,
             n_layers, experts, width, hidden, ducks * n_layers * layer_bytes / 1e9, time.perf_counter() - t0)
    rng = np.random.default_rng(seed)
    members = [_Duck(s, threads, cpus[d] if cpus else None, rng) for d, s in enumerate(slices)]
    start = threading.Barrier(ducks)
    plan = {"rounds": 0}

    def set_rounds() -> None:   # about `seconds` of rounds at the slowest duck's free-running pace
        plan["rounds"] = max(8, min(m.calls for m in members))
    rounds = threading.Barrier(ducks, action=lambda: plan["rounds"] or set_rounds())
    runners = [threading.Thread(target=m.run, args=(start, seconds, rounds, plan), name=f"probe-duck-{d}")
               for d, m in enumerate(members)]
    for r in runners:
        r.start()
    for r in runners:
        r.join()
    failed = [m.error for m in members if m.error is not None]
    if failed:
        raise RuntimeError(f"kernel probe: {failed[0]}") from failed[0]
    per_call = first.experts[0].weight_bytes * TOPK
    gbps = sorted(m.calls * per_call / m.seconds / 1e9 for m in members)
    layer_s = [max(r) for r in zip(*(m.round_s for m in members))]   # each round waits for its slowest duck
    return {"ducks": ducks, "threads": threads, "shape": [experts, 3, width, hidden], "tokens": 1, "layers": n_layers,
            "kernels": members[0].kernels, "seconds": seconds,
            "gbps_per_duck": round(statistics.median(gbps), 3), "gbps_slowest_duck": round(gbps[0], 3),
            "calls": [m.calls for m in members],
            # synchronized rounds: a duck's bytes over the median round (its slowest duck's call)
            "rounds": len(layer_s), "gbps_per_duck_in_step": round(per_call / statistics.median(layer_s) / 1e9, 3),
            "round_ms_median": round(statistics.median(layer_s) * 1e3, 3)}
