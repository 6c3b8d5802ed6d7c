"""Python face of the native host ops (native/host/host_ops.h) on NumPy fp32
arrays, one kernel set at a time: what the tests compare with each other and
with torch. The decoder (engine.cpu.decode) calls the C directly. Outputs
start as NaN (_poisoned), so that an element the C leaves unwritten shows."""
from __future__ import annotations

import numpy as np

from native._native import ffi, lib

KERNEL_SETS = ("best", "ref", "avx2", "avx512")
_CHOOSERS = {"best": lib.duck_host_kernels_best, "ref": lib.duck_host_kernels_ref,
             "avx2": lib.duck_host_kernels_avx2, "avx512": lib.duck_host_kernels_avx512}
_NEEDS = {"avx2": "AVX2 and FMA", "avx512": "AVX-512F"}


class KernelsUnavailable(RuntimeError):
    """The CPU (or the build) lacks the instructions of the kernel set asked for."""


def host_kernels(name: str = "best"):
    """The kernel set: 'best' (CPU detection; DUCK_HOST_KERNELS=ref|avx2|avx512 overrides),
    'ref' (portable scalar), 'avx2' or 'avx512' (KernelsUnavailable where the CPU lacks them)."""
    if name not in _CHOOSERS:
        raise ValueError(f"unknown host kernel set {name!r}: expected one of {', '.join(KERNEL_SETS)}")
    k = _CHOOSERS[name]()
    if k == ffi.NULL:
        raise KernelsUnavailable(f"the {name} host kernels need {_NEEDS[name]}, which this CPU (or build) lacks")
    return k


def available(name: str) -> bool:
    return name in _CHOOSERS and _CHOOSERS[name]() != ffi.NULL


def kernels_name(k) -> str:
    return ffi.string(k.name).decode()


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _poisoned(shape) -> np.ndarray:
    return np.full(shape, np.nan, dtype=np.float32)


def _ptr(a: np.ndarray, kind: str = "float *"):
    return ffi.cast(kind, ffi.from_buffer(a))


def pack_half(w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Half weights [N, K] (float16) in the half-weight kernels' panels (host_kernels.h,
    gemm_h): a flat array of duck_host_packed_halves(N, K) halves, new or out (contiguous)."""
    w = np.ascontiguousarray(w, dtype=np.float16)
    rows, k = w.shape
    n = lib.duck_host_packed_halves(rows, k)
    if out is None:
        out = np.empty(n, dtype=np.float16)
    if out.size != n or out.dtype != np.float16 or not out.flags.c_contiguous:
        raise ValueError(f"pack_half: out is {out.size} {out.dtype} halves, [{rows}, {k}] packs into {n} "
                         "contiguous float16")
    lib.duck_host_pack_half(_ptr(w, "const uint16_t *"), k, rows, k, _ptr(out, "uint16_t *"))
    return out


def gemm(w, x, kernel_set: str = "best", pool=None) -> np.ndarray:
    """y [T, N] = x [T, K] W [N, K]^T (pool: a native.kernels.Pool, or None for this thread).
    W float16 runs the half-weight kernels (gemm_h, on W packed first), anything else fp32."""
    half = getattr(w, "dtype", None) == np.float16
    w, x = (np.ascontiguousarray(w) if half else _f32(w)), _f32(x)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm: x {x.shape} and W {w.shape} do not share K")
    y = _poisoned((x.shape[0], w.shape[0]))
    weights = pack_half(w) if half else w
    lib.duck_host_gemm(pool.ptr if pool is not None else ffi.NULL, host_kernels(kernel_set),
                       lib.DUCK_HOST_F16 if half else lib.DUCK_HOST_F32, _ptr(weights, "void *"), w.shape[0],
                       w.shape[1], x.shape[0], _ptr(x), _ptr(y))
    return y


def _padded(a: np.ndarray, pad: int) -> np.ndarray:
    """a [R, C] inside a [R, C + pad] array whose extra columns are NaN (a kernel reading them shows)."""
    out = _poisoned((a.shape[0], a.shape[1] + pad))
    out[:, :a.shape[1]] = a
    return out


def kernel_gemm(w, x, kernel_set: str, pad: int = 0) -> np.ndarray:
    """The kernel table's own gemm on this thread (no row split), every row of W, x
    and y `pad` floats longer than its data: returns y [T, N + pad] (the pad must stay NaN)."""
    w, x = _padded(_f32(w), pad), _padded(_f32(x), pad)
    n, k = w.shape[0], w.shape[1] - pad
    y = _poisoned((x.shape[0], n + pad))
    host_kernels(kernel_set).gemm(_ptr(w), w.shape[1], n, k, x.shape[0], _ptr(x), x.shape[1], _ptr(y), y.shape[1])
    return y


def dot(a, b, kernel_set: str) -> float:
    a, b = _f32(a), _f32(b)
    return host_kernels(kernel_set).dot(_ptr(a), _ptr(b), a.size)


def gemv_t(p, v, kernel_set: str, pad: int = 0) -> np.ndarray:
    """y [N] = p [R] V [R, N], V's rows `pad` NaN floats longer than N."""
    p, v = _f32(p), _padded(_f32(v), pad)
    n = v.shape[1] - pad
    y = _poisoned(n + pad)
    host_kernels(kernel_set).gemv_t(_ptr(p), _ptr(v), v.shape[1], v.shape[0], n, _ptr(y))
    return y


