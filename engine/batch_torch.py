"""The torch path of continuous batching (engine.batch): one forward of the model's own
modules over the tokens of many sequences, each in its own slot of a SlotKVCache, for
hosts where the native CPU decoder does not run (a GPU host, or DUCK_CPU_NATIVE=0).

The step's tokens go through every projection and FFN call together, so a duck streams
each expert once for the whole batch, as on the native path; attention writes each
token's key and value at its slot's position (engine.layers.SlotBatch) and each
sequence's run of tokens attends to its own slot with the call one sequence alone makes.

Families: the native decoder's (engine.cpu.host_model.FAMILIES: Llama, Qwen3, Qwen3-MoE,
whose attention is engine.models.llama.LlamaAttention). DeepSeek's latent cache and
Qwen3.5's recurrent state have no slot form yet: UnsupportedModel. Eager only: no CUDA
graphs per batch size yet."""
from __future__ import annotations

import logging

import torch

from engine.cpu.host_model import FAMILIES, UnsupportedModel
from engine.layers import SlotBatch, SlotKVCache

log = logging.getLogger(__name__)


class TorchSlotDecoder:
    """Steps of many sequences through the model's torch modules (see the module docstring):
    layers(ids, positions, slots) -> the final hidden states [T, H]; logits(y, rows)."""

    def __init__(self, model, cache: SlotKVCache, max_tokens: int):
        if type(model) not in FAMILIES:   # the native decoder's: their attention is LlamaAttention
            raise UnsupportedModel(f"{type(model).__name__} ({model.config.model_type}) has no batched torch "
                                   f"path (Llama, Qwen3 and Qwen3-MoE have)")
        weight = model.model.embed_tokens.weight
        if cache.k.device != weight.device or cache.k.dtype != weight.dtype:
            raise UnsupportedModel(f"the slot cache is {cache.k.dtype} on {cache.k.device}, the model "
                                   f"{weight.dtype} on {weight.device}")
        self.model, self.cache, self.max_tokens = model, cache, max_tokens
        self.device = weight.device
        self._ntok = 0
        self.last_batch: SlotBatch | None = None   # the last step's plan
        log.debug("torch slot decoder for %s on %s: %d slots of %d positions", type(model).__name__, self.device,
                  cache.slots, cache.max_model_len)

    @torch.inference_mode()
    def layers(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """ids, positions, slots [T] (host) -> the last layer's normed hidden states [T, H]."""
        if ids.dim() != 1 or ids.shape != positions.shape or ids.shape != slots.shape:
            raise ValueError(f"ids {tuple(ids.shape)}, positions {tuple(positions.shape)} and slots "
                             f"{tuple(slots.shape)} must be one [T] each")
        if not 0 < ids.shape[0] <= self.max_tokens:
            raise ValueError(f"a step of {ids.shape[0]} tokens: this decoder takes 1..{self.max_tokens}")
        batch = self.last_batch = SlotBatch.plan(self.cache, positions.tolist(), slots.tolist(), self.device)
        self._ntok = ids.shape[0]
        return self.model(ids.to(self.device, torch.int64), batch.positions, batch)

    @torch.inference_mode()
    def logits(self, y: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """lm_head of the rows asked for (all by default) -> [len(rows), V] fp32."""
        if y.shape[0] != self._ntok:
            raise ValueError(f"logits need the step's hidden states [{self._ntok}, H], got {tuple(y.shape)}")
        if rows is not None:
            y = y[torch.tensor(rows, dtype=torch.int64, device=y.device)]
        return self.model.compute_logits(y).float()
