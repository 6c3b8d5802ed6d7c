"""Where each expert FFN is computed: the GPU keeps what saves a token most (dense FFN layers,
then whole MoE layers or their most chosen experts) within a memory budget; the ducks compute
the rest. The ducks keep every slice whatever the plan (nothing is uploaded again when it
changes, and a lost duck's cover is untouched): the plan decides who computes.

    resident = place(model, fleet_ffn, budget_bytes)      # plan (engine.placement_plan), copies, split
    place(model, fleet_ffn, other_budget, histogram)      # again, between two steps

A layer the GPU holds whole never reaches the ducks: its FFN is computed inline (inside the
decode step's CUDA graph: no cut, no duck call, no transport round trip). A layer held in part
sends the routing with the GPU's experts masked out (-1, which a duck skips: it reads nothing of
them) and adds the GPU's share to the ducks' sum. The GPU's copies are the ducks' own fp9
weights: kept as fp9 bytes and read by a fused GEMV (engine.gpu.fp9_gemv) where the budget cannot
hold every FFN decoded, decoded to the model's dtype where it can (the faster read). Either way
the greedy output is the same whatever the budget, up to the order of the sums.

The plan (engine.placement_plan.plan_placement): dense layers first, then whole MoE layers or a
spread of the most chosen experts (RoutingHistogram, counted on the device while serving), or
nothing, whichever its cost model finds fastest: the ducks' calls and bytes, and on a GPU its own
bytes at its read rate (the share runs before or after the ducks', not beside them).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.placement_plan import (CALL_S, DUCK_BYTES_PER_WEIGHT, DUCK_GBPS, GPU_BYTES_PER_WEIGHT,  # noqa: F401
                                   FfnShape, PlacementPlan, plan_placement)

log = logging.getLogger(__name__)


def model_ffn_shapes(model, main_only: bool = True) -> list[FfnShape]:
    """The FFN layers the backends run; main_only: of the main model (an MTP layer's FFN runs only
    when drafting: not placed)."""
    out = []
    for m in model.ffn_modules():
        if main_only and m.layer_idx >= model.config.num_hidden_layers:
            continue
        if hasattr(m, "experts"):
            out.append(FfnShape(m.layer_idx, len(m.experts), m.hidden_size, m.experts[0].gate_proj.out_features))
        else:
            out.append(FfnShape(m.layer_idx, 1, m.gate_proj.in_features, m.gate_proj.out_features))
    return out


class RoutingHistogram:
    """How often each expert of each MoE layer was chosen. attach() makes the model's routed FFN modules
    count every call on the model's device (an index_add: no host sync, so the decode graphs count too);
    frequencies() reads a layer's counts (one sync)."""

    def __init__(self):
        self.counts: dict[int, torch.Tensor] = {}

    def attach(self, model) -> "RoutingHistogram":
        """Counts kept on the model's device for each of its routed layers, fed by every FFN call
        (RoutedExperts.routed); before the decode graphs are captured, so that they count too."""
        device = model.model.embed_tokens.weight.device
        for m in model.ffn_modules():
            if hasattr(m, "experts") and m.layer_idx < model.config.num_hidden_layers:
                self.counts.setdefault(m.layer_idx, torch.zeros(len(m.experts), dtype=torch.int64, device=device))
                m.histogram = self
        return self

    def count(self, layer: int, ids: torch.Tensor) -> None:
        """A call's routing [T, k] into the layer's counts, on their device."""
        c = self.counts[layer]
        flat = ids.reshape(-1).long()
        c.index_add_(0, flat, torch.ones_like(flat))

    def frequencies(self, layer: int, experts: int) -> list[float] | None:
        """Each expert's share of the layer's choices (None before any)."""
        c = self.counts.get(layer)
        if c is None:
            return None
        c = c.cpu()
        total = int(c.sum())
        return None if total == 0 else (c.double() / total).tolist()

    @property
    def choices(self) -> int:
        """Choices counted, all layers (one sync)."""
        return int(sum(int(c.sum()) for c in self.counts.values()))


