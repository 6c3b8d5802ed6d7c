"""A grouped GEMV straight from fp9 bytes on the GPU: the experts a placement keeps there
(engine.placement) stay in the ducks' fp9 (1.125 bytes a weight, against bf16's 2), laid as
engine.gpu.expert_stream lays a layer (per held expert, its tp slices' gate_up tensors, then
their down tensors, each in a slot of its own), and a decode step reads them once, decoding in
the kernel. No host sync, so it runs inside the decode step's CUDA graph.

    h = fp9_gate_up(lay, src, slots, x, k)     # [J, tp * gu_rows] fp32: pair j = (token j // k, slot)
    a = silu(h[:, 0::2]) * h[:, 1::2]          # [J, tp * slice_cols]
    y = fp9_down(lay, src, slots, a)           # [J, H] fp32, the tp slices' partials summed

slots [J] int32: a pair's expert as its position among the held ones; -1 reads nothing and gives
zeros (the ducks' pairs). One program per (pair, slice for gate_up, row pair), looping over the
row pair's blocks in groups of GB: the blocks of one row pair are consecutive in a panel (docs/fp9.md).
fp9_gemv_ref is the torch reference (decode, then matmul): the tests hold them together, on CUDA
and in Triton's interpreter.
"""
from __future__ import annotations

import torch

from engine.gpu.fp9_decode import GROUP, Placement, decode_fp9, fp9_header, fp9_values

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the reference runs
    triton = None

GB = 8   # blocks (of 64 columns) a program reads at a time


