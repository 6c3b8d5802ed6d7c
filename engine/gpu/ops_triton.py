"""Triton kernels of the fused decoder ops; engine.ops holds their torch references
and dispatches between the two.

    rms_norm            [T, N] rows, an optional residual added first (one kernel)
    qk_norm_rope        per-head RMSNorm of q and k, rotary, and optionally k and v
                        written into a static KV cache at the positions (one kernel)
    router_topk         softmax, top-k, optional renormalization (one kernel)
    (decode attention over the static cache: engine.gpu.decode_attention)

Rounding: every value the reference rounds to the model dtype (a bf16 product, a sum,
the normalized row before its weight) is rounded here too, in the same order, by
_round. For bf16 it rounds to nearest even by integer arithmetic on the fp32 bits:
the GPU's own conversion does the same, while the interpreter's truncates, so one
helper makes both agree. What is left between kernel and reference is the order of
fp32 sums (the row reductions) and the last bit of cos/sin/exp: a bf16 ulp at most,
now and then.

With TRITON_INTERPRET=1 set before triton and this module are imported, the kernels
run in Triton's interpreter on CPU tensors (the tests).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: engine.ops runs the references
    triton = None

MAX_ROW = 1 << 16          # rms_norm holds a whole row in registers
ROUTER_MAX_EXPERTS = 4096  # router_topk holds a whole row of logits

_TL_DTYPES = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        """fp32 x rounded to DTYPE (to nearest, ties to even), returned as fp32."""
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            y = bits.to(tl.float32, bitcast=True)
        elif DTYPE == tl.float16:
            y = x.to(tl.float16).to(tl.float32)
        else:
            y = x
        return y

    @triton.jit
    def _rsqrt(x):
        # 1 / sqrt(x), each correctly rounded: torch's CPU rsqrt (tl.rsqrt is an approximation)
        return tl.math.div_rn(1.0, tl.math.sqrt_rn(x))

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps,
                         stride_x, stride_res, stride_out, stride_res_out,
                         DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr = False):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
            x = _round(x + r, DTYPE)                   # the residual stream is kept in the model dtype
            tl.store(res_out_ptr + row * stride_res_out + cols, x.to(DTYPE), mask=ok)
        rstd = _rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if ZERO_CENTERED:    # the weight stored as w for a scale (1 + w), the product in fp32
            y = _round(x * rstd * (1.0 + w), DTYPE)
        else:
            y = _round(_round(x * rstd, DTYPE) * w, DTYPE)
        tl.store(out_ptr + row * stride_out + cols, y.to(DTYPE), mask=ok)

    @triton.jit
    def _norm_rope_head(src, w_ptr, inv_freq_ptr, pos, dst, cache_dst, cache_ok, eps,
                        DTYPE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                        NORM: tl.constexpr, CACHE: tl.constexpr):
        """One head [2 * HALF] at src: RMSNorm (NORM), rotate_half rotary at pos, stored
        at dst and (CACHE, where cache_ok) at cache_dst."""
        i = tl.arange(0, BLOCK_HALF)
        ok = i < HALF
        x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            rstd = _rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
            w1 = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
            x1 = _round(_round(x1 * rstd, DTYPE) * w1, DTYPE)
            x2 = _round(_round(x2 * rstd, DTYPE) * w2, DTYPE)
        freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=ok, other=0.0)
        cos = _round(tl.cos(freq), DTYPE)
        sin = _round(tl.sin(freq), DTYPE)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product and the sum rounded
        y1 = _round(_round(x1 * cos, DTYPE) + _round(-x2 * sin, DTYPE), DTYPE).to(DTYPE)
        y2 = _round(_round(x2 * cos, DTYPE) + _round(x1 * sin, DTYPE), DTYPE).to(DTYPE)
        tl.store(dst + i, y1, mask=ok)
        tl.store(dst + HALF + i, y2, mask=ok)
        if CACHE:
            tl.store(cache_dst + i, y1, mask=ok & cache_ok)
            tl.store(cache_dst + HALF + i, y2, mask=ok & cache_ok)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, row_ptr, inv_freq_ptr, qw_ptr, kw_ptr,
                             q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, H, KVH, S, eps,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs, stride_ch,
                             DTYPE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             NORM: tl.constexpr, CACHE: tl.constexpr, ROWS: tl.constexpr):
        """Program (t, head): heads [0, H) are q's, [H, H + KVH) k's, then (CACHE) KVH of v's.
        The cache row of token t is its position, or (ROWS) row_ptr[t] (a slot cache seen flat)."""
        t = tl.program_id(0)
        head = tl.program_id(1)
        pos = tl.load(pos_ptr + t)
        row = tl.load(row_ptr + t) if ROWS else pos
        # a row outside the cache writes nothing (the callers check it on the host
        # where they can; a CUDA graph cannot, and must not write out of bounds)
        in_cache = (row >= 0) & (row < S)
        if head < H:
            _norm_rope_head(q_ptr + t * stride_qt + head * stride_qh, qw_ptr, inv_freq_ptr, pos,
                            q_out_ptr + t * stride_qot + head * stride_qoh, q_out_ptr, False, eps,
                            DTYPE, HALF, BLOCK_HALF, NORM, False)
        elif head < H + KVH:
            kh = head - H
            slot = k_cache_ptr + row * stride_cs + kh * stride_ch
            _norm_rope_head(k_ptr + t * stride_kt + kh * stride_kh, kw_ptr, inv_freq_ptr, pos,
                            k_out_ptr + t * stride_kot + kh * stride_koh, slot, in_cache, eps,
                            DTYPE, HALF, BLOCK_HALF, NORM, CACHE)
        else:
            vh = head - H - KVH
            d = tl.arange(0, 2 * BLOCK_HALF)
            ok = (d < 2 * HALF) & in_cache
            v = tl.load(v_ptr + t * stride_vt + vh * stride_vh + d, mask=ok)
            tl.store(v_cache_ptr + row * stride_cs + vh * stride_ch + d, v, mask=ok)

    @triton.jit
    def _router_topk_kernel(logits_ptr, ids_ptr, weights_ptr, E, stride_l,
                            TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
        num = tl.exp(x - tl.max(x, axis=0))
        probs = num / tl.sum(num, axis=0)
        # chosen by the logits, which order the probabilities exactly (no exp rounding
        # can make two of them tie); among equal logits the lowest expert id wins
        free = ok
        k = tl.arange(0, BLOCK_K)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
        weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for i in tl.static_range(TOP_K):
            best = tl.max(tl.where(free, x, float("-inf")), axis=0)
            pick = tl.min(tl.where(free & (x == best), e, BLOCK_E), axis=0)
            ids = tl.where(k == i, pick, ids)
            weights = tl.where(k == i, tl.sum(tl.where(e == pick, probs, 0.0), axis=0), weights)
            free = free & (e != pick)
        if NORMALIZE:
            weights = weights / tl.sum(weights, axis=0)
        k_ok = k < TOP_K
        tl.store(ids_ptr + t * TOP_K + k, ids, mask=k_ok)
        tl.store(weights_ptr + t * TOP_K + k, weights, mask=k_ok)

    INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def runs_on(x: torch.Tensor) -> bool:
    """Whether these kernels can take x: triton is there, and x is on CUDA or the interpreter runs them."""
    return triton is not None and (x.device.type == "cuda" or INTERPRETED)


def tl_dtype(t: torch.Tensor, what: str):
    if t.dtype not in _TL_DTYPES:
        raise ValueError(f"{what}: Triton ops take fp32, bf16 or fp16 tensors, got {t.dtype}")
    return _TL_DTYPES[t.dtype]


def _same_dtype(what: str, first: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != first.dtype:
            raise ValueError(f"{what}: {name} is {t.dtype}, the input {first.dtype}; the Triton ops run in one "
                             f"dtype (load the model in one dtype, or set DUCK_TRITON_OPS=0)")


def _row_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, N] (+ residual [T, N]) -> (normed [T, N], x + residual or None); zero_centered:
    the scale is (1 + weight) (Qwen3.5)."""
    _same_dtype("rms_norm", x, weight=weight, residual=residual)
    n = x.shape[-1]
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: x must be [T, N] with unit column stride and weight [N], got "
                         f"x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)}")
    if n > MAX_ROW:
        raise ValueError(f"rms_norm: rows of {n} > {MAX_ROW} elements do not fit one program")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} stride {residual.stride()} "
                             f"does not match x {tuple(x.shape)}")
        res_out = torch.empty_like(out)
    if x.shape[0]:
        block = _next_pow2(n)
        _rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
            n, eps, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            out.stride(0), DTYPE=tl_dtype(x, "rms_norm"), HAS_RESIDUAL=residual is not None, BLOCK=block,
            ZERO_CENTERED=zero_centered, num_warps=_row_warps(block))
    return out, res_out


