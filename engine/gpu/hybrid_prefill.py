"""A long prompt's FFN layers computed by the GPU and the ducks at once.

Each FFN call of the prefill (one chunk: the whole prompt, up to a memory bound) is
split by experts: experts [0, g) of the layer run on the GPU from weights streamed
over PCIe (engine.gpu.expert_stream), the others on the ducks (the backend, with the
GPU's experts masked out of the routing as -1, which a duck skips). The ducks' call
runs on a thread of its own while the GPU computes its share, and the copy of layer
L + 2 crosses PCIe meanwhile, so the three overlap.

g is chosen per layer so that the GPU's copy and the ducks' work end together
(PrefillSplit): from the copies' measured seconds per byte, the ducks' measured kernel
seconds per expert and token and their call's cost beside the kernels per token (the
activations out and the partials back), updated after every layer and kept across
prompts. Where the ducks' call costs more than its share saves, the GPU takes every
expert the host holds; where the GPU is slower than the ducks, none.
The model of the split does not see everything (the ducks share the host's cores with
the threads that feed the GPU; a layer's time outside its call absorbs GPU work queued
before it), so the split also checks itself: per prompt length (a power of two) it times
whole passes of both plans, "split" (the model's g) and "gpu" (every expert held to the
GPU), and runs the faster one, trying the other again every EXPLORE_EVERY prompts
(measured on an H100: a split that gave the ducks 5 of 128 experts ran 748 tok/s where
the GPU alone ran 867).
Mode "gpu" takes every expert the host holds to the GPU (the ducks get what it does
not hold); "fleet" does not split (the caller just does not install the hook).

    split = PrefillSplit()
    with HybridPrefill(stream, backend, split, tokens=len(prompt)):
        hidden = model(ids, positions, cache)           # the FFN calls come here (engine.ffn.ffn_call)
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.ffn import FfnBackend, FfnRequest, set_lane
from engine.host_ffn import FfnIO

log = logging.getLogger(__name__)

MODES = ("hybrid", "gpu")
EMA = 0.5                   # weight of a new measurement in the split's rates
PLANS = ("split", "gpu")    # a hybrid pass: the model's split, or every held expert to the GPU
EXPLORE_EVERY = 16          # prompts of one length between two tries of the plan not chosen


@dataclass
class Rates:
    """What the split has measured of one layer shape (experts per layer, bytes per expert):
    duck_s the ducks' kernel seconds per (expert, token), duck_call_s their call's seconds per
    token beside the kernel (transport), gpu_s the GPU's seconds per (expert, token)."""
    duck_s: float | None = None
    duck_call_s: float = 0.0
    gpu_s: float | None = None