# -- the GPU's share --------------------------------------------------------------------------------
@dataclass
class _Held:
    experts: int                # the layer's experts
    ids: tuple[int, ...]        # the ones held here, in slot order
    slot: torch.Tensor          # [experts] int32: an expert's slot here, -1 where the ducks compute it
    gate_up: torch.Tensor | None = None   # decoded copies: [n, 2I, H], gate row i at 2i, up at 2i + 1
    down: torch.Tensor | None = None      # [n, H, I]
    fp9: tuple | None = None              # or the ducks' fp9 bytes: (fp9_layout.Layer, uint8 device buffer)

    @property
    def whole(self) -> bool:
        return len(self.ids) == self.experts

    @property
    def nbytes(self) -> int:
        return self.fp9[1].numel() if self.fp9 else self.gate_up.nbytes + self.down.nbytes


def keeps_fp9(device) -> bool:
    """Whether a placement on device keeps the ducks' fp9 bytes (read by engine.gpu.fp9_gemv's kernel:
    CUDA) rather than decoded copies (the CPU, where the torch path computes)."""
    from engine.gpu.fp9_gemv import kernel_runs
    return torch.device(device).type == "cuda" and kernel_runs(torch.device(device))


def bytes_per_weight(device, dtype: torch.dtype) -> float:
    """What one weight of a placement costs device's memory."""
    return GPU_BYTES_PER_WEIGHT if keeps_fp9(device) else dtype.itemsize


