"""DeepSeek-V3.2's lightning indexer (DSA) scores in one Triton kernel: the logits that pick the
top-k keys each query attends. Unfused, torch makes a [T, H, S] fp32 tensor of per-head logits
(T * H * S * 4 bytes: 2 GiB for 64 heads at T = 64, S = 131072) only to reduce it over the heads;
the kernel keeps each tile's per-head logits in registers and writes only [T, S].

    scores = index_scores(q, w, k, k_scale, q_pos)          # [T, S] fp32
    scores[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])   for s <= q_pos[t]
                 = -inf                                                 for s > q_pos[t]

q [T, H, D] and k [S, D] are fp8 e4m3 (the indexer's cache, on CUDA), bf16 or fp32, one dtype;
w [T, H] fp32 (the head weights, every scale but k's folded in), k_scale [S] fp32, q_pos [T] int.
n_keys computes only the first n_keys columns (out [T, n_keys]); rows_slot [T] reads a slot cache
(k [N, S, D], k_scale [N, S]), row t over slot rows_slot[t] (a batch's decode step).
index_scores_ref is the torch reference, held to the kernel by tests/engine/test_dsa_index.py
(Triton's interpreter) and tests/gpu/test_dsa_index_cuda.py (fp8 and bf16 on CUDA).

The tiling puts the heads on the dot's N side ("K stationary"): a program holds one tile of
BLOCK_S keys [BLOCK_S, D] and walks a chunk of up to BLOCK_T queries, one query a step:

    logits = tl.dot(k_tile [BLOCK_S, D], q_t^T [D, H])     # [BLOCK_S, H], fp32 accumulate
    scores[t, tile] = k_scale * sum(relu(logits) * w[t, None, :], axis=1)

so a single decode query fills a 64-wide dot (a [BLOCK_T, D] x [D, BLOCK_S] dot per head would
pad T = 1 to 16 rows and do 16 times the work), the head sum is a row reduction inside each warp
(no shared-memory round trip), and the key tile is read once per chunk of queries, whatever the
number of heads. On sm_89+ the dot is fp8 x fp8 on the tensor cores (bf16 for bf16 inputs, and for
fp8 on older GPUs, exactly: every e4m3 value is a bf16 value); fp32 inputs, and the interpreter,
dot in fp32 ("ieee"). A program whose key tile starts past every position of its chunk writes
-inf and computes nothing, so a causal prefill does about half the dots and a decode step's work
follows the context, not S. No host sync and, with out given, no allocation: CUDA-graph safe.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the reference runs
    triton = None

FP8 = torch.float8_e4m3fn
DTYPES = (FP8, torch.bfloat16, torch.float16, torch.float32)
MIN_DOT = 16                # tl.dot needs every tile side >= 16: fewer heads (or a small D) are padded
MAX_CHUNK = 64              # queries a program walks with one key tile
REF_ELEMENTS = 1 << 28      # the reference's per-head logits in chunks of at most this many floats (1 GiB)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:
    @triton.jit
    def _index_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, pos_ptr, slot_ptr, out_ptr, T, N, BLOCK_T,
                      stride_qt, stride_qh, stride_wt, stride_wh, stride_kn, stride_ks, stride_ksn, stride_kss,
                      stride_ot, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_TP: tl.constexpr, TPD: tl.constexpr, SLOTS: tl.constexpr,
                      DOT: tl.constexpr):
        """out[t, s] for the queries t0 ..< t0 + BLOCK_T (program_id 0) and the keys of tile program_id 1.
        BLOCK_T is no constexpr (a decode step of any T <= 64 reuses the compiled kernel of its
        BLOCK_TP = next_pow2(BLOCK_T)). DOT: 0 fp32 ("ieee"), 1 the inputs' own dtype (fp8 or
        bf16/fp16), 2 fp8 upcast to bf16. TPD: queries a dot (1: a [BLOCK_S, BLOCK_H] dot a query)."""
        t0 = tl.program_id(0) * BLOCK_T
        s0 = tl.program_id(1) * BLOCK_S
        n_t = tl.minimum(T - t0, BLOCK_T)
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < N
        r = tl.arange(0, BLOCK_TP)
        pos = tl.load(pos_ptr + t0 + r, mask=r < n_t, other=-1).to(tl.int64)
        if SLOTS:   # one query a program (BLOCK_T 1): its slot's cache
            slot = tl.load(slot_ptr + t0).to(tl.int64)
            k_ptr += slot * stride_kn
            ks_ptr += slot * stride_ksn
        if s0 > tl.max(pos, axis=0):      # past every query's position: no dot
            for i in range(0, n_t):
                tl.store(out_ptr + (t0 + i).to(tl.int64) * stride_ot + s, tl.full((BLOCK_S,), float("-inf"),
                                                                               tl.float32), mask=s_ok)
        else:
            d = tl.arange(0, BLOCK_D)
            h = tl.arange(0, BLOCK_H)
            d_ok = d < D
            h_ok = h < H
            kt = tl.load(k_ptr + s[:, None].to(tl.int64) * stride_ks + d[None, :],
                         mask=s_ok[:, None] & d_ok[None, :], other=0.0)                     # [BLOCK_S, D]
            if DOT == 0:
                kt = kt.to(tl.float32)
            elif DOT == 2:
                kt = kt.to(tl.bfloat16)
            ks = tl.load(ks_ptr + s * stride_kss, mask=s_ok, other=0.0)
            if TPD == 1:
                for i in range(0, n_t):
                    t = (t0 + i).to(tl.int64)
                    qt = tl.load(q_ptr + t * stride_qt + h[None, :] * stride_qh + d[:, None],
                                 mask=d_ok[:, None] & h_ok[None, :], other=0.0)              # [D, BLOCK_H]
                    wt = tl.load(w_ptr + t * stride_wt + h * stride_wh, mask=h_ok, other=0.0)  # [BLOCK_H]
                    if DOT == 0:
                        logits = tl.dot(kt, qt.to(tl.float32), input_precision="ieee")
                    elif DOT == 2:
                        logits = tl.dot(kt, qt.to(tl.bfloat16))
                    else:
                        logits = tl.dot(kt, qt)                                              # [BLOCK_S, BLOCK_H]
                    score = tl.sum(tl.maximum(logits, 0.0) * wt[None, :], axis=1) * ks      # [BLOCK_S]
                    p = tl.load(pos_ptr + t).to(tl.int64)
                    score = tl.where(s <= p, score, float("-inf"))
                    tl.store(out_ptr + t * stride_ot + s, score, mask=s_ok)
            else:   # TPD queries a dot: [BLOCK_S, D] x [D, TPD * BLOCK_H], the head sum per query
                c = tl.arange(0, TPD * BLOCK_H)
                hc = c % BLOCK_H
                j = tl.arange(0, TPD)
                for i in range(0, n_t, TPD):
                    tc = i + c // BLOCK_H
                    c_ok = (hc < H) & (tc < n_t)
                    tq = (t0 + tc).to(tl.int64)
                    qt = tl.load(q_ptr + tq[None, :] * stride_qt + hc[None, :] * stride_qh + d[:, None],
                                 mask=d_ok[:, None] & c_ok[None, :], other=0.0)              # [D, TPD * BLOCK_H]
                    wt = tl.load(w_ptr + tq * stride_wt + hc * stride_wh, mask=c_ok, other=0.0)
                    if DOT == 0:
                        logits = tl.dot(kt, qt.to(tl.float32), input_precision="ieee")
                    elif DOT == 2:
                        logits = tl.dot(kt, qt.to(tl.bfloat16))
                    else:
                        logits = tl.dot(kt, qt)                                              # [BLOCK_S, TPD * BLOCK_H]
                    v = tl.reshape(tl.maximum(logits, 0.0) * wt[None, :], (BLOCK_S, TPD, BLOCK_H))
                    score = tl.sum(v, axis=2) * ks[:, None]                                   # [BLOCK_S, TPD]
                    j_ok = i + j < n_t
                    tj = (t0 + i + j).to(tl.int64)
                    p = tl.load(pos_ptr + tj, mask=j_ok, other=-1).to(tl.int64)
                    score = tl.where(s[:, None] <= p[None, :], score, float("-inf"))
                    tl.store(out_ptr + tj[None, :] * stride_ot + s[:, None], score, mask=s_ok[:, None] & j_ok[None, :])

    INTERPRETED = type(_index_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def kernel_runs(device: torch.device) -> bool:
    """Whether the Triton kernel runs here (CUDA, or the interpreter), else the reference."""
    return triton is not None and (device.type == "cuda" or INTERPRETED)


@functools.lru_cache(maxsize=None)
def _fp8_dot(index: int) -> bool:
    """Whether device index's tensor cores take fp8 (sm_89 and later)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def plan(t: int, n: int, h: int, d: int, slots: bool = False) -> dict:
    """The launch shape for T queries over n keys, h heads of d: no autotuning, the same shape
    for the same sizes (a CUDA graph's replay). A chunk of at most MAX_CHUNK queries a key tile;
    BLOCK_S 64 keys while a launch has few programs (a decode step over a short context), else 128;
    one query a dot (tpd 1). A first guess, not yet timed on a GPU: `python -m bench.gpu_dsa --sweep`
    times the alternatives (BLOCK_S 64/128/256, 4/8 warps, 2/3 stages, chunks of 64/128, tpd 1/2)."""
    block_t = 1 if slots else min(t, MAX_CHUNK)
    block_s = 128
    if _cdiv(t, block_t) * _cdiv(n, block_s) < 512:
        block_s = 64
    return dict(block_t=block_t, block_tp=_next_pow2(block_t), block_s=block_s,
                block_h=max(MIN_DOT, _next_pow2(h)), block_d=max(MIN_DOT, _next_pow2(d)),
                tpd=1, num_warps=4, num_stages=2)


