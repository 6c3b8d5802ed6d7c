"""The placement plan (engine.placement builds on it; `duckctl plan` reads it without torch):
which FFN weights a GPU budget holds, in the order a token saves most by. See engine.placement
for the whole story.

    plan = plan_placement([FfnShape(layer, experts, hidden, intermediate), ...], topk, budget_bytes)
    plan.gpu                    # layer -> experts the GPU computes
    plan.duck_bytes_per_token   # what the ducks still read per token

A histogram is anything with frequencies(layer, experts) -> a list of fractions or None
(engine.placement.RoutingHistogram keeps one while serving).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

GPU_BYTES_PER_WEIGHT = 2        # bf16 copies of the ducks' fp9 weights
DUCK_BYTES_PER_WEIGHT = 1.125   # fp9
CALL_S = 150e-6                 # a duck call's cost beside its bytes (transport, host stage): the planner's default
DUCK_GBPS = 40.0                # the fleet's aggregate read rate: the planner's default


@dataclass(frozen=True, slots=True)
class FfnShape:
    """One FFN layer as the ducks hold it: `experts` experts [intermediate, hidden] (1: a dense FFN)."""
    layer: int
    experts: int
    hidden: int
    intermediate: int

    @property
    def expert_weights(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def dense(self) -> bool:
        return self.experts == 1


@dataclass
class PlacementPlan:
    """gpu: layer -> the experts the GPU computes (all of them: the layer is the GPU's alone)."""
    shapes: dict[int, FfnShape]
    topk: int
    budget_bytes: int
    gpu: dict[int, tuple[int, ...]] = field(default_factory=dict)
    share: dict[int, float] = field(default_factory=dict)   # layer -> fraction of its routed activations on the GPU
    filling: str = "none"                                    # how the MoE layers were filled: whole, spread, none

    def whole(self, layer: int) -> bool:
        return len(self.gpu.get(layer, ())) == self.shapes[layer].experts

    @property
    def gpu_bytes(self) -> int:
        return sum(len(ids) * self.shapes[layer].expert_weights * GPU_BYTES_PER_WEIGHT
                   for layer, ids in self.gpu.items())

    @property
    def duck_bytes(self) -> int:
        """fp9 bytes the ducks hold (all of it: they keep every slice)."""
        return int(sum(s.experts * s.expert_weights for s in self.shapes.values()) * DUCK_BYTES_PER_WEIGHT)

    def _read(self, layer: int) -> float:
        """Expected fp9 bytes one token has the ducks read of this layer."""
        s = self.shapes[layer]
        k = 1 if s.dense else min(self.topk, s.experts)
        return k * s.expert_weights * DUCK_BYTES_PER_WEIGHT * (1.0 - self.share.get(layer, 0.0))

    @property
    def duck_bytes_per_token(self) -> float:
        return sum(self._read(layer) for layer in self.shapes)

    @property
    def duck_calls_per_token(self) -> int:
        return sum(1 for layer in self.shapes if not self.whole(layer))

    def duck_seconds(self, call_s: float = CALL_S, duck_gbps: float = DUCK_GBPS) -> float:
        """The cost model: a token's duck time under this plan."""
        return self.duck_calls_per_token * call_s + self.duck_bytes_per_token / (duck_gbps * 1e9)

    def summary(self) -> dict:
        """What status, the console and /metrics show."""
        whole = sorted(layer for layer in self.gpu if self.whole(layer))
        return {"budget_gb": round(self.budget_bytes / 1e9, 3), "gpu_gb": round(self.gpu_bytes / 1e9, 3),
                "duck_gb": round(self.duck_bytes / 1e9, 3),
                "duck_gb_per_token": round(self.duck_bytes_per_token / 1e9, 4),
                "gpu_layers_whole": whole, "gpu_layers_part": sorted(set(self.gpu) - set(whole)),
                "gpu_experts": sum(len(v) for v in self.gpu.values()),
                "duck_calls_per_token": self.duck_calls_per_token, "filling": self.filling}


def plan_placement(shapes: list[FfnShape], topk: int, budget_bytes: int, histogram: RoutingHistogram | None = None,
                   call_s: float = CALL_S, duck_gbps: float = DUCK_GBPS) -> PlacementPlan:
    """The plan for a GPU budget (see the module docstring)."""
    by_layer = {s.layer: s for s in shapes}
    base = PlacementPlan(by_layer, topk, max(0, int(budget_bytes)))
    left = base.budget_bytes
    for s in shapes:                                   # 1. dense layers, in order, while they fit
        cost = s.expert_weights * GPU_BYTES_PER_WEIGHT
        if s.dense and cost <= left:
            base.gpu[s.layer], base.share[s.layer] = (0,), 1.0
            left -= cost
    moe = [s for s in shapes if not s.dense]
    if not moe or left <= 0:
        return base
    candidates = [_fill(base, moe, left, histogram, whole_first=True),
                  _fill(base, moe, left, histogram, whole_first=False)]
    best = min(candidates, key=lambda p: p.duck_seconds(call_s, duck_gbps))
    log.info("placement: %.2f GB on the GPU (%s), %.3f GB per token from the ducks in %d calls",
             best.gpu_bytes / 1e9, best.filling, best.duck_bytes_per_token / 1e9, best.duck_calls_per_token)
    return best


def _fill(base: PlacementPlan, moe: list[FfnShape], left: int, histogram, whole_first: bool) -> PlacementPlan:
    plan = PlacementPlan(base.shapes, base.topk, base.budget_bytes, dict(base.gpu), dict(base.share))
    rest = list(moe)
    if whole_first:
        # whole layers from the last one down: a prefill streams the first layers' experts first
        # (engine.gpu.expert_stream), so the GPU's own copies spare the last copies of a pass
        for s in sorted(moe, key=lambda s: -s.layer):
            cost = s.experts * s.expert_weights * GPU_BYTES_PER_WEIGHT
            if cost <= left:
                plan.gpu[s.layer], plan.share[s.layer] = tuple(range(s.experts)), 1.0
                left -= cost
                rest.remove(s)
    plan.filling = "whole" if len(rest) < len(moe) else "none"
    if rest and left > 0:
        picked = _spread(rest, left, histogram)
        for s in rest:
            ids = picked.get(s.layer, [])
            if ids:
                plan.gpu[s.layer] = tuple(sorted(ids))
                freq = histogram.frequencies(s.layer, s.experts) if histogram else None
                plan.share[s.layer] = (sum(freq[e] for e in ids) if freq is not None else len(ids) / s.experts)
        if picked:
            plan.filling = "whole+spread" if plan.filling == "whole" else "spread"
    return plan


def _spread(layers: list[FfnShape], left: int, histogram) -> dict[int, list[int]]:
    """Experts of these layers within left bytes: the most often chosen first (by the histogram;
    with none, round-robin over the layers so that each holds as many as the next)."""
    ranked = []   # (-frequency of the activations it takes, turn, layer, expert)
    for s in layers:
        freq = histogram.frequencies(s.layer, s.experts) if histogram else None
        order = (sorted(range(s.experts), key=lambda e: -freq[e]) if freq is not None else list(range(s.experts)))
        for turn, e in enumerate(order):
            ranked.append((-(float(freq[e]) if freq is not None else 0.0), turn, s.layer, e))
    ranked.sort()
    shapes = {s.layer: s for s in layers}
    picked: dict[int, list[int]] = {}
    for _, _, layer, e in ranked:
        cost = shapes[layer].expert_weights * GPU_BYTES_PER_WEIGHT
        if cost > left:
            break
        picked.setdefault(layer, []).append(e)
        left -= cost
    return picked
