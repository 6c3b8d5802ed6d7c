"""fp9 tensors: packing from fp32 / bf16 / fp8 e4m3 (+128x128 block scales),
the reference unpack, and the serialized form that travels to the ducks.

The layout and the math are specified in docs/fp9.md and native/fp9.h.
"""
from __future__ import annotations

import hashlib

import numpy as np

from native._native import ffi, lib

GROUP = 64
SCALE_BLOCK = 128
HEADER_BYTES = 64
BLOCK_BYTES = 144
MAX_VALUE = 122880.0

_ERRORS = {-1: "bad shape or argument", -2: "NaN or Inf in the source",
           -3: "not a valid fp9 tensor", -4: "block scale not finite or not positive"}


class Fp9Error(ValueError):
    """A tensor that cannot be packed or read; the message names it."""


def _aligned_bytes(n: int) -> np.ndarray:
    """A zeroed uint8 buffer of n bytes whose data pointer is 64-byte aligned."""
    raw = np.zeros(n + 64, dtype=np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + n]


def _as_2d(a: np.ndarray, name: str) -> np.ndarray:
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise Fp9Error(f"tensor {name!r}: expected a non-empty 2-D matrix, got shape {tuple(a.shape)}")
    return np.ascontiguousarray(a)


class Fp9Tensor:
    """A packed fp9 matrix [rows, cols]: header + row-pair blocks (+ block scales)."""

    def __init__(self, buf: np.ndarray, name: str = "<fp9>"):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise Fp9Error(f"tensor {name!r}: serialized fp9 must be a 1-D uint8 buffer")
        if buf.ctypes.data % 8:
            aligned = _aligned_bytes(buf.size)
            aligned[:] = buf
            buf = aligned
        self.buf = buf
        self.name = name
        self.matrix = ffi.new("fp9_matrix *")
        rc = lib.fp9_tensor_view(ffi.from_buffer(buf), buf.size, self.matrix)
        if rc != 0:
            raise Fp9Error(f"tensor {name!r}: {_ERRORS.get(rc, rc)} ({buf.size} bytes)")

    # -- construction -----------------------------------------------------
    @classmethod
    def from_float(cls, w, name: str = "<tensor>") -> "Fp9Tensor":
        """Packs an fp32 array, or a bf16 tensor (torch bfloat16, or uint16 bits)."""
        w = _to_numpy(w)
        w = _as_2d(w, name)
        rows, cols = w.shape
        out = _aligned_bytes(lib.fp9_tensor_bytes(rows, cols, 0))
        bad = ffi.new("size_t *")
        if w.dtype == np.uint16:
            rc = lib.fp9_pack_bf16(ffi.cast("const uint16_t *", ffi.from_buffer(w)), rows, cols, cols,
                                   ffi.from_buffer(out), bad)
        else:
            w = np.ascontiguousarray(w, dtype=np.float32)
            rc = lib.fp9_pack_f32(ffi.cast("const float *", ffi.from_buffer(w)), rows, cols, cols,
                                  ffi.from_buffer(out), bad)
        if rc == -2:
            r, c = divmod(bad[0], cols)
            raise Fp9Error(f"tensor {name!r}: NaN or Inf at [{r}, {c}]; refusing to pack it")
        if rc != 0:
            raise Fp9Error(f"tensor {name!r}: {_ERRORS.get(rc, rc)} (shape {rows}x{cols})")
        return cls(out, name)

    @classmethod
    def from_fp8(cls, codes, scale_inv, name: str = "<tensor>") -> "Fp9Tensor":
        """Packs fp8 e4m3fn codes [rows, cols] with Hugging Face weight_scale_inv
        [ceil(rows/128), ceil(cols/128)]. Bit-exact: power-of-two scales fold
        into the prescale where the range allows, else block scales are kept."""
        codes = _as_2d(_to_numpy(codes, fp8_ok=True).view(np.uint8), name)
        rows, cols = codes.shape
        scale_inv = np.ascontiguousarray(_to_numpy(scale_inv), dtype=np.float32)
        want = (-(-rows // SCALE_BLOCK), -(-cols // SCALE_BLOCK))
        if scale_inv.ndim == 1 and want[0] == 1:
            scale_inv = scale_inv.reshape(1, -1)
        if scale_inv.shape != want:
            raise Fp9Error(f"tensor {name!r}: weight_scale_inv has shape {tuple(scale_inv.shape)}, "
                           f"expected {want} for a {rows}x{cols} weight in 128x128 blocks")
        cap = lib.fp9_pack_fp8_bound(rows, cols)
        out = _aligned_bytes(cap)
        scaled = ffi.new("int *")
        bad = ffi.new("size_t *")
        rc = lib.fp9_pack_fp8(ffi.cast("const uint8_t *", ffi.from_buffer(codes)), rows, cols, cols,
                              ffi.cast("const float *", ffi.from_buffer(scale_inv)), want[1],
                              ffi.from_buffer(out), cap, scaled, bad)
        if rc == -2:
            r, c = divmod(bad[0], cols)
            raise Fp9Error(f"tensor {name!r}: fp8 NaN code at [{r}, {c}]; refusing to pack it")
        if rc != 0:
            raise Fp9Error(f"tensor {name!r}: {_ERRORS.get(rc, rc)}")
        return cls(out[:lib.fp9_tensor_bytes(rows, cols, scaled[0])].copy(), name)

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<fp9>") -> "Fp9Tensor":
        buf = _aligned_bytes(len(data))
        buf[:] = np.frombuffer(data, dtype=np.uint8)
        return cls(buf, name)

    # -- properties -------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.matrix.rows, self.matrix.cols)

    @property
    def prescale(self) -> float:
        return self.matrix.prescale

    @property
    def has_block_scales(self) -> bool:
        return self.matrix.block_scales != ffi.NULL

    @property
    def nbytes(self) -> int:
        return int(self.buf.size)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the blocks: what a kernel streams per pass."""
        m = self.matrix
        return m.row_pairs * m.groups * BLOCK_BYTES

    def to_bytes(self) -> bytes:
        return self.buf.tobytes()

    def digest(self) -> str:
        """Content hash of the serialized tensor (the ducks' cache key)."""
        return hashlib.blake2b(memoryview(self.buf), digest_size=16).hexdigest()

    def to_float(self) -> np.ndarray:
        """Reference decode to fp32 [rows, cols]."""
        rows, cols = self.shape
        out = np.empty((rows, cols), dtype=np.float32)
        lib.fp9_unpack_f32(self.matrix, ffi.cast("float *", ffi.from_buffer(out)), cols)
        return out


def _to_numpy(a, fp8_ok: bool = False) -> np.ndarray:
    """numpy view of a numpy array or torch tensor; bf16 as uint16 bits,
    fp8 e4m3fn as uint8 codes (only where fp8_ok)."""
    if isinstance(a, np.ndarray):
        return a
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return np.asarray(a)
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().contiguous()
        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).numpy().view(np.uint16)
        if a.dtype == torch.float8_e4m3fn:
            if not fp8_ok:
                raise Fp9Error("fp8 tensor passed where a float tensor was expected; use from_fp8")
            return a.view(torch.uint8).numpy()
        if a.dtype in (torch.float16, torch.float64):
            a = a.float()
        return a.numpy()
    return np.asarray(a)


def pack_gate_up(gate, up, name: str = "<gate_up>") -> np.ndarray:
    """Interleaves gate [S, H] and up [S, H] rows into [2S, H] (g0, u0, g1, u1, ...),
    so each row pair of the packed matrix yields one unit of silu(g) * u."""
    gate, up = _to_numpy(gate), _to_numpy(up)
    if gate.shape != up.shape:
        raise Fp9Error(f"tensor {name!r}: gate {gate.shape} and up {up.shape} differ in shape")
    out = np.empty((2 * gate.shape[0], gate.shape[1]), dtype=gate.dtype)
    out[0::2] = gate
    out[1::2] = up
    return out


def decode_table() -> np.ndarray:
    """The 256 magnitudes by code, computed from the spec (not the C codec)."""
    codes = np.arange(256)
    e, m = codes >> 3, codes & 7
    normal = np.ldexp(1.0 + m / 8.0, e - 15)
    sub = np.ldexp(m / 8.0, -14)
    return np.where(e == 0, sub, normal)
