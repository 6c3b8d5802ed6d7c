"""Prefill and decoding on the CPU for engine.generate: the steps of a
Llama-family model in native C (native/host/), over the model's weights (the
projections and lm_head as float16 copies by default: engine.cpu.host_model)
and its KV cache. One step of T tokens (a decode step, or a prefill
chunk of up to max_tokens):

    duck_host_begin                     embeddings, rotary tables
    per layer: duck_host_layer_step     [+ previous FFN output] input norm, q/k/v, rotary, cache write,
                                        attention, o_proj, residual add, post norm (, router)
               CpuDecoder.ffn           the layer's FFN backend: one C call on these buffers
                                        (engine.host_ffn, the FFN host contract)
    duck_host_finish                    [+ last FFN output] final norm, lm_head -> logits [T, V]

With the fleet (a backend with step_session()), the layers of a step are one C
call instead (native/transport/host_step.h): each layer step, then its forward
on the same buffers, with no interpreter between them; DUCK_NATIVE_STEP=0 keeps
the loop in Python (the reference the tests hold it to).

    decoder = cpu_decoder(model, cache)          # None: not on the CPU, unsupported, or DUCK_CPU_NATIVE=0
    decoder, cache = decoder_on_own_cache(model, max_model_len)   # on native_cache (else the model's own)
    logits = decoder.prefill(ids, positions)     # [V]: the prompt in steps of max_tokens, the last token's logits
    logits = decoder(ids, positions)             # [T, V], T <= decoder.max_tokens

With weights="float32" the math is the torch path's (fp32; sums may be ordered
differently); with float16 projections (DUCK_CPU_WEIGHTS, default float16) it
is the torch path's on those weights rounded to float16. Threads: a pool of one per CPU this process may run on,
blocking when idle (the ducks share these cores).
"""
from __future__ import annotations

import logging
import os

import torch

from engine.cpu.host_model import FAMILIES, WEIGHT_TYPES, HalfUnfit, HostModel, UnsupportedModel
from engine.layers import KVCache, SlotKVCache
from engine.prefill import prefill_chunks
from native._native import ffi, lib
from native.host.ops import host_kernels, kernels_name
from native.kernels import Pool
from native.transport.step import HostStep, HostStepError

log = logging.getLogger(__name__)

NATIVE_ENV = "DUCK_CPU_NATIVE"   # auto (default): where supported; 0: never; 1: always (unsupported raises)
_MODES = {"auto": "auto", "": "auto", "0": "off", "off": "off", "false": "off", "no": "off",
          "1": "on", "on": "on", "true": "on", "yes": "on", "force": "on"}
WEIGHTS_ENV = "DUCK_CPU_WEIGHTS"   # float16 (default): the projections and lm_head as half copies; float32
KV_ENV = "DUCK_CPU_KV"             # float16 (default): native_cache holds halves; float32
MAX_TOKENS = 16   # decode steps, MTP pairs and short verification steps (a prefill's decoder takes its chunk)
MAX_STEP_TOKENS = lib.DUCK_HOST_MAX_TOKENS   # the longest step, a prefill chunk


class NativeDecodeError(RuntimeError):
    """The C decoder refused a step (bad token id, position past the cache, ...); says what."""


def native_mode() -> str:
    """'auto', 'off' or 'on', from DUCK_CPU_NATIVE."""
    raw = os.environ.get(NATIVE_ENV, "auto")
    mode = _MODES.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"{NATIVE_ENV}={raw!r}: expected auto, 0 (torch decode steps) or 1 (native, required)")
    return mode


def weight_type() -> str:
    """'float16' or 'float32', from DUCK_CPU_WEIGHTS (default float16)."""
    raw = os.environ.get(WEIGHTS_ENV, "").strip().lower() or "float16"
    name = {"f16": "float16", "fp16": "float16", "half": "float16", "f32": "float32", "fp32": "float32"}.get(raw, raw)
    if name not in WEIGHT_TYPES:
        raise ValueError(f"{WEIGHTS_ENV}={raw!r}: expected float16 (half copies of the projections and lm_head) "
                         f"or float32 (the model's own weights)")
    return name


