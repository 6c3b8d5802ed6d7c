"""The decoder's fused ops, and the one place that chooses how each runs.

    rms_norm(x, weight, eps)                       RMSNorm
    add_rms_norm(x, residual, weight, eps)         residual + x, then its RMSNorm -> (normed, sum)
    qk_norm_rope(q, k, positions, inv_freq, ...)   per-head RMSNorm of q and k, rotary, and the
                                                   KV-cache write at the positions
    decode_attention(q, k_cache, v_cache, positions, scale)
                                                   attention over a whole static cache, masked
                                                   to slots <= each row's position
    router_topk(logits, top_k, normalize)          softmax router -> ids int32, weights fp32
    gated_delta_decode(qkv, z, b, a, ...)          Qwen3.5's DeltaNet mixer for a few tokens: conv,
                                                   gates, the delta rule, the gated norm (one kernel)

Each `*_ref` is plain torch with the math of Hugging Face transformers' Llama / Qwen3 /
Qwen3-MoE, rounding to the model dtype where they round. The Triton kernels
(engine.gpu.ops_triton, engine.gpu.decode_attention, engine.gpu.delta_triton) run instead when the tensors are
on CUDA (or on any device under TRITON_INTERPRET=1: the tests) and triton imports;
DUCK_TRITON_OPS=0 keeps the references everywhere. tests/engine/test_ops_triton.py
holds each kernel to its reference.

Top-k ties: torch.topk leaves the order of equal values unspecified (on the CPU it
does not pick the lowest index). The kernel ranks experts by their logits (which order
the probabilities exactly) and, among equal logits, takes the lowest expert id. Only
exactly equal logits can make the two choose different experts, and those experts
then get the same weight.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

TRITON_OPS_ENV = "DUCK_TRITON_OPS"


@functools.cache
def _kernels():
    """(engine.gpu.ops_triton, engine.gpu.decode_attention), or None where triton does not import."""
    from engine.gpu import decode_attention, ops_triton

    return (ops_triton, decode_attention) if ops_triton.triton is not None else None


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether the ops below run their Triton kernels on tensors like x."""
    if os.environ.get(TRITON_OPS_ENV, "1") == "0":
        return False
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False                 # the CPU path never imports triton
    kernels = _kernels()
    return kernels is not None and kernels[0].runs_on(x)


# -- RMSNorm ------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N]: computed in fp32, cast to x's dtype, times weight;
    zero_centered (Qwen3.5): times (1 + weight) in fp32, then cast."""
    if triton_runs_on(x):
        rows = x.reshape(-1, x.shape[-1])
        return _kernels()[0].rms_norm(rows, weight, eps, zero_centered=zero_centered)[0].view(x.shape)
    return rms_norm_ref(x, weight, eps, zero_centered)


def add_rms_norm_ref(x, residual, weight, eps, zero_centered: bool = False):
    stream = x if residual is None else residual + x
    return rms_norm_ref(stream, weight, eps, zero_centered), stream


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) for x, residual [T, N]; residual None: x is the
    whole stream (the first layer). The sum is rounded to the model dtype, as HF's residual add is."""
    if residual is not None and triton_runs_on(x):
        return _kernels()[0].rms_norm(x, weight, eps, residual, zero_centered)
    return add_rms_norm_ref(x, residual, weight, eps, zero_centered)


# -- q/k norm, rotary, KV-cache write -----------------------------------------------------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qk_norm_rope_ref(q, k, positions, inv_freq, q_weight=None, k_weight=None, eps=0.0, *, v=None, k_cache=None,
                     v_cache=None, rows=None):
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    freqs = positions.float()[:, None] * inv_freq[None, :]   # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                   # [T, D]
    cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if k_cache is not None:
        k_cache.index_copy_(0, positions if rows is None else rows, k)
        v_cache.index_copy_(0, positions if rows is None else rows, v)
    return q, k


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0, *,
                 v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] -> (q, k) with RMSNorm over each head (Qwen3's q_norm/k_norm
    weights [D]; None: no norm, Llama) and half-split (rotate_half) rotary at positions [T]:
    freqs = positions * inv_freq [D/2] in fp32, cos/sin cast to q's dtype before the products.
    k_cache, v_cache [S, KVH, D] (one layer of a KVCache): k and v [T, KVH, D] are written
    there at positions (or at rows [T] int64 where given: a slot cache seen as one [N * S, KVH, D]),
    which the caller has checked to be within S."""
    if triton_runs_on(q):
        return _kernels()[0].qk_norm_rope(q, k, positions, inv_freq, q_weight, k_weight, eps, v, k_cache, v_cache,
                                          rows)
    return qk_norm_rope_ref(q, k, positions, inv_freq, q_weight, k_weight, eps, v=v, k_cache=k_cache,
                            v_cache=v_cache, rows=rows)


# -- attention over the static cache ------------------------------------------------------
def decode_attention_ref(q, k_cache, v_cache, positions, scale, masked: bool = True):
    """masked False: every row attends every slot given (one token at the last of them).
    A run's positions are consecutive; when it fills the slots from 0 (as many slots as rows: a
    prompt's first chunk) the mask is the causal one, given as such (head_attention)."""
    keys, values = k_cache.transpose(0, 1), v_cache.transpose(0, 1)   # [KVH, S, D]
    mask = None
    causal = masked and q.shape[0] > 1 and k_cache.shape[0] == q.shape[0]
    if masked and not causal:
        mask = positions[:, None] >= torch.arange(k_cache.shape[0], device=q.device)[None, :]  # [T, S]
    out = head_attention(q.transpose(0, 1), keys, values, mask, causal, scale)    # [H, T, D]
    return out.transpose(0, 1).reshape(out.shape[1], -1)


