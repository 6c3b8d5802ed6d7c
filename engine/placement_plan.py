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

GPU_BYTES_PER_WEIGHT = 1.125    # the GPU keeps the ducks' fp9 (engine.gpu.fp9_gemv reads it); decoded copies:
                                # their dtype's size (engine.placement.bytes_per_weight)
DUCK_BYTES_PER_WEIGHT = 1.125   # fp9
CALL_S = 150e-6                 # a duck call's cost beside its bytes (transport, host stage): the planner's default
GPU_CALL_S = 15e-6              # a GPU-computed FFN's fixed cost per layer (its kernels' launches)
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
    gpu_bytes_per_weight: float = GPU_BYTES_PER_WEIGHT       # what a weight costs the GPU (fp9, or a decoded copy)

    def whole(self, layer: int) -> bool:
        return len(self.gpu.get(layer, ())) == self.shapes[layer].experts

    @property
    def gpu_bytes(self) -> int:
        return int(sum(len(ids) * self.shapes[layer].expert_weights * self.gpu_bytes_per_weight
                       for layer, ids in self.gpu.items()))

    @property
    def duck_bytes(self) -> int:
        """fp9 bytes the ducks hold (all of it: they keep every slice)."""
        return int(sum(s.experts * s.expert_weights for s in self.shapes.values()) * DUCK_BYTES_PER_WEIGHT)

    def _duck_read(self, layer: int) -> float:
        """Expected fp9 bytes one token has the ducks read of this layer."""
        return self._reads(layer) * DUCK_BYTES_PER_WEIGHT * (1.0 - self.share.get(layer, 0.0))

    @property
    def duck_bytes_per_token(self) -> float:
        return sum(self._duck_read(layer) for layer in self.shapes)

    @property
    def duck_calls_per_token(self) -> int:
        return sum(1 for layer in self.shapes if not self.whole(layer))

    def duck_seconds(self, call_s: float = CALL_S, duck_gbps: float = DUCK_GBPS) -> float:
        """The cost model: a token's duck time under this plan."""
        return self.duck_calls_per_token * call_s + self.duck_bytes_per_token / (duck_gbps * 1e9)

    def _reads(self, layer: int) -> int:
        """Weights one token reads of this layer (its k experts; a dense layer's one)."""
        sh = self.shapes[layer]
        return (1 if sh.dense else min(self.topk, sh.experts)) * sh.expert_weights

    @property
    def gpu_bytes_per_token(self) -> float:
        """Expected bytes one token has the GPU read of what it holds (its share of each layer's reads)."""
        return sum(self._reads(layer) * self.share.get(layer, 0.0) * self.gpu_bytes_per_weight for layer in self.gpu)

    def seconds(self, call_s: float = CALL_S, duck_gbps: float = DUCK_GBPS, gpu_gbps: float | None = None,
                gpu_call_s: float = GPU_CALL_S) -> float:
        """The cost model of a token's FFNs: the ducks' time, and with gpu_gbps (the GPU's read rate of
        what it holds, effective) the GPU's, which runs before or after the ducks', not beside them."""
        gpu = 0.0 if gpu_gbps is None else (len(self.gpu) * gpu_call_s + self.gpu_bytes_per_token / (gpu_gbps * 1e9))
        return self.duck_seconds(call_s, duck_gbps) + gpu

    def summary(self) -> dict:
        """What status, the console and /metrics show."""
        whole = sorted(layer for layer in self.gpu if self.whole(layer))
        return {"budget_gb": round(self.budget_bytes / 1e9, 3), "gpu_gb": round(self.gpu_bytes / 1e9, 3),
                "duck_gb": round(self.duck_bytes / 1e9, 3),
                "duck_gb_per_token": round(self.duck_bytes_per_token / 1e9, 4),
                "gpu_layers_whole": whole, "gpu_layers_part": sorted(set(self.gpu) - set(whole)),
                "gpu_experts": sum(len(v) for v in self.gpu.values()),
                "duck_calls_per_token": self.duck_calls_per_token, "filling": self.filling}


