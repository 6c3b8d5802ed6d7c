"""The FFN host contract: backends that compute on this host's CPU (the local fp9
kernels) or through it (the fleet) take one C call per layer on host buffers that
are already in the wire's types, and leave the summed result in the buffer the
model reads.

    io = FfnIO.allocate(tokens, hidden, topk, x_dtype)     # pinned when CUDA is present
    x, ids, weights, y = io.views(T, k)                    # a CUDA graph fills x, ids, weights (engine.gpu.graphs)
    backend.forward(layer, x, ids, weights, out=y)         # one C call, nothing converted

x is the model's dtype (bf16 on the GPU, fp32 on the CPU), ids int32, weights fp32,
y the model's dtype: the partials travel in it and are summed in fp32 (docs/wire.md).
A call with tensors of other types or on the GPU (prefill, an eager step) goes
through an FfnIO of the calling thread: one conversion each way.
"""
from __future__ import annotations

import abc
import logging
import os
import threading
from dataclasses import dataclass

import torch

from engine.ffn import ExpertWeights, FfnBackend, FfnLayer

log = logging.getLogger(__name__)

WIRE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class FfnIO:
    """Host buffers for FFN calls of up to `tokens` tokens, in the wire's types."""
    x: torch.Tensor        # [tokens, hidden], fp32 or bf16
    ids: torch.Tensor      # [tokens * topk] int32: a call of t tokens with k <= topk experts uses the first t*k
    weights: torch.Tensor  # [tokens * topk] fp32, likewise
    y: torch.Tensor        # [tokens, hidden], fp32 or bf16

    @classmethod
    def allocate(cls, tokens: int, hidden: int, topk: int, x_dtype: torch.dtype,
                 y_dtype: torch.dtype | None = None, pinned: bool | None = None) -> "FfnIO":
        if x_dtype not in WIRE_DTYPES or (y_dtype or x_dtype) not in WIRE_DTYPES:
            raise ValueError(f"FFN activations travel as float32 or bfloat16, not {x_dtype} / {y_dtype}")
        pin = torch.cuda.is_available() if pinned is None else pinned
        empty = lambda *shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin)  # noqa: E731
        return cls(empty(tokens, hidden, dtype=x_dtype), empty(tokens * topk, dtype=torch.int32),
                   empty(tokens * topk, dtype=torch.float32), empty(tokens, hidden, dtype=y_dtype or x_dtype))

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def topk(self) -> int:
        return self.ids.shape[0] // self.tokens

    def views(self, t: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [t, H], ids [t, k], weights [t, k], y [t, H] for a call of t tokens with k experts each
        (contiguous views of the buffers)."""
        if t > self.tokens or k > self.topk:
            raise ValueError(f"an FFN call of {t} tokens x {k} experts does not fit buffers for "
                             f"{self.tokens} x {self.topk}")
        return self.x[:t], self.ids[:t * k].view(t, k), self.weights[:t * k].view(t, k), self.y[:t]


def is_wire_call(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether a call's tensors are host tensors in the wire's types, ready for the C call as they are."""
    return (out is not None and x.device.type == "cpu" and out.device.type == "cpu" and x.dtype in WIRE_DTYPES
            and out.dtype in WIRE_DTYPES and ids.dtype == torch.int32 and weights.dtype == torch.float32
            and x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous() and out.is_contiguous())


class HostFfn(FfnBackend):
    """A backend whose layers run through one C call on host buffers (see the module
    docstring). Subclasses implement run(); forward() stages any other call."""

    def __init__(self):
        self._local = threading.local()

    @property
    def host_io(self) -> bool:
        return True

    @property
    def frees_torch_weights(self) -> bool:
        return True

    @abc.abstractmethod
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
        """The C call: host tensors in the wire's types (contiguous), out [T, H] receives the sum."""

    def forward(self, layer, x, ids, weights, out=None):
        if is_wire_call(x, ids, weights, out):
            self.run(layer, x, ids, weights, out)
            return out
        t, k = ids.shape
        wire_dtype = x.dtype if x.dtype in WIRE_DTYPES else torch.float32
        io = self._staging(t, x.shape[1], k, wire_dtype)
        xh, ih, wh, yh = io.views(t, k)
        stream = torch.cuda.current_stream(x.device) if x.device.type == "cuda" else None
        xh.copy_(x, non_blocking=stream is not None)
        ih.copy_(ids, non_blocking=stream is not None)
        wh.copy_(weights, non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()   # the copies (and any earlier copy out of yh) are done
        self.run(layer, xh, ih, wh, yh)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return out.copy_(yh, non_blocking=stream is not None)

    def _staging(self, t: int, hidden: int, k: int, dtype: torch.dtype) -> FfnIO:
        """This thread's buffers for a call of t tokens x k experts (grown as needed)."""
        key = (hidden, dtype)
        io = getattr(self._local, "io", {}).get(key)
        if io is None or io.tokens < t or io.topk < k:
            tokens, topk = max(t, 2 * io.tokens if io else 1), max(k, io.topk if io else 1)
            io = FfnIO.allocate(tokens, hidden, topk, dtype)
            self._local.__dict__.setdefault("io", {})[key] = io
        return io


# -- the local fp9 backend ------------------------------------------------------------------

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


class Fp9Ffn(HostFfn):
    """Local fp9 backend: each layer's experts packed once, run by native.kernels
    on a worker pool of this host (the same slice forward a duck runs, tp=1)."""
    name = "fp9"

    def __init__(self, threads: int | None = None, kernel_set: str = "best"):
        from native.kernels import Pool, Workspace

        super().__init__()
        self.pool = Pool(threads or len(os.sched_getaffinity(0)), pin=False)
        self.ws = Workspace()
        self.kernel_set = kernel_set
        self.slices: dict[int, object] = {}

    def load_layer(self, layer: FfnLayer) -> None:
        from native.kernels import MoeSlice

        experts = [pack_expert_fp9(e, f"layers.{layer.index}.experts.{i}") for i, e in enumerate(layer.experts)]
        self.slices[layer.index] = MoeSlice(experts, layer.hidden, name=f"layer {layer.index} FFN")

    def run(self, layer, x, ids, weights, out):
        self.slices[layer].forward(x, ids, weights, self.pool, self.ws, self.kernel_set, out=out)

    @property
    def bytes_streamed(self) -> int:
        return sum(s.bytes_streamed for s in self.slices.values())
