"""The benchmarks' view of an FFN backend: the same calls, each one's wall time, the
slowest duck's kernel time and the routed experts recorded (TimedFfn), and how those
routes spread over the experts (routing_spread): a synthetic model must route over
all experts as a trained one does, and this is where that shows."""
from __future__ import annotations

import time

import torch

from engine.ffn import FfnBackend


class TimedFfn(FfnBackend):
    """The benchmark's view of a backend: the same calls, each one's wall time and the
    slowest duck's kernel time recorded (eager steps on the CPU have no lane to time them)."""
    name = "timed"

    def __init__(self, backend: FfnBackend):
        self.backend = backend
        self.calls: list[tuple[int, float, float]] = []   # (layer, wall s, kernel s)
        self.routes: list[tuple[int, torch.Tensor]] = []   # (layer, ids) of calls with host ids
        self.keep_device_routes = False                    # a prefill's too (counted after it)

    def load_layer(self, layer):
        self.backend.load_layer(layer)

    @property
    def host_io(self) -> bool:
        return self.backend.host_io

    @property
    def captures_in_graph(self) -> bool:
        return self.backend.captures_in_graph

    @property
    def overlaps_host(self) -> bool:
        return self.backend.overlaps_host

    @property
    def kernel_us_total(self) -> float:
        return self.backend.kernel_us_total

    @property
    def bytes_streamed(self) -> int:
        return self.backend.bytes_streamed

    def step_session(self):
        """The fleet's session when the backend is one (a step driven from C), else None."""
        inner = getattr(self.backend, "step_session", None)
        return inner() if inner is not None else None

    def record_native_step(self, step, times) -> None:
        """A step driven from C: its calls and routes, as forward() records them."""
        for (layer, k), ffn, kernel, ids in zip(step.calls, times.ffn, times.kernel, times.ids):
            self.calls.append((layer, ffn, kernel))
            if k > 1:
                self.routes.append((layer, ids))

    def record_host_step(self, times) -> None:
        """The CPU host decoder's layers driven from C (native/transport/step.py HostStep):
        one call per layer, as forward() records them (no routes: they stay in C)."""
        for layer, (ffn, kernel) in enumerate(zip(times.ffn, times.kernel)):
            self.calls.append((layer, ffn, kernel))

    def forward(self, layer, x, ids, weights, out=None):
        k0 = self.kernel_us_total
        t0 = time.perf_counter()
        y = self.backend.forward(layer, x, ids, weights, out=out)
        self.calls.append((layer, time.perf_counter() - t0, (self.kernel_us_total - k0) * 1e-6))
        if ids.shape[1] > 1 and (ids.device.type == "cpu" or self.keep_device_routes):   # a routed layer
            self.routes.append((layer, ids.clone()))   # counted after the step
        return y


def routing_spread(steps: list[list[tuple[int, object]]], n_experts: int) -> dict | None:
    """How the decode steps spread over the experts, per routed layer: distinct experts per
    step, the share of a step's experts that the step before also read (data a cache may
    still hold: a trained model reuses few), and the share of all experts read over the steps.
    A random model whose routing collapsed onto a few experts shows here."""
    per_layer: dict[int, list[set[int]]] = {}
    for step in steps:
        for layer, experts in step:
            chosen = experts.flatten().tolist() if isinstance(experts, torch.Tensor) else experts
            per_layer.setdefault(layer, []).append(set(chosen))
    if not per_layer:
        return None
    distinct, reused, coverage = [], [], []
    for sets in per_layer.values():
        distinct += [len(s) for s in sets]
        reused += [len(a & b) / len(b) for a, b in zip(sets, sets[1:])]
        coverage.append(len(set().union(*sets)) / n_experts)
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return {"layers": len(per_layer), "steps": len(steps), "experts": n_experts,
            "distinct_experts_per_layer_step": mean(distinct),
            "reused_from_previous_step": mean(reused),
            "experts_read_over_the_steps": mean(coverage)}
