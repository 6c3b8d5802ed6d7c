"""FFN backends: where the expert FFNs (routed experts and dense MLPs) run.

Every FFN of a model is seen as a list of experts (gate [I, H], up [I, H],
down [H, I]); a dense MLP is one expert with id 0 and weight 1. The router,
shared experts, attention and everything else stay in the model on the host.

    backend.load_layer(FfnLayer)                         once per FFN layer
    backend.finish_loading()                             once, after the last layer
    backend.forward(layer, x[T,H], ids[T,k], w[T,k])     -> y[T,H] = sum_e w_e * down_e(silu(gate_e x) * up_e x)

an id of -1 names no expert (its pair adds nothing): how a split (engine.placement,
engine.gpu.hybrid_prefill) keeps the experts another device computes out of a call.

ids are int32 and w fp32 (the wire's types: the routers make them so). The model's
FFN modules call ffn_call(backend, ...), which hands the call to the lane running
on this thread if there is one (engine.lanes: a step cut at its FFN calls), else to
the backend. No wrappers stack in front of a backend.

Backends: TorchFfn (the reference, in the model's dtype on its device), and the
host backends of engine.host_ffn (one C call per layer on host buffers in the
wire's types): Fp9Ffn (native fp9 kernels on this host: the math the ducks run)
and engine.fleet_ffn.FleetFfn (the ducks, through native.transport).
"""
from __future__ import annotations

import abc
import logging
import threading
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


@dataclass(slots=True)
class FfnRequest:
    """One FFN call of a step: what a lane hands out at each FFN call and takes the result of."""
    layer: int
    x: torch.Tensor                  # [T, H]
    ids: torch.Tensor                # [T, k] int32
    weights: torch.Tensor            # [T, k] fp32
    out: torch.Tensor | None = None  # [T, H]: where the result goes (a lane's pinned buffer), or None


class FfnBackend(abc.ABC):
    """One interface for every place the FFNs can run (see the module docstring)."""
    name = "abstract"

    @abc.abstractmethod
    def load_layer(self, layer: FfnLayer) -> None:
        """Takes one FFN layer's experts (packing or uploading them as the backend needs)."""

    def finish_loading(self) -> None:
        """Called once after every layer was loaded (the fleet uploads and opens its session here)."""

    @abc.abstractmethod
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] -> [T, H]: sum_e w_e * down_e(silu(gate_e x) * up_e x),
        written into out when given (and returned)."""

    @property
    def host_io(self) -> bool:
        """Whether the backend computes on this host's CPU (or through it, the fleet), so a
        model on the GPU hands it host copies of x / ids / weights (pinned, in the wire's types)."""
        return False

    @property
    def overlaps_host(self) -> bool:
        """Whether a call leaves this host's CPU and GPU free while it runs (the ducks compute it),
        so that a prefill of several chunks overlaps one chunk's host work with another's FFN
        calls (engine.prefill.prefill_hidden_overlapped)."""
        return False

    @property
    def captures_in_graph(self) -> bool:
        """Whether the backend runs on the model's GPU without host syncs, so its calls stay
        inside a CUDA graph of the decode step (engine.gpu.graphs)."""
        return False

    @property
    def kernel_us_total(self) -> float:
        """Kernel microseconds summed over every call so far (the fleet: the slowest duck's); 0 if unknown."""
        return 0.0

    @property
    def bytes_streamed(self) -> int:
        """fp9 bytes read by the kernels so far (0 for backends that do not count them)."""
        return 0

    def close(self) -> None:
        pass

    @property
    def frees_torch_weights(self) -> bool:
        """Whether the model's own expert tensors may be released once loaded."""
        return False


class _LaneHook(threading.local):
    lane = None   # the lane whose step runs on this thread (engine.lanes), or None


_hook = _LaneHook()


def ffn_call(backend: FfnBackend, layer: int, x: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
    """What a model's FFN module calls: the lane running on this thread takes the call
    (it becomes that lane's FFN request), otherwise the backend computes it."""
    lane = _hook.lane
    if lane is not None:
        return lane._ffn_call(FfnRequest(layer, x, ids, weights))
    return backend.forward(layer, x, ids, weights)


def set_lane(lane):
    """Makes lane take this thread's FFN calls (None: back to the backends); returns the previous one."""
    before, _hook.lane = _hook.lane, lane
    return before


def torch_experts_forward(experts: list[ExpertWeights], x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
    """The reference: x [T, H], ids [T, k] (-1: no expert, as a duck skips it), weights [T, k] -> [T, H]
    in x's dtype.
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
            if e_id < 0:
                continue
            e = experts[int(e_id)]
            y = F.linear(F.silu(F.linear(x, e.gate)) * F.linear(x, e.up), e.down) * w   # [1, H]
            out = y if out is None else out + y
        return (out if out is not None else torch.zeros_like(x)).to(x.dtype)
    chosen: dict[int, list[tuple[int, float]]] = {}
    for tok, row in enumerate(routing):
        for e_id, w in zip(row[:k], row[k:]):
            if e_id >= 0:
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

    @property
    def host_io(self) -> bool:
        return self.device is not None and self.device.type == "cpu"

    def forward(self, layer, x, ids, weights, out=None):
        # the routing weights arrive in the wire's fp32; like the model's own block (transformers)
        # they are taken in the experts' dtype, on host buffers and device tensors alike
        dtype = self.layers[layer][0].gate.dtype
        if self.device is None or (x.device == self.device and x.dtype == dtype):
            y = torch_experts_forward(self.layers[layer], x, ids, weights.to(dtype))
        else:
            y = torch_experts_forward(self.layers[layer], x.to(self.device, dtype), ids.to(self.device),
                                      weights.to(self.device, dtype)).to(x.device, x.dtype)
        return y if out is None else out.copy_(y)


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
