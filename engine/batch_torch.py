"""The torch path of continuous batching (engine.batch): one forward of the model's own
modules over the tokens of many sequences, each in its own slot of the model's slot cache
(make_slot_cache), for hosts where the native CPU decoder does not run (a GPU host, a
family the native decoder lacks, or DUCK_CPU_NATIVE=0).

The step's tokens go through every projection and FFN call together, so a duck streams
each expert once for the whole batch, as on the native path; attention writes each
token's cache entries at its slot's position (engine.layers.SlotBatch) and each
sequence's run of tokens attends to its own slot with the call one sequence alone makes
(a decode step, one token per slot: one masked call for all slots).

Families: those whose class sets slot_batching (engine.models.base.CausalLM): Llama,
Qwen3, Qwen3-MoE (engine.layers' attention over a SlotKVCache), DeepSeek-V3/V3.2 (the
latent cache, engine.models.deepseek_v3.SlotMlaCache), Qwen3.5 dense and MoE
(engine.models.qwen3_5.SlotHybridCache: a SlotKVCache over the full-attention layers, and
per linear-attention layer and slot the DeltaNet conv and recurrent states, zeroed when a
sequence starts in the slot; a decode step updates all slots' states in one batched call,
engine.delta_rule.gated_delta_mixer_slots).

On CUDA, decode steps (MTP pairs included) of the families whose slot cache holds entries
per position only (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3/V3.2) replay CUDA graphs captured per
batch-size bucket (engine.gpu.batch_graphs) unless DUCK_CUDA_GRAPHS=0; steps with prefill
chunks, and Qwen3.5 (its DeltaNet state per sequence), run eagerly."""
from __future__ import annotations

import logging

import torch

from engine.cpu.host_model import UnsupportedModel
from engine.layers import SlotBatch

log = logging.getLogger(__name__)


class TorchSlotDecoder:
    """Steps of many sequences through the model's torch modules (see the module docstring):
    layers(ids, positions, slots) -> the final hidden states [T, H]; logits(y, rows).
    graphs: decode steps from CUDA graphs per batch-size bucket (None: on CUDA unless
    DUCK_CUDA_GRAPHS=0; ignored off CUDA and for caches with per-sequence state)."""

    def __init__(self, model, cache, max_tokens: int, graphs: bool | None = None):
        if not getattr(type(model), "slot_batching", False):
            raise UnsupportedModel(f"{type(model).__name__} ({model.config.model_type}) has no batched torch "
                                   f"path (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3/V3.2 and Qwen3.5 have)")
        weight = model.model.embed_tokens.weight
        for t in cache_tensors(cache):
            if t.device != weight.device or t.dtype not in (weight.dtype, torch.float32, torch.float8_e4m3fn):
                raise UnsupportedModel(f"the slot cache holds {t.dtype} on {t.device}, the model is "
                                       f"{weight.dtype} on {weight.device}")
        self.model, self.cache, self.max_tokens = model, cache, max_tokens
        self.device = weight.device
        self._ntok = 0
        self.last_batch: SlotBatch | None = None   # the last step's plan (None: a graph replay)
        self.graphs = None                           # engine.gpu.batch_graphs.BatchGraphs on CUDA
        if self.device.type == "cuda" and not cache.per_sequence() and graphs is not False:
            from engine.gpu.batch_graphs import BatchGraphs
            from engine.gpu.decode import graphs_enabled
            if graphs or graphs_enabled():
                self.graphs = BatchGraphs(model, cache, max_tokens)
        self.graph_steps = 0                         # steps replayed from the graphs
        log.debug("torch slot decoder for %s on %s: %d slots of %d positions", type(model).__name__, self.device,
                  cache.slots, cache.max_model_len)

    @torch.inference_mode()
    def layers(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               limit: int | None = None) -> torch.Tensor:
        """ids, positions, slots [T] (host) -> the last layer's normed hidden states [T, H].
        limit: the most tokens this step may have (default max_tokens; a streamed prefill's
        step of one long prompt is larger, and eager)."""
        if ids.dim() != 1 or ids.shape != positions.shape or ids.shape != slots.shape:
            raise ValueError(f"ids {tuple(ids.shape)}, positions {tuple(positions.shape)} and slots "
                             f"{tuple(slots.shape)} must be one [T] each")
        if not 0 < ids.shape[0] <= (limit or self.max_tokens):
            raise ValueError(f"a step of {ids.shape[0]} tokens: this decoder takes 1..{limit or self.max_tokens}")
        self._ntok = ids.shape[0]
        if self.graphs is not None and limit is None:
            hidden = self.graphs.step(ids, positions, slots)
            if hidden is not None:
                self.last_batch = None
                self.graph_steps += 1
                return hidden
        batch = self.last_batch = SlotBatch.plan(self.cache, positions.tolist(), slots.tolist(), self.device)
        return self.model(ids.to(self.device, torch.int64), batch.positions, batch)

    @torch.inference_mode()
    def draft(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> torch.Tensor:
        """The MTP layer over many sequences (engine.batch's speculative steps): token t is
        ids[t] at positions[t] + 1 of slot slots[t], hidden[t] the main model's hidden state
        at positions[t] -> the drafts' logits [T, V] (for positions[t] + 2)."""
        mtp = self.model.mtp_layers[0]
        batch = SlotBatch.plan(self.cache, positions.tolist(), slots.tolist(), self.device)
        embeds = self.model.model.embed_tokens(ids.to(self.device, torch.int64))
        return mtp.draft(embeds, hidden, batch.positions, batch).float()

    @torch.inference_mode()
    def logits(self, y: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """lm_head of the rows asked for (all by default) -> [len(rows), V] fp32."""
        if y.shape[0] != self._ntok:
            raise ValueError(f"logits need the step's hidden states [{self._ntok}, H], got {tuple(y.shape)}")
        if rows is not None:
            y = y[torch.tensor(rows, dtype=torch.int64, device=y.device)]
        return self.model.compute_logits(y).float()

    def logits_argmax(self, y: torch.Tensor, rows: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """logits(y, rows) and each row's argmax (the greedy token)."""
        logits = self.logits(y, rows)
        return logits, logits.argmax(dim=-1).tolist()


def cache_tensors(cache) -> list[torch.Tensor]:
    """The tensors of a slot cache: its per-position entries and its per-sequence state."""
    return cache.per_position() + cache.per_sequence()
