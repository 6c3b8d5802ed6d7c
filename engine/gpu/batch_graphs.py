"""CUDA graphs for a batch's decode steps (engine.batch on the torch path, a GPU host):
one graph lane (engine.gpu.graphs) per batch-size bucket, each a decode step of that many
sequences of the slot cache, one token each, captured when the batch decoder is made.

    graphs = BatchGraphs(model, cache, max_tokens)       # cache: the batch's slot cache
    hidden = graphs.step(ids, positions, slots)          # [T, H]; None: not a step the graphs run

A step of B decoding sequences replays the smallest bucket >= B; the rows past B repeat
row 0 (its token, position and slot), so they route to (nearly always) row 0's experts and
padding adds no expert a duck must stream. They write their keys and values at the last
position of row 0's slot, which its sequence writes before it ever reads it (attention
reads a slot only up to the row's own position): row 0's own entry stays row 0's. An MTP
pair (a sequence's token and its draft, two rows at consecutive positions of its slot) is
two rows like any others: each attends up to its own position, the draft to the token's
entry written in the same layer. Steps with a prefill chunk or more rows than the largest
bucket run eagerly (engine.batch_torch). The cache is any slot cache whose every tensor
holds entries per position (SlotKVCache; DeepSeek's SlotMlaCache), not one carrying
per-sequence state (Qwen3.5's DeltaNet). Under static_decode attention reads each row's slot through the
slot kernel (engine.ops.decode_attention with slots), masked on the device, and the FFN
calls go through the lane's host io as the one-sequence graphs' do (one C call per step
with the fleet).
"""
from __future__ import annotations

import logging
import time

import torch

from engine.gpu.graphs import GraphLane
from engine.lanes import run_lane
from engine.layers import SlotBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _SlotGuard:
    """The cache entries a capture's warm-up writes (position 0 of the first `tokens`
    slots, in each per-position tensor), saved to be put back: a lane captured again while
    sequences run leaves them whole."""

    def __init__(self, cache, tokens: int):
        self.n = min(tokens, cache.slots)
        self.saved = [(t, t[:, :self.n, 0].clone()) for t in cache.per_position()]

    def restore(self) -> None:
        for t, entries in self.saved:
            t[:, :self.n, 0] = entries


class SlotGraphLane(GraphLane):
    """A GraphLane over SlotBatch.static(cache, tokens): a decode step of `tokens` rows, row t
    in slot slots[t] at positions[t]. set_slots() before each step (run_lane then starts it)."""

    one_sequence = False   # rows of different sequences: any cache length holds a step

    def __init__(self, model, cache, tokens: int, name: str):
        device = model.model.embed_tokens.weight.device
        self.slot_cache = cache
        self.batch = SlotBatch.static(cache, tokens, device)
        self._slot_rows = torch.zeros((2, tokens), dtype=torch.int64, pin_memory=True)   # slots, flat
        self._slots: list[int] | None = None
        super().__init__(model, self.batch, tokens, name=name)

    def _capture_positions(self) -> torch.Tensor:
        """Warm-up and capture: row t at position 0 of slot t (mod slots), put back after."""
        b, s = self.batch, self.slot_cache.max_model_len
        b.positions.zero_()
        b.slots.copy_(torch.arange(self.tokens, device=self.device) % self.slot_cache.slots)
        b.flat.copy_(b.slots * s)
        return b.positions

    def _state_guard(self):
        return _SlotGuard(self.slot_cache, self.tokens)

    def set_slots(self, slots: list[int], write_at: list[int] | None = None) -> None:
        """The slots of the next step's rows (one per row), and where in its slot each row writes
        its key and value (None: at its position)."""
        if len(slots) != self.tokens or (write_at is not None and len(write_at) != self.tokens):
            raise ValueError(f"{self.name} runs {self.tokens} rows, got {len(slots)} slots")
        if min(slots) < 0 or max(slots) >= self.slot_cache.slots:
            raise ValueError(f"{self.name}: slots {slots} outside the cache's {self.slot_cache.slots}")
        if write_at is not None and (min(write_at) < 0 or max(write_at) >= self.slot_cache.max_model_len):
            raise ValueError(f"{self.name}: writes at {write_at} outside the cache")
        self._slots = (slots, write_at)

    def start_inputs(self, ids: torch.Tensor, positions: torch.Tensor) -> bool:
        if self._slots is None:
            raise RuntimeError(f"{self.name}: set_slots() before each step")
        pos = positions.tolist()
        if len(pos) != self.tokens or min(pos) < 0 or max(pos) >= self.slot_cache.max_model_len:
            raise ValueError(f"{self.name}: positions {pos} (max_model_len={self.slot_cache.max_model_len})")
        (slots, write_at), self._slots = self._slots, None
        was = self._next is not None and self._next > 0
        self.hidden = None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._to_static(self.ids, ids, 0)
            self._to_static(self.positions, positions, 1)
            self._slot_rows[0] = torch.tensor(slots)
            self._slot_rows[1] = torch.tensor(write_at) if write_at is not None else positions.to(torch.int64)
            self._slot_rows[1] += self._slot_rows[0] * self.slot_cache.max_model_len
            self.batch.slots.copy_(self._slot_rows[0], non_blocking=True)
            self.batch.flat.copy_(self._slot_rows[1], non_blocking=True)
        return was


