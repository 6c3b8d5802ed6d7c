"""Python face of the fp9 kernels: a worker pool, matmul, and the MLP / MoE
slice forward the ducks run. Every call releases the GIL while in C."""
from __future__ import annotations

import os
import time

import numpy as np

from native._native import ffi, lib
from native.fp9 import Fp9Error, Fp9Tensor, _aligned_bytes, _to_numpy

MAX_TOKENS = lib.DUCK_MAX_TOKENS   # tokens per C call; longer inputs are cut into calls of this many
MAX_TOPK = lib.DUCK_MAX_TOPK

_FFN_ERRORS = {-1: "counts out of range or missing buffers", -2: "expert id out of range",
               -3: "expert shapes do not fit the hidden size", -4: "out of memory"}


KERNEL_SETS = ("best", "ref", "avx2", "avx2-xor", "avx2-blend", "avx512", "avx512-bf16", "amx", "amx-emu")
_NEEDS = {"avx2": "AVX2+FMA", "avx2-xor": "AVX2+FMA", "avx2-blend": "AVX2+FMA", "avx512": "AVX-512 F/BW/VL",
          "avx512-bf16": "AVX-512 F/BW/VL and AVX512_BF16",
          "amx": "AMX-BF16 (and the kernel's leave to use the tiles) with AVX512_BF16",
          "amx-emu": "AVX-512 F/BW/VL and AVX512_BF16"}


def kernels(name: str = "best"):
    """The kernel set: 'best' (CPU detection, DUCK_KERNELS overrides), 'ref',
    'avx2' (the variant for this CPU's vendor), 'avx2-xor', 'avx2-blend', 'avx512', 'avx512-bf16',
    'amx' or 'amx-emu' (the amx tile program with the tiles emulated in C: tests only, slow)."""
    if name not in KERNEL_SETS:
        raise ValueError(f"unknown kernel set {name!r}: expected one of {', '.join(KERNEL_SETS)}")
    k = lib.duck_kernels_named(name.encode())
    if k == ffi.NULL:
        raise RuntimeError(f"the {name} kernels need {_NEEDS[name]}, which this CPU or build lacks")
    return k


def kernels_available() -> list[str]:
    """The named kernel sets this CPU runs (not 'best')."""
    return [n for n in KERNEL_SETS[1:] if lib.duck_kernels_named(n.encode()) != ffi.NULL]


# Batch invariance of fp32 activations (native/kernels/kernels.h): on unless
# DUCK_BATCH_INVARIANT=0, as in the firmware.
lib.duck_kernels_set_batch_invariant(int(os.environ.get("DUCK_BATCH_INVARIANT", "1") != "0"))
BATCH_INVARIANT_SETS = ("ref", "avx2-xor", "avx2-blend", "avx512", "avx512-bf16", "amx", "amx-emu")


def batch_invariant() -> bool:
    """Whether the kernels sum a token's rows in one order whatever the token count (fp32 activations)."""
    return bool(lib.duck_kernels_batch_invariant())


def set_batch_invariant(on: bool) -> None:
    """Process-wide: off lets avx2, avx512 and amx take their faster many-token GEMMs on fp32 activations."""
    lib.duck_kernels_set_batch_invariant(int(bool(on)))


def kernels_name(k) -> str:
    return ffi.string(k.name).decode()


class Pool:
    """Persistent pinned worker threads; threads counts the calling thread.
    spin_us > 0 spins before parking (dedicated hardware only)."""

    def __init__(self, threads: int | None = None, pin: bool = True, spin_us: int = 0):
        threads = threads or len(os.sched_getaffinity(0))
        ptr = lib.duck_pool_create(threads, int(pin), spin_us)
        if ptr == ffi.NULL:
            raise OSError(f"cannot start a pool of {threads} threads")
        self._ptr = ffi.gc(ptr, lib.duck_pool_destroy)
        self.threads = threads

    @property
    def ptr(self):
        return self._ptr

    @property
    def pinned(self) -> int:
        return lib.duck_pool_pinned(self._ptr)


class Workspace:
    def __init__(self):
        self.ptr = ffi.gc(lib.duck_ffn_workspace_create(), lib.duck_ffn_workspace_destroy)


