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


class SyntheticFleet:
    """A synthetic model at real widths (bench.synthetic) on a fleet of local ducks that hold its
    random fp9 experts, for the benchmarks that compare paths in one run (bench.prefill_compare,
    bench.loop_compare). args: ducks, duck_threads, pin_ducks, duck_spin_us, seed.

        with SyntheticFleet(args, config, device, dtype) as fleet:
            fleet.model, fleet.backend
    """

    def __init__(self, args, config, device, dtype):
        self.args, self.config, self.device, self.dtype = args, config, device, dtype
        self.model = self.backend = self.local = None

    def __enter__(self) -> "SyntheticFleet":
        from bench.synthetic import build_host_model, ffn_shapes, install_synthetic_fleet
        from engine.fleet_ffn import FleetFfn, LocalDucks

        a = self.args
        self.model = build_host_model(self.config, self.device, self.dtype, seed=a.seed)
        per_duck = sum(duck_share(n, h, i, a.ducks, 64) for _, n, h, i in ffn_shapes(self.model))
        a.multiple_of = 64
        self.local = LocalDucks(a.ducks, threads=a.duck_threads, cpus=duck_cpus(a), spin_us=duck_spin_us(a),
                                cache_capacity=f"{(per_duck * 1.05 + (64 << 20)) // (1 << 20):.0f}M")
        try:
            self.backend = FleetFfn(addresses=self.local.addresses, key=self.local.key, deadline_ms=60000)
            install_synthetic_fleet(self.model, self.backend, seed=a.seed)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.backend is not None:
            self.backend.close()
        if self.local is not None:
            self.local.stop()
        self.model = None


def add_synthetic_arguments(ap) -> None:
    """The arguments of a synthetic model on local ducks (SyntheticFleet, synthetic_run)."""
    from bench.synthetic import SHAPES
    ap.add_argument("--synthetic", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--dense-layers", type=int, default=None)
    ap.add_argument("--ducks", type=int, default=4)
    ap.add_argument("--duck-threads", type=int, default=4)
    ap.add_argument("--pin-ducks", action="store_true", help="each duck on CPUs of its own (as boxes are)")
    ap.add_argument("--duck-spin-us", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)


def synthetic_run(args):
    """(device, dtype, config, the result's header) of a one-run comparison on a synthetic model:
    bf16 on CUDA where there is one, fp32 on the CPU otherwise."""
    import time

    import torch

    from bench.synthetic import synthetic_config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = synthetic_config(args.synthetic, args.layers, args.experts, args.dense_layers)
    header = {"commit": commit(), "date": time.strftime("%Y-%m-%d"), "model": args.synthetic,
              "machine": {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                          "cpus": len(os.sched_getaffinity(0))},
              "shape": {"layers": config.num_hidden_layers, "experts": config.num_experts,
                        "experts_per_token": config.num_experts_per_tok, "hidden": config.hidden_size},
              "fleet": {"ducks": args.ducks, "duck_threads": args.duck_threads}}
    return device, dtype, config, header


def commit() -> str:
    """HEAD, marked "+changes" where the tree differs from it (a device's copy of a working tree)."""
    import subprocess
    if os.environ.get("DUCK_COMMIT"):
        return os.environ["DUCK_COMMIT"]
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout.strip()  # noqa: E731
        return git("rev-parse", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_and_write(run, args) -> int:
    """run(args)'s result as JSON to args.json (stdout without one), progress logged on stderr."""
    import json
    import logging
    import sys
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    text = json.dumps(run(args), indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0
