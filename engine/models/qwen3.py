"""Qwen3 dense: Llama with a per-head RMSNorm on q and k before rotary."""
from __future__ import annotations

from torch import nn

from engine.config import ModelConfig
from engine.models.base import CausalLM, DecoderStack
from engine.models.llama import LlamaDecoderLayer


def qwen3_stack(config: ModelConfig, make_mlp=None) -> DecoderStack:
    """Qwen3's decoder stack; make_mlp(config, i) gives layer i its FFN (default: a gated MLP)."""
    return DecoderStack(config, (LlamaDecoderLayer(config, i, make_mlp(config, i) if make_mlp else None, qk_norm=True)
                                 for i in range(config.num_hidden_layers)))


class Qwen3ForCausalLM(CausalLM):
    slot_batching = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = qwen3_stack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
