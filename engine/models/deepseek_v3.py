"""DeepSeek-V3 / V3.1 (model_type deepseek_v3) and DeepSeek-V3.2 (deepseek_v32).

Attention is MLA: per token the cache holds the normalized latent (kv_lora_rank)
and the shared rotary key (qk_rope_head_dim), never expanded K/V. A prefill
expands the cached latents through kv_b_proj; a decode step (a few tokens, the
MTP pair included) absorbs kv_b_proj into the query and output instead.
FFNs: sigmoid-scored routed experts with e_score_correction_bias, group-limited
top-k and routed_scaling_factor go to the FFN backend; shared experts stay on
the host; the first first_k_dense_replace layers are dense MLPs, also offloaded.
DeepSeek-V3.2 (DSA): past index_topk tokens each query attends to the tokens its
lightning indexer selects (engine.models.deepseek_dsa); within them, densely.
The MTP (nextn) layers sit after the main ones, at model.layers[num_hidden_layers:],
as in the checkpoint; engine.mtp drives them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.config import ConfigError, ModelConfig
from engine.layers import RMSNorm, SlotBatch, static_decode_active
from engine.models.base import CausalLM, GatedMLP, RoutedExperts
from engine.models.deepseek_dsa import (DeepseekV32Indexer, cache_bytes_per_token, index_scores, put_rows,
                                        row_chunk, select, slot_scores, sparse_latent_attention)
from engine.weights import WeightSpec

log = logging.getLogger(__name__)

ABSORB_MAX_TOKENS = 16   # forwards of at most this many tokens use the absorbed (decode) MLA path
LATENT_NORM_EPS = 1e-6   # q_a_layernorm / kv_a_layernorm, as the reference builds them


@dataclass(frozen=True, slots=True)
class DeepseekArgs:
    """The DeepSeek-specific fields of config.json, checked once."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_shared_experts: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    dense_layers: frozenset[int]
    rope_interleave: bool
    index_topk: int             # 0: not a DSA model
    index_n_heads: int
    index_head_dim: int
    index_ue8m0: bool           # the indexer's fp8 scales are powers of two (scale_fmt "ue8m0")
    num_nextn_predict_layers: int

    @classmethod
    def from_config(cls, c: ModelConfig) -> DeepseekArgs:
        x, where = c.extra, c.source

        def need(name):
            if not isinstance(x.get(name), int) or x[name] <= 0:
                raise ConfigError(f"{where}: {c.model_type} needs a positive integer {name}, got {x.get(name)!r}")
            return x[name]

        if x.get("scoring_func", "sigmoid") != "sigmoid" or x.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"{where}: scoring_func={x.get('scoring_func')!r} topk_method={x.get('topk_method')!r}"
                              f" is not supported (only sigmoid / noaux_tc, as in DeepSeek-V3)")
        if not c.num_experts:
            raise ConfigError(f"{where}: {c.model_type} needs n_routed_experts")
        n_group, topk_group = x.get("n_group") or 1, x.get("topk_group") or 1
        if c.num_experts % n_group or not 0 < topk_group <= n_group:
            raise ConfigError(f"{where}: n_routed_experts={c.num_experts}, n_group={n_group}, topk_group={topk_group}:"
                              f" groups must divide the experts and 0 < topk_group <= n_group")
        if c.num_experts_per_tok > topk_group * (c.num_experts // n_group):
            raise ConfigError(f"{where}: num_experts_per_tok={c.num_experts_per_tok} exceeds the experts of "
                              f"topk_group={topk_group} groups")
        types = x.get("mlp_layer_types")
        if types is not None:
            if len(types) < c.num_hidden_layers or set(types) - {"dense", "sparse"}:
                raise ConfigError(f"{where}: mlp_layer_types must name 'dense' or 'sparse' for each layer")
            dense = frozenset(i for i, t in enumerate(types) if t == "dense")
        else:
            dense = frozenset(range(min(x.get("first_k_dense_replace") or 0, c.num_hidden_layers)))
        dsa = c.model_type == "deepseek_v32"
        rope_kind = (c.rope_scaling or {}).get("rope_type", (c.rope_scaling or {}).get("type", "default"))
        if rope_kind not in ("default", "yarn"):
            raise ConfigError(f"{where}: rope_scaling {rope_kind!r} is not supported for DeepSeek (default, yarn)")
        q_lora = x.get("q_lora_rank")
        scale_fmt = x.get("scale_fmt") or (x.get("quantization_config") or {}).get("scale_fmt")
        if dsa and not q_lora:
            raise ConfigError(f"{where}: deepseek_v32 needs q_lora_rank (its indexer reads the query latent)")
        return cls(q_lora_rank=q_lora or None, kv_lora_rank=need("kv_lora_rank"),
                   qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
                   v_head_dim=need("v_head_dim"), n_shared_experts=int(x.get("n_shared_experts") or 0),
                   routed_scaling_factor=float(x.get("routed_scaling_factor", 1.0)), n_group=n_group,
                   topk_group=topk_group, dense_layers=dense,
                   rope_interleave=dsa or bool(x.get("rope_interleave", True)),
                   index_topk=need("index_topk") if dsa else 0, index_n_heads=need("index_n_heads") if dsa else 0,
                   index_head_dim=need("index_head_dim") if dsa else 0, index_ue8m0=scale_fmt == "ue8m0",
                   num_nextn_predict_layers=int(x.get("num_nextn_predict_layers") or 0))


# -- rotary (YaRN) -------------------------------------------------------------
def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(config: ModelConfig, dim: int) -> tuple[torch.Tensor, float, float]:
    """inv_freq [dim/2], the factor on cos/sin, and the multiplier of the softmax scale."""
    base, s = config.rope_theta, config.rope_scaling or {}
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / base ** exponent
    if s.get("rope_type", s.get("type", "default")) != "yarn":
        return inv_freq, 1.0, 1.0
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / old_len
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)   # interpolate the long wavelengths only
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    softmax_mult = _yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return inv_freq, float(attention_factor), softmax_mult


