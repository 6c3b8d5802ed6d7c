"""Decode attention over the static KV cache in two Triton kernels, capturable in a
CUDA graph: fixed shapes, no host sync. engine.ops.decode_attention_ref is the
reference (SDPA over the whole cache under the causal mask).

    q [T, H, D], k/v cache [S, KVH, D] (one layer), positions [T] -> out [T, H * D]
    row t attends slots 0 ..= positions[t]; H = KVH * groups (GQA)
    with slots [T]: a slot cache [N, S, KVH, D], row t over slot slots[t] (a batch's
    decode step): a program then takes one token's rows (block_t 1)

split    grid (token tiles x KVH, splits): a program takes the groups x BLOCK_T query
         rows that share one KV head ("rows" of one dot) over one range of split_len
         slots, online softmax in fp32, and writes an unnormalized partial
         (acc [rows, D], running max m and sum l, log2 units). The cache length S is
         fixed, the positions are not: a program whose range starts past every row's
         position returns at once, so the work follows the context, not S.
combine  grid (T x H): the partials of the splits that reach the row's position,
         rescaled to a common max and divided by their summed weight.

Partials are fp32 in a workspace [T, H, splits, D] (+ [T, H, splits] for m and l),
no atomics: results are deterministic. On the GPU the dots are bf16/fp16 tensor-core
dots with fp32 accumulation (the probabilities go into the second one in the cache's
dtype, as flash attention does); for fp32, and in the interpreter, they are fp32 ("ieee").
"""
from __future__ import annotations

import torch

from engine.gpu.ops_triton import INTERPRETED, _next_pow2, tl_dtype, triton

if triton is not None:
    import triton.language as tl

    from engine.gpu.ops_triton import _round

MIN_DOT = 16                 # tl.dot needs every tile side >= 16
MAX_SPLITS = 256
PARTIAL_BYTES = 32 << 20     # at most this much fp32 workspace: fewer splits for many tokens
LOG2E = 1.4426950408889634   # exp(x) = exp2(x * log2(e))

