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
