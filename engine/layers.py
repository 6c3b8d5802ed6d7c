"""Building blocks shared by the model files: RMSNorm, rotary embeddings, the
static KV cache and causal attention over it. Tensors carry no batch dimension:
one sequence, T tokens at a time."""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.config import ModelConfig


class _DecodeMode(threading.local):
    static: bool = False


_mode = _DecodeMode()


@contextmanager
def static_decode():
    """Within (on this thread), attention covers the whole static cache under a mask
    built on the device from the positions: fixed shapes and no host sync, what a
    CUDA-graph capture needs. Exact: a masked slot gets zero weight, and unused slots
    hold finite values (zeros, or keys of an earlier request). The host-side checks
    (positions within the cache, linear-attention continuity) are then the caller's."""
    before = _mode.static
    _mode.static = True
    try:
        yield
    finally:
        _mode.static = before


def static_decode_active() -> bool:
    return _mode.static


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x): the residual add fused into the norm
        that follows it. residual None: x is the whole stream."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    exponent = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, smoothed))
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Half-split (rotate_half) rotary embedding as in Hugging Face Llama/Qwen; engine.ops.qk_norm_rope
    applies it. inv_freq is a plain fp32 tensor, not a buffer: it is computed, never loaded,
    and must survive building the model on the meta device."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inv_freq = rope_inv_freq(config)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device, heads_outer: bool, make) -> torch.Tensor:
    """make(shape) ([.., max_len, kv_heads, head_dim]), or the same shape as a view of memory
    with the last-but-one two dimensions swapped (heads outer)."""
    if not heads_outer:
        return make(shape, dtype=dtype, device=device)
    swapped = shape[:-3] + (shape[-2], shape[-3], shape[-1])
    return make(swapped, dtype=dtype, device=device).transpose(-3, -2)


@dataclass(slots=True)
class KVCache:
    """Static cache for one sequence: k, v [layers, max_model_len, kv_heads, head_dim].
    heads_outer: the same shape over memory ordered [layers, kv_heads, max_model_len,
    head_dim] (a transposed view), each head's positions one run: how the native CPU
    decoder reads it fastest (engine.cpu.decode.native_cache)."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, config: ModelConfig, max_model_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", heads_outer: bool = False) -> "KVCache":
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        shape = (config.num_hidden_layers, max_model_len, config.num_key_value_heads, config.head_dim)
        return cls(*(_zeros(shape, dtype, device, heads_outer, torch.zeros) for _ in "kv"))

    @property
    def max_model_len(self) -> int:
        return self.k.shape[1]

    def per_position(self) -> list[torch.Tensor]:
        """The tensors with an entry per position ([layers, S, ...]): a position's entries hold that token alone."""
        return [self.k, self.v]

    def per_sequence(self) -> list[torch.Tensor]:
        """The tensors of state a sequence carries past every position (none)."""
        return []


@dataclass(slots=True)
class SlotKVCache:
    """Static caches of several sequences at once (a batch: engine.batch): k, v [layers,
    slots, max_model_len, kv_heads, head_dim]. slot(s) is sequence s's KVCache, a view:
    what the torch forward writes there lands in the batch's cache."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, config: ModelConfig, slots: int, max_model_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", heads_outer: bool = False) -> "SlotKVCache":
        """heads_outer: as KVCache's, each slot's heads outer in memory."""
        if slots <= 0 or max_model_len <= 0:
            raise ValueError(f"slots and max_model_len must be positive, got {slots} and {max_model_len}")
        shape = (config.num_hidden_layers, slots, max_model_len, config.num_key_value_heads, config.head_dim)
        # not zeroed: a sequence writes each position before it reads it, so memory is touched as slots fill
        return cls(*(_zeros(shape, dtype, device, heads_outer, torch.empty) for _ in "kv"))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_model_len(self) -> int:
        return self.k.shape[2]

    def slot(self, s: int) -> KVCache:
        return KVCache(self.k[:, s], self.v[:, s])

    def per_position(self) -> list[torch.Tensor]:
        """The tensors with an entry per position ([layers, slots, S, ...]): a position's entries hold that token alone."""
        return [self.k, self.v]

    def per_sequence(self) -> list[torch.Tensor]:
        """The tensors of state a sequence carries past every position (none)."""
        return []


