"""Grouped GEMMs straight from fp9 bytes: the experts a placement keeps on the GPU
(engine.placement), in the ducks' fp9 layout (engine.gpu.fp9_layout), for steps of more
than a few (token, expert) pairs: a short prompt's rest after a prefix-cache hit, a batched
decode step of many sequences, a prefill of a few hundred tokens.

The pairs are sorted by expert on the device and cut into blocks of BM rows of one expert;
a program computes one block against BN output rows of that expert, decoding each 64-column
group of its fp9 tile once and running it on the tensor cores (tl.dot) for all BM rows. So
every held expert that some pair routes to is read once per block of its rows, in fp9
(1.125 bytes a weight), where fp9_experts_forward (below) decodes every held
expert to bf16 in memory first (a write and a read of 2 bytes a weight more) and the
per-pair GEMV (engine.gpu.fp9_gemv) reads an expert once per pair. No host sync: the grid is
sized by the pairs' count (cdiv(P, BM) + held experts blocks at most), so a step of fixed
size is captured in a CUDA graph.

    y = fp9_moe_forward(lay, src, x, slots, weights)     # [T, H] fp32, slot -1: not this share

fp9_moe_ref is the reference (the per-pair GEMV's reference: decode, fp32 matmuls); the tests
hold them together in Triton's interpreter and on CUDA. Also here: fp9_experts_forward (every
held expert decoded to bf16, torch's grouped GEMMs: a long prefill), held_experts_forward (the
cheaper of the two for a step) and check_fused (the kernels tried once per CUDA device).
"""
from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F

from engine.gpu.fp9_decode import GROUP, fp9_header, fp9_values
from engine.gpu.fp9_gemv import fp9_gemv_ref, kernel_runs
from engine.gpu.fp9_layout import Layer, decode_range

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the reference runs
    triton = None

log = logging.getLogger(__name__)

DECODE_GROUP_BYTES = 2 << 30   # bf16 weights decoded at a time by fp9_experts_forward (experts in groups)
BN = 64          # output rows of a program (row pairs of the fp9 layout: even)
# rows an expert gets on average up to which a step of the held experts' fp9 bytes takes these GEMMs outside a
# capture (an H100, one Qwen3-30B-A3B layer: 0.82x the decoded path's time at 32 rows, 1.43x at 64); bf16
# copies take them only inside one (engine.placement: torch's grouped GEMMs were as fast or faster from 41 tokens)
FUSED_ROWS = 32


def block_rows(pairs: int, experts: int) -> int:
    """Rows of a block for pairs spread over experts: about the rows an expert gets, 16 to 64."""
    per = pairs / max(1, experts)
    return 16 if per <= 16 else 32 if per <= 32 else 64 if per <= 64 else 128