def softmax_exp(s, scale: float, kernel_set: str, pad: int = 0) -> tuple[np.ndarray, float]:
    """The kernel table's softmax numerators of scores s [N] (exp(scale s - max)) and their
    sum; the array returned is `pad` NaN floats longer than N (they must stay NaN)."""
    s = _f32(s)
    out = _poisoned(s.size + pad)
    out[:s.size] = s
    total = host_kernels(kernel_set).softmax_exp(_ptr(out), s.size, scale)
    return out, total


def rmsnorm(x, w, eps: float, kernel_set: str = "best", add=None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [T, N]: x += add (when given), then y = rmsnorm(x) * w; returns (y, x)."""
    w = _f32(w)
    n = w.shape[0]
    x = _f32(x).reshape(-1, n).copy()
    add = _f32(add).reshape(-1, n) if add is not None else None
    y = _poisoned(x.shape)
    k = host_kernels(kernel_set)
    for t in range(x.shape[0]):
        lib.duck_host_add_rmsnorm(k, _ptr(x[t]), _ptr(add[t]) if add is not None else ffi.NULL, _ptr(w), n, eps,
                                  _ptr(y[t]))
    return y, x


def rope(x, position: int, inv_freq, kernel_set: str = "best", norm_w=None, eps: float = 1e-6) -> np.ndarray:
    """x [heads, D] of one token at position: the optional per-head RMSNorm, then rotary."""
    x, inv_freq = _f32(x).copy(), _f32(inv_freq)
    half = x.shape[-1] // 2
    if inv_freq.shape != (half,):
        raise ValueError(f"rope: inv_freq {inv_freq.shape} does not fit head_dim {x.shape[-1]}")
    cos, sin = _poisoned(half), _poisoned(half)
    lib.duck_host_rope_table(position, _ptr(inv_freq), half, _ptr(cos), _ptr(sin))
    norm = _f32(norm_w) if norm_w is not None else None
    lib.duck_host_rope(host_kernels(kernel_set), _ptr(x), x.shape[0], x.shape[-1], _ptr(cos), _ptr(sin),
                       _ptr(norm) if norm is not None else ffi.NULL, eps)
    return x


def attend(q, keys, values, scale: float, kernel_set: str = "best", head: int = 0) -> np.ndarray:
    """q [D] over keys / values [S, D], or over head `head` of keys / values
    [S, KVH, D] (strided, as in the KV cache): softmax(scale q K^T) V."""
    q, keys, values = _f32(q), _f32(keys), _f32(values)
    if keys.ndim == 2:
        keys, values = keys[:, None], values[:, None]
    s, kvh, d = keys.shape
    if values.shape != keys.shape or q.shape != (d,) or not 0 <= head < kvh:
        raise ValueError(f"attend: q {q.shape}, keys {keys.shape}, values {values.shape}, head {head}")
    scores, out = _poisoned(s), _poisoned(d)
    lib.duck_host_attend(host_kernels(kernel_set), lib.DUCK_HOST_F32, _ptr(q), 1, _ptr(keys) + head * d,
                         _ptr(values) + head * d, kvh * d, s, d, scale, _ptr(scores), ffi.NULL, _ptr(out))
    return out


def attend_half(q, keys, values, scale: float, kernel_set: str = "best") -> np.ndarray:
    """q [NQ, D] (the query heads of one kv head) over float16 keys / values [S, D]
    (a half cache's head, its positions one run): softmax(scale q K^T) V per head."""
    q = _f32(q).reshape(-1, keys.shape[-1])
    keys, values = np.ascontiguousarray(keys, np.float16), np.ascontiguousarray(values, np.float16)
    (s, d), nq = keys.shape, q.shape[0]
    if values.shape != keys.shape:
        raise ValueError(f"attend_half: keys {keys.shape}, values {values.shape}")
    scores, widen, out = _poisoned(nq * s), _poisoned(lib.DUCK_HOST_ATTN_ROWS * d), _poisoned((nq, d))
    lib.duck_host_attend(host_kernels(kernel_set), lib.DUCK_HOST_F16, _ptr(q), nq, _ptr(keys, "void *"),
                         _ptr(values, "void *"), d, s, d, scale, _ptr(scores), _ptr(widen), _ptr(out))
    return out


def gemv_t_h(p, v, kernel_set: str, pad: int = 0) -> np.ndarray:
    """gemv_t over float16 values v [R, N] (rows `pad` halves longer than N)."""
    p = _f32(p)
    v16 = np.zeros((v.shape[0], v.shape[1] + pad), np.float16)
    v16[:, :v.shape[1]] = v
    y = _poisoned(v.shape[1] + pad)
    host_kernels(kernel_set).gemv_t_h(_ptr(p), _ptr(v16, "uint16_t *"), v16.shape[1], v.shape[0], v.shape[1], _ptr(y))
    return y


def argmax(x, kernel_set: str) -> int:
    """The kernel set's argmax of x [N]."""
    x = _f32(x).ravel()
    return host_kernels(kernel_set).argmax(_ptr(x), x.size)


def to_half(x, kernel_set: str) -> np.ndarray:
    """x rounded to float16 by the kernel set's to_half."""
    x = _f32(x).ravel()
    out = np.empty(x.size, np.float16)
    host_kernels(kernel_set).to_half(_ptr(x), x.size, _ptr(out, "uint16_t *"))
    return out


def topk_softmax(logits, topk: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """One token's router: (ids int32 [k], weights fp32 [k])."""
    logits = _f32(logits)
    ids, weights = np.full(topk, -1, np.int32), _poisoned(topk)
    lib.duck_host_topk_softmax(_ptr(logits), logits.size, topk, int(normalize), _ptr(ids, "int32_t *"),
                               _ptr(weights))
    return ids, weights