if triton is not None:
    @triton.jit
    def _fp9_gemv_kernel(src, slots, x, out, base, slot_bytes, tp, rows, cols, pairs, groups, x_div, x_stride,
                         out_stride, SUM_TP: tl.constexpr, GB: tl.constexpr):
        """out[j, d * rows + r] (gate_up: program_id(2) is the slice d) or out[j, r] summed over the tp
        slices (down, SUM_TP) = sum_c W_d[r, c] * x[j // x_div, (d * cols if SUM_TP) + c]."""
        j = tl.program_id(0)
        p = tl.program_id(1)
        e = tl.load(slots + j).to(tl.int64)
        held = e >= 0
        e = tl.maximum(e, 0)
        xrow = x + (j // x_div).to(tl.int64) * x_stride
        q = tl.arange(0, 128)
        r = q // 64
        c = q % 64
        acc = tl.zeros((GB, 128), dtype=tl.float32)
        n_tp = tp if SUM_TP else 1
        for i in range(0, n_tp):
            d = i if SUM_TP else tl.program_id(2)
            tensor, prescale, flags = fp9_header(src, base, e, tp, d, slot_bytes, held)
            xoff = d * cols if SUM_TP else 0
            for g0 in range(0, groups, GB):
                g = g0 + tl.arange(0, GB)
                gp = g - g % 32
                n = tl.minimum(groups - gp, 32)
                idx = (pairs * gp + p * n + (g - gp)).to(tl.int64)
                live = (g[:, None] < groups) & held
                at = 64 + idx[:, None] * 144
                mag = tl.load(tensor + at + 16 + q[None, :], mask=live, other=0).to(tl.int32)
                sign = tl.load((tensor + at + 8 * r[None, :]).to(tl.pointer_type(tl.int64)), mask=live, other=0)
                w = fp9_values(mag, sign, c[None, :], prescale)
                col = g[:, None] * 64 + c[None, :]
                ok = live & (col < cols)
                if flags & 1:
                    row = 2 * p + r[None, :]
                    ns = (cols + 127) // 128
                    scales = (tensor + 64 + pairs.to(tl.int64) * groups * 144).to(tl.pointer_type(tl.float32))
                    w = w * tl.load(scales + row * ns + col // 128, mask=ok & (row < rows), other=1.0)
                xv = tl.load(xrow + xoff + col, mask=ok, other=0.0).to(tl.float32)
                acc += w * xv
        s = tl.sum(acc, axis=0)                                                   # [128]: per (row, column)
        y0 = tl.sum(tl.where(r == 0, s, 0.0), axis=0)
        y1 = tl.sum(tl.where(r == 1, s, 0.0), axis=0)
        dst = out + j.to(tl.int64) * out_stride + (0 if SUM_TP else tl.program_id(2) * rows) + 2 * p
        tl.store(dst, y0)
        tl.store(dst + 1, y1, mask=2 * p + 1 < rows)


def _check(lay, src: torch.Tensor, slots: torch.Tensor) -> None:
    if src.dtype != torch.uint8 or src.dim() != 1 or slots.dtype != torch.int32 or slots.dim() != 1:
        raise ValueError(f"fp9 GEMV: src must be uint8 [bytes], slots int32 [J]; got {src.dtype} "
                         f"{tuple(src.shape)}, {slots.dtype} {tuple(slots.shape)}")
    if src.numel() < lay.gu_bytes + lay.held * lay.tp * lay.dn_slot:
        raise ValueError(f"fp9 GEMV: src holds {src.numel()} bytes, the layer's {lay.held} experts need "
                         f"{lay.gu_bytes + lay.held * lay.tp * lay.dn_slot}")


def kernel_runs(device: torch.device) -> bool:
    """Whether the Triton kernel runs here (CUDA, or the interpreter), else the reference."""
    return triton is not None and (device.type == "cuda" or INTERPRETED)


def fp9_gate_up(lay, src: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, x_div: int) -> torch.Tensor:
    """x [R, H], slots [J] (pair j reads x[j // x_div]) -> h [J, tp * gu_rows] fp32 (module docstring)."""
    _check(lay, src, slots)
    j = slots.numel()
    if not kernel_runs(src.device):
        return fp9_gemv_ref(lay, src, slots, x, x_div, down=False)
    out = torch.empty((j, lay.tp * lay.gu_rows), dtype=torch.float32, device=x.device)
    pairs, groups = (lay.gu_rows + 1) // 2, -(-lay.hidden // GROUP)
    _fp9_gemv_kernel[(j, pairs, lay.tp)](src, slots, x.contiguous(), out, 0, lay.gu_slot, lay.tp, lay.gu_rows,
                                         lay.hidden, pairs, groups, x_div, x.shape[1], out.shape[1],
                                         SUM_TP=False, GB=GB)
    return out


def fp9_down(lay, src: torch.Tensor, slots: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """a [J, tp * slice_cols], slots [J] -> y [J, H] fp32, the slices' partials summed (module docstring)."""
    _check(lay, src, slots)
    j = slots.numel()
    if not kernel_runs(src.device):
        return fp9_gemv_ref(lay, src, slots, a, 1, down=True)
    out = torch.empty((j, lay.hidden), dtype=torch.float32, device=a.device)
    pairs, groups = (lay.hidden + 1) // 2, -(-lay.slice_cols // GROUP)
    _fp9_gemv_kernel[(j, pairs, 1)](src, slots, a.contiguous(), out, lay.gu_bytes, lay.dn_slot, lay.tp, lay.hidden,
                                    lay.slice_cols, pairs, groups, 1, a.shape[1], out.shape[1], SUM_TP=True, GB=GB)
    return out


def fp9_gemv_ref(lay, src: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, x_div: int, down: bool) -> torch.Tensor:
    """The reference of fp9_gate_up (down=False) and fp9_down: each held expert decoded (bf16, exact), fp32 GEMVs."""
    tp, rows, h, s = lay.tp, lay.gu_rows, lay.hidden, lay.slice_cols
    n = lay.held
    if down:
        w = torch.empty(n, h, tp * s, dtype=torch.bfloat16, device=src.device)
        decode_fp9(src[lay.gu_bytes:], n * tp, lay.dn_slot, h, s, w,
                   Placement(per=tp, outer=h * tp * s, inner=s, row_stride=tp * s))
    else:
        w = torch.empty(n, tp * rows, h, dtype=torch.bfloat16, device=src.device)
        decode_fp9(src, n * tp, lay.gu_slot, rows, h, w, Placement(per=tp, outer=tp * rows * h, inner=rows * h,
                                                                   row_stride=h))
    ids = slots.long()
    out = torch.zeros(ids.numel(), w.shape[1], dtype=torch.float32, device=x.device)
    for j, e in enumerate(ids.tolist()):
        if e >= 0:
            out[j] = w[e].float() @ x[j // x_div].float()
    return out


INTERPRETED = triton is not None and type(_fp9_gemv_kernel).__name__ == "InterpretedFunction"
