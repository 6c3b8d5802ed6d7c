"""The model registry: config.json's model_type -> the class that runs it.

A new family is a new file plus one line here; DeepSeek-V3.x (deepseek_v3,
deepseek_v32) and Qwen3.5 (qwen3_5, qwen3_5_moe) register the same way.
"""
from __future__ import annotations

import importlib

from engine.config import ConfigError, ModelConfig

# model_type -> "module:Class", imported on first use
_REGISTRY: dict[str, str] = {
    "deepseek_v3": "engine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "deepseek_v32": "engine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "llama": "engine.models.llama:LlamaForCausalLM",
    "qwen3": "engine.models.qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "qwen3_5": "engine.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "engine.models.qwen3_5:Qwen3_5ForConditionalGeneration",
}


def register(model_type: str, target: str) -> None:
    """Adds (or replaces) a model family: target is 'package.module:ClassName'."""
    _REGISTRY[model_type] = target


def supported() -> list[str]:
    return sorted(_REGISTRY)


def model_class(config: ModelConfig):
    target = _REGISTRY.get(config.model_type)
    if target is None:
        raise ConfigError(f"{config.source}: model_type {config.model_type!r} is not supported; "
                          f"supported: {', '.join(supported())}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
