"""Qwen3.5 dense and MoE, text only: layers interleave gated DeltaNet linear
attention and gated full attention (config layer_types); norms are zero-centered
(x * (1 + w)); rotary covers the first partial_rotary_factor of each head (the
MRoPE sections coincide for text, where the t/h/w positions are equal).

Checkpoints are Qwen3_5(Moe)ForConditionalGeneration: the text model lives under
`model.language_model.`, the vision tower (`model.visual.`) and the MTP head
(`mtp.`) are known and skipped. Routed experts and the dense MLP run on the FFN
backend; the MoE shared expert stays on the host."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.config import ConfigError, ModelConfig
from engine.delta_rule import gated_delta_mixer, gated_delta_mixer_slots, gated_rms_norm
from engine.layers import KVCache, SlotBatch, SlotKVCache, cached_attention, static_decode_active
from engine.merged_linear import MergedLinear
from engine.models.base import CausalLM, GatedMLP, RoutedExperts, TopKRouter
from engine.weights import WeightSpec

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class HybridSettings:
    """The Qwen3.5 fields ModelConfig keeps in config.extra, checked once."""
    layer_types: tuple[str, ...]
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    rotary_dim: int
    shared_expert_intermediate_size: int

    @classmethod
    def of(cls, config: ModelConfig) -> HybridSettings:
        x, where, n = config.extra, config.source, config.num_hidden_layers
        types = x.get("layer_types") or [FULL if (i + 1) % int(x.get("full_attention_interval", 4)) == 0 else LINEAR
                                         for i in range(n)]
        if len(types) != n or set(types) - {LINEAR, FULL}:
            raise ConfigError(f"{where}: layer_types must list {n} entries of {LINEAR!r} / {FULL!r}, got {types}")
        rope = x.get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor", x.get("partial_rotary_factor", 0.25)))
        rotary_dim = int(config.head_dim * factor)
        if not 0 < rotary_dim <= config.head_dim or rotary_dim % 2:
            raise ConfigError(f"{where}: partial_rotary_factor={factor} gives rotary dim {rotary_dim} for "
                              f"head_dim={config.head_dim}; it must be even and in 2..head_dim")
        section = rope.get("mrope_section")
        if section is not None and sum(section) != rotary_dim // 2:
            raise ConfigError(f"{where}: mrope_section {section} sums to {sum(section)}, expected rotary_dim/2 = "
                              f"{rotary_dim // 2}")
        s = cls(tuple(types), int(x.get("linear_conv_kernel_dim", 4)), int(x.get("linear_num_key_heads", 16)),
                int(x.get("linear_num_value_heads", 32)), int(x.get("linear_key_head_dim", 128)),
                int(x.get("linear_value_head_dim", 128)), rotary_dim,
                int(x.get("shared_expert_intermediate_size", 0)))
        if min(s.conv_kernel, s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim) <= 0:
            raise ConfigError(f"{where}: linear attention sizes must be positive, got {s}")
        if s.num_v_heads % s.num_k_heads:
            raise ConfigError(f"{where}: linear_num_value_heads={s.num_v_heads} is not a multiple of "
                              f"linear_num_key_heads={s.num_k_heads}")
        if config.num_experts and s.shared_expert_intermediate_size <= 0:
            raise ConfigError(f"{where}: shared_expert_intermediate_size must be positive for Qwen3.5-MoE")
        return s


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as w with scale (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, zero_centered=True)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x), as engine.layers.RMSNorm.add."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, zero_centered=True)


class GatedRMSNorm(nn.Module):
    """DeltaNet output norm: w * rmsnorm(x) * silu(z); a plain (not zero-centered) weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)


