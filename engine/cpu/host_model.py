"""The C description (native/host/host_decoder.h: duck_host_model) of a model's
host part: the torch tensors the native decoder reads in place, checked for
what it needs (fp32, on the CPU, dense, the Llama family's layout), and
kept referenced for as long as the description lives.

The projections (q, k, v, o) and lm_head are read as float16 copies by default
(weights="float16", packed in the kernels' panels of 16 rows): half the bytes
of a decode step, which on the CPU is bound by memory bandwidth; the arithmetic
stays fp32 and the rounding (2^-11 relative per weight) is far below the fp9
experts'. weights="float32" reads the model's own tensors in place. A model
with weights beyond float16's range raises HalfOverflow, one whose head_dim is
not a multiple of 16 (the packed panels' rows) HalfUnfit: engine.cpu.decode
then takes float32.

The KV cache may be float32 or float16, with its dimensions [max_len, kv_heads,
head_dim] or the heads outer in memory (engine.cpu.decode.native_cache makes
the native decoder's own: float16, heads outer, so that attention reads each
head's keys and values as one stream of half the bytes).

Supported: Llama (SmolLM2 and the like), Qwen3 (per-head q/k RMSNorm) and
Qwen3-MoE (softmax top-k router on the host). Anything else raises
UnsupportedModel saying why; engine.cpu.decode then keeps the torch path.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers import KVCache, SlotKVCache, rope_inv_freq
from engine.models.base import GatedMLP
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock
from native._native import ffi, lib
from native.host.ops import pack_half

FAMILIES = (LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)
SUPPORTED = ("llama", "qwen3", "qwen3_moe")


WEIGHT_TYPES = ("float16", "float32")
KV_TYPES = {torch.float32: lib.DUCK_HOST_F32, torch.float16: lib.DUCK_HOST_F16}


class UnsupportedModel(ValueError):
    """The native CPU decoder cannot run this model (or this cache); says why."""


class HalfUnfit(UnsupportedModel):
    """The model cannot have float16 projections (engine.cpu.decode then takes float32)."""


class HalfOverflow(HalfUnfit):
    """A projection or lm_head holds values float16 cannot (|w| > 65504)."""


class HostModel:
    """duck_host_model and its layer table for one model and one KV cache.
    .model is the cffi struct; .ffn[i] the module whose backend runs layer i's FFN."""

    def __init__(self, model, cache: KVCache, max_tokens: int, weights: str = "float16"):
        if weights not in WEIGHT_TYPES:
            raise ValueError(f"host weights {weights!r}: expected one of {', '.join(WEIGHT_TYPES)}")
        self.weights = weights
        config = model.config
        if type(model) not in FAMILIES:
            raise UnsupportedModel(f"{type(model).__name__} ({config.model_type}) is not supported by the native "
                                   f"CPU decoder (supported: {', '.join(SUPPORTED)})")
        if weights == "float16" and config.head_dim % lib.DUCK_HOST_PANEL:
            raise HalfUnfit(f"head_dim {config.head_dim} is not a multiple of {lib.DUCK_HOST_PANEL} (a head's rows "
                            "must start a panel of the packed float16 weights): the projections stay float32")
        self._keep: list[torch.Tensor] = []   # every tensor the C points into
        self.config = config
        m = self.model = ffi.new("duck_host_model *")
        # the model's own tensors first: a bf16 model is told so before its (bf16) cache is
        m.embed = self._weight(model.model.embed_tokens.weight, "model.embed_tokens.weight",
                               (config.vocab_size, config.hidden_size))
        m.final_norm = self._weight(model.model.norm.weight, "model.norm.weight", (config.hidden_size,))
        if getattr(model.lm_head, "bias", None) is not None:
            raise UnsupportedModel("lm_head has a bias: the native CPU decoder's lm_head has none")
        m.lm_head = self._projection(self._linear(model.lm_head, "lm_head"), "lm_head.weight",
                                     (config.vocab_size, config.hidden_size))
        m.wtype = lib.DUCK_HOST_F16 if weights == "float16" else lib.DUCK_HOST_F32
        m.inv_freq = self._ptr(rope_inv_freq(config).float().contiguous())
        self._check_cache(cache)
        self.layers = ffi.new("duck_host_layer[]", config.num_hidden_layers)
        self.ffn: list[nn.Module] = []
        self.routed: list[bool] = []
        for i, layer in enumerate(model.model.layers):
            self._describe_layer(i, layer, cache)
        m.hidden, m.heads, m.kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        m.head_dim, m.layers, m.vocab = config.head_dim, config.num_hidden_layers, config.vocab_size
        m.max_len, m.max_tokens, m.eps = cache.max_model_len, max_tokens, config.rms_norm_eps
        if isinstance(cache, SlotKVCache):   # a batch: layer i's cache is [slots, max_len, kv, D]
            m.slots, m.slot_stride = cache.slots, cache.k.stride(1)
        m.kv_type = KV_TYPES[cache.k.dtype]
        m.pos_stride, m.head_stride = cache.k.stride(-3), cache.k.stride(-2)
        if any(self.routed):
            m.n_experts, m.topk, m.norm_topk = config.num_experts, config.num_experts_per_tok, config.norm_topk_prob
        m.layer = self.layers

    # -- checks -----------------------------------------------------------------------------
    def _check_cache(self, cache: KVCache | SlotKVCache) -> None:
        c = self.config
        want = (c.num_hidden_layers, cache.max_model_len, c.num_key_value_heads, c.head_dim)
        names = "(layers, max_model_len, kv_heads, head_dim)"
        if isinstance(cache, SlotKVCache):
            want, names = want[:1] + (cache.slots,) + want[1:], names.replace("layers,", "layers, slots,")
        for name, t in (("k", cache.k), ("v", cache.v)):
            if tuple(t.shape) != want:
                raise UnsupportedModel(f"KV cache {name} has shape {tuple(t.shape)}; this model needs {want} "
                                       f"{names}")
            # in memory [.., max_len, kv_heads, head_dim], or with the heads outer (make_cache(heads_outer=True))
            dense = t.is_contiguous() or t.transpose(-3, -2).is_contiguous()
            if t.dtype not in KV_TYPES or t.device.type != "cpu" or not dense:
                raise UnsupportedModel(f"KV cache {name} is {t.dtype} on {t.device}"
                                       f"{'' if dense else ', not dense'}: the native CPU decoder needs a float32 "
                                       f"or float16 cache on the CPU, [max_len, kv_heads, head_dim] or heads outer "
                                       f"in memory (model.make_cache)")
        if (cache.k.dtype, cache.k.stride()) != (cache.v.dtype, cache.v.stride()):
            raise UnsupportedModel(f"KV cache k and v differ in type or layout ({cache.k.dtype}, {cache.k.stride()} "
                                   f"vs {cache.v.dtype}, {cache.v.stride()})")

    def _ptr(self, t: torch.Tensor, kind: str = "const float *"):
        self._keep.append(t)
        return ffi.cast(kind, t.data_ptr())

    def _weight(self, t: torch.Tensor, what: str, shape: tuple[int, ...]):
        if tuple(t.shape) != shape:
            raise UnsupportedModel(f"{what} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise UnsupportedModel(f"{what} is {t.dtype} on {t.device}: the native CPU decoder reads float32 weights "
                                   f"on the CPU (load the model with dtype='float32')")
        if not t.is_contiguous():
            raise UnsupportedModel(f"{what} is not contiguous")
        return self._ptr(t.detach())

    def _projection(self, t: torch.Tensor, what: str, shape: tuple[int, ...]):
        """A projection's (or lm_head's) weights in the decoder's weight type: the
        model's own fp32 tensor, or a float16 copy of it."""
        ptr = self._weight(t, what, shape)
        if self.weights == "float32":
            return ptr
        half = t.detach().to(torch.float16).contiguous()
        if not torch.isfinite(half).all():
            raise HalfOverflow(f"{what} holds values beyond float16's range (max |w| = "
                               f"{float(t.abs().max()):.4g} > 65504): its projections stay float32")
        packed = torch.empty(lib.duck_host_packed_halves(*shape), dtype=torch.float16)
        pack_half(half.numpy(), packed.numpy())   # the kernels' panels of 16 rows (the views share memory)
        return self._ptr(packed, "const void *")

    @staticmethod
    def _linear(module: nn.Module, what: str) -> torch.Tensor:
        if type(module) is not nn.Linear:
            raise UnsupportedModel(f"{what} is a {type(module).__name__}, not a plain nn.Linear "
                                   f"(quantized projections keep the torch path)")
        return module.weight

    def _bias(self, module: nn.Linear, what: str, n: int):
        return self._weight(module.bias, what + ".bias", (n,)) if module.bias is not None else ffi.NULL

    def _describe_layer(self, i: int, layer: nn.Module, cache: KVCache) -> None:
        c, d = self.config, self.layers[i]
        h, qd, kvd = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        p = f"model.layers.{i}."
        attn = layer.self_attn
        d.input_norm = self._weight(layer.input_layernorm.weight, p + "input_layernorm.weight", (h,))
        d.post_norm = self._weight(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight", (h,))
        for name, rows, cols in (("q_proj", qd, h), ("k_proj", kvd, h), ("v_proj", kvd, h), ("o_proj", h, qd)):
            proj = getattr(attn, name)
            what = p + "self_attn." + name
            setattr(d, "w" + name[0], self._projection(self._linear(proj, what), what + ".weight", (rows, cols)))
            setattr(d, "b" + name[0], self._bias(proj, what, rows))
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name, None)
            setattr(d, name, self._weight(norm.weight, p + f"self_attn.{name}.weight", (c.head_dim,))
                    if norm is not None else ffi.NULL)
        mlp = layer.mlp
        if type(mlp) is Qwen3MoeSparseMoeBlock:
            d.router = self._weight(mlp.gate.weight, p + "mlp.gate.weight", (c.num_experts, h))
            if (mlp.gate.top_k, mlp.gate.norm_topk_prob) != (c.num_experts_per_tok, c.norm_topk_prob):
                raise UnsupportedModel(f"{p}mlp.gate routes top-{mlp.gate.top_k}, the config says "
                                       f"{c.num_experts_per_tok}")
        elif type(mlp) is not GatedMLP:
            raise UnsupportedModel(f"{p}mlp is a {type(mlp).__name__}: the native CPU decoder runs dense gated "
                                   f"MLPs and softmax-routed experts")
        if getattr(mlp, "resident", None) is not None:
            raise UnsupportedModel(f"{p}mlp is placed in part on this host (engine.placement): the torch path runs it")
        if mlp.layer_idx != i:
            raise UnsupportedModel(f"{p}mlp has layer_idx {mlp.layer_idx}, expected {i}")
        self.ffn.append(mlp)
        self.routed.append(type(mlp) is Qwen3MoeSparseMoeBlock)
        d.k_cache = self._ptr(cache.k[i], "void *")
        d.v_cache = self._ptr(cache.v[i], "void *")
