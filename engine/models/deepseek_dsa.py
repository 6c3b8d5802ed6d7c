"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer and MLA over
the tokens it selects.

Per layer the indexer keeps one small key per token beside the latent cache: k =
LayerNorm(wk x), the first qk_rope_head_dim dims rotated half-split (MLA's own rotary is
interleaved), turned by a Walsh-Hadamard matrix and rounded to fp8 (e4m3) with one scale
per token (index_head_dim <= 128: one quantization block, as the checkpoint's 128), the
scale a power of two where the config says scale_fmt "ue8m0". A query scores every
earlier token:

    score[t, s] = k_scale[s] * sum_h w[t, h] * relu(q8[t, h] . k8[s])
    w[t, h]     = weights_proj(x)[t, h] * index_n_heads^-0.5 * index_head_dim^-0.5 * q_scale[t, h]

and attends, in latent space (kv_b_proj absorbed, as a decode step does), to its
index_topk best only. Within index_topk tokens every earlier token is selected, so the
callers keep dense attention there and score nothing (the keys are written all the same).
The Hadamard turn leaves dot products unchanged; it spreads outliers before the fp8
rounding. `exact` (tests: transformers' DeepseekV32 skips the rounding) keeps the keys in
the model's dtype, unrounded and unturned.

Scores run on the GPU in engine.gpu.dsa_index's fused kernel where it is importable (one
sequence's rows), else in torch here, a block of rows at a time so that [rows, heads, keys]
stays under SCORE_BYTES; the torch path is the reference the kernel is held to.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4            # a zero vector's scale (DeepSeek's act_quant clamps amax the same)
QUANT_BLOCK = 128            # the checkpoint's quantization block: index_head_dim must fit one
SCORE_BYTES = {"cpu": 8 << 20, "cuda": 256 << 20}   # the torch scorer's largest fp32 [rows, heads, keys]
                                                     # block: within the CPU's caches
GATHER_BYTES = 256 << 20     # the largest [rows, index_topk, latent] block the sparse MLA gathers


@functools.lru_cache(maxsize=8)
def hadamard(d: int, device: torch.device) -> torch.Tensor:
    """The Walsh-Hadamard matrix of order d (a power of two), Sylvester's order, scaled by
    d^-0.5: orthogonal and symmetric, so x @ H turns each row."""
    if d & (d - 1):
        raise ValueError(f"index_head_dim={d}: the Hadamard turn needs a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * d ** -0.5).to(device)


def quantize(x: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> fp8 values [..., D] and one fp32 scale per vector [...]: amax / 448,
    rounded up to a power of two under ue8m0."""
    amax = x.float().abs().amax(-1).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def put_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst[rows] = src along dim 0 for any dtype (the CPU has no fp8 index_copy_: bytes are copied)."""
    if dst.dtype == FP8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, rows, src)


def take_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """src[rows] along dim 0 (rows of any shape), fp8 included."""
    if src.dtype == FP8:
        return src.view(torch.uint8)[rows].view(FP8)
    return src[rows]


class DeepseekV32Indexer(nn.Module):
    """The lightning indexer's weights (the checkpoint's names) and its per-token work."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, topk: int,
                 rotary, ue8m0: bool):
        super().__init__()
        if head_dim > QUANT_BLOCK:
            raise ValueError(f"index_head_dim={head_dim}: at most {QUANT_BLOCK} (one fp8 block per key)")
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False)
        self.heads, self.head_dim, self.topk = heads, head_dim, topk
        self.rotary, self.ue8m0 = rotary, ue8m0      # rotary: half-split, on the first rope dims
        self.exact = False                           # True: no fp8 rounding (see the module's docstring)

    def key_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.exact else FP8

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] (attention's normed input), q_latent [T, q_lora_rank] (MLA's normed
        query latent) -> queries [T, H, D], their weights [T, H] fp32 (every scale folded
        in), keys [T, D] and key scales [T] fp32 for the cache."""
        t, rope = x.shape[0], self.rotary.inv_freq.numel() * 2
        q = self.wq_b(q_latent).view(t, self.heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        q_rot, k_rot = self.rotary(positions, q[..., :rope], k[:, None, :rope])
        q = torch.cat((q_rot, q[..., rope:]), -1)
        k = torch.cat((k_rot[:, 0], k[:, rope:]), -1)
        w = self.weights_proj(x).float() * (self.heads ** -0.5 * self.head_dim ** -0.5)
        if self.exact:
            return q, w, k, torch.ones(t, dtype=torch.float32, device=x.device)
        turn = hadamard(self.head_dim, x.device)
        q8, q_scale = quantize(q.float() @ turn, self.ue8m0)
        k8, k_scale = quantize(k.float() @ turn, self.ue8m0)
        return q8, w * q_scale, k8, k_scale


def scores_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor,
                 keep: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], w [T, H], keys [S, D] (or [T, S, D]: each row its own), key_scale [S]
    (or [T, S]), keep [T, S] bool -> scores [T, S] fp32, -inf where keep is false. A block of
    rows at a time, its [rows, H, S] logits under SCORE_BYTES (per-row keys widened a block at
    a time too)."""
    t, h, _ = q.shape
    s = keys.shape[-2]
    out = torch.empty(t, s, dtype=torch.float32, device=q.device)
    qf = q.float()
    shared = keys.float() if keys.dim() == 2 else None
    rows = max(1, SCORE_BYTES.get(q.device.type, 8 << 20) // (4 * h * s))
    for a in range(0, t, rows):
        b = min(t, a + rows)
        if shared is not None:
            logits = torch.einsum("thd,sd->ths", qf[a:b], shared)
        else:
            logits = torch.einsum("thd,tsd->ths", qf[a:b], keys[a:b].float())
        torch.bmm(w[a:b, None, :], logits.relu_(), out=out[a:b, None, :])     # sum over heads
    out.mul_(key_scale.float()).masked_fill_(~keep, float("-inf"))
    return out


def index_scores(q, w, keys, key_scale, positions: torch.Tensor, end: int) -> torch.Tensor:
    """One sequence: queries at positions [T] over its first `end` keys -> [T, end] fp32,
    -inf past each query's position."""
    kernel = _kernel(q)
    if kernel is not None:
        return kernel(q, w, keys, key_scale, positions, n_keys=end)
    keep = positions[:, None] >= torch.arange(end, device=q.device)[None, :]
    return scores_torch(q, w, keys[:end], key_scale[:end], keep)


def slot_scores(q, w, keys, key_scale, positions: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Row b of a batch's decode step over slot slots[b] of a slot cache (keys [N, S, D],
    key_scale [N, S]) up to its position (keep [B, E]: the first E keys, true up to it) -> [B, E]."""
    end = keep.shape[-1]
    kernel = _kernel(q)
    if kernel is not None:
        return kernel(q, w, keys, key_scale, positions, n_keys=end, rows_slot=slots)
    return scores_torch(q, w, take_rows(keys[:, :end], slots), key_scale[:, :end].index_select(0, slots), keep)


def _kernel(q: torch.Tensor):
    """engine.gpu.dsa_index's kernel where it runs for q: CUDA, or Triton's interpreter (tests)."""
    mod = _kernel_module()
    return mod.index_scores if mod is not None and (q.is_cuda or mod.INTERPRETED) else None


@functools.lru_cache(maxsize=1)
def _kernel_module():
    try:
        from engine.gpu import dsa_index
    except ImportError:       # no Triton (a CPU-only install)
        return None
    return dsa_index


def select(scores: torch.Tensor, topk: int, graph_safe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, S] -> the best min(topk, S) key positions per row [T, K] and whether each
    is a real choice [T, K] (false: a masked key, where a row has fewer than K before it).
    Equal scores at a row's edge (a key every head's ReLU zeroes scores 0) go to the earlier
    position, so the choice is the same whatever the shape of the call (a prompt whole or in
    chunks, alone or in a batch). The plain top-k runs first; rows with such a tie are chosen
    again on an int64 key (the score's bits made order-preserving, above the position), which
    graph_safe (a CUDA graph: no host sync) does for every row."""
    k = min(topk, scores.shape[-1])
    if graph_safe:
        picks = _keyed_topk(scores, k)
    else:
        best = scores.topk(k, dim=-1)
        picks, edge = best.indices, best.values[:, -1:]
        tied = ((scores >= edge).sum(-1) > k) & (edge[:, 0] > float("-inf"))
        if tied.any():
            rows = tied.nonzero()[:, 0]
            picks[rows] = _keyed_topk(scores[rows], k)
    return picks, scores.gather(-1, picks) > float("-inf")


def _keyed_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    bits = (scores + 0.0).view(torch.int32)                         # + 0.0: -0.0 becomes 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    n = scores.shape[-1]
    key = ordered * (1 << 32) + torch.arange(n - 1, -1, -1, device=scores.device)
    return key.topk(k, dim=-1).indices


def sparse_latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                            k_ropes: torch.Tensor, picks: torch.Tensor, valid: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """MLA in latent space over each row's own keys: q_latent [T, H, R] (kv_b_proj's key part
    absorbed), q_rope [T, H, r]; latents [N, R] and k_ropes [N, r] (a cache seen flat); picks
    [T, K] rows of them, valid [T, K] -> the attention-weighted latents [T, H, R]. Invalid
    picks are zeroed before use (a slot's stale memory may hold NaN) and masked."""
    t, k = picks.shape
    out = torch.empty_like(q_latent)
    rows = max(1, GATHER_BYTES // max(1, k * latents.shape[-1] * latents.element_size()))
    for a in range(0, t, rows):
        b = min(t, a + rows)
        drop = ~valid[a:b, :, None]
        lat = latents[picks[a:b]].masked_fill_(drop, 0)                                # [t, K, R]
        kr = k_ropes[picks[a:b]].masked_fill_(drop, 0)                                 # [t, K, r]
        scores = (torch.einsum("thr,tkr->thk", q_latent[a:b], lat)
                  + torch.einsum("thp,tkp->thk", q_rope[a:b], kr)) * scale             # [t, H, K]
        probs = scores.float().masked_fill_(drop.transpose(1, 2), float("-inf")).softmax(-1).to(lat.dtype)
        out[a:b] = torch.einsum("thk,tkr->thr", probs, lat)
    return out


def cache_bytes_per_token(kv_lora_rank: int, rope_dim: int, index_head_dim: int, layers: int,
                          dtype_bytes: int) -> int:
    """One position's cache across layers: the latent and rotary key, and with an indexer its
    fp8 key and fp32 scale."""
    per_layer = (kv_lora_rank + rope_dim) * dtype_bytes + (index_head_dim + 4 if index_head_dim else 0)
    return per_layer * layers


def row_chunk(keys: int) -> int:
    """Query rows scored and selected at once: their [rows, keys] fp32 scores and int64
    selection keys stay under 256 MB."""
    return max(1, min(1024, (256 << 20) // (12 * keys)))