class DeepseekRotary:
    """Rotary on the qk_rope_head_dim slice. interleave: pairs (x0, x1), (x2, x3), ...
    are rotated and written back as [evens | odds]; q and k alike, so scores are unchanged."""

    def __init__(self, config: ModelConfig, dim: int, interleave: bool):
        self.inv_freq, self.attention_factor, self.softmax_mult = rope_tables(config, dim)
        self.interleave = interleave

    def __call__(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]                  # [T, D/2]
        cos, sin = ((f * self.attention_factor)[:, None, :] for f in (freqs.cos(), freqs.sin()))  # [T, 1, D/2]
        out = []
        for x in xs:                                                                 # [T, heads, D]
            x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.interleave else x.chunk(2, dim=-1)
            c, s = cos.to(x.dtype), sin.to(x.dtype)
            out.append(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return out


# -- the compressed cache and MLA ----------------------------------------------
@dataclass(slots=True)
class MlaCache:
    """Static cache for one sequence: latent [layers, S, kv_lora_rank], k_rope [layers, S, rope_dim];
    with DSA the indexer's keys [layers, S, index_head_dim] (fp8) and their scales [layers, S] (fp32)."""
    latent: torch.Tensor
    k_rope: torch.Tensor
    index_k: torch.Tensor | None = None
    index_scale: torch.Tensor | None = None

    @property
    def max_model_len(self) -> int:
        return self.latent.shape[1]

    def per_position(self) -> list[torch.Tensor]:
        """The tensors with an entry per position ([layers, S, ...]): a position's entries hold that token alone."""
        return [t for t in (self.latent, self.k_rope, self.index_k, self.index_scale) if t is not None]

    def per_sequence(self) -> list[torch.Tensor]:
        """The tensors of state a sequence carries past every position (none)."""
        return []


@dataclass(slots=True)
class SlotMlaCache:
    """The latent caches of several sequences at once (engine.batch on the torch path):
    latent [layers, slots, S, kv_lora_rank], k_rope [layers, slots, S, rope_dim]; the main
    layers, and the MTP layers when the batch drafts with them; with DSA the indexer's keys
    [layers, slots, S, index_head_dim] and scales [layers, slots, S]."""
    latent: torch.Tensor
    k_rope: torch.Tensor
    index_k: torch.Tensor | None = None
    index_scale: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.latent.shape[1]

    @property
    def max_model_len(self) -> int:
        return self.latent.shape[2]

    def per_position(self) -> list[torch.Tensor]:
        """The tensors with an entry per position ([layers, slots, S, ...]): a position's entries hold that token alone."""
        return [t for t in (self.latent, self.k_rope, self.index_k, self.index_scale) if t is not None]

    def per_sequence(self) -> list[torch.Tensor]:
        """The tensors of state a sequence carries past every position (none)."""
        return []


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: ModelConfig, args: DeepseekArgs, layer_idx: int, rotary: DeepseekRotary):
        super().__init__()
        self.layer_idx, self.rotary, self.args = layer_idx, rotary, args
        h, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.num_heads = heads
        qk_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, args.kv_lora_rank + args.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * args.v_head_dim, h, bias=bias)
        if args.index_topk:
            self.indexer = DeepseekV32Indexer(
                h, args.q_lora_rank, args.index_n_heads, args.index_head_dim, args.index_topk,
                DeepseekRotary(config, args.qk_rope_head_dim, interleave=False), args.index_ue8m0)
        self.scale = qk_dim ** -0.5 * rotary.softmax_mult

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: MlaCache) -> torch.Tensor:
        a, t, layer = self.args, x.shape[0], self.layer_idx
        if a.q_lora_rank:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        else:
            q_latent, q = None, self.q_proj(x)
        q_nope, q_rope = q.view(t, self.num_heads, -1).split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)  # [T, R], [T, r]
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope[:, None, :])             # [T, H, r], [T, 1, r]
        latent, k_rope = self.kv_a_layernorm(latent), k_rope[:, 0]
        index = self.indexer(x, q_latent, positions) if a.index_topk else None         # queries, weights, keys, scales
        if isinstance(cache, SlotBatch):   # many sequences, each in its own slot
            out = self._slots(q_nope, q_rope, latent, k_rope, index, cache)
            return self.o_proj(out.reshape(t, -1))
        # static_decode: the whole cache under the mask below
        end = cache.max_model_len if static_decode_active() else int(positions[-1]) + 1
        if end > cache.max_model_len:
            raise ValueError(f"position {end - 1} is beyond the KV cache (max_model_len={cache.max_model_len})")
        cache.latent[layer].index_copy_(0, positions, latent)
        cache.k_rope[layer].index_copy_(0, positions, k_rope)
        if index is not None:
            put_rows(cache.index_k[layer], positions, index[2])
            cache.index_scale[layer].index_copy_(0, positions, index[3])
        latents, k_ropes = cache.latent[layer, :end], cache.k_rope[layer, :end]       # [S, R], [S, r]
        if index is not None and end > a.index_topk:
            out = self._sparse(q_nope, q_rope, index, positions, latents, k_ropes, cache.index_k[layer],
                               cache.index_scale[layer], end)
        else:
            mask = positions[:, None] >= torch.arange(end, device=x.device)[None, :]  # [T, S]
            attend = self._absorbed if t <= ABSORB_MAX_TOKENS else self._expanded
            out = attend(q_nope, q_rope, latents, k_ropes, mask)                        # [T, H, v]
        return self.o_proj(out.reshape(t, -1))

    def _slots(self, q_nope, q_rope, latent, k_rope, index, batch: SlotBatch) -> torch.Tensor:
        """The tokens' latents and rotary keys (and indexer keys) written at their slots'
        positions; each run of tokens then attends to its own slot with the call one sequence
        alone makes, or, when every run is one token (a decode step), all of them in one
        absorbed call."""
        a, cache, layer = self.args, batch.cache, self.layer_idx
        latents, k_ropes = cache.latent[layer], cache.k_rope[layer]                      # [slots, S, R], [slots, S, r]
        latents.view(-1, latents.shape[-1]).index_copy_(0, batch.flat, latent)
        k_ropes.view(-1, k_ropes.shape[-1]).index_copy_(0, batch.flat, k_rope)
        ikeys = iscale = None
        if index is not None:
            ikeys, iscale = cache.index_k[layer], cache.index_scale[layer]              # [slots, S, D], [slots, S]
            put_rows(ikeys.view(-1, ikeys.shape[-1]), batch.flat, index[2])
            iscale.view(-1).index_copy_(0, batch.flat, index[3])
        rows = None
        if static_decode_active():   # a graph's decode step (SlotBatch.static): each row over its whole slot,
            keep = batch.positions[:, None] >= torch.arange(latents.shape[1], device=latents.device)[None, :]
            rows = (batch.slots, keep[:, None, None, :])
        elif batch.decode_rows is not None:   # masked on the device (no host sync)
            rows = batch.decode_rows
        if rows is not None:
            if index is not None and rows[1].shape[-1] > a.index_topk:
                return self._sparse_rows(q_nope, q_rope, index, batch.positions, latents, k_ropes, ikeys, iscale,
                                         *rows)
            return self._absorbed_rows(q_nope, q_rope, latents, k_ropes, *rows)
        outs = []
        for (slot, start, stop), end in zip(batch.runs, batch.ends):
            positions = batch.positions[start:stop]
            if index is not None and end > a.index_topk:
                outs.append(self._sparse(q_nope[start:stop], q_rope[start:stop], [i[start:stop] for i in index],
                                         positions, latents[slot, :end], k_ropes[slot, :end], ikeys[slot],
                                         iscale[slot], end))
                continue
            mask = positions[:, None] >= torch.arange(end, device=positions.device)[None, :]   # [t, S]
            attend = self._absorbed if stop - start <= ABSORB_MAX_TOKENS else self._expanded
            outs.append(attend(q_nope[start:stop], q_rope[start:stop], latents[slot, :end], k_ropes[slot, :end],
                               mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _sparse(self, q_nope, q_rope, index, positions, latents, k_ropes, ikeys, iscale, end: int) -> torch.Tensor:
        """One sequence's tokens at positions [T] (ascending) over its first `end` cache
        entries, each attending to the index_topk entries its indexer scores best: scored and
        selected a block of rows at a time (eagerly, only the keys up to the block's last
        position), MLA absorbed over the picks."""
        iq, iw = index[0], index[1]
        graph = static_decode_active()
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)                          # [T, H, R]
        o_latent = torch.empty_like(q_latent)
        t, step = q_latent.shape[0], row_chunk(end)
        for a in range(0, t, step):
            b = min(t, a + step)
            stop = end if graph else min(end, int(positions[b - 1]) + 1)
            scores = index_scores(iq[a:b], iw[a:b], ikeys, iscale, positions[a:b], stop)
            picks, valid = select(scores, self.args.index_topk, graph_safe=graph)
            o_latent[a:b] = sparse_latent_attention(q_latent[a:b], q_rope[a:b], latents, k_ropes, picks, valid,
                                                    self.scale)
        return torch.einsum("thr,hvr->thv", o_latent, w_uv)                            # [T, H, v]

    def _sparse_rows(self, q_nope, q_rope, index, positions, latents, k_ropes, ikeys, iscale, slots: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """_absorbed_rows under DSA: row b (slot slots[b] at positions[b], its keys where mask
        [B, 1, 1, E] holds) scores its slot's indexer keys, keeps the index_topk best and attends
        to those."""
        scores = slot_scores(index[0], index[1], ikeys, iscale, positions, slots, mask[:, 0, 0])   # [B, E]
        picks, valid = select(scores, self.args.index_topk, graph_safe=static_decode_active())   # [B, K]
        flat = picks + slots[:, None] * latents.shape[1]                                 # rows of the slots seen flat
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        o_latent = sparse_latent_attention(q_latent, q_rope, latents.view(-1, latents.shape[-1]),
                                           k_ropes.view(-1, k_ropes.shape[-1]), flat, valid, self.scale)
        return torch.einsum("bhr,hvr->bhv", o_latent, w_uv)

    def _absorbed_rows(self, q_nope, q_rope, latents, k_ropes, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """_absorbed for B tokens, row b in slot slots[b], in one call: the slots' latents and
        rotary keys gathered [B, E, .] (E: the furthest row's end, or the whole slot), zeroed
        where mask [B, 1, 1, E] is false (a reused slot's stale entries, or never-written memory,
        must not reach a result: weight 0 times NaN is NaN), masked in the softmax. Rows may
        share a slot (an MTP pair: the token and its draft, each masked at its own position)."""
        end, keep = mask.shape[-1], mask[:, 0]                                           # keep [B, 1, E]
        lat = latents[:, :end].index_select(0, slots).masked_fill_(~keep[:, 0, :, None], 0)   # [B, E, R]
        kr = k_ropes[:, :end].index_select(0, slots).masked_fill_(~keep[:, 0, :, None], 0)    # [B, E, r]
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)                           # [B, H, R]
        scores = (torch.einsum("bhr,ber->bhe", q_latent, lat)
                  + torch.einsum("bhp,bep->bhe", q_rope, kr)) * self.scale              # [B, H, E]
        probs = scores.float().masked_fill(~keep, float("-inf")).softmax(-1).to(lat.dtype)
        o_latent = torch.einsum("bhe,ber->bhr", probs, lat)                             # [B, H, R]
        return torch.einsum("bhr,hvr->bhv", o_latent, w_uv)                             # [B, H, v]

    def _expanded(self, q_nope, q_rope, latents, k_ropes, mask):
        """Prefill: K/V of every cached token from its latent, then ordinary attention."""
        a, s = self.args, latents.shape[0]
        kv = self.kv_b_proj(latents).view(s, self.num_heads, -1)                        # [S, H, nope + v]
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], -1)
        k = torch.cat((k_nope, k_ropes[:, None, :].expand(-1, self.num_heads, -1)), -1)  # [S, H, qk]
        q = torch.cat((q_nope, q_rope), -1)                                             # [T, H, qk]
        causal = mask.shape[0] == mask.shape[1]        # a prompt's first chunk: positions from 0
        out = ops.head_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                 None if causal else mask, causal, self.scale)         # [H, T, v]
        return out.transpose(0, 1)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split for absorption: w_uk [H, nope, R] (into q), w_uv [H, v, R] (out of the latent)."""
        w = self.kv_b_proj.weight.view(self.num_heads, -1, self.args.kv_lora_rank)   # [H, nope + v, R]
        return w[:, :self.args.qk_nope_head_dim], w[:, self.args.qk_nope_head_dim:]

    def _absorbed(self, q_nope, q_rope, latents, k_ropes, mask):
        """Decode: kv_b_proj folded into q (nope part) and the output; attention runs in latent space."""
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)                          # [T, H, R]
        scores = (torch.einsum("thr,sr->hts", q_latent, latents)
                  + torch.einsum("thp,sp->hts", q_rope, k_ropes)) * self.scale         # [H, T, S]
        probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).to(latents.dtype)
        o_latent = torch.einsum("hts,sr->thr", probs, latents)                         # [T, H, R]
        return torch.einsum("thr,hvr->thv", o_latent, w_uv)                            # [T, H, v]


# -- FFN -----------------------------------------------------------------------
class DeepseekV3MLP(nn.Module):
    """A shared expert: runs on the host, never through the FFN backend."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV3TopkRouter(nn.Module):
    """Sigmoid scores; the bias steers the choice only; top-k within the topk_group best
    groups (a group scores the sum of its two best); weights normalized and scaled."""

    def __init__(self, config: ModelConfig, args: DeepseekArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = args.n_group, args.topk_group, args.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, e = x.shape[0], self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()                       # [T, E]
        choice = scores + self.e_score_correction_bias.float()                            # [T, E]
        grouped = choice.view(t, self.n_group, e // self.n_group)                         # [T, G, E/G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)     # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(self.topk_group, dim=-1).indices, True)                   # [T, G]
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices                                     # [T, k]
        weights = scores.gather(1, ids)                                                   # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids.to(torch.int32), weights * self.scaling                                # int32, fp32: the wire's types


class DeepseekV3MoE(RoutedExperts):
    def __init__(self, config: ModelConfig, args: DeepseekArgs, layer_idx: int):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts, layer_idx)
        self.gate = DeepseekV3TopkRouter(config, args)
        self.shared_experts = (DeepseekV3MLP(config.hidden_size, config.moe_intermediate_size * args.n_shared_experts)
                               if args.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)                                # [T, k], [T, k]
        y = self.routed(x, ids, weights)                           # [T, H]
        return y + self.shared_experts(x) if self.shared_experts is not None else y


# -- layers and model ----------------------------------------------------------
class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, args: DeepseekArgs, layer_idx: int, rotary: DeepseekRotary):
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, args, layer_idx, rotary)
        self.mlp = (GatedMLP(config.hidden_size, config.intermediate_size, layer_idx) if layer_idx in args.dense_layers
                    else DeepseekV3MoE(config, args, layer_idx))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: MlaCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """The nextn layer: h' = eh_proj([enorm(embed(token i+1)); hnorm(h_i)]), one decoder
    layer, then shared_head -> logits for token i+2. The input embedding is the main model's."""

    def __init__(self, config: ModelConfig, args: DeepseekArgs, layer_idx: int, rotary: DeepseekRotary):
        super().__init__(config, args, layer_idx, rotary)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config)

    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              cache: MlaCache) -> torch.Tensor:
        """embeds of tokens i+1 [T, H], main hidden states at i [T, H] -> logits for i+2 [T, V]."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), -1))    # [T, H]
        x = super().forward(x, positions, cache)
        return self.shared_head.head(self.shared_head.norm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, args: DeepseekArgs):
        super().__init__()
        n = config.num_hidden_layers
        rotary = DeepseekRotary(config, args.qk_rope_head_dim, args.rope_interleave)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DeepseekV3DecoderLayer(config, args, i, rotary) for i in range(n)]
            + [DeepseekV3MTPLayer(config, args, n + i, rotary) for i in range(args.num_nextn_predict_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.num_main_layers = n

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: MlaCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                            # [T, H]
        for layer in self.layers[:self.num_main_layers]:
            x = layer(x, positions, cache)
        return self.norm(x)


class DeepseekV3ForCausalLM(CausalLM):
    slot_batching = True   # the latent cache per slot: SlotMlaCache

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.args = DeepseekArgs.from_config(config)
        self.model = DeepseekV3Model(config, self.args)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def weight_spec(self) -> WeightSpec:
        spec = super().weight_spec()
        # the nextn layer's copy of the input embedding (identical to the model's, which it uses)
        ignored = spec.ignored + (r"model\.layers\.\d+\.embed_tokens\.weight",)
        if not self.args.num_nextn_predict_layers:  # a checkpoint may carry an MTP layer the config does not enable
            ignored += tuple(rf"model\.layers\.{self.config.num_hidden_layers + i}\..*" for i in range(4))
        return WeightSpec(renames=spec.renames, tied=spec.tied, ignored=ignored)

    def adapt_to_checkpoint(self, names: set[str]) -> None:
        n = self.model.num_main_layers
        have = sum(1 for i in range(len(self.model.layers) - n) if f"model.layers.{n + i}.eh_proj.weight" in names)
        if have < len(self.model.layers) - n:
            log.info("config.json names %d MTP layer(s), the checkpoint carries %d: MTP limited to those",
                     len(self.model.layers) - n, have)
            self.model.layers = self.model.layers[:n + have]

    @property
    def mtp_layers(self) -> list[DeepseekV3MTPLayer]:
        return list(self.model.layers[self.model.num_main_layers:])

    def _check_len(self, max_model_len: int) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")

    def cache_bytes_per_token(self, mtp: bool = False) -> int:
        """One position's cache over the main layers (and the MTP layers): latents, rotary keys, indexer keys."""
        a = self.args
        layers = len(self.model.layers) if mtp else self.model.num_main_layers
        return cache_bytes_per_token(a.kv_lora_rank, a.qk_rope_head_dim, a.index_head_dim, layers,
                                     self.model.embed_tokens.weight.element_size())

    def _index_cache(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The indexer's key and scale caches of shape [..., S] (none without DSA)."""
        if not self.args.index_topk:
            return None, None
        indexer = self.model.layers[0].self_attn.indexer
        return (torch.zeros(*shape, self.args.index_head_dim, dtype=indexer.key_dtype(like.dtype), device=like.device),
                torch.zeros(*shape, dtype=torch.float32, device=like.device))

    def make_cache(self, max_model_len: int) -> MlaCache:
        self._check_len(max_model_len)
        p = self.model.embed_tokens.weight
        layers = len(self.model.layers)
        return MlaCache(torch.zeros(layers, max_model_len, self.args.kv_lora_rank, dtype=p.dtype, device=p.device),
                        torch.zeros(layers, max_model_len, self.args.qk_rope_head_dim, dtype=p.dtype, device=p.device),
                        *self._index_cache((layers, max_model_len), p))

    def make_slot_cache(self, slots: int, max_model_len: int, mtp: bool = False) -> SlotMlaCache:
        """mtp: the MTP layers' latents too (engine.batch with speculative steps)."""
        self._check_len(max_model_len)
        if slots <= 0:
            raise ValueError(f"slots must be positive, got {slots}")
        p = self.model.embed_tokens.weight
        layers = len(self.model.layers) if mtp else self.model.num_main_layers
        return SlotMlaCache(
            torch.zeros(layers, slots, max_model_len, self.args.kv_lora_rank, dtype=p.dtype, device=p.device),
            torch.zeros(layers, slots, max_model_len, self.args.qk_rope_head_dim, dtype=p.dtype, device=p.device),
            *self._index_cache((layers, slots, max_model_len), p))

    def exact_indexer(self, exact: bool = True) -> None:
        """The indexer's keys unrounded (no fp8, no Hadamard turn), as transformers' DeepseekV32
        computes them: for tests against it. Caches made after this call follow."""
        for layer in self.model.layers:
            if hasattr(layer.self_attn, "indexer"):
                layer.self_attn.indexer.exact = exact
