"""The measured things of the kernel benchmark (bench/kernels.py) and the
instruction sets its peers run on: shared with its compute cases
(bench/kernels_gemm.py)."""
from __future__ import annotations

from native._native import lib
from native.kernels import timed_call


class Case:
    """One measured thing: a callable doing `work_bytes` of streaming per call
    (and `flops` floating-point operations, where that is the figure of merit)."""

    def __init__(self, name: str, fn, work_bytes: int, params: int, flops: int = 0, **info):
        self.name, self.fn, self.work_bytes, self.params, self.flops, self.info = \
            name, fn, work_bytes, params, flops, info
        self.seconds: list[float] = []

    @property
    def key(self) -> tuple:
        return (self.name, str(self.info.get("shape")),
                self.info.get("kernels") or self.info.get("isa") or self.info.get("mode"), self.info.get("tokens"),
                self.info.get("part"), self.info.get("activations"))

    def run(self, min_seconds: float) -> None:
        self.seconds.append(timed_call(self.fn, min_seconds))


def rotating(items):
    """A callable cycling over items, calling each with no arguments."""
    state = {"i": 0}

    def call():
        items[state["i"] % len(items)]()
        state["i"] += 1
    return call


# The int8 peer runs on the vector width of the fp9 kernel set it is compared with.
ISA_OF_KERNELS = {"ref": lib.DUCK_BENCH_SCALAR, "avx2": lib.DUCK_BENCH_AVX2, "avx2-xor": lib.DUCK_BENCH_AVX2,
                  "avx2-blend": lib.DUCK_BENCH_AVX2,
                  "avx512": lib.DUCK_BENCH_AVX512, "avx512-bf16": lib.DUCK_BENCH_AVX512,
                  "amx": lib.DUCK_BENCH_AVX512, "amx-emu": lib.DUCK_BENCH_AVX512}
ISA_NAMES = {lib.DUCK_BENCH_SCALAR: "scalar", lib.DUCK_BENCH_AVX2: "avx2", lib.DUCK_BENCH_AVX512: "avx512"}