if triton is not None:
    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, o_ptr, m_ptr, l_ptr,
                      T, KVH, splits, qk_scale, stride_qt, stride_qh, stride_cs, stride_ch, stride_slot,
                      GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                      SPLIT_TILES: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
                      SLOTS: tl.constexpr):
        kvh = tl.program_id(0) % KVH
        split = tl.program_id(1)
        if SLOTS:   # one token per program (BLOCK_T 1): its slot's cache
            slot_base = tl.load(slot_ptr + tl.program_id(0) // KVH).to(tl.int64) * stride_slot
            k_ptr += slot_base
            v_ptr += slot_base
        r = tl.arange(0, BLOCK_M)
        t = (tl.program_id(0) // KVH) * BLOCK_T + r // GROUPS
        h = kvh * GROUPS + r % GROUPS
        row_ok = (r < BLOCK_T * GROUPS) & (t < T)
        pos = tl.load(pos_ptr + t, mask=row_ok, other=-1)                                   # [M]
        start = split * (SPLIT_TILES * BLOCK_S)
        end = tl.minimum(start + SPLIT_TILES * BLOCK_S, tl.max(pos, axis=0) + 1)
        if start < end:
            d = tl.arange(0, BLOCK_D)
            d_ok = d < D
            q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)                  # [M, D]
            if DOT_FP32:
                q = q.to(tl.float32)
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            # a fixed trip count (the bound that depends on the positions is a test inside):
            # the same loop for every launch, and no tensor as a range() bound in the interpreter
            for i in range(SPLIT_TILES):
                s = start + i * BLOCK_S + tl.arange(0, BLOCK_S)
                if start + i * BLOCK_S < end:
                    s_ok = s < end
                    kt = tl.load(k_ptr + s[None, :] * stride_cs + kvh * stride_ch + d[:, None],
                                 mask=d_ok[:, None] & s_ok[None, :], other=0.0)           # [D, S_blk]
                    if DOT_FP32:
                        scores = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
                    else:
                        scores = tl.dot(q, kt)                                             # [M, S_blk]
                    scores = tl.where(s[None, :] <= pos[:, None], scores * qk_scale, float("-inf"))
                    m_new = tl.maximum(m, tl.max(scores, axis=1))
                    base = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no slot yet: no NaN
                    p = tl.exp2(scores - base[:, None])
                    alpha = tl.exp2(m - base)
                    l = l * alpha + tl.sum(p, axis=1)
                    v = tl.load(v_ptr + s[:, None] * stride_cs + kvh * stride_ch + d[None, :],
                                mask=s_ok[:, None] & d_ok[None, :], other=0.0)            # [S_blk, D]
                    if DOT_FP32:
                        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                    else:
                        pv = tl.dot(p.to(v.dtype), v)
                    acc = acc * alpha[:, None] + pv
                    m = m_new
            row = (t * (KVH * GROUPS) + h) * splits + split
            tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(m_ptr + row, m, mask=row_ok)
            tl.store(l_ptr + row, l, mask=row_ok)

    @triton.jit
    def _combine_kernel(o_ptr, m_ptr, l_ptr, pos_ptr, out_ptr, H, split_len, stride_out,
                        SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                        CHUNK: tl.constexpr, DTYPE: tl.constexpr):
        row = tl.program_id(0)           # t * H + h
        t = row // H
        h = row % H
        # the splits the split kernel wrote for this row: those starting at or before its position
        active = tl.minimum(tl.load(pos_ptr + t) // split_len + 1, SPLITS)
        sp = tl.arange(0, BLOCK_SPLITS)
        ok = sp < active
        m = tl.load(m_ptr + row * SPLITS + sp, mask=ok, other=float("-inf"))
        top = tl.max(m, axis=0)          # finite: split 0 holds slot 0, which every row attends
        total = tl.sum(tl.exp2(m - top) * tl.load(l_ptr + row * SPLITS + sp, mask=ok, other=0.0), axis=0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for c in range(0, SPLITS, CHUNK):   # a fixed trip count, as in the split kernel
            if c < active:
                sc = c + tl.arange(0, CHUNK)
                sc_ok = sc < active
                w = tl.exp2(tl.load(m_ptr + row * SPLITS + sc, mask=sc_ok, other=float("-inf")) - top)  # [CHUNK]
                o = tl.load(o_ptr + (row * SPLITS + sc)[:, None] * D + d[None, :],
                            mask=sc_ok[:, None] & d_ok[None, :], other=0.0)                             # [CHUNK, D]
                acc += tl.sum(o * w[:, None], axis=0)
        y = _round(acc / total, DTYPE)
        tl.store(out_ptr + t * stride_out + h * D + d, y.to(DTYPE), mask=d_ok)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(t: int, h: int, kvh: int, d: int, s: int, split_tiles: int | None = None, one_token: bool = False) -> dict:
    """The launch shape for T tokens, H query / KVH kv heads of head_dim d over S slots
    (one_token: a program per token, each over a cache of its own)."""
    groups = h // kvh
    block_t = 1 if one_token else max(1, min(_next_pow2(t), 64 // groups))
    block_s = 64 if d <= 128 else 32
    tiles = _cdiv(s, block_s)
    if split_tiles is None:
        cap = max(1, min(MAX_SPLITS, PARTIAL_BYTES // (t * h * d * 4)))
        split_tiles = _cdiv(tiles, min(tiles, cap))
    splits = _cdiv(tiles, split_tiles)
    return dict(groups=groups, block_t=block_t, block_m=max(MIN_DOT, _next_pow2(block_t * groups)),
                block_s=block_s, block_d=max(MIN_DOT, _next_pow2(d)), split_len=split_tiles * block_s,
                splits=splits)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, split_tiles: int | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] attends k/v cache [S, KVH, D] at slots <= positions[t]; -> [T, H * D] in q's dtype.
    With slots [T]: a slot cache [N, S, KVH, D], row t over slot slots[t]. The caller guarantees
    0 <= positions < S and 0 <= slots < N (as static decode's callers do)."""
    t, h, d = q.shape
    stride_slot = 0
    if slots is not None:
        if k_cache.dim() != 4 or slots.shape != (t,) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"decode_attention: slots [T] (int) over a slot cache [N, S, KVH, D]; got slots "
                             f"{tuple(slots.shape)} {slots.dtype}, cache {tuple(k_cache.shape)}")
        stride_slot = k_cache.stride(0)
        if v_cache.stride(0) != stride_slot:
            raise ValueError("decode_attention: the k and v slot caches have different slot strides")
        k_cache, v_cache = k_cache[0], v_cache[0]   # the layout of one slot; the kernel adds slot * stride
    s, kvh = k_cache.shape[:2]
    if q.stride(-1) != 1 or k_cache.shape != (s, kvh, d) or v_cache.shape != k_cache.shape \
            or k_cache.stride() != v_cache.stride() or k_cache.stride()[1:] != (d, 1) or h % kvh:
        raise ValueError(f"decode_attention: q [T, H, D] (unit last stride), k/v cache [S, KVH, D] with contiguous "
                         f"rows and H a multiple of KVH; got q {tuple(q.shape)} {q.stride()}, k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.stride()}, v_cache {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"decode_attention: q is {q.dtype}, the cache {k_cache.dtype}/{v_cache.dtype}")
    dtype = tl_dtype(q, "decode_attention")
    out = torch.empty((t, h * d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    p = plan(t, h, kvh, d, s, split_tiles, one_token=slots is not None)
    o = torch.empty((t, h, p["splits"], d), dtype=torch.float32, device=q.device)
    ml = torch.empty((2, t, h, p["splits"]), dtype=torch.float32, device=q.device)
    grid = (_cdiv(t, p["block_t"]) * kvh, p["splits"])
    _split_kernel[grid](q, k_cache, v_cache, positions, positions if slots is None else slots, o, ml[0], ml[1], t,
                        kvh, p["splits"], scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0),
                        k_cache.stride(1), stride_slot,
                        GROUPS=p["groups"], BLOCK_T=p["block_t"], BLOCK_M=p["block_m"], BLOCK_S=p["block_s"],
                        SPLIT_TILES=p["split_len"] // p["block_s"], D=d, BLOCK_D=p["block_d"],
                        DOT_FP32=q.dtype == torch.float32 or INTERPRETED, SLOTS=slots is not None,
                        num_warps=4, num_stages=2)
    _combine_kernel[(t * h,)](o, ml[0], ml[1], positions, out, h, p["split_len"], out.stride(0),
                              SPLITS=p["splits"], D=d, BLOCK_D=p["block_d"], BLOCK_SPLITS=_next_pow2(p["splits"]),
                              CHUNK=8, DTYPE=dtype, num_warps=1 if p["block_d"] <= 128 else 2)
    return out