def _check(q, w, k, k_scale, q_pos, rows_slot) -> tuple[int, int, int, int]:
    """(T, H, D, S) of valid arguments; raises ValueError naming what is off."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"index_scores: q must be [T, H, D] with a unit last stride, got {tuple(q.shape)} "
                         f"{q.stride()}")
    t, h, d = q.shape
    want_k = 3 if rows_slot is not None else 2
    if k.dim() != want_k or k.shape[-1] != d or k.stride(-1) != 1:
        raise ValueError(f"index_scores: k must be [{'N, ' if want_k == 3 else ''}S, {d}] with a unit last stride, "
                         f"got {tuple(k.shape)} {k.stride()}")
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        raise ValueError(f"index_scores: q and k are one of {DTYPES}, the same; got {q.dtype}, {k.dtype}")
    if w.shape != (t, h) or w.dtype != torch.float32:
        raise ValueError(f"index_scores: w must be float32 [{t}, {h}], got {w.dtype} {tuple(w.shape)}")
    if k_scale.shape != k.shape[:-1] or k_scale.dtype != torch.float32:
        raise ValueError(f"index_scores: k_scale must be float32 {tuple(k.shape[:-1])}, got {k_scale.dtype} "
                         f"{tuple(k_scale.shape)}")
    if q_pos.shape != (t,) or q_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index_scores: q_pos must be int32/int64 [{t}], got {q_pos.dtype} {tuple(q_pos.shape)}")
    if rows_slot is not None and (rows_slot.shape != (t,) or rows_slot.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"index_scores: rows_slot must be int32/int64 [{t}], got {rows_slot.dtype} "
                         f"{tuple(rows_slot.shape)}")
    devices = {x.device for x in (q, w, k, k_scale, q_pos) + ((rows_slot,) if rows_slot is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"index_scores: the arguments are on several devices: {devices}")
    return t, h, d, k.shape[-2]


def _out(out, t: int, n: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty((t, n), dtype=torch.float32, device=device)
    if out.shape != (t, n) or out.dtype != torch.float32 or out.stride(-1) != 1 or out.device != device:
        raise ValueError(f"index_scores: out must be float32 [{t}, {n}] with a unit last stride on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} {out.stride()} on {out.device}")
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, q_pos: torch.Tensor,
                 out: torch.Tensor | None = None, n_keys: int | None = None,
                 rows_slot: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """The indexer's scores [T, n_keys] fp32 (module docstring); n_keys defaults to S, the cache's length.
    Positions may be anything: q_pos[t] >= n_keys scores every key, q_pos[t] < 0 none (a row of -inf).
    The caller guarantees 0 <= rows_slot < N. config overrides plan's entries (bench/gpu_dsa.py --sweep).
    Where the kernel can't run (no triton, a CPU tensor outside the interpreter) the reference answers."""
    t, h, d, s = _check(q, w, k, k_scale, q_pos, rows_slot)
    n = s if n_keys is None else n_keys
    if not 0 <= n <= s:
        raise ValueError(f"index_scores: n_keys must be in [0, {s}], got {n_keys}")
    out = _out(out, t, n, q.device)
    if not kernel_runs(q.device):
        out.copy_(index_scores_ref(q, w, k, k_scale, q_pos, n_keys=n, rows_slot=rows_slot))
        return out
    if t == 0 or n == 0:
        return out
    if q.dtype == torch.float32 or INTERPRETED:
        dot = 0
    elif q.dtype == FP8 and not _fp8_dot(q.device.index if q.device.index is not None else
                                         torch.cuda.current_device()):
        dot = 2
    else:
        dot = 1
    slots = rows_slot is not None
    p = plan(t, n, h, d, slots=slots) | (config or {})
    if slots and p["block_t"] != 1:
        raise ValueError(f"index_scores: a slot cache takes one query a program (block_t 1), got {p['block_t']}")
    p["block_tp"] = _next_pow2(p["block_t"])
    grid = (_cdiv(t, p["block_t"]), _cdiv(n, p["block_s"]))
    _index_kernel[grid](q, w, k, k_scale, q_pos, rows_slot if slots else q_pos, out, t, n, p["block_t"],
                        q.stride(0), q.stride(1), w.stride(0), w.stride(1), k.stride(0) if slots else 0,
                        k.stride(-2), k_scale.stride(0) if slots else 0, k_scale.stride(-1), out.stride(0),
                        H=h, D=d, BLOCK_H=p["block_h"], BLOCK_D=p["block_d"], BLOCK_S=p["block_s"],
                        BLOCK_TP=p["block_tp"], TPD=p["tpd"], SLOTS=slots, DOT=dot,
                        num_warps=p["num_warps"], num_stages=p["num_stages"])
    return out


