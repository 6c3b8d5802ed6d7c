"""FFN backends: where the expert FFNs (routed experts and dense MLPs) run.

Every FFN of a model is seen as a list of experts (gate [I, H], up [I, H],
down [H, I]); a dense MLP is one expert with id 0 and weight 1. The router,
shared experts, attention and everything else stay in the model on the host.

    backend.load_layer(FfnLayer)                         once per FFN layer
    backend.finish_loading()                             once, after the last layer
    backend.forward(layer, x[T,H], ids[T,k], w[T,k])     -> y[T,H] = sum_e w_e * down_e(silu(gate_e x) * up_e x)

Backends: TorchFfn (the reference, in the model's dtype on its device),
Fp9Ffn (native fp9 kernels on this host: the math the ducks run) and
engine.fleet.FleetFfn (the ducks, through native.transport).
"""
from __future__ import annotations

import abc
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ExpertWeights:
    gate: torch.Tensor   # [I, H]
    up: torch.Tensor     # [I, H]
    down: torch.Tensor   # [H, I]

    def __post_init__(self):
        i, h = self.gate.shape
        if self.up.shape != (i, h) or self.down.shape != (h, i):
            raise ValueError(f"expert shapes do not agree: gate {tuple(self.gate.shape)}, "
                             f"up {tuple(self.up.shape)}, down {tuple(self.down.shape)}")


@dataclass(slots=True)
class FfnLayer:
    index: int                     # decoder layer index
    experts: list[ExpertWeights]   # a dense MLP has exactly one
    hidden: int

    def __post_init__(self):
        if not self.experts:
            raise ValueError(f"FFN layer {self.index} has no experts")
        for e in self.experts:
            if e.gate.shape[1] != self.hidden:
                raise ValueError(f"FFN layer {self.index}: expert hidden size {e.gate.shape[1]} != {self.hidden}")


class FfnBackend(abc.ABC):
    """One interface for every place the FFNs can run (see the module docstring)."""
    name = "abstract"

    @abc.abstractmethod
    def load_layer(self, layer: FfnLayer) -> None:
        """Takes one FFN layer's experts (packing or uploading them as the backend needs)."""

    def finish_loading(self) -> None:
        """Called once after every layer was loaded (the fleet uploads and opens its session here)."""

    @abc.abstractmethod
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] -> [T, H]: sum_e w_e * down_e(silu(gate_e x) * up_e x)."""

    def close(self) -> None:
        pass

    @property
    def frees_torch_weights(self) -> bool:
        """Whether the model's own expert tensors may be released once loaded."""
        return False


def innermost_backend(backend: FfnBackend) -> FfnBackend:
    """The backend that computes, behind any wrappers (LaneFfn, PinnedFfn, timing: anything with .backend)."""
    while hasattr(backend, "backend"):
        backend = backend.backend
    return backend


