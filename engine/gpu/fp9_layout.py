"""The ducks' fp9 slices of one layer's experts laid in one byte buffer (the host's pinned copy
of engine.gpu.expert_stream, a placement's fp9 bytes on the GPU):

    [gate_up of expert 0, slice 0 .. tp-1][expert 1 ...] ... [down of expert 0, slice 0 ..] ...

each tensor in a slot of its own size (rounded to 64 bytes), so the first g experts are two
ranges of bytes. decode_range decodes experts of such a buffer to bf16 (engine.gpu.fp9_decode).
"""
from __future__ import annotations

import torch

from engine.gpu.fp9_decode import Placement, decode_fp9

SLOT_ALIGN = 64


def slot_size(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def nbytes_of(t) -> int:
    return int(t.nbytes)


def layer_slots(per_duck) -> tuple[int, int]:
    """(gate_up slot, down slot) of a layer: its largest tensor of each kind, rounded to SLOT_ALIGN."""
    tensors = [e for duck in per_duck for e in duck]
    return slot_size(max(nbytes_of(e.gate_up) for e in tensors)), slot_size(max(nbytes_of(e.down) for e in tensors))


class Layer:
    """One layer's experts in host memory: shapes, slot sizes and the pinned bytes."""

    def __init__(self, index: int, per_duck, max_experts: int | None, pin: bool, workers,
                 which: list[int] | None = None):
        """Experts [0, max_experts) of the layer (None: all), or the experts `which` in that order."""
        tp, experts = len(per_duck), len(per_duck[0])
        self.index, self.tp, self.experts = index, tp, experts
        first = per_duck[0][0]
        (self.gu_rows, self.hidden), (_, self.slice_cols) = first.gate_up.shape, first.down.shape
        for d in range(tp):
            for e in range(experts):
                s = per_duck[d][e]
                if s.gate_up.shape != first.gate_up.shape or s.down.shape != first.down.shape:
                    raise ValueError(f"layer {index}: expert {e} slice {d} is {s.gate_up.shape} / {s.down.shape}, "
                                     f"expert 0 slice 0 {first.gate_up.shape} / {first.down.shape}: the GPU stream "
                                     "needs slices of one shape")
        self.gu_slot, self.dn_slot = layer_slots(per_duck)
        if which is None:
            which = list(range(experts if max_experts is None else max(0, min(experts, max_experts))))
        self.held = len(which)
        self.gu_bytes = self.held * tp * self.gu_slot
        # every byte a decode reads is written below (a slot's tail past its tensor is never read)
        self.host = torch.empty(self.gu_bytes + self.held * tp * self.dn_slot, dtype=torch.uint8, pin_memory=pin)
        jobs = [(per_duck[d][e].gate_up, (p * tp + d) * self.gu_slot) for p, e in enumerate(which) for d in range(tp)]
        jobs += [(per_duck[d][e].down, self.gu_bytes + (p * tp + d) * self.dn_slot)
                 for p, e in enumerate(which) for d in range(tp)]
        list(workers.map(lambda job: self._put(*job), jobs))     # tensor by tensor: the C releases the GIL

    def _put(self, tensor, at: int) -> None:
        """The serialized tensor's bytes into the host buffer (a synthetic one generated there)."""
        import numpy as np

        from native._native import ffi, lib
        from native.fp9 import Fp9Error, SynthTensor
        dst = self.host[at:at + tensor.nbytes]
        if isinstance(tensor, SynthTensor):
            rc = lib.fp9_synth_generate(tensor.desc, ffi.cast("void *", dst.data_ptr()), tensor.nbytes, ffi.NULL)
            if rc != 0:
                raise Fp9Error(f"synthetic tensor {tensor.name!r}: generation failed ({rc})")
        else:
            dst.copy_(torch.from_numpy(np.asarray(tensor.buf[:tensor.nbytes])))

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert crosses PCIe with (all its slices)."""
        return self.tp * (self.gu_slot + self.dn_slot)

    @property
    def intermediate(self) -> int:
        return self.tp * self.slice_cols


def decode_range(lay: "Layer", src: torch.Tensor, g: int, e0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [e0, e0 + n) of the g fetched (gate_up slices of all g, then their down slices)
        as bf16 [n, 2I, H] and [n, H, I]: the tp slices of an expert side by side."""
        tp, rows, h, s = lay.tp, lay.gu_rows, lay.hidden, lay.slice_cols
        gu = torch.empty(n, tp * rows, h, dtype=torch.bfloat16, device=src.device)
        dn = torch.empty(n, h, tp * s, dtype=torch.bfloat16, device=src.device)
        decode_fp9(src[e0 * tp * lay.gu_slot:], n * tp, lay.gu_slot, rows, h, gu,
                   Placement(per=tp, outer=tp * rows * h, inner=rows * h, row_stride=h))
        down_at = g * tp * lay.gu_slot + e0 * tp * lay.dn_slot
        decode_fp9(src[down_at:], n * tp, lay.dn_slot, h, s, dn,
                   Placement(per=tp, outer=h * tp * s, inner=s, row_stride=tp * s))
        return gu, dn