@dataclass(slots=True)
class HybridCache:
    """kv: a KVCache over the full-attention layers only; per linear-attention layer
    the last conv_kernel-1 conv inputs [C, K-1] and the delta-rule state [Hv, Dk, Dv] (fp32)."""
    kv: KVCache
    conv: torch.Tensor
    recurrent: torch.Tensor
    slot: dict[int, int]    # decoder layer -> index in kv (full) or conv/recurrent (linear)
    consumed: list[int] | None = None   # per linear-attention slot: tokens its states have consumed

    @classmethod
    def allocate(cls, config: ModelConfig, s: HybridSettings, max_model_len: int, dtype, device) -> HybridCache:
        kv, conv, recurrent, slot = _hybrid_shapes(config, s, max_model_len)

        def zeros(shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(KVCache(zeros(kv), zeros(kv)), zeros(conv), zeros(recurrent, torch.float32), slot)

    @property
    def max_model_len(self) -> int:
        return self.kv.max_model_len

    def per_position(self) -> list[torch.Tensor]:
        """The full-attention layers' k, v [layers, S, ...]."""
        return self.kv.per_position()

    def per_sequence(self) -> list[torch.Tensor]:
        """The linear-attention layers' conv inputs and delta-rule states: every token read so far."""
        return [self.conv, self.recurrent]


def _hybrid_shapes(config: ModelConfig, s: HybridSettings, max_model_len: int, *slots: int):
    """A hybrid cache's kv, conv and recurrent shapes (slots, where given, after the layer
    dimension) and its layer -> index map: full-attention layers index kv, linear ones conv/recurrent."""
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    full = [i for i, kind in enumerate(s.layer_types) if kind == FULL]
    linear = [i for i, kind in enumerate(s.layer_types) if kind == LINEAR]
    conv_dim = 2 * s.num_k_heads * s.head_k_dim + s.num_v_heads * s.head_v_dim
    return ((len(full), *slots, max_model_len, config.num_key_value_heads, config.head_dim),
            (len(linear), *slots, conv_dim, s.conv_kernel - 1),
            (len(linear), *slots, s.num_v_heads, s.head_k_dim, s.head_v_dim),
            {i: j for ids in (full, linear) for j, i in enumerate(ids)})


@dataclass(slots=True)
class SlotHybridCache:
    """HybridCache for several sequences at once (engine.batch on the torch path): kv a
    SlotKVCache over the full-attention layers only; per linear-attention layer and slot the
    conv inputs conv [n_linear, slots, C, K-1] (model dtype) and the delta-rule state
    recurrent [n_linear, slots, Hv, Dk, Dv] (fp32). Not zeroed: a sequence's run from
    position 0 zeroes its slot's states first (a slot serves one sequence after another);
    consumed[linear index][slot] counts the tokens those states have taken. Its per-sequence
    state holds every token read so far, not one entry per position: engine.batch's prefix
    cache passes this family by."""
    kv: SlotKVCache
    conv: torch.Tensor
    recurrent: torch.Tensor
    slot: dict[int, int]    # decoder layer -> index in kv (full) or conv/recurrent (linear)
    consumed: list[list[int]]

    @classmethod
    def allocate(cls, config: ModelConfig, s: HybridSettings, slots: int, max_model_len: int, dtype,
                 device) -> SlotHybridCache:
        if slots <= 0:
            raise ValueError(f"slots must be positive, got {slots}")
        kv, conv, recurrent, slot = _hybrid_shapes(config, s, max_model_len, slots)

        def empty(shape, dt=dtype):
            return torch.empty(shape, dtype=dt, device=device)

        return cls(SlotKVCache(empty(kv), empty(kv)), empty(conv), empty(recurrent, torch.float32), slot,
                   [[0] * slots for _ in range(conv[0])])   # conv[0]: the linear-attention layers

    @property
    def slots(self) -> int:
        return self.kv.slots

    @property
    def max_model_len(self) -> int:
        return self.kv.max_model_len

    def per_position(self) -> list[torch.Tensor]:
        """The full-attention layers' k, v [layers, slots, S, ...]."""
        return self.kv.per_position()

    def per_sequence(self) -> list[torch.Tensor]:
        """Per linear-attention layer and slot: the conv inputs and the delta-rule state."""
        return [self.conv, self.recurrent]


class Qwen3_5GatedDeltaNet(nn.Module):
    """Linear attention: in_proj_qkv -> causal depthwise conv (state: the last K-1 inputs) -> silu ->
    l2-normed q, k; gated delta rule (chunked for prefill, recurrent for decode) -> gated norm -> out_proj."""

    def __init__(self, config: ModelConfig, s: HybridSettings, layer_idx: int):
        super().__init__()
        self.layer_idx, self.s = layer_idx, s
        self.key_dim, self.value_dim = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim
        conv_dim, h = 2 * self.key_dim + self.value_dim, config.hidden_size
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, s.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, s.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, s.num_v_heads, bias=False)
        self.in_proj = MergedLinear()     # qkv, z, b, a: one matmul
        self.heads = (s.num_k_heads, s.head_k_dim, s.num_v_heads, s.head_v_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        if isinstance(cache, SlotBatch):
            return self.out_proj(self._slot_forward(x, cache))
        t, slot = x.shape[0], cache.slot[self.layer_idx]
        static = static_decode_active()   # no host sync: whoever runs static decode keeps cache.consumed
        if not static:
            if cache.consumed is None:
                cache.consumed = [0] * cache.conv.shape[0]
            if int(positions[0]) != cache.consumed[slot]:
                raise ValueError(f"layer {self.layer_idx}: linear attention continues at token "
                                 f"{cache.consumed[slot]}, got position {int(positions[0])}; its state cannot "
                                 f"rewind (use a fresh cache)")
            cache.consumed[slot] = int(positions[-1]) + 1
        qkv, z, b, a = self.in_proj(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        args = (qkv, z, b, a, cache.conv[slot], self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight,
                self.norm.eps, cache.recurrent[slot], self.heads)
        # static decode: a few tokens, the fused kernel where it runs; a prompt: the chunked rule
        out = ops.gated_delta_decode(*args) if t == 1 or static else gated_delta_mixer(*args, chunked=True)
        return self.out_proj(out)

    def _slot_forward(self, x: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """x [T, H] of a SlotBatch over a SlotHybridCache -> the mixer output [T, Hv Dv]: each run
        on its slot's states, from zero at position 0 (the slot may hold an earlier sequence's
        states, or garbage), else where that slot's states left off; a decode step (one token
        per run) as one update batched over the slots."""
        cache = batch.cache
        layer = cache.slot[self.layer_idx]
        conv, recurrent, consumed = cache.conv[layer], cache.recurrent[layer], cache.consumed[layer]
        firsts = [end - (stop - start) for (_, start, stop), end in zip(batch.runs, batch.ends)]   # host ints
        for (slot, _, _), first in zip(batch.runs, firsts):   # all checked before any state changes
            if first and first != consumed[slot]:
                raise ValueError(f"layer {self.layer_idx}, slot {slot}: linear attention continues at token "
                                 f"{consumed[slot]}, got a run from position {first}; its state cannot skip or "
                                 f"rewind (a sequence starts at position 0)")
        for (slot, start, stop), first in zip(batch.runs, firsts):
            if first == 0:
                conv[slot].zero_()
                recurrent[slot].zero_()
            consumed[slot] = first + stop - start
        qkv, z, b, a = self.in_proj(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        weights = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps)
        if batch.decode_rows is not None:
            return gated_delta_mixer_slots(qkv, z, b, a, conv, *weights, recurrent, self.heads, batch.decode_rows[0])
        outs = []
        for slot, start, stop in batch.runs:   # the call the sequence alone makes, on its slot's views
            args = (qkv[start:stop], z[start:stop], b[start:stop], a[start:stop], conv[slot], *weights,
                    recurrent[slot], self.heads)
            outs.append(ops.gated_delta_decode(*args) if stop - start == 1 else gated_delta_mixer(*args, chunked=True))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class Qwen3_5Attention(nn.Module):
    """GQA with q_proj doubled (per head: query then gate); the output is scaled by sigmoid(gate)."""

    def __init__(self, config: ModelConfig, s: HybridSettings, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        h, bias, hd = config.hidden_size, config.attention_bias, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.qkv = MergedLinear()
        self.q_norm = ZeroCenteredRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, config.rms_norm_eps)
        self.rotary_dim = s.rotary_dim
        exponent = torch.arange(0, s.rotary_dim, 2, dtype=torch.int64, device="cpu").float() / s.rotary_dim
        self.inv_freq = 1.0 / (config.rope_theta ** exponent)  # plain tensor: computed, never loaded
        self.scale = hd ** -0.5

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Half-split rotary on the first rotary_dim of each head [T, H, D]; the rest passes."""
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]              # [T, R/2]
        cos, sin = freqs.cos().to(x.dtype)[:, None, :], freqs.sin().to(x.dtype)[:, None, :]
        half = self.rotary_dim // 2
        x1, x2, rest = x[..., :half], x[..., half:self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv(x, self.q_proj, self.k_proj, self.v_proj)            # one matmul; views of its output
        q, gate = q.view(t, self.num_heads, 2 * hd).split(hd, dim=-1)           # [T, H, D] each
        q = self.rotate(self.q_norm(q), positions)
        k = self.rotate(self.k_norm(k.view(t, self.num_kv_heads, hd)), positions)  # [T, KVH, D]
        v = v.view(t, self.num_kv_heads, hd)
        if isinstance(cache, SlotBatch):   # each run in its slot of the SlotHybridCache's kv
            layer, kv = cache.cache.slot[self.layer_idx], replace(cache, cache=cache.cache.kv)
        else:
            layer, kv = cache.slot[self.layer_idx], cache.kv
        out = cached_attention(layer, kv, positions, q, k, v, self.scale)        # [T, H*D]
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpert(GatedMLP):
    """The MoE shared expert: the same weights as any expert, computed on the host."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_proj(x), self.up_proj(x))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of gate and up computed elsewhere (one matmul with the router)."""
        return self.down_proj(F.silu(gate) * up)


class Qwen3_5MoeSparseMoeBlock(RoutedExperts):
    """Routed experts on the FFN backend + sigmoid(shared_expert_gate(x)) * shared_expert(x) on the host."""

    def __init__(self, config: ModelConfig, s: HybridSettings, layer_idx: int):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts, layer_idx)
        self.gate = TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok, True)
        self.shared_expert = SharedExpert(config.hidden_size, s.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.shared_in = MergedLinear()   # the router's logits and the shared expert's gate, up and gate: one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.shared_expert
        logits, gate, up, shared_gate = self.shared_in(x, self.gate, e.gate_proj, e.up_proj, self.shared_expert_gate)
        ids, weights = self.gate.route(logits)                            # [T, k], [T, k]
        shared = torch.sigmoid(shared_gate) * e.down(gate, up)
        return self.routed(x, ids, weights) + shared                       # [T, H]


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, s: HybridSettings, layer_idx: int):
        super().__init__()
        self.is_linear = s.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = Qwen3_5GatedDeltaNet(config, s, layer_idx)
        else:
            self.self_attn = Qwen3_5Attention(config, s, layer_idx)
        self.mlp = (Qwen3_5MoeSparseMoeBlock(config, s, layer_idx) if config.num_experts
                    else GatedMLP(config.hidden_size, config.intermediate_size, layer_idx))
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
        """As engine.models.llama's layer: x the last sublayer's output, the stream residual + x;
        each residual add fused into the norm that follows it."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x, residual = self.input_layernorm.add(x, residual)
        x, residual = self.post_attention_layernorm.add(mixer(x, positions, cache), residual)
        return self.mlp(x), residual


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config: ModelConfig, s: HybridSettings):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, s, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None   # [T, H]; the stream is residual + x
        for layer in self.layers:
            x, residual = layer(x, residual, positions, cache)
        return self.norm.add(x, residual)[0]


class Qwen3_5ForConditionalGeneration(CausalLM):
    """Dense (qwen3_5) and MoE (qwen3_5_moe) alike; config.num_experts tells them apart."""

    slot_batching = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.settings = HybridSettings.of(config)
        self.model = Qwen3_5TextModel(config, self.settings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def weight_spec(self) -> WeightSpec:
        tied = (("lm_head.weight", "model.embed_tokens.weight"),) if self.config.tie_word_embeddings else ()
        return WeightSpec(renames=((r"model\.(.+)", r"model.language_model.\1"),), tied=tied,
                          ignored=(r"model\.visual\..+", r"mtp\..+"))

    def make_cache(self, max_model_len: int) -> HybridCache:
        p = self.model.embed_tokens.weight
        return HybridCache.allocate(self.config, self.settings, max_model_len, p.dtype, p.device)

    def make_slot_cache(self, slots: int, max_model_len: int) -> SlotHybridCache:
        p = self.model.embed_tokens.weight
        return SlotHybridCache.allocate(self.config, self.settings, slots, max_model_len, p.dtype, p.device)