class PrefillSplit:
    """The GPU's share of each layer's experts, from measured rates (see the module docstring).
    The copies' time per byte (pcie_s_per_byte) and a layer's time outside its FFN call (other_s)
    are the host's; the ducks' and the GPU's rates are kept per layer shape (Rates): a dense FFN
    layer (one expert, all tokens) costs some hundred times a routed expert per (expert, token),
    and one set of rates for both mis-splits every MoE layer after it."""

    def __init__(self, mode: str = "hybrid", pcie_gbps: float | None = None):
        if mode not in MODES:
            raise ValueError(f"prefill split mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.pcie_s_per_byte = 1.0 / (pcie_gbps * 1e9) if pcie_gbps else None
        self.other_s = 0.0
        self.shapes: dict[tuple[int, int], Rates] = {}   # (experts, expert bytes) -> Rates
        self.history: list[dict] = []          # per layer of the last prefill: g, experts, times
        self.plan = "gpu" if mode == "gpu" else "split"   # of the pass under way
        self.passes: dict[int, dict] = {}      # log2 of the prompt length -> {plan: s per token, "n": prompts}
        self.pass_seconds: deque[float] = deque(maxlen=8)   # the last passes' times, whole

    def begin(self, tokens: int) -> str:
        """The plan of a pass of tokens (see the module docstring): a plan not yet timed at this
        length first, then the faster, the other again every EXPLORE_EVERY prompts."""
        if self.mode == "gpu":
            self.plan = "gpu"
            return self.plan
        seen = self.passes.setdefault(_bucket(tokens), {"n": 0})
        seen["n"] += 1
        untimed = [p for p in PLANS if p not in seen]
        if untimed:
            self.plan = untimed[0]
        else:
            best = min(PLANS, key=lambda p: seen[p])
            self.plan = best if seen["n"] % EXPLORE_EVERY else next(p for p in PLANS if p != best)
        return self.plan

    def timed(self, tokens: int, seconds: float) -> None:
        """The pass of tokens begun last took seconds, its results on the GPU."""
        if seconds <= 0:
            return
        self.pass_seconds.append(seconds)
        if self.mode != "gpu" and tokens:
            seen = self.passes.setdefault(_bucket(tokens), {"n": 0})
            seen[self.plan] = _ema(seen.get(self.plan), seconds / tokens)

    def rates(self, experts: int, expert_bytes: int) -> Rates:
        return self.shapes.setdefault((experts, expert_bytes), Rates())

    def moe_rates(self) -> Rates | None:
        """The rates of the shape with the most experts (a report's figure), None before any."""
        return self.shapes[max(self.shapes)] if self.shapes else None

    def share(self, experts: int, held: int, expert_bytes: int, tokens: int) -> int:
        """How many of a layer's experts (the first ones) the GPU takes."""
        r = self.rates(experts, expert_bytes)
        if self.plan == "gpu" or experts == 1 and r.duck_s is None:
            return held
        a = (self.pcie_s_per_byte or 1.0 / 25e9) * expert_bytes                 # s per expert over PCIe ...
        a = max(a, r.gpu_s * tokens if r.gpu_s is not None else 0.0)            # ... or computing, if longer
        if r.duck_s is None:
            b, c = a, 0.0                                                        # a first guess: alike
        else:
            b, c = r.duck_s * tokens, r.duck_call_s * tokens                     # per expert, per call

        def wall(g: int) -> float:       # a layer with the GPU taking g experts: the slower side
            return max(a * g, self.other_s + (c + b * (experts - g) if g < experts else 0.0))
        balanced = max(0, min(held, round((self.other_s + c + experts * b) / (a + b))))
        return min((balanced, held, 0), key=wall)

    def observe(self, shape: tuple[int, int], pcie_s_per_byte: float | None, duck_seconds: float,
                duck_kernel_s: float, duck_experts: int, tokens: int, other_s: float,
                gpu: list[tuple[tuple[int, int], int, int, float]] = ()) -> None:
        """A layer's measurements: its shape (experts, bytes per expert), the copies' rate, the
        ducks' call (its seconds and the slowest duck's kernel seconds, for duck_experts experts
        of tokens tokens; a backend that reports no kernel time counts the whole call as work),
        the time outside the FFN call, and the GPU shares timed since the last layer ((shape,
        experts, tokens, seconds) each: a share's time is known a layer or two late)."""
        if pcie_s_per_byte:
            self.pcie_s_per_byte = pcie_s_per_byte
        if duck_experts and tokens:
            r = self.rates(*shape)
            work = duck_kernel_s if 0 < duck_kernel_s <= duck_seconds else duck_seconds
            r.duck_s = _ema(r.duck_s, work / (duck_experts * tokens))
            r.duck_call_s = _ema(r.duck_call_s, (duck_seconds - work) / tokens)
        for key, g, t, seconds in gpu:
            if g and t:
                r = self.rates(*key)
                r.gpu_s = _ema(r.gpu_s, seconds / (g * t))
        self.other_s = _ema(self.other_s, other_s)


def fleet_fit(points, tokens: int) -> float | None:
    """a + b x tokens least-squares fitted to (tokens, seconds) points, a and b kept >= 0; the mean time
    per token where every point has one length; None without points."""
    if not points:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    ms = sum(s for _, s in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return ms / mt * tokens
    b = max(0.0, sum((t - mt) * (s - ms) for t, s in points) / var)
    a = max(0.0, ms - b * mt)
    if a == 0.0:    # the intercept clipped: the slope through the origin's least squares
        b = sum(t * s for t, s in points) / sum(t * t for t, _ in points)
    return a + b * tokens


def _bucket(tokens: int) -> int:
    return max(0, round(math.log2(max(1, tokens))))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class HybridPrefill:
    """The FFN calls of one prefill on this thread, shared as the module docstring says."""

    def __init__(self, stream, backend: FfnBackend, split: PrefillSplit, tokens: int, count_experts: bool = False):
        self.stream, self.backend, self.split, self.tokens = stream, backend, split, tokens
        self.count_experts = count_experts   # record the distinct experts of each layer (a benchmark's check)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duck-prefill-ffn")
        self._io: FfnIO | None = None
        self._prev = None
        self._last_end = None
        self.layers: list[dict] = []

    def _fetch(self, layer: int | None) -> None:
        if layer is None:
            return
        s = self.stream
        g = self.split.share(s.experts(layer), s.held(layer), s.expert_bytes(layer), self.tokens)
        s.fetch(layer, g)

    def __enter__(self) -> "HybridPrefill":
        self.plan = self.split.begin(self.tokens)
        self._t0 = time.perf_counter()
        first = self.stream.order[0] if self.stream.order else None
        self._fetch(first)
        self._fetch(self.stream.next_layer(first) if first is not None else None)
        self._prev = set_lane(self)
        return self

    def __exit__(self, *exc) -> None:
        set_lane(self._prev)
        self._pool.shutdown(wait=True)
        self.split.history = self.layers
        if exc[0] is None:
            if self.stream.cuda:    # the pass's results: the caller's next step (the logits) waits for them anyway
                torch.cuda.synchronize(self.stream.device)
            self.split.timed(self.tokens, time.perf_counter() - self._t0)

    # -- the lane hook (engine.ffn.ffn_call) ------------------------------------------------------
    def _ffn_call(self, req: FfnRequest) -> torch.Tensor:
        s, layer = self.stream, req.layer
        now = time.perf_counter()
        other = now - self._last_end if self._last_end is not None else 0.0
        if layer not in s.layers:
            return self.backend.forward(layer, req.x, req.ids, req.weights)
        if not s.pending(layer):   # a pass after the first (a prompt longer than the chunk) starts again
            self._fetch(layer)
            self._fetch(s.next_layer(layer))
        g, experts = s.fetched(layer), s.experts(layer)
        t, k = req.ids.shape
        duck = self._send_to_ducks(layer, req, g) if g < experts else None
        y = s.forward(layer, req.x, req.ids, req.weights)                       # [T, H] fp32, the GPU's share
        nxt = s.next_layer(layer)
        self._fetch(s.next_layer(nxt) if nxt is not None else None)             # L + 2 into the buffer L used
        duck_s = kernel_s = 0.0
        if duck is not None:
            duck_s, kernel_s = duck.result()
            y += self._io.views(t, k)[3].to(y.device, non_blocking=True).float()
        self._last_end = time.perf_counter()
        self.split.observe(s.shape(layer), s.pcie_seconds_per_byte(), duck_s, kernel_s,
                           experts - g if duck is not None else 0, t, other,
                           [(s.shape(at), n, m, sec) for at, n, m, sec in s.compute_seconds()])
        self.layers.append({"layer": layer, "gpu_experts": g, "experts": experts, "duck_s": duck_s,
                            "call_s": self._last_end - now})
        if self.count_experts:
            self.layers[-1]["distinct"] = int(torch.unique(req.ids[req.ids >= 0]).numel())
        return y.to(req.x.dtype)

    def _send_to_ducks(self, layer: int, req: FfnRequest, g: int):
        """The ducks' share on the worker thread: the routing with experts [0, g) masked out (-1),
        copied to pinned buffers first (an event the worker waits for: the GPU's own work queued
        after the copies is not waited for)."""
        t, k = req.ids.shape
        wire = req.x.dtype if req.x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        if self._io is None or self._io.tokens < t or self._io.topk < k or self._io.x.dtype != wire:
            self._io = FfnIO.allocate(t, req.x.shape[1], k, wire)
        xh, ih, wh, yh = self._io.views(t, k)
        ids = torch.where(req.ids >= g, req.ids, torch.full_like(req.ids, -1)).to(torch.int32)
        cuda = req.x.device.type == "cuda"
        xh.copy_(req.x, non_blocking=cuda)
        ih.copy_(ids, non_blocking=cuda)
        wh.copy_(req.weights, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(req.x.device))

        def call() -> tuple[float, float]:
            """(the call's seconds, the slowest duck's kernel seconds in it: 0 if not reported)"""
            if ready is not None:
                ready.synchronize()
            t0, k0 = time.perf_counter(), self.backend.kernel_us_total
            with torch.inference_mode():
                self.backend.forward(layer, xh, ih, wh, out=yh)
            return time.perf_counter() - t0, (self.backend.kernel_us_total - k0) * 1e-6
        return self._pool.submit(call)


class StreamedPrefill:
    """What a host with a GPU and a fleet keeps for long prompts (engine.generate asks it): the
    expert stream, the split's rates across prompts, the chunk (the whole prompt up to this
    bound: each weight crosses PCIe once per chunk) and when a prompt is long enough.

    A prompt is streamed when its estimated time so is below the fleet's alone: one pass of
    the held experts over PCIe (at the measured copy rate; no less than the fastest of the last
    passes measured whole, copies, GPU decode and GEMMs: 0.6 s on an H100 for the Qwen3-30B-A3B
    shape where its 16 GB take 0.3 s over PCIe) against the fleet's time for its
    tokens, a + b x tokens fitted to the last FLEET_POINTS prefills the fleet did (the batch times
    each step that reads prompt tokens without the stream, engine.generate each prefill): a short
    rest touches nearly every expert, so the ducks' time has a part no token count shrinks (a
    per-token rate alone sent a chat's 41-token rest through a 0.6 s pass where the ducks take
    0.3 s). One length seen: its time per token. Until the fleet has been timed, from
    FIRST_GUESS_TOKENS on; with min_tokens set, always from min_tokens on."""

    FIRST_GUESS_TOKENS = 256
    FLEET_POINTS = 32

    def __init__(self, stream, backend: FfnBackend, mode: str = "hybrid", pcie_gbps: float | None = None,
                 chunk: int = 16384, min_tokens: int = 0):
        self.stream, self.backend = stream, backend
        self.split = PrefillSplit(mode, pcie_gbps)
        self.chunk, self.min_tokens = chunk, min_tokens
        self.fleet_points: deque[tuple[int, float]] = deque(maxlen=self.FLEET_POINTS)   # (tokens, seconds)
        self.pass_bytes = sum(stream.held(layer) * stream.expert_bytes(layer) for layer in stream.order)

    def placed(self, resident) -> None:
        """The GPU's placement changed (engine.placement): a layer it holds whole leaves the stream's
        passes, one it holds no more comes back."""
        stream = self.stream
        stream.order = sorted(i for i in stream.layers if resident is None or not resident.whole(i))
        self.pass_bytes = sum(stream.held(i) * stream.expert_bytes(i) for i in stream.order)
        self.split.pass_seconds.clear()   # passes of the old placement time another pass

    def worth(self, tokens: int) -> bool:
        if self.min_tokens:
            return tokens >= self.min_tokens
        fleet = self.fleet_seconds(tokens)
        if fleet is None or not self.split.pcie_s_per_byte:
            return tokens >= self.FIRST_GUESS_TOKENS
        return self.pass_estimate() < fleet

    def pass_estimate(self) -> float:
        """A pass's seconds, for any prompt it takes: its bytes over PCIe, or the fastest pass
        measured of late where that is longer."""
        copy = self.pass_bytes * (self.split.pcie_s_per_byte or 0.0)
        if not self.pass_bytes or not self.split.pass_seconds:   # nothing to stream: a pass costs no copy
            return copy
        return max(copy, min(self.split.pass_seconds))

    def fleet_timed(self, tokens: int, seconds: float) -> None:
        """A prefill of tokens the fleet did (a step of that many tokens), in seconds: what worth() weighs."""
        if tokens > 0 and seconds > 0:
            self.fleet_points.append((tokens, seconds))

    def fleet_seconds(self, tokens: int) -> float | None:
        """The fleet's estimated time for a prefill of tokens (see the class docstring); None before any."""
        return fleet_fit(self.fleet_points, tokens)

    def hook(self, tokens: int) -> HybridPrefill:
        return HybridPrefill(self.stream, self.backend, self.split, tokens)

    def close(self) -> None:
        self.stream.close()
