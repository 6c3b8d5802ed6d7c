"""Qwen3.5 dense and MoE, text only: layers interleave gated DeltaNet linear
attention and gated full attention (config layer_types); norms are zero-centered
(x * (1 + w)); rotary covers the first partial_rotary_factor of each head (the
MRoPE sections coincide for text, where the t/h/w positions are equal).

Checkpoints are Qwen3_5(Moe)ForConditionalGeneration: the text model lives under
`model.language_model.`, the vision tower (`model.visual.`) and the MTP head
(`mtp.`) are known and skipped. Routed experts and the dense MLP run on the FFN
backend; the MoE shared expert stays on the host."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.layers import KVCache, cached_attention, static_decode_active
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
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """DeltaNet output norm: w * rmsnorm(x) * silu(z); a plain (not zero-centered) weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


# -- the gated delta rule ------------------------------------------------------
# Per value head, state S [Dk, Dv]: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q.
def gated_delta_recurrent(q, k, v, g, beta, state):
    """One token at a time. q, k [H, T, Dk], v [H, T, Dv], g, beta [H, T], state [H, Dk, Dv] (fp32)
    -> out [H, T, Dv], new state."""
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]                              # [H, Dk, Dv]
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hk,hkv->hv", k[:, t], state))  # [H, Dv]
        state = state + k[:, t, :, None] * u[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[:, t], state))                    # [H, Dv]
    return torch.stack(out, dim=1), state


def _unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], row by row (forward substitution):
    on CPU ~9x faster than batched torch.linalg.solve_triangular for these small systems."""
    c = lower.shape[-1]
    inv = -lower  # row i: X[i, :i] = -L[i, :i] - sum_j L[i, j] X[j, :i], with X[j, j] = 1
    for i in range(1, c):
        inv[..., i, :i] += (inv[..., i, :i, None] * inv[..., :i, :i]).sum(-2)
    return inv + torch.eye(c, dtype=lower.dtype, device=lower.device)


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence, C tokens per step: within a chunk the delta updates are
    solved as one unit-lower-triangular system (the UT transform), so the sequential
    part is T/C small matmuls. Shapes as gated_delta_recurrent."""
    h, t, dk = k.shape
    pad = -t % chunk  # padded tokens have beta = 0, k = 0, g = 0: they leave the state alone
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, -1) for x in (q, k, v))                   # [H, N, C, D]
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    cum = g.cumsum(-1)                                                           # [H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    kb = k * beta[..., None]
    inverse = _unit_lower_inverse(((kb @ k.transpose(-1, -2)) * decay).tril(-1))  # [H, N, C, C]
    u0 = inverse @ (v * beta[..., None])                                         # [H, N, C, Dv]
    w = inverse @ (kb * cum.exp()[..., None])                                    # [H, N, C, Dk]
    attn = (q @ k.transpose(-1, -2)) * decay                                     # [H, N, C, C]
    q_decayed = q * cum.exp()[..., None]                                         # [H, N, C, Dk]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]                        # [H, N, C, Dk]
    out = torch.empty_like(u0)
    for c in range(n):
        u = u0[:, c] - w[:, c] @ state                                           # [H, C, Dv]
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ u
        state = state * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.reshape(h, n * chunk, -1)[:, :t], state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # eps inside the root, as the reference kernels


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
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        full = [i for i, kind in enumerate(s.layer_types) if kind == FULL]
        linear = [i for i, kind in enumerate(s.layer_types) if kind == LINEAR]
        kv_shape = (len(full), max_model_len, config.num_key_value_heads, config.head_dim)
        conv_dim = 2 * s.num_k_heads * s.head_k_dim + s.num_v_heads * s.head_v_dim

        def zeros(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(KVCache(zeros(*kv_shape), zeros(*kv_shape)), zeros(len(linear), conv_dim, s.conv_kernel - 1),
                   zeros(len(linear), s.num_v_heads, s.head_k_dim, s.head_v_dim, dt=torch.float32),
                   {i: j for ids in (full, linear) for j, i in enumerate(ids)})

    @property
    def max_model_len(self) -> int:
        return self.kv.max_model_len


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        s, t, slot = self.s, x.shape[0], cache.slot[self.layer_idx]
        static = static_decode_active()   # no host sync: whoever runs static decode keeps cache.consumed
        if not static:
            if cache.consumed is None:
                cache.consumed = [0] * cache.conv.shape[0]
            if int(positions[0]) != cache.consumed[slot]:
                raise ValueError(f"layer {self.layer_idx}: linear attention continues at token "
                                 f"{cache.consumed[slot]}, got position {int(positions[0])}; its state cannot "
                                 f"rewind (use a fresh cache)")
            cache.consumed[slot] = int(positions[-1]) + 1
        mixed = torch.cat((cache.conv[slot], self.in_proj_qkv(x).T), dim=-1)      # [C, K-1+T]
        cache.conv[slot] = mixed[:, mixed.shape[1] - (s.conv_kernel - 1):]
        mixed = F.silu(F.conv1d(mixed[None], self.conv1d.weight, groups=mixed.shape[0]))[0].T  # [T, C]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = s.num_v_heads // s.num_k_heads  # each q/k head serves `rep` consecutive value heads
        q = q.reshape(t, s.num_k_heads, s.head_k_dim).repeat_interleave(rep, dim=1).transpose(0, 1).float()
        k = k.reshape(t, s.num_k_heads, s.head_k_dim).repeat_interleave(rep, dim=1).transpose(0, 1).float()
        v = v.reshape(t, s.num_v_heads, s.head_v_dim).transpose(0, 1).float()      # [Hv, T, Dv]
        q = _l2norm(q) * s.head_k_dim ** -0.5                                      # [Hv, T, Dk]
        k = _l2norm(k)
        beta = self.in_proj_b(x).float().sigmoid().T                               # [Hv, T]
        g = (-self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())).T  # [Hv, T]
        rule = gated_delta_recurrent if t == 1 or static else gated_delta_chunked   # static: a few tokens
        out, cache.recurrent[slot] = rule(q, k, v, g, beta, cache.recurrent[slot])
        z = self.in_proj_z(x).reshape(t, s.num_v_heads, s.head_v_dim)
        out = self.norm(out.transpose(0, 1).to(x.dtype), z)                         # [T, Hv, Dv]
        return self.out_proj(out.reshape(t, self.value_dim))


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
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * hd).split(hd, dim=-1)  # [T, H, D] each
        q = self.rotate(self.q_norm(q), positions)
        k = self.rotate(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, hd)), positions)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, hd)
        out = cached_attention(cache.slot[self.layer_idx], cache.kv, positions, q, k, v, self.scale)  # [T, H*D]
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpert(GatedMLP):
    """The MoE shared expert: the same weights as any expert, computed on the host."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3_5MoeSparseMoeBlock(RoutedExperts):
    """Routed experts on the FFN backend + sigmoid(shared_expert_gate(x)) * shared_expert(x) on the host."""

    def __init__(self, config: ModelConfig, s: HybridSettings, layer_idx: int):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts, layer_idx)
        self.gate = TopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok, True)
        self.shared_expert = SharedExpert(config.hidden_size, s.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)                                       # [T, k], [T, k]
        routed = self.routed(x, ids, weights)                             # [T, H]
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config: ModelConfig, s: HybridSettings):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, s, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        for layer in self.layers:
            x = layer(x, positions, cache)
        return self.norm(x)


class Qwen3_5ForConditionalGeneration(CausalLM):
    """Dense (qwen3_5) and MoE (qwen3_5_moe) alike; config.num_experts tells them apart."""

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
