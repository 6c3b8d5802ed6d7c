"""fp8 e4m3 linear with block scales, the weights kept fp8 in (GPU) memory.

    y[T, N] = x[T, K] @ (W[N, K] * S[ceil(N/bn), ceil(K/bk)], each scale over its bn x bk block)^T

DeepSeek-V3/V3.2 checkpoints store W as e4m3 codes and S as weight_scale_inv with
128 x 128 blocks. Dequantizing them to bf16 doubles the GPU memory of every
projection; these kernels read the 1-byte codes and apply the scale of each
(n block, k block) to the fp32 partial sum of that k block.

fp8_linear_ref      the torch reference: dequantize, one fp32 matmul
fp8_linear_triton   the Triton kernels, two tilings (choose_config picks one):
    gemv  T <= 4 (decode): CUDA-core FMAs on [BLOCK_N, BLOCK_K] weight tiles, many
          small N tiles and split-K so that every SM streams weights: HBM-bound.
    gemm  T > 4: tl.dot with the weight as the left operand ("swap AB":
          acc[BLOCK_N, BLOCK_T] = W_tile @ x_tile^T), so a handful of tokens fills
          the dot's narrow side and the upcast weight tile is the operand Hopper's
          wgmma can take from registers.
Fp8Linear           the module; fp8_linears_from_checkpoint swaps a loaded model's
                    fp8-sourced nn.Linear for it.

Split-K partials go to an fp32 workspace [split_k, T, N] that a second small kernel
sums and casts (no atomics: results are deterministic). With TRITON_INTERPRET=1 set
before triton and this module are imported, the kernels run in Triton's interpreter
on CPU tensors (the tests).
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.weights import WeightError, block_scales, dequantize_fp8_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: Fp8Linear runs the reference
    triton = None

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
GEMV_MAX_T = 4            # the FMA tiling up to this many tokens, tl.dot beyond
MIN_DOT = 16              # tl.dot needs every tile side >= 16
SUM_BLOCK = 1024          # elements per program of the split-K sum
MIN_SPLIT_K_TILES = 4     # choose_config: a split-K program streams at least this many k tiles
# nn.Linear modules whose .weight is read as a matrix rather than called: DeepSeek's
# absorbed MLA decode folds kv_b_proj.weight into the query and the output
KEEP_DENSE = (r"(^|\.)kv_b_proj$",)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     name: str = "<weight>") -> torch.Tensor:
    """Validates an e4m3 weight [N, K] and its block scales; returns the scales as
    float32 [ceil(N/bn), ceil(K/bk)] (a single row of scales may come 1-D)."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise WeightError(f"{name}: expected a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    scale = block_scales(*weight.shape, scale_inv, block, name)
    if scale.device != weight.device:
        raise WeightError(f"{name}: weight on {weight.device}, weight_scale_inv on {scale.device}")
    return scale