@dataclass(slots=True)
class SlotBatch:
    """One forward of many sequences over a SlotKVCache (engine.batch on the torch path):
    token t is at positions[t] of slot slots[t]; a sequence's tokens are one run of the step
    (runs: (slot, start, stop) over the tokens, host ints). What attention writes lands at
    flat[t] = slot * max_model_len + position of the layer's cache seen as one long cache,
    and each run attends to its own slot only, causally (rotary_cached_attention)."""
    cache: SlotKVCache
    positions: torch.Tensor      # [T] int64, on the model's device
    flat: torch.Tensor           # [T] int64, on the model's device
    runs: list[tuple[int, int, int]]
    ends: list[int]              # per run: its last position + 1 (the slots it reads)
    decode_rows: tuple[torch.Tensor, torch.Tensor] | None = None   # all runs one token: (slots [B], mask [B,1,1,E])
    slots: torch.Tensor | None = None   # static_decode (a CUDA graph's decode step, one token per slot): [T] int64

    @property
    def max_model_len(self) -> int:
        return self.cache.max_model_len

    @classmethod
    def static(cls, cache: SlotKVCache, tokens: int, device) -> "SlotBatch":
        """A decode step of `tokens` sequences, one token each, in fixed buffers that a CUDA
        graph reads (engine.gpu.batch_graphs fills positions, slots and flat before each replay):
        under static_decode attention reads each row's slot over the whole cache, masked on
        the device."""
        zeros = torch.zeros(tokens, dtype=torch.int64, device=device)
        return cls(cache, zeros.clone(), zeros.clone(), [], [], None, zeros.clone())

    @classmethod
    def plan(cls, cache: SlotKVCache, positions: list[int], slots: list[int], device) -> "SlotBatch":
        if len(positions) != len(slots) or not slots:
            raise ValueError(f"a slot batch needs one slot per token, got {len(slots)} for {len(positions)}")
        n, length = cache.slots, cache.max_model_len
        runs, ends, start = [], [], 0
        for t in range(1, len(slots) + 1):
            if t == len(slots) or slots[t] != slots[start]:
                slot = slots[start]
                if not 0 <= slot < n:
                    raise ValueError(f"slot {slot} is not one of the cache's {n}")
                if any(positions[i] != positions[start] + i - start for i in range(start, t)):
                    raise ValueError(f"slot {slot}: a run's positions must be consecutive, got "
                                     f"{positions[start:t]}")
                if not 0 <= positions[start] or positions[t - 1] >= length:
                    raise ValueError(f"slot {slot}: positions {positions[start]}..{positions[t - 1]} are outside "
                                     f"the cache (max_model_len={length})")
                runs.append((slot, start, t))
                ends.append(positions[t - 1] + 1)
                start = t
        if len({r[0] for r in runs}) != len(runs):
            raise ValueError("a slot batch takes each sequence's tokens as one run")
        flat = [s * length + p for s, p in zip(slots, positions)]
        decode_rows = None
        if len(runs) > 1 and len(runs) == len(slots):
            end = max(ends)
            mask = torch.arange(end, device=device)[None, :] < torch.tensor(ends, device=device)[:, None]
            decode_rows = (torch.tensor(slots, dtype=torch.int64, device=device), mask[:, None, None, :])
        return cls(cache, torch.tensor(positions, dtype=torch.int64, device=device),
                   torch.tensor(flat, dtype=torch.int64, device=device), runs, ends, decode_rows)


