"""fp9 tensors: packing from fp32 / bf16 / fp8 e4m3 (+128x128 block scales),
the reference unpack, and the serialized form that travels to the ducks.

The layout and the math are specified in docs/fp9.md and native/fp9/fp9.h.
"""
from __future__ import annotations

import hashlib

import numpy as np

from native._native import ffi, lib
from native.fp9.memory import aligned_bytes

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
    """A zeroed uint8 buffer of n bytes whose data pointer is 64-byte aligned
    (in huge pages where large: native.fp9.memory)."""
    return aligned_bytes(n)


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


class SynthTensor:
    """Benchmarks only: a synthetic fp9 tensor named by a 32-byte descriptor
    (docs/fp9.md section 8), so a duck can make it in its cache (wire SYNTH)
    instead of receiving it. Random signs and codes in four binades, scaled
    so the largest weight is about 1/sqrt(cols) (an nn.Linear init); zero
    outside [0, live_rows) x [0, live_cols) (tensor-parallel padding).

    Quacks like an Fp9Tensor where the transport needs it (shape, nbytes,
    weight_bytes, name, digest()); materialize() makes the same bytes here
    with the C generator the ducks run. The digest is a cache key in a
    namespace of its own (BLAKE2b-128 of "duck-synth-v1" + descriptor), never
    the digest of any uploaded tensor."""

    __slots__ = ("name", "desc", "_digest")   # a DeepSeek-V3 fleet has a million of them

    def __init__(self, rows: int, cols: int, seed: int, name: str = "<synth>", *, live_rows: int | None = None,
                 live_cols: int | None = None, prescale_log2: int | None = None):
        self.name = name
        if prescale_log2 is None:
            prescale_log2 = lib.fp9_synth_default_prescale_log2(min(max(int(cols), 0), 2**32 - 1))
        fields = {"rows": rows, "cols": cols, "live_rows": rows if live_rows is None else live_rows,
                  "live_cols": cols if live_cols is None else live_cols, "prescale_log2": prescale_log2, "seed": seed}
        d = ffi.new("fp9_synth_desc *")
        d.version = lib.FP9_SYNTH_VERSION
        for field, value in fields.items():
            try:
                setattr(d, field, int(value))
            except OverflowError:
                ctype = dict(ffi.typeof("fp9_synth_desc").fields)[field].type.cname
                raise Fp9Error(f"synthetic tensor {name!r}: {field} {value} does not fit its {ctype} field") from None
        err = ffi.new("char[256]")
        if lib.fp9_synth_check(d, err, 256) != 0:
            raise Fp9Error(f"synthetic tensor {name!r}: {ffi.string(err).decode()}")
        self.desc = d
        out = ffi.new("uint8_t[16]")
        lib.wire_synth_digest(d, out)
        self._digest = bytes(out).hex()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.desc.rows, self.desc.cols)

    @property
    def seed(self) -> int:
        return self.desc.seed

    @property
    def prescale(self) -> float:
        return 2.0 ** self.desc.prescale_log2

    @property
    def nbytes(self) -> int:
        """Bytes of the serialized tensor: what a duck's cache holds."""
        return int(lib.fp9_synth_bytes(self.desc))

    @property
    def weight_bytes(self) -> int:
        return self.nbytes - HEADER_BYTES

    def descriptor(self) -> bytes:
        """The 32 bytes that travel in a SYNTH request and are hashed for the digest."""
        return bytes(ffi.buffer(self.desc))

    def digest(self) -> str:
        """The cache key (hex), as Fp9Tensor.digest() is for real tensors."""
        return self._digest

    def materialize(self, pool=None) -> Fp9Tensor:
        """The tensor itself, generated here; pool (a native.kernels.Pool) splits the
        work, which changes no byte."""
        buf = _aligned_bytes(self.nbytes)
        rc = lib.fp9_synth_generate(self.desc, ffi.from_buffer(buf), buf.size, pool.ptr if pool else ffi.NULL)
        if rc != 0:
            raise Fp9Error(f"synthetic tensor {self.name!r}: generation failed ({_ERRORS.get(rc, rc)})")
        return Fp9Tensor(buf, self.name)

    def __repr__(self) -> str:
        d = self.desc
        return (f"SynthTensor({d.rows}x{d.cols}, seed={d.seed}, live {d.live_rows}x{d.live_cols}, "
                f"prescale 2^{d.prescale_log2}, name={self.name!r})")


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
