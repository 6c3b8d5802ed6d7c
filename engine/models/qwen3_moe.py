"""Qwen3-MoE: Qwen3 attention; FFN layers are softmax-top-k routed experts
(a dense MLP where config.mlp_only_layers / decoder_sparse_step say so)."""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.base import CausalLM, GatedMLP, RoutedExperts, TopKRouter
from engine.models.qwen3 import qwen3_stack


class Qwen3MoeSparseMoeBlock(RoutedExperts):
    """Router on the host; the routed experts are what an FFN backend runs."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts, layer_idx)
        self.gate = TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                               config.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)                                # [T, k], [T, k]
        return self.routed(x, ids, weights)                        # [T, H]


def _make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    if config.is_moe_layer(layer_idx):
        return Qwen3MoeSparseMoeBlock(config, layer_idx)
    return GatedMLP(config.hidden_size, config.intermediate_size, layer_idx)


class Qwen3MoeForCausalLM(CausalLM):
    slot_batching = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = qwen3_stack(config, make_mlp=_make_mlp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
