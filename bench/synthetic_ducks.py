"""The local ducks of `duckctl bench e2e --synthetic` (bench/e2e_synthetic.py): the
slice each holds, the CPUs each is pinned to (--pin-ducks), how long it spins
before it blocks, and the read bandwidth of all of them at once."""
from __future__ import annotations

import os

from bench.synthetic import fp9_bytes


def duck_share(n_experts: int, hidden: int, intermediate: int, tp: int, multiple_of: int) -> int:
    """fp9 bytes one duck holds for a layer (its slice of every expert, padded as split_experts pads)."""
    from native.transport import slice_width
    w = slice_width(intermediate, tp, multiple_of)
    return n_experts * (fp9_bytes(2 * w, hidden) + fp9_bytes(hidden, w) + 2 * 64)


def measure_fleet_read(ducks: int, threads: int) -> float:
    """The host's read bandwidth with every duck's threads reading at once (GB/s)."""
    from native.kernels import measure_read_gbps
    return measure_read_gbps(ducks * threads, mib=512, seconds=0.5)


def duck_cpus(args) -> list[list[int]] | None:
    """Each duck's CPUs with --pin-ducks (None: unpinned)."""
    if not args.pin_ducks:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    cpus = [allowed[i * args.duck_threads:(i + 1) * args.duck_threads] for i in range(args.ducks)]
    if any(len(c) < args.duck_threads for c in cpus):
        raise ValueError(f"--pin-ducks: {args.ducks} ducks x {args.duck_threads} threads need "
                         f"{args.ducks * args.duck_threads} CPUs, this host allows {len(allowed)}")
    return cpus


# Ducks on CPUs of their own (--pin-ducks) spin-then-block for this long, as duckd's network-booted
# ducks do (fleet.spin_us): a decode layer then finds the duck's workers awake (docs/duckd-config.md).
PINNED_DUCK_SPIN_US = 1000


def duck_spin_us(args) -> int:
    """--duck-spin-us as given, else PINNED_DUCK_SPIN_US for pinned ducks (dedicated cores), 0 for the others."""
    if args.duck_spin_us is not None:
        return args.duck_spin_us
    return PINNED_DUCK_SPIN_US if args.pin_ducks else 0
