"""A slow, independent reading of docs/fp9.md in NumPy: the reference the C
codec is held to. It shares no code with native/."""
import struct

import numpy as np

MAGIC = 0x54395046
GROUP, PANEL_GROUPS = 64, 32


def decode_table() -> np.ndarray:
    """Magnitude of each of the 256 codes (e5m3, bias 15, e=0 subnormal), float64."""
    codes = np.arange(256)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, np.ldexp(m / 8.0, -14), np.ldexp(1.0 + m / 8.0, e - 15))


TABLE = decode_table()


def encode(mag: np.ndarray) -> np.ndarray:
    """Nearest code by value, ties to the even code, saturating at 255."""
    mag = np.asarray(mag, dtype=np.float64)
    hi = np.clip(np.searchsorted(TABLE, mag, side="left"), 1, 255)
    lo = hi - 1
    dlo, dhi = mag - TABLE[lo], TABLE[hi] - mag
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    return np.where(mag >= TABLE[255], 255, code).astype(np.uint8)


def prescale_for(w: np.ndarray) -> float:
    maxabs = float(np.max(np.abs(w)))
    if maxabs == 0.0:
        return 1.0
    return 2.0 ** (np.floor(np.log2(maxabs)) - 15)


def pack(w: np.ndarray) -> bytes:
    """Serialized fp9 tensor of a float matrix, laid out as docs/fp9.md says."""
    rows, cols = w.shape
    pairs, groups = -(-rows // 2), -(-cols // GROUP)
    p = prescale_for(w)
    full = np.zeros((2 * pairs, GROUP * groups))
    full[:rows, :cols] = np.asarray(w, dtype=np.float64) / p
    mags = encode(np.abs(full))
    signs = (full < 0) & (mags > 0)
    out = [struct.pack("<IHHIIf44x", MAGIC, 1, 0, rows, cols, p)]
    for g0 in range(0, groups, PANEL_GROUPS):
        for pair in range(pairs):
            for g in range(g0, min(groups, g0 + PANEL_GROUPS)):
                cols_g = slice(GROUP * g, GROUP * (g + 1))
                for r in (0, 1):
                    out.append(np.packbits(signs[2 * pair + r, cols_g], bitorder="little").tobytes())
                for r in (0, 1):
                    out.append(mags[2 * pair + r, cols_g].tobytes())
    return b"".join(out)


def e4m3_value(code: int) -> float:
    """fp8 e4m3fn code -> value (NaN for 0x7f / 0xff)."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    v = np.ldexp(m / 8.0, -6) if e == 0 else np.ldexp(1 + m / 8.0, e - 7)
    return -v if s else v


# --- synthetic tensors (docs/fp9.md section 8) ----------------------------

SYNTH_TAG = b"duck-synth-v1"
M64 = (1 << 64) - 1


def synth_descriptor(rows, cols, seed, live_rows, live_cols, prescale_log2) -> bytes:
    return struct.pack("<IIIIIiQ", 1, rows, cols, live_rows, live_cols, prescale_log2, seed)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def synth(rows, cols, seed, live_rows, live_cols, prescale_log2) -> bytes:
    """The serialized synthetic tensor of a descriptor, as section 8 says."""
    pairs, groups = -(-rows // 2), -(-cols // GROUP)
    key = int(_mix(np.array([seed], dtype=np.uint64))[0])
    b = np.arange(pairs * groups, dtype=np.uint64).reshape(pairs, groups)                   # [P, G]
    counters = np.uint64(18) * b[..., None] + np.arange(1, 19, dtype=np.uint64)             # [P, G, 18]
    words = _mix(np.uint64(key) + np.uint64(0x9E3779B97F4A7C15) * counters)                  # [P, G, 18]
    signs = np.unpackbits(words[..., :2].copy().view(np.uint8), bitorder="little")          # bit c of word r
    signs = signs.reshape(pairs, groups, 2, GROUP).astype(bool)                             # [P, G, 2, 64]
    mags = (words[..., 2:].copy().view(np.uint8) & 0x1F) | 0xE0                              # byte i of word j
    mags = mags.reshape(pairs, groups, 2, GROUP)                                            # [P, G, 2, 64]
    row = 2 * np.arange(pairs)[:, None, None, None] + np.arange(2)[None, None, :, None]
    col = GROUP * np.arange(groups)[None, :, None, None] + np.arange(GROUP)[None, None, None, :]
    live = (row < live_rows) & (col < live_cols)                                            # [P, G, 2, 64]
    mags = np.where(live, mags, 0).astype(np.uint8)
    signs = signs & live
    out = [struct.pack("<IHHIIf44x", MAGIC, 1, 0, rows, cols, 2.0 ** prescale_log2)]
    for g0 in range(0, groups, PANEL_GROUPS):
        for pair in range(pairs):
            for g in range(g0, min(groups, g0 + PANEL_GROUPS)):
                out.append(np.packbits(signs[pair, g], axis=-1, bitorder="little").tobytes())
                out.append(mags[pair, g].tobytes())
    return b"".join(out)