def _flat_slots(batch: SlotBatch, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's k and v slot caches seen as one cache [slots * S, KVH, D] (batch.flat indexes it)."""
    ck, cv = batch.cache.k[layer], batch.cache.v[layer]
    return ck.view(-1, *ck.shape[2:]), cv.view(-1, *cv.shape[2:])


def _slot_attention(layer: int, batch: SlotBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """k, v [T, KVH, D] written at their slots' positions, then each run's q over its own slot."""
    fk, fv = _flat_slots(batch, layer)
    fk.index_copy_(0, batch.flat, k)
    fv.index_copy_(0, batch.flat, v)
    return _slot_attend(layer, batch, q, scale)


def _slot_attend(layer: int, batch: SlotBatch, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Each run's q over its own slot, the step's keys and values written there."""
    ck, cv = batch.cache.k[layer], batch.cache.v[layer]      # [slots, S, KVH, D]
    if _mode.static:   # a graph's decode step (SlotBatch.static): each row over its slot, no host sync
        return ops.decode_attention(q, ck, cv, batch.positions, scale, slots=batch.slots)
    if batch.decode_rows is not None:   # every run one token (a decode step): one masked call for all
        return _decode_rows_attention(batch, ck, cv, q, scale)
    outs = []
    for (slot, start, stop), end in zip(batch.runs, batch.ends):
        # the slot's cache up to its run's last position: the same call one sequence alone makes
        outs.append(ops.decode_attention_ref(q[start:stop], ck[slot, :end], cv[slot, :end],
                                             batch.positions[start:stop], scale, masked=stop - start > 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode_rows_attention(batch: SlotBatch, ck: torch.Tensor, cv: torch.Tensor, q: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [B, H, D], one token per slot: each row over its slot's cache up to its position, as
    one SDPA call over the slots' first max(ends) positions, the rest masked. The slots' keys
    and values are gathered [B, end, KVH, D] and zeroed past each row's position: a slot's
    cache is not cleared (SlotKVCache), and a masked key's weight 0 times a NaN left there
    would still be NaN."""
    slots, mask = batch.decode_rows
    end = mask.shape[-1]
    past = ~mask[:, 0, 0, :, None, None]                            # [B, end, 1, 1]
    keys = ck[:, :end].index_select(0, slots).masked_fill_(past, 0).transpose(1, 2)   # [B, KVH, end, D]
    values = cv[:, :end].index_select(0, slots).masked_fill_(past, 0).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)          # [B, H, 1, D]
    return out.reshape(q.shape[0], -1)


def attention_end(cache: KVCache, positions: torch.Tensor) -> int:
    """The cache slots attention reads: all of them under static_decode (no host sync), else
    up to the last position, checked to be within the cache before anything is written."""
    if _mode.static:
        return cache.max_model_len
    end = int(positions[-1]) + 1
    if end > cache.max_model_len:
        raise ValueError(f"position {end - 1} is beyond the KV cache (max_model_len={cache.max_model_len})")
    return end


def attend_cache(layer: int, cache: KVCache, positions: torch.Tensor, q: torch.Tensor, end: int,
                 scale: float) -> torch.Tensor:
    """q [T, H, D] over the layer's cache slots [0, end), causally (static_decode: the whole
    cache, masked on the device); -> [T, H * D]."""
    if _mode.static:
        return ops.decode_attention(q, cache.k[layer], cache.v[layer], positions, scale)
    return ops.decode_attention_ref(q, cache.k[layer, :end], cache.v[layer, :end], positions, scale,
                                    masked=q.shape[0] > 1)


def cached_attention(layer: int, cache: KVCache, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, scale: float) -> torch.Tensor:
    """Writes k, v [T, KVH, D] at positions, attends q [T, H, D] causally over the
    cache up to the last position (static_decode: over all of it, masked); returns [T, H * D].
    A SlotBatch instead of a cache: each sequence's run in its own slot."""
    if isinstance(cache, SlotBatch):
        return _slot_attention(layer, cache, q, k, v, scale)
    end = attention_end(cache, positions)
    cache.k[layer].index_copy_(0, positions, k)
    cache.v[layer].index_copy_(0, positions, v)
    return attend_cache(layer, cache, positions, q, end, scale)


def rotary_cached_attention(layer: int, cache: KVCache, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, rotary: RotaryEmbedding, scale: float, q_norm: RMSNorm | None = None,
                            k_norm: RMSNorm | None = None) -> torch.Tensor:
    """cached_attention of q, k after their per-head norms (Qwen3; None: Llama) and rotary,
    the norms, rotary and cache write being one op (engine.ops.qk_norm_rope). A SlotBatch
    instead of a cache: rotary at each token's position, then each run in its own slot."""
    norms = ((q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 0.0))
    inv_freq = rotary.inv_freq_on(q.device)
    if isinstance(cache, SlotBatch):   # the cache write in the same kernel, at each token's row of the flat slots
        fk, fv = _flat_slots(cache, layer)
        q, _ = ops.qk_norm_rope(q, k, cache.positions, inv_freq, *norms, v=v, k_cache=fk, v_cache=fv, rows=cache.flat)
        return _slot_attend(layer, cache, q, scale)
    end = attention_end(cache, positions)
    q, _ = ops.qk_norm_rope(q, k, positions, inv_freq, *norms, v=v, k_cache=cache.k[layer], v_cache=cache.v[layer])
    return attend_cache(layer, cache, positions, q, end, scale)
