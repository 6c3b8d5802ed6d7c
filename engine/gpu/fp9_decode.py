"""fp9 tensors decoded on the GPU: many serialized fp9 matrices of one shape (docs/fp9.md:
a 64-byte header, row-pair blocks in panels of 32 groups, optional block scales), laid side
by side in one byte buffer, become bf16 matrices where the caller says, in one kernel launch.
A streamed prefill (engine.gpu.expert_stream) copies the ducks' own fp9 slices over PCIe and
decodes them here, so the GPU computes with the very weights the ducks hold.

The decode is exact: every e5m3 magnitude times a power-of-two prescale is a bf16 value (3
mantissa bits of 7), unless it leaves bf16's range; a block scale that is no power of two is
applied in fp32 and rounded once to bf16.

    decode_fp9(src, count, stride, rows, cols, out, place)

src: uint8 [count * stride] on the device, tensor t at byte t * stride; tensor t's element
[r, c] goes to out.view(-1)[place(t) + r * row_stride + c], place(t) = (t // per) * outer +
(t % per) * inner: the tp slices of an expert side by side (engine.gpu.expert_stream).

decode_fp9_ref is the torch reference (any device: the tests, and a CPU "GPU" share); the
Triton kernel runs on CUDA or, with TRITON_INTERPRET=1, in Triton's interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the reference runs
    triton = None

HEADER = 64
BLOCK = 144            # 2 sign words, 2 x 64 magnitude bytes
GROUP = 64             # columns of a block
PANEL = 32             # groups of a panel
SCALE_COLS = 128       # columns of a block scale
FLAG_BLOCK_SCALES = 1
GROUPS_PER_PROGRAM = 4


@dataclass(frozen=True, slots=True)
class Placement:
    """Where tensor t's [rows, cols] goes in out (flat): (t // per) * outer + (t % per) * inner
    + r * row_stride + c."""
    per: int
    outer: int
    inner: int
    row_stride: int

    def base(self, t: int) -> int:
        return (t // self.per) * self.outer + (t % self.per) * self.inner


def tensor_bytes(rows: int, cols: int, block_scales: bool = False) -> int:
    """Bytes of one serialized fp9 tensor (fp9_tensor_bytes)."""
    pairs, groups = (rows + 1) // 2, -(-cols // GROUP)
    scales = 2 * pairs * -(-cols // SCALE_COLS) * 4 if block_scales else 0
    return HEADER + pairs * groups * BLOCK + scales


def _block_index(p: torch.Tensor, g: torch.Tensor, pairs: int, groups: int) -> torch.Tensor:
    g0 = g - g % PANEL
    n = torch.clamp(groups - g0, max=PANEL)
    return pairs * g0 + p * n + (g - g0)


def decode_fp9_ref(src: torch.Tensor, count: int, stride: int, rows: int, cols: int, out: torch.Tensor,
                   place: Placement) -> None:
    """The reference: the spec's arithmetic in torch, tensor by tensor."""
    pairs, groups = (rows + 1) // 2, -(-cols // GROUP)
    p = torch.arange(pairs, device=src.device).view(-1, 1)
    g = torch.arange(groups, device=src.device).view(1, -1)
    idx = _block_index(p, g, pairs, groups)                                        # [P, G]
    flat = out.view(-1)
    for t in range(count):
        tensor = src[t * stride:(t + 1) * stride]
        head = tensor[:HEADER]
        prescale = head[16:20].view(torch.float32)[0].double()
        blocks = tensor[HEADER:HEADER + pairs * groups * BLOCK].view(pairs * groups, BLOCK)[idx.view(-1)]
        signs = blocks[:, :16].contiguous().view(torch.int64)                      # [P*G, 2]
        mags = blocks[:, 16:].view(-1, 2, GROUP).long()                            # [P*G, 2, 64]
        e, m = mags >> 3, mags & 7
        value = torch.where(e == 0, torch.ldexp(m.double() / 8, torch.tensor(-14.0, device=src.device)),
                            torch.ldexp(1 + m.double() / 8, (e - 15).double()))
        bit = (signs.view(-1, 2, 1) >> torch.arange(GROUP, device=src.device)) & 1
        value = torch.where(bit == 1, -value, value) * prescale
        w = value.view(pairs, groups, 2, GROUP).permute(0, 2, 1, 3).reshape(2 * pairs, groups * GROUP)[:rows, :cols]
        if int(head[6:8].view(torch.int16)[0]) & FLAG_BLOCK_SCALES:
            ns = -(-cols // SCALE_COLS)
            at = HEADER + pairs * groups * BLOCK
            scale = tensor[at:at + 2 * pairs * ns * 4].view(torch.float32).view(2 * pairs, ns)[:rows].double()
            w = (w.float() * scale.float().repeat_interleave(SCALE_COLS, 1)[:, :cols]).double()
        base = place.base(t)
        rows_at = base + torch.arange(rows, device=src.device).view(-1, 1) * place.row_stride
        flat[(rows_at + torch.arange(cols, device=src.device)).view(-1)] = w.reshape(-1).to(out.dtype)


if triton is not None:
    @triton.jit
    def fp9_values(mag, sign, c, prescale):
        """fp32 weights of e5m3 magnitudes (int32), their column c's bit of the block's sign word
        (int64) and the tensor's prescale: the spec's arithmetic on the exponent bits (a subnormal,
        magnitude < 8, is its normal of exponent 1 less 2^-14)."""
        neg = ((sign >> c.to(tl.int64)) & 1) != 0
        sub = mag < 8
        bits = ((mag | tl.where(sub, 8, 0)) << 20) + (112 << 23)                   # the code's exponent + 112
        w = bits.to(tl.float32, bitcast=True) - tl.where(sub, 0.00006103515625, 0.0)
        return tl.where(neg, -w, w) * prescale

    @triton.jit
    def fp9_header(src, base, e, tp, d, slot_bytes, live):
        """Slice d of expert e among tensors of slot_bytes from src + base: (its bytes, its prescale,
        its flags); 0s where not live."""
        tensor = src + base + (e * tp + d) * slot_bytes
        prescale = tl.load(tensor.to(tl.pointer_type(tl.float32)) + 4, mask=live, other=0.0)
        flags = tl.load(tensor.to(tl.pointer_type(tl.int16)) + 3, mask=live, other=0).to(tl.int32)
        return tensor, prescale, flags

    @triton.jit
    def _decode_kernel(src, out, stride, rows, cols, pairs, groups, per, outer, inner, row_stride,
                       GB: tl.constexpr):
        """One tensor, one row pair, GB groups: [GB, 128] magnitudes (both rows of each block)."""
        t = tl.program_id(0)
        p = tl.program_id(1)
        g = tl.program_id(2) * GB + tl.arange(0, GB)                               # [GB]
        tensor = src + t.to(tl.int64) * stride
        prescale = tl.load(tensor.to(tl.pointer_type(tl.float32)) + 4)
        flags = tl.load(tensor.to(tl.pointer_type(tl.int16)) + 3).to(tl.int32)
        g0 = g - g % 32
        n = tl.minimum(groups - g0, 32)
        idx = (pairs * g0 + p * n + (g - g0)).to(tl.int64)                          # [GB]
        j = tl.arange(0, 128)
        r = j // 64
        c = j % 64
        live = (g[:, None] < groups) & (j[None, :] >= 0)
        at = 64 + idx[:, None] * 144                                               # [GB, 1]
        mag = tl.load(tensor + at + 16 + j[None, :], mask=live, other=0).to(tl.int32)
        sign = tl.load((tensor + at + 8 * r[None, :]).to(tl.pointer_type(tl.int64)), mask=live, other=0)
        w = fp9_values(mag, sign, c[None, :], prescale)
        row = 2 * p + r[None, :]
        col = g[:, None] * 64 + c[None, :]
        ok = live & (row < rows) & (col < cols)
        if flags & 1:
            ns = (cols + 127) // 128
            scales = (tensor + 64 + pairs.to(tl.int64) * groups * 144).to(tl.pointer_type(tl.float32))
            w = w * tl.load(scales + row * ns + col // 128, mask=ok, other=1.0)
        base = (t // per).to(tl.int64) * outer + (t % per).to(tl.int64) * inner
        # to bf16 by hand, nearest even (a scaled weight is rounded here; Triton's interpreter truncates)
        u = w.to(tl.int32, bitcast=True)
        half = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int16)
        tl.store(out.to(tl.pointer_type(tl.int16)) + base + row.to(tl.int64) * row_stride + col, half, mask=ok)
else:   # no triton: the kernels' shared parts are not there either
    fp9_values = fp9_header = None


def decode_fp9(src: torch.Tensor, count: int, stride: int, rows: int, cols: int, out: torch.Tensor,
               place: Placement) -> None:
    """count serialized fp9 tensors [rows, cols] (src, stride bytes apart) into out (see the module
    docstring): the Triton kernel on CUDA or under the interpreter, else the reference."""
    if src.dtype != torch.uint8 or src.dim() != 1 or src.numel() < count * stride or stride < tensor_bytes(rows, cols):
        raise ValueError(f"decode_fp9: {count} tensors of {rows}x{cols} need {count} x >= "
                         f"{tensor_bytes(rows, cols)} bytes; src has {src.numel()} ({src.dtype}), stride {stride}")
    last = place.base(count - 1) + (rows - 1) * place.row_stride + cols
    if not out.is_contiguous() or out.numel() < last:
        raise ValueError(f"decode_fp9: out ({out.numel()} elements, contiguous {out.is_contiguous()}) "
                         f"does not hold tensor {count - 1} (up to element {last})")
    if out.dtype != torch.bfloat16:
        raise ValueError(f"decode_fp9: out must be bfloat16, not {out.dtype}")
    if triton is None or (src.device.type != "cuda" and not INTERPRETED):
        return decode_fp9_ref(src, count, stride, rows, cols, out, place)
    pairs, groups = (rows + 1) // 2, -(-cols // GROUP)
    grid = (count, pairs, triton.cdiv(groups, GROUPS_PER_PROGRAM))
    _decode_kernel[grid](src, out, stride, rows, cols, pairs, groups, place.per, place.outer, place.inner,
                         place.row_stride, GB=GROUPS_PER_PROGRAM)


INTERPRETED = triton is not None and type(_decode_kernel).__name__ == "InterpretedFunction"
