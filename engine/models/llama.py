"""Llama (SmolLM2 and the like): GQA attention, rotary, RMSNorm, gated MLP."""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers import KVCache, RMSNorm, RotaryEmbedding, rotary_cached_attention
from engine.merged_linear import MergedLinear
from engine.models.base import CausalLM, DecoderStack, GatedMLP


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, qk_norm: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        # Qwen3: a per-head RMSNorm on q and k before rotary
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(config)
        self.scale = self.head_dim ** -0.5
        self.qkv = MergedLinear()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x, self.q_proj, self.k_proj, self.v_proj)   # one matmul; views of its output
        q = q.view(t, self.num_heads, self.head_dim)       # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)    # [T, KVH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)    # [T, KVH, D]
        out = rotary_cached_attention(self.layer_idx, cache, positions, q, k, v, self.rotary_emb, self.scale,
                                      self.q_norm, self.k_norm)           # [T, H * D]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP. The residual stream is carried beside the sublayer
    output, vLLM-style: each residual add is fused into the norm that follows it."""

    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module | None = None, qk_norm: bool = False):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, qk_norm)
        self.mlp = mlp if mlp is not None else GatedMLP(config.hidden_size, config.intermediate_size, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output (layer 0: the embeddings, residual None) ->
        (this layer's MLP output, the stream before it); the stream is residual + x."""
        x, residual = self.input_layernorm.add(x, residual)
        x, residual = self.post_attention_layernorm.add(self.self_attn(x, positions, cache), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    slot_batching = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, (LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
