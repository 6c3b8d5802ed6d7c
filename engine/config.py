"""Model configuration: the fields of a Hugging Face config.json that our models
use, as one slotted dataclass that checks itself."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can run; says which field."""


# Hugging Face has renamed a few fields across versions; published checkpoints
# use the left spelling, transformers 5 saves the right one.
_ALIASES = {"num_local_experts": "num_experts", "n_routed_experts": "num_experts"}

# rope_scaling types every model supports through engine.layers, and the extra
# ones a model family implements itself (its model file validates the fields)
_ROPE_TYPES = ("default", "linear", "llama3")
_FAMILY_ROPE_TYPES = {"deepseek_v3": ("yarn",), "deepseek_v32": ("yarn",)}


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0          # 0: same as num_attention_heads
    head_dim: int = 0                     # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    # mixture of experts (0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # checkpoint facts
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    fp8_block: tuple[int, int] | None = None  # fp8 e4m3 weights with weight_scale_inv blocks
    # config.json keys without a field here (family-specific: a model file validates what it reads)
    extra: dict = field(default_factory=dict)
    source: str = "<config>"

    def __post_init__(self):
        where = f"{self.source}"
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if name == "intermediate_size" and self._all_layers_moe():
                continue  # no dense FFN anywhere: checkpoints may omit it (Qwen3.5-MoE)
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{where}: {name} must be a positive integer, got {getattr(self, name)!r}")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"{where}: hidden_size={self.hidden_size} is not divisible by "
                                  f"num_attention_heads={self.num_attention_heads}; set head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ConfigError(f"{where}: head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act != "silu":
            raise ConfigError(f"{where}: hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError(f"{where}: rms_norm_eps and rope_theta must be positive")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            allowed = _ROPE_TYPES + _FAMILY_ROPE_TYPES.get(self.model_type, ())
            if kind not in allowed:
                raise ConfigError(f"{where}: rope_scaling type {kind!r} is not supported for {self.model_type} "
                                  f"(supported: {', '.join(allowed)})")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"{where}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                                  f"1..num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"{where}: moe_intermediate_size must be positive for an MoE model")
            if self.decoder_sparse_step <= 0:
                raise ConfigError(f"{where}: decoder_sparse_step must be positive")
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = (self.eos_token_id,)
        self.eos_token_id = tuple(int(i) for i in (self.eos_token_id or ()))
        if self.fp8_block is not None:
            self.fp8_block = tuple(int(b) for b in self.fp8_block)
            if len(self.fp8_block) != 2 or min(self.fp8_block) <= 0:
                raise ConfigError(f"{where}: weight_block_size must be two positive integers, got {self.fp8_block}")

    def _all_layers_moe(self) -> bool:
        return (self.num_experts > 0 and self.decoder_sparse_step == 1 and not self.mlp_only_layers
                and self.intermediate_size == 0)

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: dict, source: str = "<config>") -> "ModelConfig":
        d = dict(d)
        if "hidden_size" not in d and isinstance(d.get("text_config"), dict):  # multimodal wrappers
            # the wrapper's model_type names the checkpoint layout (e.g. qwen3_5: model.language_model.*)
            d = {**d, **d["text_config"], "model_type": d.get("model_type", d["text_config"].get("model_type"))}
        raw = dict(d)
        for old, new in _ALIASES.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        rope = d.pop("rope_parameters", None)  # transformers 5 spelling
        if rope:
            d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        quant = d.pop("quantization_config", None)
        if quant:
            if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
                raise ConfigError(f"{source}: quantization {quant.get('quant_method')!r} is not supported "
                                  f"(only fp8 e4m3 with block scales)")
            d["fp8_block"] = tuple(quant.get("weight_block_size") or (128, 128))
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
        if "model_type" not in d:
            raise ConfigError(f"{source}: no model_type")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        kwargs["extra"] = {k: v for k, v in raw.items() if k not in names and k != "text_config"}
        if kwargs.get("num_experts") and "intermediate_size" not in kwargs:
            kwargs["intermediate_size"] = 0  # every layer MoE; __post_init__ checks that
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if n not in kwargs]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)}")
        return cls(source=source, **kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read config: {e}") from e
        return cls.from_dict(d, source=str(path))
