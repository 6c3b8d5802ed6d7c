"""Qwen3 dense: Llama with a per-head RMSNorm on q and k before rotary."""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers import KVCache, RMSNorm, RotaryEmbedding, cached_attention
from engine.models.base import CausalLM, DecoderStack, GatedMLP


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))     # [T, H, D]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)               # [T, KVH, D]
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(cached_attention(self.layer_idx, cache, positions, q, k, v, self.scale))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.mlp = mlp if mlp is not None else GatedMLP(config.hidden_size, config.intermediate_size, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def qwen3_stack(config: ModelConfig, make_mlp=None) -> DecoderStack:
    """Qwen3's decoder stack; make_mlp(config, i) gives layer i its FFN (default: a gated MLP)."""
    return DecoderStack(config, (Qwen3DecoderLayer(config, i, make_mlp(config, i) if make_mlp else None)
                                 for i in range(config.num_hidden_layers)))


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = qwen3_stack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