def fp8_linear_ref(x: torch.Tensor, weight_fp8: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """x [..., K] @ dequantized(W)^T -> [..., N] in x's dtype, accumulated in fp32 (fp64 for fp64 x)."""
    check_fp8_weight(weight_fp8, scale_inv, block, "fp8_linear_ref")
    w = dequantize_fp8_blocks(weight_fp8, scale_inv, block, name="fp8_linear_ref")   # [N, K] fp32
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return F.linear(x.to(acc), w.to(acc)).to(x.dtype)


# -- tilings ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fp8LinearConfig:
    """One launch of fp8_linear_triton: which kernel and its tile sizes.
    block_k must divide the scale block's K side (a k tile never straddles two scales)."""
    kind: str          # "gemv" (FMAs, block_t <= 8 tokens unrolled) or "gemm" (tl.dot)
    block_t: int
    block_n: int
    block_k: int
    split_k: int = 1   # K ranges computed by separate programs, fp32 partials summed after
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.kind not in ("gemv", "gemm"):
            raise ValueError(f"Fp8LinearConfig.kind must be 'gemv' or 'gemm', got {self.kind!r}")
        sides = dict(block_t=self.block_t, block_n=self.block_n, block_k=self.block_k)
        bad = [f"{k}={v}" for k, v in sides.items() if not _pow2(v)]
        if bad:
            raise ValueError(f"Fp8LinearConfig: tile sides must be powers of two, got {', '.join(bad)}")
        if self.kind == "gemm" and min(sides.values()) < MIN_DOT:
            raise ValueError(f"Fp8LinearConfig: the gemm kernel's tl.dot needs tiles >= {MIN_DOT}, got {sides}")
        if self.kind == "gemv" and self.block_t > 8:
            raise ValueError(f"Fp8LinearConfig: the gemv kernel unrolls its tokens, block_t <= 8, got {self.block_t}")
        if self.split_k < 1:
            raise ValueError(f"Fp8LinearConfig.split_k must be >= 1, got {self.split_k}")


def _largest_block_k(scale_bk: int, cap: int = 128) -> int:
    bk = cap
    while bk > 1 and scale_bk % bk:
        bk //= 2
    return bk


@functools.lru_cache(maxsize=1024)
def choose_config(t: int, n: int, k: int, block: tuple[int, int] = DEFAULT_BLOCK,
                  sm_count: int = 132) -> Fp8LinearConfig:
    """The default tiling for x [t, k] and W [n, k] on a GPU with sm_count SMs: enough
    programs that every SM has several weight streams in flight (decode), or one
    wave of 128-wide dot tiles split along K when the tiles alone are too few."""
    bk = _largest_block_k(block[1])
    if bk < MIN_DOT:
        raise ValueError(f"scale block {block}: its K side {block[1]} has no power-of-two divisor >= {MIN_DOT} "
                         f"for a k tile; fp8_linear_triton does not support it (use fp8_linear_ref)")
    if t <= GEMV_MAX_T:
        bt = 1 if t <= 1 else 2 if t == 2 else 4
        kind, bn, warps, stages, target = "gemv", 32, 4, 3, 8 * sm_count
    elif t <= 16:
        kind, bt, bn, warps, stages, target = "gemm", 16, 64, 4, 4, 4 * sm_count
    else:
        bt = 64 if t <= 64 else 128   # 8 warps: with 4, a 64 x 128 tile spills registers on sm_90
        kind, bn, warps, stages, target = "gemm", 128, 8, 3, sm_count
    tiles = _cdiv(t, bt) * _cdiv(n, bn)
    k_tiles = _cdiv(k, bk)
    split = max(1, min(_cdiv(k_tiles, MIN_SPLIT_K_TILES), target // tiles))
    return Fp8LinearConfig(kind, bt, bn, bk, _cdiv(k_tiles, _cdiv(k_tiles, split)), warps, stages)


def k_splits(k: int, config: Fp8LinearConfig) -> tuple[int, int]:
    """(splits, k tiles per split) that a launch with config makes for K = k: split_k
    evened out so that no split is empty (the workspace has that many rows)."""
    k_tiles = _cdiv(k, config.block_k)
    per_split = _cdiv(k_tiles, config.split_k)
    return _cdiv(k_tiles, per_split), per_split


# -- the kernels -----------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, k_tiles_per_split,
                         stride_xt, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
                         stride_os, stride_ot, stride_on,
                         SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        t_tiles = tl.cdiv(T, BLOCK_T)
        pid_t = tl.program_id(0) % t_tiles      # token tiles vary fastest: neighbours share a weight tile
        pid_n = tl.program_id(0) // t_tiles
        split = tl.program_id(1)
        rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        first = split * k_tiles_per_split
        last = tl.minimum(first + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
        for kt in range(first, last):
            rk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :] * stride_wk,
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)            # [BN, BK]
            s = tl.load(s_ptr + (rn // SCALE_BN) * stride_sn + (kt * BLOCK_K // SCALE_BK) * stride_sk,
                        mask=n_ok, other=0.0)                                                    # [BN]
            for i in tl.static_range(BLOCK_T):
                t = pid_t * BLOCK_T + i
                xi = tl.load(x_ptr + t * stride_xt + rk * stride_xk, mask=k_ok & (t < T),
                             other=0.0).to(tl.float32)                                          # [BK]
                part = tl.sum(w * xi[None, :], axis=1) * s                                       # [BN]
                acc += tl.where(rt[:, None] == t, part[None, :], 0.0)                            # row i of [BT, BN]
        tl.store(out_ptr + split * stride_os + rt[:, None] * stride_ot + rn[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=(rt[:, None] < T) & n_ok[None, :])

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, k_tiles_per_split,
                         stride_xt, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
                         stride_os, stride_ot, stride_on,
                         SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_FP32: tl.constexpr):
        t_tiles = tl.cdiv(T, BLOCK_T)
        pid_t = tl.program_id(0) % t_tiles
        pid_n = tl.program_id(0) // t_tiles
        split = tl.program_id(1)
        rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        t_ok, n_ok = rt < T, rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)                                     # y^T tile
        first = split * k_tiles_per_split
        last = tl.minimum(first + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
        for kt in range(first, last):
            rk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :] * stride_wk,
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)                           # [BN, BK] fp8
            xt = tl.load(x_ptr + rk[:, None] * stride_xk + rt[None, :] * stride_xt,
                         mask=k_ok[:, None] & t_ok[None, :], other=0.0)                          # [BK, BT]
            s = tl.load(s_ptr + (rn // SCALE_BN) * stride_sn + (kt * BLOCK_K // SCALE_BK) * stride_sk,
                        mask=n_ok, other=0.0)                                                    # [BN]
            if DOT_FP32:  # fp32 activations, and the interpreter (whose dot has no bf16)
                part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:         # e4m3 values are exact in bf16 and fp16
                part = tl.dot(w.to(xt.dtype), xt)
            acc += part * s[:, None]
        tl.store(out_ptr + split * stride_os + rn[:, None] * stride_on + rt[None, :] * stride_ot,
                 acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(ws_ptr, out_ptr, splits, numel, BLOCK: tl.constexpr):
        """out = the sum of the split-K partials ws [splits, numel] (fp32), in out's dtype."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in range(splits):
            acc += tl.load(ws_ptr + split * numel + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

    INTERPRETED = type(_fp8_gemm_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def fp8_linear_triton(x: torch.Tensor, weight_fp8: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int] = DEFAULT_BLOCK, *, config: Fp8LinearConfig | None = None,
                      out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (bf16, fp16 or fp32) @ W^T -> [T, N] in x's dtype, W as e4m3 codes [N, K]
    with float32 block scales; config: the tiling (choose_config's when None). out: a
    contiguous [T, N] to write into; workspace: contiguous fp32 [k_splits(K, config)[0], T, N]
    for the split-K partials. Both are made when absent (pass them for static buffers, as
    CUDA graphs want)."""
    if triton is None:
        raise RuntimeError("fp8_linear_triton needs triton (pip install triton; torch's CUDA wheels bring it)")
    scale = check_fp8_weight(weight_fp8, scale_inv, block, "fp8_linear_triton")
    if x.dim() != 2 or x.shape[1] != weight_fp8.shape[1]:
        raise ValueError(f"fp8_linear_triton: x must be [T, {weight_fp8.shape[1]}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_linear_triton: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.device != weight_fp8.device:
        raise ValueError(f"fp8_linear_triton: x on {x.device}, weight on {weight_fp8.device}")
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"fp8_linear_triton: tensors on {x.device} need TRITON_INTERPRET=1 set before "
                         f"engine.gpu.fp8 is imported (or use fp8_linear_ref)")
    (t, k), n = x.shape, weight_fp8.shape[0]
    if out is None:
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    elif out.shape != (t, n) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"fp8_linear_triton: out must be a contiguous {x.dtype} [{t}, {n}] on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if t == 0 or n == 0 or k == 0:
        return out.zero_()
    cfg = config or choose_config(t, n, k, tuple(block), _sm_count(x.device))
    if block[1] % cfg.block_k:
        raise ValueError(f"fp8_linear_triton: block_k={cfg.block_k} does not divide the scale block's K side "
                         f"{block[1]}: a k tile would straddle two scales")
    split, per_split = k_splits(k, cfg)
    # the interpreter casts fp32 to bf16/fp16 by truncation: there the kernels write fp32
    # and torch rounds (to nearest even, as the GPU's stores do)
    final = torch.empty((t, n), dtype=torch.float32, device=x.device) if (
        INTERPRETED and out.dtype != torch.float32) else out
    target = out if split == 1 and final is out else workspace
    if target is None:
        target = workspace = torch.empty((split, t, n), dtype=torch.float32, device=x.device)
    elif target is workspace and (workspace.shape != (split, t, n) or workspace.dtype != torch.float32
                                  or workspace.device != x.device or not workspace.is_contiguous()):
        raise ValueError(f"fp8_linear_triton: workspace must be a contiguous float32 [{split}, {t}, {n}] on "
                         f"{x.device}, got {workspace.dtype} {tuple(workspace.shape)} on {workspace.device}")
    grid = (_cdiv(t, cfg.block_t) * _cdiv(n, cfg.block_n), split)
    args = (x, weight_fp8, scale, target, t, n, k, per_split, x.stride(0), x.stride(1),
            weight_fp8.stride(0), weight_fp8.stride(1), scale.stride(0), scale.stride(1),
            t * n if target is workspace else 0, n, 1)
    tiles = dict(SCALE_BN=block[0], SCALE_BK=block[1], BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.kind == "gemv":
        _fp8_gemv_kernel[grid](*args, **tiles)
    else:
        dot_fp32 = x.dtype == torch.float32 or INTERPRETED
        _fp8_gemm_kernel[grid](*args, **tiles, DOT_FP32=dot_fp32)
    if target is workspace:
        _sum_splits_kernel[(_cdiv(t * n, SUM_BLOCK),)](workspace, final, split, t * n, BLOCK=SUM_BLOCK)
    if final is not out:
        out.copy_(final)
    return out


# -- the module --------------------------------------------------------------------
def _triton_runs_on(x: torch.Tensor) -> bool:
    return triton is not None and (x.device.type == "cuda" or INTERPRETED)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W held as e4m3 codes [N, K] (buffer `weight`) and float32
    block scales (buffer `weight_scale_inv`): the checkpoint's own tensors and names.
    Triton where it runs (CUDA tensors, or any under the interpreter), the torch
    reference elsewhere."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                 block: tuple[int, int] = DEFAULT_BLOCK):
        super().__init__()
        scale = check_fp8_weight(weight, weight_scale_inv, tuple(block), "Fp8Linear")
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)                                          # [T, K]
        if _triton_runs_on(x):
            y = fp8_linear_triton(rows, self.weight, self.weight_scale_inv, self.block)
        else:
            y = fp8_linear_ref(rows, self.weight, self.weight_scale_inv, self.block)    # [T, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        # model.to(device) moves the codes and scales; a dtype change (model.to(bf16),
        # .float()) must not re-type them: that is the blow-up this module avoids
        fixed = {name: self._buffers.pop(name) for name in ("weight", "weight_scale_inv")}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in fixed.items():
                device = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device
                self._buffers[name] = t.to(device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}")


def fp8_linears_from_checkpoint(model: nn.Module, keep_dense: tuple[str, ...] = KEEP_DENSE) -> list[str]:
    """Replaces every nn.Linear of model whose weight was loaded from fp8 (load_weights
    leaves `fp8_source` on it) by an Fp8Linear made from the checkpoint's codes and
    scales, on the linear's device; returns the replaced modules' names.
    Left alone: the FFNs an FFN backend runs (their packers read the codes themselves)
    and modules whose name matches a keep_dense regex (their weight is read as a matrix)."""
    owned = {id(p) for m in model.modules() if hasattr(m, "ffn_layer") and getattr(m, "layer_idx", -1) >= 0
             for p in m.expert_parameters()}
    keep = [re.compile(p) for p in keep_dense]
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and hasattr(m.weight, "fp8_source") and id(m.weight) not in owned
              and not any(p.search(name) for p in keep)]
    saved = 0
    for name, linear in chosen:
        ckpt, cname, sname = linear.weight.fp8_source
        codes = ckpt.get(cname)
        if codes.dtype != FP8 or tuple(codes.shape) != tuple(linear.weight.shape):
            raise WeightError(f"{name}: checkpoint tensor {cname!r} in {ckpt.file_of(cname)} is {codes.dtype} "
                              f"{tuple(codes.shape)}, the module holds {tuple(linear.weight.shape)} from fp8")
        device = linear.weight.device
        block = ckpt.fp8_block or DEFAULT_BLOCK
        scale = check_fp8_weight(codes, ckpt.get(sname), block, cname)
        swapped = Fp8Linear(codes.to(device), scale.to(device), linear.bias, block)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, swapped)
        saved += linear.weight.nbytes - swapped.weight.nbytes - swapped.weight_scale_inv.nbytes
    log.info("fp8: %d linear modules now hold their checkpoint's e4m3 codes (%.2f GiB less than dense)",
             len(chosen), saved / 2**30)
    return [name for name, _ in chosen]