def head_attention(q, keys, values, mask, causal: bool, scale: float) -> torch.Tensor:
    """q [H, T, D] over keys [KVH, S, D] and values [KVH, S, Dv] (H a multiple of KVH) under a
    bool mask [T, S] or the causal one -> [H, T, Dv]. On CUDA with more than one row the call
    is 4-D with grouped heads expanded: SDPA's fused kernels (flash, memory-efficient) take
    only that; 3-D inputs or a GQA mask fall back to the math path, which materializes the
    H x T x S scores (32 x 8192^2 for a prompt). On the CPU it stays 3-D: the math path, whose
    bf16 results the kernels' tests are held to."""
    grouped = q.shape[0] != keys.shape[0]
    if q.is_cuda and q.shape[1] > 1:
        if grouped:
            keys = keys.repeat_interleave(q.shape[0] // keys.shape[0], 0)     # [H, S, D]
            values = values.repeat_interleave(q.shape[0] // values.shape[0], 0)
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                              is_causal=causal)[0]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, is_causal=causal,
                                          enable_gqa=grouped)


def decode_attention_slots_ref(q, k_cache, v_cache, positions, slots, scale):
    """q [T, H, D], one token per row, row t over slot slots[t] of a k/v cache [N, S, KVH, D]
    at positions <= positions[t] -> [T, H * D]: the slots gathered [T, S, KVH, D], zeroed past
    each row's position (a slot's cache is not cleared: a masked weight 0 times a NaN left
    there would still be NaN), one masked SDPA call."""
    s = k_cache.shape[1]
    mask = positions[:, None] >= torch.arange(s, device=q.device)[None, :]           # [T, S]
    past = ~mask[:, :, None, None]
    keys = k_cache.index_select(0, slots).masked_fill_(past, 0).transpose(1, 2)     # [T, KVH, S, D]
    values = v_cache.index_select(0, slots).masked_fill_(past, 0).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)               # [T, H, 1, D]
    return out.reshape(q.shape[0], -1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, slots: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] over a k/v cache [S, KVH, D] (GQA: H a multiple of KVH), row t over the
    slots <= positions[t] (within S) -> [T, H * D]. Fixed shapes, no host sync. With slots
    [T] (int64) the cache is a slot cache [N, S, KVH, D] and row t reads slot slots[t]
    (a batch's decode step, one token per sequence)."""
    if triton_runs_on(q):
        return _kernels()[1].decode_attention(q, k_cache, v_cache, positions, scale, slots=slots)
    if slots is not None:
        return decode_attention_slots_ref(q, k_cache, v_cache, positions, slots, scale)
    return decode_attention_ref(q, k_cache, v_cache, positions, scale)


# -- the softmax router -------------------------------------------------------------------
def router_topk_ref(logits, top_k, normalize):
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)   # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)          # [T, k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [T, E] -> (expert ids int32 [T, k], weights fp32 [T, k]): softmax in fp32,
    the top_k largest, renormalized to sum 1 when normalize (norm_topk_prob)."""
    if triton_runs_on(logits):
        return _kernels()[0].router_topk(logits, top_k, normalize)
    return router_topk_ref(logits, top_k, normalize)


# -- the gated DeltaNet mixer (Qwen3.5), decode ------------------------------------------
def gated_delta_decode(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       conv_state: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                       heads: tuple[int, int, int, int]) -> torch.Tensor:
    """engine.delta_rule.gated_delta_mixer (token by token) for a few tokens: one kernel
    where Triton runs, the torch reference elsewhere. conv_state and state change in place."""
    from engine.delta_rule import gated_delta_mixer

    args = (qkv, z, b, a, conv_state, conv_weight, a_log, dt_bias, norm_weight, eps, state, heads)
    if triton_runs_on(qkv):
        from engine.gpu import delta_triton

        if delta_triton.takes(qkv.shape[0], conv_weight.shape[-1]):
            return delta_triton.gated_delta_decode(*args)
    return gated_delta_mixer(*args)
