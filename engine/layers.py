"""Building blocks shared by the model files: RMSNorm, rotary embeddings, the
static KV cache and causal attention over it. Tensors carry no batch dimension:
one sequence, T tokens at a time."""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


class _DecodeMode(threading.local):
    static: bool = False


_mode = _DecodeMode()


@contextmanager
def static_decode():
    """Within (on this thread), attention covers the whole static cache under a mask
    built on the device from the positions: fixed shapes and no host sync, what a
    CUDA-graph capture needs. Exact: a masked slot gets zero weight, and unused slots
    hold finite values (zeros, or keys of an earlier request). The host-side checks
    (positions within the cache, linear-attention continuity) are then the caller's."""
    before = _mode.static
    _mode.static = True
    try:
        yield
    finally:
        _mode.static = before


def static_decode_active() -> bool:
    return _mode.static


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    exponent = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, smoothed))
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Half-split (rotate_half) rotary embedding as in Hugging Face Llama/Qwen.
    inv_freq is a plain fp32 tensor, not a buffer: it is computed, never loaded,
    and must survive building the model on the meta device."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inv_freq = rope_inv_freq(config)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                               # [T, D]
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass(slots=True)
class KVCache:
    """Static cache for one sequence: k, v [layers, max_model_len, kv_heads, head_dim]."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, config: ModelConfig, max_model_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "KVCache":
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        shape = (config.num_hidden_layers, max_model_len, config.num_key_value_heads, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_model_len(self) -> int:
        return self.k.shape[1]


def cached_attention(layer: int, cache: KVCache, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, scale: float) -> torch.Tensor:
    """Writes k, v [T, KVH, D] at positions, attends q [T, H, D] causally over the
    cache up to the last position (static_decode: over all of it, masked); returns [T, H * D]."""
    static = _mode.static
    end = cache.max_model_len if static else int(positions[-1]) + 1
    if end > cache.max_model_len:
        raise ValueError(f"position {end - 1} is beyond the KV cache (max_model_len={cache.max_model_len})")
    cache.k[layer].index_copy_(0, positions, k)
    cache.v[layer].index_copy_(0, positions, v)
    keys = cache.k[layer, :end].transpose(0, 1)     # [KVH, S, D]
    values = cache.v[layer, :end].transpose(0, 1)   # [KVH, S, D]
    mask = None
    if q.shape[0] > 1 or static:
        mask = positions[:, None] >= torch.arange(end, device=q.device)[None, :]  # [T, S]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=True)  # [H, T, D]
    return out.transpose(0, 1).reshape(q.shape[0], -1)