def _f32_rows(x, cols: int, what: str) -> np.ndarray:
    x = np.ascontiguousarray(_to_numpy(x), dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2 or x.shape[1] != cols:
        raise Fp9Error(f"{what}: activation of shape {x.shape} does not match {cols} columns")
    return x


def gemm(w: Fp9Tensor, x, kernel_set: str = "best", accumulate_into: np.ndarray | None = None) -> np.ndarray:
    """y[t] = W x[t] on one thread with the chosen kernel set (tests, references)."""
    rows, cols = w.shape
    x = _f32_rows(x, cols, w.name)
    ntok = x.shape[0]
    kp = w.matrix.groups * 64
    xp = np.empty((ntok, kp), dtype=np.float32)
    for t in range(ntok):
        lib.fp9_prepare_x_f32(ffi.cast("const float *", ffi.from_buffer(x[t])), cols, kp,
                              ffi.cast("float *", ffi.from_buffer(xp[t])))
    y = accumulate_into if accumulate_into is not None else np.zeros((ntok, rows), dtype=np.float32)
    xrows = ffi.new("const float *[]", [ffi.cast("const float *", ffi.from_buffer(xp[t])) for t in range(ntok)])
    yrows = ffi.new("float *[]", [ffi.cast("float *", ffi.from_buffer(y[t])) for t in range(ntok)])
    kernels(kernel_set).gemm(w.matrix, 0, w.matrix.row_pairs, ntok, xrows, yrows,
                             int(accumulate_into is not None))
    return y


def matmul(w: Fp9Tensor, x, pool: Pool | None = None, ws: Workspace | None = None,
           kernel_set: str = "best") -> np.ndarray:
    """y = x W^T over the pool, up to MAX_TOKENS tokens per C call (more are chunked)."""
    rows, cols = w.shape
    x = _f32_rows(x, cols, w.name)
    ws = ws or Workspace()
    y = np.empty((x.shape[0], rows), dtype=np.float32)
    k = kernels(kernel_set)
    for t0 in range(0, x.shape[0], MAX_TOKENS):
        xs, ys = x[t0:t0 + MAX_TOKENS], y[t0:t0 + MAX_TOKENS]
        rc = lib.duck_fp9_matmul(pool.ptr if pool else ffi.NULL, k, ws.ptr, w.matrix, xs.shape[0],
                                 ffi.cast("const float *", ffi.from_buffer(xs)),
                                 ffi.cast("float *", ffi.from_buffer(ys)))
        if rc != 0:
            raise Fp9Error(f"matmul {w.name!r}: {_FFN_ERRORS.get(rc, rc)}")
    return y


def ffn_inputs(x, expert_ids, expert_weights) -> tuple[np.ndarray, bool, np.ndarray, np.ndarray]:
    """The arrays an FFN forward hands to C, converted only where needed:
    x [T, H] fp32, or bf16 bits as uint16 (torch bf16 is viewed, not converted);
    ids [T, k] int32; weights [T, k] fp32; all C-contiguous."""
    xn = x if type(x) is np.ndarray else _to_numpy(x)
    bf16 = xn.dtype == np.uint16
    if not bf16 and xn.dtype != np.float32:
        xn = xn.astype(np.float32)
    if xn.ndim == 1:
        xn = xn.reshape(1, -1)
    if not xn.flags.c_contiguous:
        xn = np.ascontiguousarray(xn)
    ids = expert_ids if type(expert_ids) is np.ndarray else _to_numpy(expert_ids)
    if ids.dtype != np.int32 or not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
    ids = ids.reshape(xn.shape[0], -1)
    wts = expert_weights if type(expert_weights) is np.ndarray else _to_numpy(expert_weights)
    if wts.dtype != np.float32 or not wts.flags.c_contiguous:
        wts = np.ascontiguousarray(wts, dtype=np.float32)
    return xn, bf16, ids, wts.reshape(ids.shape)


class ExpertSlice:
    """One expert's tensor-parallel slice: gate_up [2S, H] interleaved, down [H, S]."""

    def __init__(self, gate_up: Fp9Tensor, down: Fp9Tensor):
        self.gate_up, self.down = gate_up, down

    @property
    def weight_bytes(self) -> int:
        return self.gate_up.weight_bytes + self.down.weight_bytes


class MoeSlice:
    """The experts of one layer as one duck holds them (a dense MLP: one expert)."""

    def __init__(self, experts: list[ExpertSlice], hidden: int, name: str = "<moe>"):
        self.experts = list(experts)
        self.hidden = hidden
        self.name = name
        self._table = ffi.new("duck_expert_slice[]", len(self.experts))
        for i, e in enumerate(self.experts):
            self._table[i].gate_up = e.gate_up.matrix[0]
            self._table[i].down = e.down.matrix[0]
            if lib.duck_expert_slice_check(ffi.addressof(self._table, i), hidden) != 0:
                raise Fp9Error(f"{name}: expert {i} has gate_up {e.gate_up.shape} and down {e.down.shape}, "
                               f"which do not form a slice of hidden size {hidden}")
        self.bytes_streamed = 0
        # reused by every call: forward runs once per layer per token
        self._args = ffi.new("duck_moe_args *")
        self._args.experts = self._table
        self._args.n_experts = len(self.experts)
        self._args.hidden = hidden
        self._nbytes = ffi.new("uint64_t *")
        self._ws = Workspace()

    def forward(self, x, expert_ids, expert_weights, pool: Pool | None = None,
                ws: Workspace | None = None, kernel_set: str = "best", out=None):
        """x [T, H] fp32 or bf16 (numpy uint16 bits, or torch bf16), ids/weights [T, k]
        -> the partial y [T, H]: written into out and returned, if given (fp32, or bf16:
        numpy uint16 bits or a torch bf16 tensor; contiguous, on the CPU), else a new
        fp32 array. Sums are fp32; bf16 is rounded (to nearest even) once at the end.
        Without ws the slice's own workspace is used: pass one per thread for concurrent calls."""
        xn, bf16, ids, wts = ffn_inputs(x, expert_ids, expert_weights)
        if xn.shape[1] != self.hidden:
            raise Fp9Error(f"{self.name}: activation has {xn.shape[1]} columns, hidden size is {self.hidden}")
        if ids.shape[1] > MAX_TOPK:
            raise Fp9Error(f"{self.name}: {ids.shape[1]} experts per token, at most {MAX_TOPK}")
        ws = ws or self._ws
        if out is None:
            y = np.empty((xn.shape[0], self.hidden), dtype=np.float32)
            y_dtype = lib.DUCK_DT_F32
        else:
            y, y_dtype = _output_view(out, (xn.shape[0], self.hidden), self.name)
        args = self._args
        args.topk = ids.shape[1]
        args.x_dtype = lib.DUCK_DT_BF16 if bf16 else lib.DUCK_DT_F32
        args.y_dtype = y_dtype
        k = kernels(kernel_set)
        for t0 in range(0, xn.shape[0], MAX_TOKENS):
            if xn.shape[0] <= MAX_TOKENS:
                xs, ys, si, sw = xn, y, ids, wts
            else:
                sl = slice(t0, t0 + MAX_TOKENS)
                xs, ys, si, sw = xn[sl], y[sl], ids[sl], wts[sl]
            args.ntok = xs.shape[0]
            args.expert_ids = ffi.from_buffer("int32_t[]", si)
            args.expert_weights = ffi.from_buffer("float[]", sw)
            args.x = ffi.from_buffer(xs)
            args.y = ffi.from_buffer(ys, require_writable=True)
            rc = lib.duck_moe_forward(pool.ptr if pool else ffi.NULL, k, ws.ptr, args, self._nbytes)
            if rc != 0:
                raise Fp9Error(f"{self.name}: {_FFN_ERRORS.get(rc, rc)}")
            self.bytes_streamed += self._nbytes[0]
        return y if out is None else out


def _output_view(out, shape: tuple, name: str) -> tuple[np.ndarray, int]:
    """A writable numpy view of out (fp32, or bf16 as uint16 bits) and its DUCK_DT_* type."""
    arr = out
    if not isinstance(out, np.ndarray):
        import torch

        if not isinstance(out, torch.Tensor):
            raise Fp9Error(f"{name}: out= must be a numpy array or a torch tensor, not {type(out).__name__}")
        if out.device.type != "cpu" or not out.is_contiguous():
            raise Fp9Error(f"{name}: out= must be a contiguous CPU tensor (got {out.device}, "
                           f"contiguous={out.is_contiguous()})")
        arr = out.view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 else out.numpy()
    if arr.dtype == np.float32:
        dtype = lib.DUCK_DT_F32
    elif arr.dtype == np.uint16:
        dtype = lib.DUCK_DT_BF16
    else:
        raise Fp9Error(f"{name}: out= has dtype {getattr(out, 'dtype', arr.dtype)}; expected float32, "
                       "or bf16 (a torch bfloat16 tensor, or numpy uint16 holding bf16 bits)")
    if arr.shape != shape or not arr.flags.c_contiguous or not arr.flags.writeable:
        raise Fp9Error(f"{name}: out= must be a writable C-contiguous array of shape {shape}, "
                       f"got {arr.shape}")
    return arr, dtype


# --- probes: what the benchmarks and the daemon measure this host with ---------

def measure_read_gbps(threads: int, mib: int = 256, seconds: float = 0.2) -> float:
    """Streaming read bandwidth of this host with `threads` threads reading at once."""
    buf = _aligned_bytes(mib << 20)
    buf[:] = 1
    pool = Pool(threads)
    return buf.size / timed_call(lambda: lib.duck_bench_read(pool.ptr, ffi.from_buffer(buf), buf.size), seconds) / 1e9


def timed_call(fn, min_seconds: float) -> float:
    """Seconds per call of fn, repeated until min_seconds have passed."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed / n