def _heads(t: torch.Tensor, name: str, d: int) -> None:
    if t.dim() != 3 or t.shape[-1] != d or t.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope: {name} must be [T, heads, {d}] with unit stride in the last dim, "
                         f"got {tuple(t.shape)} stride {t.stride()}")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] (views with any row and head strides) -> rotated (q, k),
    new contiguous tensors; with k_cache, v_cache [S, KVH, D] also k and v [T, KVH, D]
    written there at positions, or at rows [T] (int64) where given."""
    t, h, d = q.shape
    kvh = k.shape[1]
    _heads(q, "q", d)
    _heads(k, "k", d)
    if d % 2 or inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"qk_norm_rope: head_dim {d} must be even and inv_freq fp32 [{d // 2}], "
                         f"got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    _same_dtype("qk_norm_rope", q, k=k, q_weight=q_weight, k_weight=k_weight, v=v, k_cache=k_cache, v_cache=v_cache)
    norm = q_weight is not None
    if norm != (k_weight is not None):
        raise ValueError("qk_norm_rope: give both q_weight and k_weight, or neither")
    cache = k_cache is not None
    if cache:
        _heads(v, "v", d)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c is None or c.dim() != 3 or c.shape[1:] != (kvh, d) or c.stride()[1:] != (d, 1):
                raise ValueError(f"qk_norm_rope: {name} must be [S, {kvh}, {d}] with contiguous rows, got "
                                 f"{None if c is None else tuple(c.shape)}")
        if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
            raise ValueError(f"qk_norm_rope: k_cache {tuple(k_cache.shape)} {k_cache.stride()} and v_cache "
                             f"{tuple(v_cache.shape)} {v_cache.stride()} differ in layout")
        if rows is not None and (rows.shape != positions.shape or rows.dtype != torch.int64):
            raise ValueError(f"qk_norm_rope: rows must be int64 like positions {tuple(positions.shape)}, got "
                             f"{rows.dtype} {tuple(rows.shape)}")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, kvh, d), dtype=k.dtype, device=k.device)
    if t:
        half = d // 2
        block_half = _next_pow2(half)
        _qk_norm_rope_kernel[(t, h + kvh + (kvh if cache else 0))](
            q, k, v if cache else k, positions, rows if cache and rows is not None else positions, inv_freq,
            q_weight if norm else q, k_weight if norm else k,
            q_out, k_out, k_cache if cache else k_out, v_cache if cache else k_out, h, kvh,
            k_cache.shape[0] if cache else 0, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0) if cache else 0, v.stride(1) if cache else 0, q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), k_cache.stride(0) if cache else 0, d if cache else 0,
            DTYPE=tl_dtype(q, "qk_norm_rope"), HALF=half, BLOCK_HALF=block_half, NORM=norm, CACHE=cache,
            ROWS=cache and rows is not None, num_warps=1 if block_half <= 64 else 2)
    return q_out, k_out


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> ids int32 [T, top_k], weights fp32 [T, top_k] (see engine.ops.router_topk)."""
    t, e = logits.shape
    if not 1 <= top_k <= e or e > ROUTER_MAX_EXPERTS or logits.stride(-1) != 1:
        raise ValueError(f"router_topk: needs 1 <= top_k <= E <= {ROUTER_MAX_EXPERTS} and unit column stride, "
                         f"got top_k={top_k}, logits {tuple(logits.shape)} stride {logits.stride()}")
    tl_dtype(logits, "router_topk")
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        block_e = _next_pow2(e)
        _router_topk_kernel[(t,)](logits, ids, weights, e, logits.stride(0), TOP_K=top_k, NORMALIZE=normalize,
                                  BLOCK_E=block_e, BLOCK_K=_next_pow2(top_k), num_warps=1 if block_e <= 256 else 4)
    return ids, weights