class ResidentExperts:
    """The experts a plan keeps on the model's device, and each FFN call's split (module docstring)."""

    def __init__(self, plan: PlacementPlan, device, dtype: torch.dtype):
        self.plan, self.device, self.dtype = plan, torch.device(device), dtype
        self.layers: dict[int, _Held] = {}

    @classmethod
    def from_slices(cls, plan: PlacementPlan, slices: dict, device, dtype: torch.dtype,
                    on_progress=None, threads: int = 1, fp9: bool | None = None) -> "ResidentExperts":
        """The plan's experts from the ducks' fp9 slices (FleetFfn.layers) on device: their bytes as they
        are (fp9: default on CUDA), or decoded to dtype."""
        from concurrent.futures import ThreadPoolExecutor

        from engine.gpu.expert_stream import decode_experts, held_experts
        from engine.gpu.fp9_moe import check_fused

        self = cls(plan, device, dtype)
        check_fused(self.device)      # the grouped GEMMs of steps of many pairs, before any capture
        fp9 = keeps_fp9(self.device) if fp9 is None else fp9
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="placement") as workers:
            for done, (layer, ids) in enumerate(sorted(plan.gpu.items()), 1):
                if fp9:
                    self.add(layer, ids, plan.shapes[layer].experts,
                             fp9=held_experts(slices[layer], list(ids), self.device, workers))
                else:
                    gu, dn = decode_experts(slices[layer], list(ids), self.device, threads)
                    self.add(layer, ids, plan.shapes[layer].experts, gu.to(dtype), dn.to(dtype))
                if on_progress:
                    on_progress(done, len(plan.gpu))
        log.info("placement: %d layers' experts on %s in %s (%.2f GB; %d whole)", len(self.layers), self.device,
                 "fp9" if fp9 else str(dtype).removeprefix("torch."), self.nbytes / 1e9,
                 sum(h.whole for h in self.layers.values()))
        return self

    def add(self, layer: int, ids, experts: int, gate_up: torch.Tensor | None = None,
            down: torch.Tensor | None = None, fp9: tuple | None = None) -> None:
        """A layer's held experts: decoded (gate_up [n, 2I, H] interleaved, down [n, H, I]) or fp9 bytes."""
        slot = torch.full((experts,), -1, dtype=torch.int32)
        slot[list(ids)] = torch.arange(len(ids), dtype=torch.int32)
        where = fp9[1].device if fp9 else gate_up.device
        self.layers[layer] = _Held(experts, tuple(ids), slot.to(where), gate_up, down, fp9)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.layers.values())

    def whole(self, layer: int) -> bool:
        held = self.layers.get(layer)
        return held is not None and held.whole

    def call(self, backend, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The FFN of one call: the GPU's experts here, the others through ffn_call (the ducks)."""
        from engine.ffn import ffn_call

        held = self.layers[layer]
        if held.whole:
            return self._compute(held, x, ids, weights).to(x.dtype)
        slots = held.slot[ids.long()]                                          # [T, k], -1: the ducks'
        duck_ids = torch.where(slots >= 0, torch.full_like(ids, -1), ids).to(torch.int32)
        y = ffn_call(backend, layer, x, duck_ids, weights)
        return (y.float() + self._compute(held, x, slots, weights)).to(x.dtype)

    @staticmethod
    def _compute(held: _Held, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], slots / weights [T, k] (slot -1: not this share) -> [T, H] fp32."""
        from engine.gpu.moe import MAX_PAIRS

        t, k = slots.shape
        capturing = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if held.fp9 is not None:
            return _fp9_share(held, x, slots, weights, capturing)
        gate_up, down = held.gate_up, held.down
        dtype = gate_up.dtype
        if held.experts == 1:                      # a dense FFN: every token, weight 1 (the router's are ones)
            h = F.linear(x.to(dtype), gate_up[0])                                # [T, 2I]
            a = F.silu(h[:, 0::2]) * h[:, 1::2]
            return F.linear(a, down[0]).float() * weights.float().sum(-1, keepdim=True)
        from engine.gpu.fp9_moe import copies_moe_forward, fused_ready
        fused = fused_ready(x.device)
        if (t * k <= MAX_PAIRS or (capturing and not fused)) and x.device.type == "cuda":
            from engine.gpu.moe import grouped_gemv
            h = grouped_gemv(x.to(dtype), slots.to(torch.int32), gate_up, k)   # [T*k, 2I] fp32
            a = (F.silu(h[:, 0::2]) * h[:, 1::2]).to(dtype)
            y = grouped_gemv(a, slots.to(torch.int32), down, 1)                # [T*k, H] fp32
            return (y.view(t, k, -1) * weights.float()[:, :, None]).sum(1)
        if fused and capturing:   # no host sync; outside a capture torch's grouped GEMMs were as fast or faster
            return copies_moe_forward(gate_up, down, x, slots, weights)
        return _grouped_share(gate_up, down, x.to(dtype), slots, weights)


def _fp9_share(held: _Held, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, capturing: bool) -> torch.Tensor:
    """The share of experts held in fp9: a decode step's few pairs through the fused GEMV, more through
    the grouped GEMMs from fp9 (both without a host sync: inside the graphs), a long prefill's through
    groups decoded to bf16 and torch's grouped GEMMs (engine.gpu.fp9_moe.held_experts_forward)."""
    from engine.gpu.fp9_moe import fused_ready, held_experts_forward
    from engine.gpu.fp9_gemv import fp9_down, fp9_gate_up, kernel_runs
    from engine.gpu.moe import MAX_PAIRS

    lay, src = held.fp9
    t, k = slots.shape
    if held.experts == 1:
        slots = torch.zeros_like(slots)          # a dense FFN: every token its one expert
    gemv = t * k <= MAX_PAIRS or (capturing and not fused_ready(x.device))   # a capture takes no host sync
    if not gemv or not kernel_runs(x.device):
        return held_experts_forward(lay, src, lay.held, x, slots, weights, capturing=capturing)
    flat = slots.reshape(-1).to(torch.int32)
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    h = fp9_gate_up(lay, src, flat, x.to(dtype), k)                              # [T*k, tp*gu_rows] fp32
    a = (F.silu(h[:, 0::2]) * h[:, 1::2]).to(dtype)
    y = fp9_down(lay, src, flat, a)                                              # [T*k, H] fp32
    return (y.view(t, k, -1) * weights.float()[:, :, None]).sum(1)


def _grouped_share(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """The reference (and prefill) path on decoded copies: pairs sorted by slot, one grouped GEMM per
    weight (one host sync)."""
    from engine.gpu.fp9_moe import grouped_ffn, route_pairs

    y = torch.zeros(slots.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    tokens, w, counts = route_pairs(slots, weights, gate_up.shape[0])
    if tokens.numel():
        y.index_add_(0, tokens, grouped_ffn(x[tokens], gate_up, down, counts).float() * w[:, None])
    return y


MARGIN_BYTES = 4 << 30      # GPU memory a default budget leaves free (activations, graphs' pools, a new cache)
MARGIN_FRACTION = 0.10


def default_budget(device) -> int:
    """What a placement takes when not told: the GPU memory free now, less a margin; 0 off CUDA
    (a CPU host computes nothing of the ducks' share)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(free - MARGIN_BYTES - MARGIN_FRACTION * total))


def auto_budget(model, fleet_ffn, streamed: bool) -> int:
    """The budget "auto" means: what is free on the model's GPU (default_budget) and what its placement
    holds now, less, where long prompts stream their experts to the GPU, the stream's two buffers (the
    largest layer's experts each)."""
    device = model.lm_head.weight.device
    held = model.__dict__.get("resident")
    auto = default_budget(device) + (held.nbytes if held is not None else 0)
    if auto and streamed:
        layer = max(sum(t.nbytes for duck in slices for e in duck for t in (e.gate_up, e.down))
                    for slices in fleet_ffn.layers.values())
        auto = max(0, auto - 2 * layer)
    return auto


FP9_GEMV_GBPS = 400.0     # the fused fp9 GEMV's read rate on a decode step (H200: 210-587 GB/s measured)
COPY_GEMV_GBPS = 1000.0   # the grouped GEMV's on decoded bf16 copies (H200: 523-3000 GB/s)


def place(model, fleet_ffn, budget_bytes: int, histogram: RoutingHistogram | None = None,
          on_progress=None, threads: int = 1, duck_gbps: float = DUCK_GBPS, call_s: float = CALL_S,
          gpu_gbps: float | None = None) -> ResidentExperts | None:
    """Plans the model's FFNs for a GPU budget and makes the model compute the GPU's share; None
    when the budget holds nothing, or nothing that pays (every FFN is then the ducks' again).
    duck_gbps / call_s: the fleet's read rate and a duck call's fixed cost (the plan's cost model);
    gpu_gbps: the GPU's read rate of its copies (default on CUDA: FP9_GEMV_GBPS or COPY_GEMV_GBPS;
    elsewhere none: the host's own share is not weighed)."""
    config = model.config
    weight = model.model.embed_tokens.weight
    dtype = weight.dtype if weight.dtype in (torch.float32, torch.bfloat16) else torch.bfloat16
    shapes = model_ffn_shapes(model)
    decoded = dtype.itemsize
    # fp9 where the budget cannot hold every FFN decoded (it holds 1.78x more experts than bf16, at a slower
    # GEMV: engine.gpu.fp9_gemv); decoded copies, the fastest to read, where it can
    fp9 = keeps_fp9(weight.device) and budget_bytes < sum(s.experts * s.expert_weights for s in shapes) * decoded
    if gpu_gbps is None and weight.device.type == "cuda":
        gpu_gbps = FP9_GEMV_GBPS if fp9 else COPY_GEMV_GBPS
    plan = plan_placement(shapes, max(1, config.num_experts_per_tok or 1), budget_bytes, histogram, call_s=call_s,
                          duck_gbps=duck_gbps, gpu_bytes_per_weight=GPU_BYTES_PER_WEIGHT if fp9 else decoded,
                          gpu_gbps=gpu_gbps)
    if not plan.gpu:
        model.set_resident(None)
        return None
    model.set_resident(None)     # the old plan's copies go before the new ones are made
    resident = ResidentExperts.from_slices(plan, fleet_ffn.layers, weight.device, dtype, on_progress, threads,
                                           fp9=fp9)
    model.set_resident(resident)
    return resident