def plan_placement(shapes: list[FfnShape], topk: int, budget_bytes: int, histogram=None,
                   call_s: float = CALL_S, duck_gbps: float = DUCK_GBPS,
                   gpu_bytes_per_weight: float = GPU_BYTES_PER_WEIGHT, gpu_gbps: float | None = None) -> PlacementPlan:
    """The plan for a GPU budget (see the module docstring). With gpu_gbps (the GPU's effective read
    rate of its copies) the GPU's time counts too, and a placement that would cost more than it saves
    (a GPU that reads slower than the fleet) is not made: the plan holds less, or nothing."""
    by_layer = {s.layer: s for s in shapes}
    base = PlacementPlan(by_layer, topk, max(0, int(budget_bytes)), gpu_bytes_per_weight=gpu_bytes_per_weight)
    left = base.budget_bytes
    for s in shapes:                                   # 1. dense layers, in order, while they fit
        cost = s.expert_weights * gpu_bytes_per_weight
        if s.dense and cost <= left:
            base.gpu[s.layer], base.share[s.layer] = (0,), 1.0
            left -= cost
    moe = [s for s in shapes if not s.dense]
    none = PlacementPlan(by_layer, topk, base.budget_bytes, gpu_bytes_per_weight=gpu_bytes_per_weight)
    candidates = [none, base]
    if moe and left > 0:
        candidates += [_fill(base, moe, left, histogram, whole_first=True),
                       _fill(base, moe, left, histogram, whole_first=False)]
    if gpu_gbps is None:
        candidates = candidates[1:]   # without the GPU's rate, holding more never costs
    best = min(candidates, key=lambda p: p.seconds(call_s, duck_gbps, gpu_gbps))
    log.info("placement: %.2f GB on the GPU (%s), %.3f GB per token from the ducks in %d calls",
             best.gpu_bytes / 1e9, best.filling, best.duck_bytes_per_token / 1e9, best.duck_calls_per_token)
    return best


def _fill(base: PlacementPlan, moe: list[FfnShape], left: int, histogram, whole_first: bool) -> PlacementPlan:
    plan = PlacementPlan(base.shapes, base.topk, base.budget_bytes, dict(base.gpu), dict(base.share),
                         gpu_bytes_per_weight=base.gpu_bytes_per_weight)
    rest = list(moe)
    if whole_first:
        # whole layers from the last one down: a prefill streams the first layers' experts first
        # (engine.gpu.expert_stream), so the GPU's own copies spare the last copies of a pass
        for s in sorted(moe, key=lambda s: -s.layer):
            cost = s.experts * s.expert_weights * plan.gpu_bytes_per_weight
            if cost <= left:
                plan.gpu[s.layer], plan.share[s.layer] = tuple(range(s.experts)), 1.0
                left -= cost
                rest.remove(s)
    plan.filling = "whole" if len(rest) < len(moe) else "none"
    if rest and left > 0:
        picked = _spread(rest, left, histogram, plan.gpu_bytes_per_weight)
        for s in rest:
            ids = picked.get(s.layer, [])
            if ids:
                plan.gpu[s.layer] = tuple(sorted(ids))
                freq = histogram.frequencies(s.layer, s.experts) if histogram else None
                plan.share[s.layer] = (sum(freq[e] for e in ids) if freq is not None else len(ids) / s.experts)
        if picked:
            plan.filling = "whole+spread" if plan.filling == "whole" else "spread"
    return plan


def _spread(layers: list[FfnShape], left: int, histogram, per_weight: float) -> dict[int, list[int]]:
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
        cost = shapes[layer].expert_weights * per_weight
        if cost > left:
            break
        picked.setdefault(layer, []).append(e)
        left -= cost
    return picked