def torch_experts_forward(experts: list[ExpertWeights], x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """The reference: x [T, H], ids [T, k], weights [T, k] -> [T, H] in x's dtype.
    The routing is read to the host once (one sync), then each chosen expert runs on
    its tokens; a single token needs no gathers."""
    if len(experts) == 1:
        e = experts[0]
        y = F.linear(F.silu(F.linear(x, e.gate)) * F.linear(x, e.up), e.down)   # [T, H]
        return y * weights.sum(-1, keepdim=True).to(y.dtype)                   # ids are all 0
    t, k = ids.shape
    routing = torch.cat((ids.to(torch.float64), weights.to(torch.float64)), 1).tolist()   # [T, 2k], one sync
    if t == 1:
        out = None
        for e_id, w in zip(routing[0][:k], routing[0][k:]):
            e = experts[int(e_id)]
            y = F.linear(F.silu(F.linear(x, e.gate)) * F.linear(x, e.up), e.down) * w   # [1, H]
            out = y if out is None else out + y
        return out.to(x.dtype)
    chosen: dict[int, list[tuple[int, float]]] = {}
    for tok, row in enumerate(routing):
        for e_id, w in zip(row[:k], row[k:]):
            chosen.setdefault(int(e_id), []).append((tok, w))
    out = torch.zeros_like(x)
    for e_id in sorted(chosen):
        toks = torch.tensor([tok for tok, _ in chosen[e_id]], device=x.device)            # [n]
        ws = torch.tensor([w for _, w in chosen[e_id]], device=x.device, dtype=x.dtype)   # [n]
        e, xs = experts[e_id], x[toks]                                                    # [n, H]
        y = F.linear(F.silu(F.linear(xs, e.gate)) * F.linear(xs, e.up), e.down)           # [n, H]
        out.index_add_(0, toks, (y * ws[:, None]).to(out.dtype))
    return out


class TorchFfn(FfnBackend):
    """Reference backend: the model's own tensors, in its dtype, on its device; with
    device given, the experts live there and activations travel to it and back
    (device="cpu" under a GPU model: the naive torch CPU offload)."""
    name = "torch"

    def __init__(self, device: torch.device | str | None = None):
        self.layers: dict[int, list[ExpertWeights]] = {}
        self.device = torch.device(device) if device is not None else None

    def load_layer(self, layer: FfnLayer) -> None:
        experts = layer.experts
        if self.device is not None:
            experts = [ExpertWeights(e.gate.to(self.device), e.up.to(self.device), e.down.to(self.device))
                       for e in experts]
        self.layers[layer.index] = experts

    def forward(self, layer, x, ids, weights):
        dtype = self.layers[layer][0].gate.dtype
        if self.device is None or (x.device == self.device and x.dtype == dtype):
            return torch_experts_forward(self.layers[layer], x, ids, weights)
        y = torch_experts_forward(self.layers[layer], x.to(self.device, dtype), ids.to(self.device),
                                  weights.to(self.device, dtype))
        return y.to(x.device, x.dtype)


def _to_fp9(w: torch.Tensor, what: str):
    """Packs a weight to fp9; from its fp8 codes bit-exactly when it came from an fp8 checkpoint."""
    from native.fp9 import Fp9Tensor

    src = getattr(w, "fp8_source", None)
    if src is not None:
        ckpt, cname, sname = src
        return Fp9Tensor.from_fp8(ckpt.get(cname), ckpt.get(sname), name=cname)
    if w.dtype == torch.bfloat16:
        return Fp9Tensor.from_float(w.detach().cpu(), name=what)
    return Fp9Tensor.from_float(w.detach().float().cpu().numpy(), name=what)


def pack_expert_fp9(e: ExpertWeights, what: str):
    """One whole expert as an fp9 ExpertSlice (gate/up rows interleaved)."""
    from native.fp9 import Fp9Tensor, pack_gate_up
    from native.kernels import ExpertSlice

    if any(getattr(t, "fp8_source", None) is not None for t in (e.gate, e.up)):
        # fp8 blocks span 128 rows of gate and of up separately: decode bit-exact, then interleave
        g, u = _to_fp9(e.gate, what + ".gate").to_float(), _to_fp9(e.up, what + ".up").to_float()
        gate_up = Fp9Tensor.from_float(pack_gate_up(g, u), name=what + ".gate_up")
    else:
        gate_up = Fp9Tensor.from_float(pack_gate_up(e.gate.detach().float().cpu().numpy(),
                                                    e.up.detach().float().cpu().numpy()), name=what + ".gate_up")
    return ExpertSlice(gate_up, _to_fp9(e.down, what + ".down"))


class Fp9Ffn(FfnBackend):
    """Local fp9 backend: each layer's experts packed once, run by native.kernels
    on a worker pool of this host (the same slice forward a duck runs, tp=1)."""
    name = "fp9"

    def __init__(self, threads: int | None = None, kernel_set: str = "best"):
        from native.kernels import Pool, Workspace

        self.pool = Pool(threads or len(os.sched_getaffinity(0)), pin=False)
        self.ws = Workspace()
        self.kernel_set = kernel_set
        self.slices: dict[int, object] = {}

    @property
    def frees_torch_weights(self) -> bool:
        return True

    def load_layer(self, layer: FfnLayer) -> None:
        from native.kernels import MoeSlice

        experts = [pack_expert_fp9(e, f"layers.{layer.index}.experts.{i}") for i, e in enumerate(layer.experts)]
        self.slices[layer.index] = MoeSlice(experts, layer.hidden, name=f"layer {layer.index} FFN")

    def forward(self, layer, x, ids, weights):
        xs = x.detach()
        xs = xs.cpu() if xs.dtype == torch.bfloat16 else xs.float().cpu().numpy()
        y = self.slices[layer].forward(xs, ids.to(torch.int32).cpu().numpy(),
                                       weights.float().cpu().numpy(), self.pool, self.ws, self.kernel_set)
        return torch.from_numpy(y).to(device=x.device, dtype=x.dtype)

    @property
    def bytes_streamed(self) -> int:
        return sum(s.bytes_streamed for s in self.slices.values())


def install(model, backend: FfnBackend, release_weights: bool | None = None) -> FfnBackend:
    """Hands every FFN of model to backend. With release_weights (default: when the
    backend keeps its own copy) the model's expert tensors are freed afterwards."""
    release = backend.frees_torch_weights if release_weights is None else release_weights
    for module, layer in model.ffn_layers():
        backend.load_layer(layer)
        module.ffn = backend
        if release:
            for p in module.expert_parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    backend.finish_loading()
    log.info("FFN backend %s installed on %s", backend.name, type(model).__name__)
    return backend