def kv_type() -> torch.dtype:
    """The native decoder's own KV cache type, from DUCK_CPU_KV (default float16)."""
    raw = os.environ.get(KV_ENV, "").strip().lower() or "float16"
    name = {"f16": "float16", "fp16": "float16", "half": "float16", "f32": "float32", "fp32": "float32"}.get(raw, raw)
    if name not in ("float16", "float32"):
        raise ValueError(f"{KV_ENV}={raw!r}: expected float16 (a KV cache of halves) or float32")
    return getattr(torch, name)


def native_cache(model, max_model_len: int, slots: int | None = None) -> KVCache | SlotKVCache:
    """The native decoder's own KV cache for model (one sequence, or `slots` of them): in
    kv_type() (float16 by default: attention, which reads the whole cache every step,
    reads half the bytes; keys and values rounded to nearest even as they are written,
    2^-11 relative, as llama.cpp's default cache does) and with the heads outer in
    memory, so that a head's keys are one stream. The torch path cannot run on it."""
    c, dtype = model.config, kv_type()
    if slots is None:
        return KVCache.allocate(c, max_model_len, dtype, "cpu", heads_outer=True)
    return SlotKVCache.allocate(c, slots, max_model_len, dtype, "cpu", heads_outer=True)


class CpuDecoder:
    """The native decode steps of one model over one KV cache (see the module docstring).
    weights: 'float16' or 'float32' for the projections and lm_head (None: DUCK_CPU_WEIGHTS)."""

    def __init__(self, model, cache, kernel_set: str = "best", threads: int | None = None,
                 max_tokens: int = MAX_TOKENS, weights: str | None = None):
        self.model, self.cache = model, cache
        weights = weights or weight_type()
        try:
            self.host = HostModel(model, cache, max_tokens, weights)   # raises UnsupportedModel
        except HalfUnfit as e:
            log.warning("native CPU decoder: %s", e)
            self.host = HostModel(model, cache, max_tokens, "float32")
        self.weights = self.host.weights
        c = model.config
        self.max_tokens, self.hidden, self.vocab = max_tokens, c.hidden_size, c.vocab_size
        self._ntok = 0
        self._fleet = None    # (backend, session, HostStep): the C step over that session (see _fleet_step)
        self.kernels = host_kernels(kernel_set)
        self.pool = Pool(threads or len(os.sched_getaffinity(0)), pin=False)   # spin_us=0: blocks when idle
        # the FFN's inputs, written by C, read by the backend
        topk = c.num_experts_per_tok if any(self.host.routed) else 1
        f32, i32 = torch.float32, torch.int32
        self.ffn_in = torch.zeros(max_tokens, c.hidden_size, dtype=f32)        # [Tmax, H]
        self.expert_ids = torch.zeros(max_tokens, topk, dtype=i32)             # [Tmax, k]
        self.expert_weights = torch.zeros(max_tokens, topk, dtype=f32)         # [Tmax, k]
        self._dense = (torch.zeros(max_tokens, 1, dtype=i32), torch.ones(max_tokens, 1, dtype=f32))  # id 0, weight 1
        self.ffn_out = torch.zeros(max_tokens, c.hidden_size, dtype=f32)       # [Tmax, H], the FFN's result
        io = self._io = ffi.new("duck_host_io *")
        io.ffn_in = ffi.cast("float *", self.ffn_in.data_ptr())
        io.expert_ids = ffi.cast("int32_t *", self.expert_ids.data_ptr())
        io.expert_weights = ffi.cast("float *", self.expert_weights.data_ptr())
        err = ffi.new("char[]", 256)
        ptr = lib.duck_host_decoder_create(self.host.model, io, self.kernels, self.pool.ptr, err, 256)
        if ptr == ffi.NULL:
            raise UnsupportedModel(f"native CPU decoder: {ffi.string(err).decode()}")
        self._d = ffi.gc(ptr, lib.duck_host_decoder_destroy)
        log.debug("native CPU decoder for %s: %s kernels, %s projections, %d threads, cache of %d positions",
                  type(model).__name__, kernels_name(self.kernels), self.weights, self.pool.threads,
                  cache.max_model_len)

    def _check(self, rc: int) -> int:
        if rc < 0:
            raise NativeDecodeError(ffi.string(lib.duck_host_decoder_error(self._d)).decode())
        return rc

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """ids, positions [T] (CPU) -> logits [T, V]; the step's keys and values go into the cache
        (a SlotKVCache: token t into slot slots[t], attending to that slot only)."""
        return self.logits(self.layers(ids, positions, slots))

    def layers(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer of a step: returns the last layer's FFN output [T, H] (for logits)."""
        ids = ids.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        if ids.dim() != 1 or ids.shape != positions.shape:
            raise ValueError(f"ids {tuple(ids.shape)} and positions {tuple(positions.shape)} must be one [T] each")
        ntok = self._ntok = ids.shape[0]
        slot_ptr = ffi.NULL
        if slots is not None:
            slots = slots.to(torch.int32).contiguous()
            if slots.shape != ids.shape or (ntok and int(slots.min()) < 0):
                raise ValueError(f"slots {tuple(slots.shape)} must be one non-negative slot per token ({ntok})")
            slot_ptr = ffi.cast("const uint32_t *", slots.data_ptr())
        self._check(lib.duck_host_begin_slots(self._d, ntok, ffi.cast("const int64_t *", ids.data_ptr()),
                                              ffi.cast("const int64_t *", positions.data_ptr()), slot_ptr))
        step = self._fleet_step() if ntok else None
        if step is not None:
            backend, _, run = step
            try:
                times = run.run(ntok)
            except HostStepError as e:
                raise NativeDecodeError(str(e)) from None
            record = getattr(backend, "record_host_step", None)
            if record is not None:
                record(times)
            return self.ffn_out[:ntok]
        y = None
        for layer in range(len(self.host.ffn)):
            routed = self._check(lib.duck_host_layer_step(self._d, layer, self._out_ptr(y)))
            y = self.ffn(layer, ntok, bool(routed))
        return y

    def _fleet_step(self):
        """(backend, session, HostStep) when every layer's FFN is one backend with a fleet
        session (step_session()): the step's layers in one C call; None otherwise (the
        loop in Python), or with DUCK_NATIVE_STEP=0."""
        backend = self.host.ffn[0].ffn if self.host.ffn else None
        if any(m.ffn is not backend for m in self.host.ffn) or os.environ.get("DUCK_NATIVE_STEP", "1") == "0":
            return None
        session = getattr(backend, "step_session", lambda: None)()
        if session is None:
            return None
        if self._fleet is None or self._fleet[0] is not backend or self._fleet[1] is not session:
            routed = (self.expert_ids, self.expert_weights, self.expert_ids.shape[1]) if any(self.host.routed) \
                else None
            self._fleet = (backend, session, HostStep(session, self._d, len(self.host.ffn), self.ffn_in,
                                                      self.ffn_out, self._dense, routed))
            log.debug("native CPU decoder: every layer's FFN on fleet session %s, steps driven from C", session.id)
        return self._fleet

    def ffn(self, layer: int, ntok: int, routed: bool) -> torch.Tensor:
        """Layer `layer`'s FFN on the step's ffn_in, into ffn_out: the one place the decoder
        calls out. The buffers are in the wire's types, so a host backend (the fleet, the
        local fp9 kernels) makes one C call on them (engine.host_ffn). Returns y [T, H]."""
        module = self.host.ffn[layer]
        ids, weights = (self.expert_ids, self.expert_weights) if routed else self._dense
        y = module.ffn.forward(layer, self.ffn_in[:ntok], ids[:ntok], weights[:ntok], out=self.ffn_out[:ntok])
        if y.dtype != torch.float32 or not y.is_contiguous() or y.device.type != "cpu":
            y = y.to("cpu", torch.float32).contiguous()
        if tuple(y.shape) != (ntok, self.hidden):
            raise NativeDecodeError(f"layer {layer}: the FFN backend {module.ffn.name!r} returned "
                                    f"{tuple(y.shape)}, expected {(ntok, self.hidden)}")
        return y

    def logits(self, y: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Final norm + lm_head after the last layer's FFN output y [T, H] of the step
        -> logits [T, V], or [len(rows), V] of the tokens rows (increasing indices) only
        (a prefill chunk needs its last token's, a batch each sequence's last)."""
        if tuple(y.shape) != (self._ntok, self.hidden):
            raise ValueError(f"logits need the step's last FFN output [{self._ntok}, {self.hidden}], "
                             f"got {tuple(y.shape)}")
        if rows is None:
            out = torch.empty(y.shape[0], self.vocab, dtype=torch.float32)
            self._check(lib.duck_host_finish(self._d, self._out_ptr(y), ffi.cast("float *", out.data_ptr())))
            return out
        out = torch.empty(len(rows), self.vocab, dtype=torch.float32)
        picked = ffi.new("uint32_t[]", rows) if rows else ffi.NULL
        self._check(lib.duck_host_finish_rows(self._d, self._out_ptr(y), picked, len(rows),
                                              ffi.cast("float *", out.data_ptr())))
        return out

    def logits_argmax(self, y: torch.Tensor, rows: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """logits(y, rows) and each row's argmax, the greedy token (torch.argmax's: the first
        of equal maxima), found in C on the pool right after the lm_head."""
        if tuple(y.shape) != (self._ntok, self.hidden):
            raise ValueError(f"logits need the step's last FFN output [{self._ntok}, {self.hidden}], "
                             f"got {tuple(y.shape)}")
        n = self._ntok if rows is None else len(rows)
        out, top = torch.empty(n, self.vocab, dtype=torch.float32), ffi.new("int32_t[]", n)
        picked = ffi.new("uint32_t[]", rows) if rows else ffi.NULL
        self._check(lib.duck_host_finish_argmax(self._d, self._out_ptr(y), picked, n,
                                                ffi.cast("float *", out.data_ptr()), top))
        return out, list(top)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """A prompt (or its rest) in steps of chunk tokens (at most, and by default,
        max_tokens) -> the last token's logits [V]."""
        for part in prefill_chunks(ids.shape[0], min(chunk or self.max_tokens, self.max_tokens)):
            y = self.layers(ids[part], positions[part])
        return self.logits(y, [y.shape[0] - 1])[0]

    @staticmethod
    def _out_ptr(y: torch.Tensor | None):
        return ffi.NULL if y is None else ffi.cast("const float *", y.data_ptr())


def cpu_decoder(model, cache, **options) -> CpuDecoder | None:
    """The native decoder of model on cache when the model is on the CPU and supported;
    None otherwise (the torch path), or with DUCK_CPU_NATIVE=0. With DUCK_CPU_NATIVE=1
    an unsupported model raises UnsupportedModel instead."""
    mode = native_mode()
    if mode == "off" or model.model.embed_tokens.weight.device.type != "cpu":
        return None
    try:
        return CpuDecoder(model, cache, **options)
    except UnsupportedModel as e:
        if mode == "on":
            raise
        log.debug("decode steps in torch: %s", e)
        return None


def decoder_on_own_cache(model, max_model_len: int, **options) -> tuple[CpuDecoder | None, KVCache]:
    """cpu_decoder on a native_cache of max_model_len positions, and that cache; where the
    native decoder does not run the model, None (or UnsupportedModel with DUCK_CPU_NATIVE=1)
    and model.make_cache's cache, the torch path's."""
    own = native_mode() != "off" and type(model) in FAMILIES and model.model.embed_tokens.weight.device.type == "cpu"
    cache = native_cache(model, max_model_len) if own else model.make_cache(max_model_len)
    decoder = cpu_decoder(model, cache, **options)
    if decoder is None and own:
        cache = model.make_cache(max_model_len)
    return decoder, cache