class BatchGraphs:
    """The bucket lanes of one batch decoder (see the module docstring)."""

    def __init__(self, model, cache, max_tokens: int):
        self.model, self.cache = model, cache
        top = min(cache.slots, max_tokens)
        self.buckets = [b for b in BUCKETS if b < top] + [top]
        self.lanes: dict[int, SlotGraphLane] = {}
        t0 = time.perf_counter()
        for i, b in enumerate(self.buckets):
            self.lane(b)
            log.info("batch decode graphs: %d of %d buckets captured (%d rows)", i + 1, len(self.buckets), b)
        log.info("batch decode graphs for %s rows captured in %.1f s", ",".join(map(str, self.buckets)),
                 time.perf_counter() - t0)

    def lane(self, rows: int) -> SlotGraphLane:
        """The lane of a bucket, captured again when the model's FFN backend changed since."""
        lane = self.lanes.get(rows)
        if lane is None or lane.stale(self.model.ffn_backend()):
            if lane is not None:
                lane.close()
            lane = self.lanes[rows] = SlotGraphLane(self.model, self.cache, rows, name=f"batch-{rows}")
        return lane

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """ids, positions, slots [B] (host): the last layer's hidden states [B, H] when the step
        decodes (each sequence one row, or an MTP pair: two rows at consecutive positions) and a
        bucket holds B; else None."""
        slot_list = slots.tolist()
        b = len(slot_list)
        size = self.bucket(b)
        if size is None or not _decode_rows(slot_list, positions.tolist()):
            return None
        pad = size - b
        write_at = None
        if pad:
            ids = torch.cat([ids, ids[:1].expand(pad)])
            write_at = positions.tolist() + [self.cache.max_model_len - 1] * pad
            positions = torch.cat([positions, positions[:1].expand(pad)])
            slot_list = slot_list + slot_list[:1] * pad
        lane = self.lane(size)
        lane.set_slots(slot_list, write_at)
        hidden = run_lane(lane, lane.backend, ids.to(torch.int64), positions.to(torch.int64))
        return hidden[:b].clone()   # the lane's buffer is the next replay's: a caller may keep rows (MTP)

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()


def _decode_rows(slots: list[int], positions: list[int]) -> bool:
    """Whether a step's rows are a decode step's: each sequence's rows one run, one row or an MTP
    pair (two, at consecutive positions). A prefill chunk's longer runs read the cache eagerly."""
    seen, at = set(), 0
    while at < len(slots):
        n = 2 if at + 1 < len(slots) and slots[at + 1] == slots[at] else 1
        if slots[at] in seen or (n == 2 and positions[at + 1] != positions[at] + 1):
            return False
        seen.add(slots[at])
        at += n
    return True
