"""The experts of every FFN layer streamed from host memory to the GPU for a long prompt.

The host keeps the ducks' own fp9 slices (engine.fleet_ffn.FleetFfn.layers: slice d of expert
e of layer L, the bytes duck d holds) in pinned memory, one buffer per layer:

    [gate_up of expert 0, slice 0 .. tp-1][expert 1 ...] ... [down of expert 0, slice 0 ..] ...

each tensor in a slot of its own size (rounded to 64 bytes), so the first g experts of a
layer are two ranges of bytes. A prefill copies those ranges to one of two GPU buffers
on a stream of its own (layer L + 2 crosses PCIe while layer L computes), decodes them
there to bf16 (engine.gpu.fp9_decode: exactly the ducks' weights) and runs the experts as
grouped GEMMs over the tokens routed to them. Each weight crosses PCIe once per prompt.

    stream = ExpertStream(fleet_ffn.layers, hidden, device)
    stream.fetch(layer, g)                      # start copying experts [0, g) of layer
    y = stream.forward(layer, x, ids, w)        # [T, H] fp32: the share of experts [0, g)

What the host needs: the fp9 bytes of every expert (1.125 B per weight: Qwen3-30B-A3B
32.6 GB, DeepSeek-V3.2 about 750 GB). A host with less keeps fewer experts (max_bytes): a
layer's experts beyond what is held are the ducks' (ExpertStream.held(layer)).
On a CPU "device" (the tests, CI) the same code runs with plain copies.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from engine.gpu.fp9_layout import Layer, decode_range, layer_slots, nbytes_of, slot_size
from engine.gpu.fp9_moe import check_fused, held_experts_forward

log = logging.getLogger(__name__)


class ExpertStream:
    """See the module docstring. layers: {layer: per duck, per expert ExpertSlice} (FleetFfn.layers)."""

    def __init__(self, layers: dict, hidden: int, device, max_bytes: int | None = None, threads: int = 0):
        from concurrent.futures import ThreadPoolExecutor
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        workers = ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1, thread_name_prefix="expert-stream")
        t0 = time.perf_counter()
        self.layers: dict[int, Layer] = {}
        left = max_bytes
        try:
            for index in sorted(layers):
                per_duck = layers[index]
                one = sum(slot_size(nbytes_of(per_duck[d][0].gate_up)) + slot_size(nbytes_of(per_duck[d][0].down))
                          for d in range(len(per_duck)))
                cap = None if left is None else left // one
                layer = Layer(index, per_duck, cap, self.cuda, workers)
                if layer.hidden != hidden:
                    raise ValueError(f"layer {index}: slices of hidden size {layer.hidden}, the model's is {hidden}")
                self.layers[index] = layer
                if left is not None:
                    left -= layer.host.numel()
                done = len(self.layers)
                if done % max(1, len(layers) // 8) == 0 or done == len(layers):   # pinning GBs takes a while
                    log.info("expert stream: %d/%d layers in host memory (%.1f GB)", done, len(layers),
                             sum(x.host.numel() for x in self.layers.values()) / 1e9)
        finally:
            workers.shutdown()
        total = sum(layer.host.numel() for layer in self.layers.values())
        log.info("expert stream: %d layers, %.2f GB of fp9 experts in %s host memory in %.1f s", len(self.layers),
                 total / 1e9, "pinned" if self.cuda else "plain", time.perf_counter() - t0)
        self.hidden = hidden
        self.order = sorted(self.layers)
        check_fused(self.device)
        self._gpu: list[torch.Tensor | None] = [None, None]    # fp9 bytes on the GPU, two buffers
        self._where: dict[int, tuple[int, int]] = {}             # layer -> (buffer, experts fetched)
        self._next = 0
        self._copy = torch.cuda.Stream(self.device) if self.cuda else None
        self._copied = [None, None]                              # events: a buffer's bytes are in
        self._free = [None, None]                                # events: a buffer's last reader is done
        self._timing: dict[int, tuple] = {}                      # layer -> (copy start, copy end events, bytes)
        self.copy_seconds: list[tuple[int, float]] = []          # (bytes, seconds) of finished copies (CUDA)
        self._computing: list[tuple] = []                        # (layer, experts, tokens, start, end) not read yet

    # -- what is held ------------------------------------------------------------------------
    def held(self, layer: int) -> int:
        """How many of the layer's experts (its first ones) the host holds: the most the GPU can take."""
        return self.layers[layer].held if layer in self.layers else 0

    def experts(self, layer: int) -> int:
        return self.layers[layer].experts

    def expert_bytes(self, layer: int) -> int:
        return self.layers[layer].expert_bytes

    def shape(self, layer: int) -> tuple[int, int]:
        """(experts, bytes per expert): what the split keeps its rates by (engine.gpu.hybrid_prefill)."""
        return self.experts(layer), self.expert_bytes(layer)

    def next_layer(self, layer: int) -> int | None:
        """The FFN layer after this one (None after the last)."""
        i = self.order.index(layer) + 1
        return self.order[i] if i < len(self.order) else None

    # -- copies -------------------------------------------------------------------------------
    def fetch(self, layer: int, g: int) -> None:
        """Starts copying experts [0, g) of layer into the next GPU buffer (after its last reader)."""
        lay = self.layers[layer]
        g = max(0, min(g, lay.held))
        b = self._next
        self._next ^= 1
        self._where[layer] = (b, g)
        if g == 0:
            return
        gu, dn = g * lay.tp * lay.gu_slot, g * lay.tp * lay.dn_slot
        need = gu + dn
        buf = self._gpu[b]
        if buf is None or buf.numel() < need:
            if self._free[b] is not None:
                self._free[b].synchronize()
            self._gpu[b] = buf = torch.empty(max(need, 1), dtype=torch.uint8, device=self.device)
            if self.cuda:
                buf.record_stream(self._copy)   # written on the copy stream, freed from the compute one
        if not self.cuda:
            buf[:gu].copy_(lay.host[:gu])
            buf[gu:need].copy_(lay.host[lay.gu_bytes:lay.gu_bytes + dn])
            return
        with torch.cuda.stream(self._copy):
            if self._free[b] is not None:
                self._copy.wait_event(self._free[b])
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._copy)
            buf[:gu].copy_(lay.host[:gu], non_blocking=True)
            buf[gu:need].copy_(lay.host[lay.gu_bytes:lay.gu_bytes + dn], non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self._copy)
        self._copied[b] = done
        self._timing[layer] = (start, done, need)

    def fetched(self, layer: int) -> int:
        """Experts of the layer whose copy was started (0: none)."""
        return self._where.get(layer, (0, 0))[1]

    def pending(self, layer: int) -> bool:
        """Whether a fetch of the layer waits for its forward."""
        return layer in self._where

    def pcie_seconds_per_byte(self) -> float | None:
        """Measured: the finished copies' time per byte (None before any, and on a CPU device)."""
        for layer, (start, done, nbytes) in list(self._timing.items()):
            if done.query():
                self.copy_seconds.append((nbytes, start.elapsed_time(done) * 1e-3))
                del self._timing[layer]
        recent = self.copy_seconds[-16:]
        if not recent:
            return None
        return sum(s for _, s in recent) / max(1, sum(n for n, _ in recent))

    # -- compute ----------------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] (the layer's routing) -> [T, H] fp32: the sum over the
        (token, expert) pairs whose expert is one of the fetched [0, g), nothing of the others
        (held_experts_forward)."""
        b, g = self._where.pop(layer, (0, 0))
        lay = self.layers[layer]
        if g == 0:
            return torch.zeros(ids.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        began = None

        def ready():   # after the routing's sync: the compute waits for the copy, not the host
            nonlocal began
            if self.cuda:
                compute.wait_event(self._copied[b])
                began = torch.cuda.Event(enable_timing=True)
                began.record(compute)
            else:
                began = time.perf_counter()

        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        y = held_experts_forward(lay, self._gpu[b], g, x, ids, weights, ready)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(compute)
            self._free[b] = ev
            self._computing.append((layer, g, ids.shape[0], began, ev))
        else:
            self._computing.append((layer, g, ids.shape[0], began, time.perf_counter()))
        return y

    def compute_seconds(self) -> list[tuple[int, int, int, float]]:
        """(layer, experts, tokens, seconds) of the GPU shares computed since the last call whose time is known."""
        done, left = [], []
        for layer, g, t, began, ended in self._computing:
            if not self.cuda:
                done.append((layer, g, t, ended - began))
            elif ended.query():
                done.append((layer, g, t, began.elapsed_time(ended) * 1e-3))
            else:
                left.append((layer, g, t, began, ended))
        self._computing = left
        return done

    def close(self) -> None:
        """Waits for the copies and computes in flight and lets go of the GPU buffers and the host copy."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._gpu = [None, None]
        self.layers.clear()