if triton is not None:
    @triton.jit
    def _block(block_e, block_at, block_n, xrow, BM: tl.constexpr):
        """Block program_id(0)'s expert (clamped to 0), whether it is one, its rows' positions in the
        sorted pairs, which of them are its and their rows of x."""
        m = tl.program_id(0)
        e = tl.load(block_e + m).to(tl.int64)
        live = e >= 0
        count = tl.where(live, tl.load(block_n + m), 0)
        i = tl.load(block_at + m) + tl.arange(0, BM)
        rows_ok = tl.arange(0, BM) < count
        xr = tl.load(xrow + i, mask=rows_ok, other=0).to(tl.int64)
        return tl.maximum(e, 0), live, i, rows_ok, xr

    @triton.jit
    def _fp9_moe_kernel(src, x, xrow, out, block_e, block_at, block_n, base, slot_bytes, tp, rows, cols,
                        pairs, groups, x_stride, out_stride, SUM_TP: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, LOW: tl.constexpr):
        """Block m (program_id 0): rows block_at[m] .. + block_n[m] of the sorted pairs, all of expert
        block_e[m] (-1: no block). out[i, d * rows + n] (gate_up: program_id 2 is the slice d) or
        out[i, n] summed over the tp slices (down, SUM_TP) = sum_c W_d[n, c] * x[xrow[i], (d * cols if
        SUM_TP) + c] for the block's rows i and the program's BN rows n (program_id 1)."""
        if tl.load(block_n + tl.program_id(0)) <= 0:   # no block: most of the grid when few experts are routed
            return
        e, live, i, rows_ok, xr = _block(block_e, block_at, block_n, xrow, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        p = n // 2
        r = n % 2
        c = tl.arange(0, 64)
        n_ok = n < rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        n_tp = tp if SUM_TP else 1
        for dd in range(0, n_tp):
            d = dd if SUM_TP else tl.program_id(2)
            tensor, prescale, flags = fp9_header(src, base, e, tp, d, slot_bytes, live)
            xoff = d * cols if SUM_TP else 0
            for g in range(0, groups):
                gp = g - g % 32
                width = tl.minimum(groups - gp, 32)
                blk = 64 + (pairs * gp + p * width + (g - gp)).to(tl.int64) * 144          # [BN]
                w_ok = (n_ok & live)[:, None] & (c[None, :] >= 0)
                mag = tl.load(tensor + blk[:, None] + 16 + r[:, None] * 64 + c[None, :], mask=w_ok,
                              other=0).to(tl.int32)                                        # [BN, 64]
                sign = tl.load((tensor + blk + 8 * r).to(tl.pointer_type(tl.int64)), mask=n_ok & live, other=0)
                w = fp9_values(mag, sign[:, None], c[None, :], prescale)
                col = g * 64 + c
                if flags & 1:
                    ns = (cols + 127) // 128
                    scales = (tensor + 64 + pairs.to(tl.int64) * groups * 144).to(tl.pointer_type(tl.float32))
                    w = w * tl.load(scales + n[:, None] * ns + col[None, :] // 128,
                                    mask=w_ok & (col[None, :] < cols), other=1.0)
                    # rounded to bf16 once, nearest even, as engine.gpu.fp9_decode has a scaled weight (by
                    # hand: Triton's interpreter truncates)
                    u = w.to(tl.int32, bitcast=True)
                    w = ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
                xv = tl.load(x + xr[:, None] * x_stride + xoff + col[None, :],
                             mask=rows_ok[:, None] & (col[None, :] < cols), other=0.0)     # [BM, 64]
                if LOW:
                    acc += tl.dot(xv.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
                else:
                    acc += tl.dot(xv.to(tl.float32), tl.trans(w), input_precision="ieee")
        dst = out + i.to(tl.int64)[:, None] * out_stride + (0 if SUM_TP else tl.program_id(2) * rows) + n[None, :]
        tl.store(dst, acc, mask=rows_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _copies_moe_kernel(w, x, xrow, out, block_e, block_at, block_n, N, K, stride_e, stride_n, x_stride,
                           out_stride, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        """_fp9_moe_kernel's blocks on decoded copies: out[i, n] = sum_c W[e, n, c] * x[xrow[i], c]."""
        if tl.load(block_n + tl.program_id(0)) <= 0:
            return
        e, live, i, rows_ok, xr = _block(block_e, block_at, block_n, xrow, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = (n < N) & live
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            wt = tl.load(w + e * stride_e + n.to(tl.int64)[:, None] * stride_n + kk[None, :],
                         mask=n_ok[:, None] & (kk[None, :] < K), other=0.0)
            xv = tl.load(x + xr[:, None] * x_stride + kk[None, :], mask=rows_ok[:, None] & (kk[None, :] < K),
                         other=0.0)
            if IEEE:
                acc += tl.dot(xv, tl.trans(wt), input_precision="ieee")
            else:
                acc += tl.dot(xv, tl.trans(wt))
        tl.store(out + i.to(tl.int64)[:, None] * out_stride + n[None, :], acc, mask=rows_ok[:, None] & (n[None, :] < N))


def pair_blocks(slots: torch.Tensor, experts: int, bm: int):
    """slots [P] int32 (-1: none) -> (order [P]: the pairs sorted by slot, the -1 ones last;
    block_e, block_at, block_n [cdiv(P, bm) + experts]: each block's slot (-1: none), first
    position in order and rows), all on slots' device, no host sync."""
    p = slots.numel()
    dev = slots.device
    key = torch.where(slots >= 0, slots, experts).long()
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:experts]
    starts = torch.cumsum(counts, 0) - counts
    nblocks = (counts + bm - 1) // bm
    ends = torch.cumsum(nblocks, 0)                                   # blocks of slots [0, e]
    size = -(-p // bm) + experts
    m = torch.arange(size, device=dev)
    e = torch.searchsorted(ends, m, right=True)                       # the block's slot; experts: none
    live = e < experts
    ec = e.clamp(max=experts - 1)
    k = m - (ends[ec] - nblocks[ec])                                  # the block's index among its slot's
    at = starts[ec] + k * bm
    n = torch.where(live, torch.clamp(counts[ec] - k * bm, max=bm), 0)
    return order, torch.where(live, ec, -1).to(torch.int32), at.to(torch.int32), n.to(torch.int32)


def _launch(lay, src, x, xrow, out, blocks, g: int, down: bool, bm: int) -> None:
    block_e, block_at, block_n = blocks
    low = x.dtype != torch.float32
    if down:
        pairs, groups = (lay.hidden + 1) // 2, -(-lay.slice_cols // GROUP)
        grid = (block_e.numel(), triton.cdiv(lay.hidden, BN), 1)
        _fp9_moe_kernel[grid](src, x, xrow, out, block_e, block_at, block_n, g * lay.tp * lay.gu_slot, lay.dn_slot,
                              lay.tp, lay.hidden, lay.slice_cols, pairs, groups, x.shape[1], out.shape[1],
                              SUM_TP=True, BM=bm, BN=BN, LOW=low)
    else:
        pairs, groups = (lay.gu_rows + 1) // 2, -(-lay.hidden // GROUP)
        grid = (block_e.numel(), triton.cdiv(lay.gu_rows, BN), lay.tp)
        _fp9_moe_kernel[grid](src, x, xrow, out, block_e, block_at, block_n, 0, lay.gu_slot, lay.tp,
                              lay.gu_rows, lay.hidden, pairs, groups, x.shape[1], out.shape[1],
                              SUM_TP=False, BM=bm, BN=BN, LOW=low)


def fp9_moe_forward(lay, src: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                    g: int | None = None, bm: int | None = None) -> torch.Tensor:
    """x [T, H], slots / weights [T, k] -> [T, H] fp32: sum over each token's pairs of weight x expert(x),
    a pair's expert being its slot among the g experts laid in src (lay's layout: their gate_up slices,
    then their down slices; g: lay.held), -1 not this share. Each pair's FFN in fp32 from the GEMMs'
    inputs (bf16, or fp32 for an fp32 model), weighted and added in fp32."""
    g = lay.held if g is None else g
    t, k = slots.shape
    flat = slots.reshape(-1).to(torch.int32).contiguous()
    need = g * lay.tp * (lay.gu_slot + lay.dn_slot)
    if src.dtype != torch.uint8 or src.dim() != 1 or src.numel() < need or x.shape != (t, lay.hidden):
        raise ValueError(f"fp9 MoE: src must be uint8 of >= {need} bytes ({g} experts), x [{t}, {lay.hidden}]; got "
                         f"{src.dtype} {tuple(src.shape)}, x {tuple(x.shape)}")
    if not kernel_runs(src.device):
        return fp9_moe_ref(lay, src, x, slots, weights, g)
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    bm = bm or block_rows(t * k, g)
    order, *blocks = pair_blocks(flat, g, bm)
    xs = x.to(dtype).contiguous()
    h = torch.zeros((t * k, lay.tp * lay.gu_rows), dtype=torch.float32, device=x.device)
    _launch(lay, src, xs, (order // k).to(torch.int32), h, blocks, g, down=False, bm=bm)
    a = (F.silu(h[:, 0::2]) * h[:, 1::2]).to(dtype)                       # [P, tp * slice_cols], sorted order
    ys = torch.zeros((t * k, lay.hidden), dtype=torch.float32, device=x.device)
    _launch(lay, src, a, torch.arange(t * k, dtype=torch.int32, device=x.device), ys, blocks, g, down=True, bm=bm)
    y = torch.empty_like(ys).index_copy_(0, order, ys)                    # back to pair order
    return (y.view(t, k, -1) * weights.float()[:, :, None]).sum(1)


def copies_moe_forward(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                       weights: torch.Tensor, bm: int | None = None) -> torch.Tensor:
    """fp9_moe_forward on decoded copies: gate_up [n, 2I, H] (gate row i at 2i, up at 2i + 1), down
    [n, H, I] in x's dtype, slots / weights [T, k] (-1: not this share) -> [T, H] fp32."""
    t, k = slots.shape
    n, i2, h = gate_up.shape
    if down.shape != (n, h, i2 // 2) or x.shape != (t, h) or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError(f"MoE copies: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} and x "
                         f"{tuple(x.shape)} do not agree (or are not contiguous rows)")
    flat = slots.reshape(-1).to(torch.int32).contiguous()
    dtype = gate_up.dtype
    bm = bm or block_rows(t * k, n)
    order, *blocks = pair_blocks(flat, n, bm)
    p = t * k

    def gemm(w, xs, xrow, out):
        rows, cols = w.shape[1:]
        grid = (blocks[0].numel(), triton.cdiv(rows, BN))
        _copies_moe_kernel[grid](w, xs, xrow, out, *blocks, rows, cols, w.stride(0), w.stride(1), xs.stride(0),
                                 out.stride(0), BM=bm, BN=BN, BK=64, IEEE=dtype == torch.float32)

    hh = torch.zeros((p, i2), dtype=torch.float32, device=x.device)
    gemm(gate_up, x.to(dtype).contiguous(), (order // k).to(torch.int32), hh)
    a = (F.silu(hh[:, 0::2]) * hh[:, 1::2]).to(dtype)
    ys = torch.zeros((p, h), dtype=torch.float32, device=x.device)
    gemm(down, a, torch.arange(p, dtype=torch.int32, device=x.device), ys)
    y = torch.empty_like(ys).index_copy_(0, order, ys)
    return (y.view(t, k, -1) * weights.float()[:, :, None]).sum(1)


def fp9_moe_ref(lay, src: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                g: int | None = None) -> torch.Tensor:
    """The reference: the per-pair GEMV's (each held expert decoded, fp32 matmuls), the activation in
    the GEMMs' type as the kernel has it."""
    if g is not None and g != lay.held:     # the g experts laid in src: the layout of a layer holding g
        lay = copy.copy(lay)
        lay.held, lay.gu_bytes = g, g * lay.tp * lay.gu_slot
    t, k = slots.shape
    flat = slots.reshape(-1).to(torch.int32)
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    h = fp9_gemv_ref(lay, src, flat, x.to(dtype), k, down=False)
    a = (F.silu(h[:, 0::2]) * h[:, 1::2]).to(dtype)
    y = fp9_gemv_ref(lay, src, flat, a, 1, down=True)
    return (y.view(t, k, -1) * weights.float()[:, :, None]).sum(1)


def route_pairs(ids: torch.Tensor, weights: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, expert) pairs of ids [T, k] whose expert is in [0, g), sorted by expert: their tokens [P],
    weights [P] fp32 and the count of each expert (one host sync: the grouped GEMMs' sizes)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    mine = ((flat >= 0) & (flat < g)).nonzero().squeeze(1)
    experts = flat[mine].long()
    pairs = mine[torch.argsort(experts, stable=True)]
    counts = torch.bincount(experts, minlength=g).tolist()
    return pairs // k, weights.reshape(-1)[pairs].float(), counts


def grouped_ffn(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """xs [R, H] rows grouped by expert (counts[i] rows for expert i), gate_up [n, 2I, H] interleaved,
    down [n, H, I] -> [R, H] in xs' dtype: each row's expert FFN as two grouped GEMMs."""
    h = _grouped(xs, gate_up, counts)                                            # [R, 2I]
    a = F.silu(h[:, 0::2].float()) * h[:, 1::2].float()                          # [R, I]
    return _grouped(a.to(xs.dtype), down, counts)                                # [R, H]


def fp9_experts_forward(lay: Layer, src: torch.Tensor, g: int, x: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor, ready=None) -> torch.Tensor:
    """x [T, H], ids / weights [T, k] -> [T, H] fp32: the pairs whose id is one of the g experts laid in src
    (lay's layout, experts [0, g)), decoded to bf16 a group at a time and run as grouped GEMMs; nothing of
    the other pairs. Each pair's output is rounded to the GEMMs' type (bf16, or fp32 for an fp32 model)
    before it is weighted and added in fp32. One host sync (the groups' sizes); ready() is called after
    it, before the first read of src (ExpertStream: the wait for the copy)."""
    y = torch.zeros(ids.shape[0], lay.hidden, dtype=torch.float32, device=x.device)
    tokens, w, counts = route_pairs(ids, weights, g)
    if ready is not None:
        ready()
    # the GEMMs in bf16 (the tensor cores; the weights are exact in it); an fp32 model (the CPU
    # tests) keeps fp32, as its ducks do
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    group = max(1, DECODE_GROUP_BYTES // (2 * lay.tp * (lay.gu_rows * lay.hidden + lay.hidden * lay.slice_cols)))
    at = 0
    for e0 in range(0, g, group):
        n = min(group, g - e0)
        rows = sum(counts[e0:e0 + n])
        if rows == 0:
            continue
        gu, dn = decode_range(lay, src, g, e0, n)                         # [n, 2I, H], [n, H, I]
        sel = slice(at, at + rows)
        o = grouped_ffn(x[tokens[sel]].to(dtype), gu.to(dtype), dn.to(dtype), counts[e0:e0 + n])
        y.index_add_(0, tokens[sel], o.float() * w[sel, None])
        at += rows
    return y


_FUSED: dict[str, bool] = {}   # device -> this module's kernels give the reference's result there


def check_fused(device) -> bool:
    """Whether this module's grouped GEMMs run on device, checked once per CUDA device against
    their reference on a small random layer (fp9 bytes and bf16 copies, 24 tokens): a kernel that
    does not compile there or disagrees is logged and left out (held_experts_forward and
    engine.placement then take the GEMV and the decoded path, as before them). Called where
    experts are placed or streamed, before any graph is captured; the interpreter (the tests)
    is trusted: its tests hold it to the reference."""
    device = torch.device(device)
    if device.type != "cuda" or not kernel_runs(device):
        return kernel_runs(device)
    key = _device_key(device)
    if key not in _FUSED:
        try:
            err = _fused_errors(device)
            _FUSED[key] = max(err) < 2e-2
            log.log(logging.INFO if _FUSED[key] else logging.WARNING, "fp9 grouped GEMMs on %s: %s (relative "
                    "differences from the reference %s)", device, "on" if _FUSED[key] else "off: they disagree",
                    ", ".join(f"{e:.1e}" for e in err))
        except Exception as e:   # a compiler or driver that cannot run them
            log.warning("fp9 grouped GEMMs on %s: off, they do not run here (%s: %s)", device, type(e).__name__, e)
            _FUSED[key] = False
    return _FUSED[key]


def fused_ready(device) -> bool:
    """check_fused's answer where it was asked; False where it was not (nothing runs the check in a capture)."""
    device = torch.device(device)
    return _FUSED.get(_device_key(device), False) if device.type == "cuda" else kernel_runs(device)


def _device_key(device: torch.device) -> str:
    """The device's key: cuda and cuda:<the current index> are one device."""
    return str(device if device.index is not None else torch.device(device.type, torch.cuda.current_device()))


def _fused_errors(device) -> list[float]:
    from concurrent.futures import ThreadPoolExecutor

    from native.transport import split_experts

    g = torch.Generator().manual_seed(0)
    experts = [tuple(torch.randn(*shape, generator=g) / 8 for shape in ((160, 128), (160, 128), (128, 160)))
               for _ in range(4)]
    per_duck = split_experts(experts, 2, 64, name="fp9-moe-check")
    with ThreadPoolExecutor(1) as workers:
        lay = Layer(-1, per_duck, None, False, workers)
    src = lay.host.to(device)
    # bf16 as a GPU model's activations are (fp32 elsewhere: Triton's interpreter multiplies bf16 as raw bits)
    x = torch.randn(24, 128, generator=g).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    slots = torch.randint(-1, 4, (24, 3), generator=g, dtype=torch.int32).to(device)
    w = torch.rand(24, 3, generator=g).to(device)
    want = fp9_moe_ref(lay, src, x, slots, w)
    gu, dn = (t.to(x.dtype) for t in decode_range(lay, src, 4, 0, 4))
    return [float((y - want).norm() / want.norm())
            for y in (fp9_moe_forward(lay, src, x, slots, w), copies_moe_forward(gu, dn, x, slots, w))]


def held_experts_forward(lay, src: torch.Tensor, g: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         ready=None, capturing: bool = False) -> torch.Tensor:
    """The share of the g experts laid in src (ids in [0, g); others, and -1, are not this share) of
    x [T, H] -> [T, H] fp32, by the cheaper way: this module's grouped GEMMs up to FUSED_ROWS
    rows an expert (and always inside a graph's capture: no host sync), where they run (check_fused);
    else every expert decoded to bf16 and torch's grouped GEMMs (fp9_experts_forward). ready() is
    called before src is first read."""
    t, k = ids.shape
    if fused_ready(src.device) and (capturing or t * k <= FUSED_ROWS * max(1, g)):
        slots = torch.where((ids >= 0) & (ids < g), ids, torch.full_like(ids, -1))
        if ready is not None:
            ready()
        return fp9_moe_forward(lay, src, x, slots, weights, g)
    return fp9_experts_forward(lay, src, g, x, ids, weights, ready)


def _grouped(a: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """a [R, K] bf16 rows grouped by expert (counts[i] rows for w[i]), w [n, N, K] -> [R, N] bf16."""
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(a.device)
    try:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    except (RuntimeError, AttributeError):   # no grouped GEMM here (an older torch, a GPU before sm90)
        out, at = [], 0
        for i, c in enumerate(counts):
            if c:
                out.append(a[at:at + c] @ w[i].T)
                at += c
        return torch.cat(out)