def index_scores_ref(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                     q_pos: torch.Tensor, out: torch.Tensor | None = None, n_keys: int | None = None,
                     rows_slot: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of index_scores: fp32 (fp64 for fp64 inputs) per-head logits of a chunk of
    queries at a time (at most REF_ELEMENTS of them), relu, the weighted head sum, k_scale, the causal mask."""
    t, h, d = q.shape
    s = k.shape[-2]
    n = s if n_keys is None else n_keys
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    res = torch.empty((t, n), dtype=f, device=q.device)
    keys = torch.arange(n, device=q.device)
    step = max(1, REF_ELEMENTS // max(1, h * n))
    for a in range(0, t, step):
        b = min(t, a + step)
        if rows_slot is None:
            kk, ks = k[:n].to(f), k_scale[:n].to(f)                                     # [n, D], [n]
            logits = torch.einsum("thd,sd->ths", q[a:b].to(f), kk)                      # [c, H, n]
        else:
            sl = rows_slot[a:b].long()
            kk, ks = k[sl, :n].to(f), k_scale[sl, :n].to(f)                             # [c, n, D], [c, n]
            logits = torch.einsum("thd,tsd->ths", q[a:b].to(f), kk)
        res[a:b] = torch.einsum("ths,th->ts", logits.clamp_min_(0), w[a:b].to(f)) * ks
    res.masked_fill_(keys[None, :] > q_pos[:, None].long(), float("-inf"))
    if out is None:
        return res
    out.copy_(res)
    return out