PART_BYTES = 1 << 30   # host memory a layer's experts pass through at a time on their way to the GPU


def _parts(per_duck, which: list[int], workers, part_bytes: int = PART_BYTES):
    """(position, Layer of the experts which[position:position + n]) in parts of at most part_bytes of
    host memory: the host also holds the ducks' and the streamed prefill's copies (a DeepSeek layer is
    12.7 GB of fp9)."""
    gu_slot, dn_slot = layer_slots(per_duck)
    step = max(1, part_bytes // (len(per_duck) * (gu_slot + dn_slot)))
    for at in range(0, len(which), step):
        yield at, Layer(-1, per_duck, None, False, workers, which=which[at:at + step])


def held_experts(per_duck, which: list[int], device, workers) -> tuple[Layer, torch.Tensor]:
    """The experts `which` of one layer (per duck, per expert ExpertSlice: FleetFfn.layers[layer]) as fp9
    bytes on device, in this module's layout with them as experts [0, n): (the layout, the bytes).
    Exactly the ducks' weights (engine.placement keeps them; engine.gpu.fp9_gemv reads them)."""
    layout, src = None, None
    for at, part in _parts(per_duck, which, workers):
        if layout is None:
            layout = part
            src = torch.empty(len(which) * part.expert_bytes, dtype=torch.uint8, device=device)
            gu_bytes = len(which) * part.tp * part.gu_slot
        m, gu, dn = part.held, part.tp * part.gu_slot, part.tp * part.dn_slot
        src[at * gu:(at + m) * gu].copy_(part.host[:part.gu_bytes])
        src[gu_bytes + at * dn:gu_bytes + (at + m) * dn].copy_(part.host[part.gu_bytes:])
    layout.held, layout.gu_bytes, layout.host = len(which), gu_bytes, None   # the first part's layout, all of them
    return layout, src


def decode_experts(per_duck, which: list[int], device, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts `which` of one layer decoded on device: bf16 gate_up [n, 2I, H] (gate row i at 2i, up
    at 2i + 1) and down [n, H, I], I padded as the slices are (zeros). Exactly the ducks' weights
    (engine.placement keeps them where the budget holds every FFN decoded); a part at a time."""
    from concurrent.futures import ThreadPoolExecutor

    device = torch.device(device)
    gu = dn = None
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="expert-decode") as workers:
        for at, part in _parts(per_duck, which, workers):
            n = part.held
            part_gu, part_dn = decode_range(part, part.host.to(device), n, 0, n)
            if gu is None:
                gu = torch.empty((len(which), *part_gu.shape[1:]), dtype=part_gu.dtype, device=device)
                dn = torch.empty((len(which), *part_dn.shape[1:]), dtype=part_dn.dtype, device=device)
            gu[at:at + n], dn[at:at + n] = part_gu, part_dn
    return gu, dn


def pinned_copy_gbps(device, mib: int = 512, rounds: int = 5) -> float | None:
    """The host-to-GPU copy rate from pinned memory (GB/s, the best of a few rounds): what a
    streamed prefill's copies can reach. None without CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    src = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    best = 0.0
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, src.numel() / (start.elapsed_time(end) * 1e-3) / 1e9)
    return best
