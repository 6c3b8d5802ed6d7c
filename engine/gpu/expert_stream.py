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
import torch.nn.functional as F

from engine.gpu.fp9_decode import Placement, decode_fp9
from engine.gpu.fp9_gemv import kernel_runs
from engine.gpu.fp9_moe import FUSED_ROWS, fp9_moe_forward

log = logging.getLogger(__name__)

SLOT_ALIGN = 64
DECODE_GROUP_BYTES = 2 << 30   # bf16 weights decoded at a time (experts in groups that fit this)


def _slot(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def _tensor_bytes(t) -> int:
    return int(t.nbytes)


def _slots(per_duck) -> tuple[int, int]:
    """(gate_up slot, down slot) of a layer: its largest tensor of each kind, rounded to SLOT_ALIGN."""
    tensors = [e for duck in per_duck for e in duck]
    return _slot(max(_tensor_bytes(e.gate_up) for e in tensors)), _slot(max(_tensor_bytes(e.down) for e in tensors))


class _Layer:
    """One layer's experts in host memory: shapes, slot sizes and the pinned bytes."""

    def __init__(self, index: int, per_duck, max_experts: int | None, pin: bool, workers,
                 which: list[int] | None = None):
        """Experts [0, max_experts) of the layer (None: all), or the experts `which` in that order."""
        tp, experts = len(per_duck), len(per_duck[0])
        self.index, self.tp, self.experts = index, tp, experts
        first = per_duck[0][0]
        (self.gu_rows, self.hidden), (_, self.slice_cols) = first.gate_up.shape, first.down.shape
        for d in range(tp):
            for e in range(experts):
                s = per_duck[d][e]
                if s.gate_up.shape != first.gate_up.shape or s.down.shape != first.down.shape:
                    raise ValueError(f"layer {index}: expert {e} slice {d} is {s.gate_up.shape} / {s.down.shape}, "
                                     f"expert 0 slice 0 {first.gate_up.shape} / {first.down.shape}: the GPU stream "
                                     "needs slices of one shape")
        self.gu_slot, self.dn_slot = _slots(per_duck)
        if which is None:
            which = list(range(experts if max_experts is None else max(0, min(experts, max_experts))))
        self.held = len(which)
        self.gu_bytes = self.held * tp * self.gu_slot
        # every byte a decode reads is written below (a slot's tail past its tensor is never read)
        self.host = torch.empty(self.gu_bytes + self.held * tp * self.dn_slot, dtype=torch.uint8, pin_memory=pin)
        jobs = [(per_duck[d][e].gate_up, (p * tp + d) * self.gu_slot) for p, e in enumerate(which) for d in range(tp)]
        jobs += [(per_duck[d][e].down, self.gu_bytes + (p * tp + d) * self.dn_slot)
                 for p, e in enumerate(which) for d in range(tp)]
        list(workers.map(lambda job: self._put(*job), jobs))     # tensor by tensor: the C releases the GIL

    def _put(self, tensor, at: int) -> None:
        """The serialized tensor's bytes into the host buffer (a synthetic one generated there)."""
        import numpy as np

        from native._native import ffi, lib
        from native.fp9 import Fp9Error, SynthTensor
        dst = self.host[at:at + tensor.nbytes]
        if isinstance(tensor, SynthTensor):
            rc = lib.fp9_synth_generate(tensor.desc, ffi.cast("void *", dst.data_ptr()), tensor.nbytes, ffi.NULL)
            if rc != 0:
                raise Fp9Error(f"synthetic tensor {tensor.name!r}: generation failed ({rc})")
        else:
            dst.copy_(torch.from_numpy(np.asarray(tensor.buf[:tensor.nbytes])))

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert crosses PCIe with (all its slices)."""
        return self.tp * (self.gu_slot + self.dn_slot)

    @property
    def intermediate(self) -> int:
        return self.tp * self.slice_cols


class ExpertStream:
    """See the module docstring. layers: {layer: per duck, per expert ExpertSlice} (FleetFfn.layers)."""

    def __init__(self, layers: dict, hidden: int, device, max_bytes: int | None = None, threads: int = 0):
        from concurrent.futures import ThreadPoolExecutor
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        workers = ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1, thread_name_prefix="expert-stream")
        t0 = time.perf_counter()
        self.layers: dict[int, _Layer] = {}
        left = max_bytes
        try:
            for index in sorted(layers):
                per_duck = layers[index]
                one = sum(_slot(_tensor_bytes(per_duck[d][0].gate_up)) + _slot(_tensor_bytes(per_duck[d][0].down))
                          for d in range(len(per_duck)))
                cap = None if left is None else left // one
                layer = _Layer(index, per_duck, cap, self.cuda, workers)
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

    @staticmethod
    def _decode(lay: _Layer, src: torch.Tensor, g: int, e0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [e0, e0 + n) of the g fetched (gate_up slices of all g, then their down slices)
        as bf16 [n, 2I, H] and [n, H, I]: the tp slices of an expert side by side."""
        tp, rows, h, s = lay.tp, lay.gu_rows, lay.hidden, lay.slice_cols
        gu = torch.empty(n, tp * rows, h, dtype=torch.bfloat16, device=src.device)
        dn = torch.empty(n, h, tp * s, dtype=torch.bfloat16, device=src.device)
        decode_fp9(src[e0 * tp * lay.gu_slot:], n * tp, lay.gu_slot, rows, h, gu,
                   Placement(per=tp, outer=tp * rows * h, inner=rows * h, row_stride=h))
        down_at = g * tp * lay.gu_slot + e0 * tp * lay.dn_slot
        decode_fp9(src[down_at:], n * tp, lay.dn_slot, h, s, dn,
                   Placement(per=tp, outer=h * tp * s, inner=s, row_stride=tp * s))
        return gu, dn

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._gpu = [None, None]
        self.layers.clear()


def route_pairs(ids: torch.Tensor, weights: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, expert) pairs of ids [T, k] whose expert is in [0, g), sorted by expert: their tokens [P],
    weights [P] fp32 and the count of each expert (one host sync: the grouped GEMMs' sizes)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    mine = ((flat >= 0) & (flat < g)).nonzero().squeeze(1)
    experts = flat[mine].long()
    pairs = mine[torch.argsort(experts, stable=True)]
    counts = torch.bincount(experts, minlength=g).tolist()
    return pairs // k, weights.reshape(-1)[pairs].float(), counts


def grouped_ffn(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """xs [R, H] rows grouped by expert (counts[i] rows for expert i), gate_up [n, 2I, H] interleaved,
    down [n, H, I] -> [R, H] in xs' dtype: each row's expert FFN as two grouped GEMMs."""
    h = _grouped(xs, gate_up, counts)                                            # [R, 2I]
    a = F.silu(h[:, 0::2].float()) * h[:, 1::2].float()                          # [R, I]
    return _grouped(a.to(xs.dtype), down, counts)                                # [R, H]


def fp9_experts_forward(lay: _Layer, src: torch.Tensor, g: int, x: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor, ready=None) -> torch.Tensor:
    """x [T, H], ids / weights [T, k] -> [T, H] fp32: the pairs whose id is one of the g experts laid in src
    (lay's layout, experts [0, g)), decoded to bf16 a group at a time and run as grouped GEMMs; nothing of
    the other pairs. Each pair's output is rounded to the GEMMs' type (bf16, or fp32 for an fp32 model)
    before it is weighted and added in fp32. One host sync (the groups' sizes); ready() is called after
    it, before the first read of src (ExpertStream: the wait for the copy)."""
    y = torch.zeros(ids.shape[0], lay.hidden, dtype=torch.float32, device=x.device)
    tokens, w, counts = route_pairs(ids, weights, g)
    if ready is not None:
        ready()
    # the GEMMs in bf16 (the tensor cores; the weights are exact in it); an fp32 model (the CPU
    # tests) keeps fp32, as its ducks do
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    group = max(1, DECODE_GROUP_BYTES // (2 * lay.tp * (lay.gu_rows * lay.hidden + lay.hidden * lay.slice_cols)))
    at = 0
    for e0 in range(0, g, group):
        n = min(group, g - e0)
        rows = sum(counts[e0:e0 + n])
        if rows == 0:
            continue
        gu, dn = ExpertStream._decode(lay, src, g, e0, n)                         # [n, 2I, H], [n, H, I]
        sel = slice(at, at + rows)
        o = grouped_ffn(x[tokens[sel]].to(dtype), gu.to(dtype), dn.to(dtype), counts[e0:e0 + n])
        y.index_add_(0, tokens[sel], o.float() * w[sel, None])
        at += rows
    return y


_FUSED: dict[str, bool] = {}   # device -> engine.gpu.fp9_moe's kernels give the reference's result there


def check_fused(device) -> bool:
    """Whether engine.gpu.fp9_moe's grouped GEMMs run on device, checked once per CUDA device against
    their reference on a small random layer (fp9 bytes and bf16 copies, 24 tokens): a kernel that
    does not compile there or disagrees is logged and left out (held_experts_forward and
    engine.placement then take the GEMV and the decoded path, as before them). Called where
    experts are placed or streamed, before any graph is captured; the interpreter (the tests)
    is trusted: its tests hold it to the reference."""
    device = torch.device(device)
    if device.type != "cuda" or not kernel_runs(device):
        return kernel_runs(device)
    key = _device_key(device)
    if key not in _FUSED:
        try:
            err = _fused_errors(device)
            _FUSED[key] = max(err) < 2e-2
            log.log(logging.INFO if _FUSED[key] else logging.WARNING, "fp9 grouped GEMMs on %s: %s (relative "
                    "differences from the reference %s)", device, "on" if _FUSED[key] else "off: they disagree",
                    ", ".join(f"{e:.1e}" for e in err))
        except Exception as e:   # a compiler or driver that cannot run them
            log.warning("fp9 grouped GEMMs on %s: off, they do not run here (%s: %s)", device, type(e).__name__, e)
            _FUSED[key] = False
    return _FUSED[key]


def fused_ready(device) -> bool:
    """check_fused's answer where it was asked; False where it was not (nothing runs the check in a capture)."""
    device = torch.device(device)
    return _FUSED.get(_device_key(device), False) if device.type == "cuda" else kernel_runs(device)


def _device_key(device: torch.device) -> str:
    """The device's key: cuda and cuda:<the current index> are one device."""
    return str(device if device.index is not None else torch.device(device.type, torch.cuda.current_device()))


def _fused_errors(device) -> list[float]:
    from concurrent.futures import ThreadPoolExecutor

    from engine.gpu.fp9_moe import copies_moe_forward, fp9_moe_ref
    from native.transport import split_experts

    g = torch.Generator().manual_seed(0)
    experts = [tuple(torch.randn(*shape, generator=g) / 8 for shape in ((160, 128), (160, 128), (128, 160)))
               for _ in range(4)]
    per_duck = split_experts(experts, 2, 64, name="fp9-moe-check")
    with ThreadPoolExecutor(1) as workers:
        lay = _Layer(-1, per_duck, None, False, workers)
    src = lay.host.to(device)
    # bf16 as a GPU model's activations are (fp32 elsewhere: Triton's interpreter multiplies bf16 as raw bits)
    x = torch.randn(24, 128, generator=g).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    slots = torch.randint(-1, 4, (24, 3), generator=g, dtype=torch.int32).to(device)
    w = torch.rand(24, 3, generator=g).to(device)
    want = fp9_moe_ref(lay, src, x, slots, w)
    gu, dn = (t.to(x.dtype) for t in ExpertStream._decode(lay, src, 4, 0, 4))
    return [float((y - want).norm() / want.norm())
            for y in (fp9_moe_forward(lay, src, x, slots, w), copies_moe_forward(gu, dn, x, slots, w))]


def held_experts_forward(lay, src: torch.Tensor, g: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         ready=None, capturing: bool = False) -> torch.Tensor:
    """The share of the g experts laid in src (ids in [0, g); others, and -1, are not this share) of
    x [T, H] -> [T, H] fp32, by the cheaper way: engine.gpu.fp9_moe's grouped GEMMs up to FUSED_ROWS
    rows an expert (and always inside a graph's capture: no host sync), where they run (check_fused);
    else every expert decoded to bf16 and torch's grouped GEMMs (fp9_experts_forward). ready() is
    called before src is first read."""
    t, k = ids.shape
    if fused_ready(src.device) and (capturing or t * k <= FUSED_ROWS * max(1, g)):
        slots = torch.where((ids >= 0) & (ids < g), ids, torch.full_like(ids, -1))
        if ready is not None:
            ready()
        return fp9_moe_forward(lay, src, x, slots, weights, g)
    return fp9_experts_forward(lay, src, g, x, ids, weights, ready)


def _grouped(a: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """a [R, K] bf16 rows grouped by expert (counts[i] rows for w[i]), w [n, N, K] -> [R, N] bf16."""
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(a.device)
    try:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    except (RuntimeError, AttributeError):   # no grouped GEMM here (an older torch, a GPU before sm90)
        out, at = [], 0
        for i, c in enumerate(counts):
            if c:
                out.append(a[at:at + c] @ w[i].T)
                at += c
        return torch.cat(out)


PART_BYTES = 1 << 30   # host memory a layer's experts pass through at a time on their way to the GPU


def _parts(per_duck, which: list[int], workers, part_bytes: int = PART_BYTES):
    """(position, _Layer of the experts which[position:position + n]) in parts of at most part_bytes of
    host memory: the host also holds the ducks' and the streamed prefill's copies (a DeepSeek layer is
    12.7 GB of fp9)."""
    gu_slot, dn_slot = _slots(per_duck)
    step = max(1, part_bytes // (len(per_duck) * (gu_slot + dn_slot)))
    for at in range(0, len(which), step):
        yield at, _Layer(-1, per_duck, None, False, workers, which=which[at:at + step])


def held_experts(per_duck, which: list[int], device, workers) -> tuple[_Layer, torch.Tensor]:
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
            part_gu, part_dn = ExpertStream._decode(part, part.host.to(device), n, 0, n)
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
