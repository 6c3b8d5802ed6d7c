"""Host memory for weights: zeroed, 64-byte aligned buffers carved out of
2 MiB-aligned anonymous mappings that ask for transparent huge pages, so
that streaming many separate expert slices takes one TLB entry per 2 MiB,
not per 4 KiB (the duck's cache does the same, firmware/cache.c).

On the 2-core dev VM (Zen 5) a top-8 MoE forward over 128 Qwen3-30B slices
ran at 24-29 GB/s from separate allocations, 25-33 from one 4 KiB-page
mapping and 27-37 from one huge-page mapping (1 thread, medians, same runs).

DUCK_HUGE_PAGES=0 in the environment asks for 4 KiB pages instead (to
measure the difference). Buffers below SMALL bytes come from numpy as before. Larger ones are bumped
out of shared CHUNK-byte mappings (one of their own when larger than that);
a mapping is returned to the OS once every buffer carved from it is gone,
so a long-lived buffer keeps its whole chunk.
"""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np

HUGE = 2 << 20
CHUNK = 64 << 20
SMALL = 64 << 10
_ALIGN = 64


def huge_pages_mode() -> str:
    """The kernel's transparent huge page setting: always, madvise or never
    (what a MADV_HUGEPAGE mapping gets), or 'unknown'."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping holding nbytes from a 2 MiB boundary, and that offset."""
    # private: shared anonymous memory is shmem, which THP leaves alone by default
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = "MADV_NOHUGEPAGE" if os.environ.get("DUCK_HUGE_PAGES") == "0" else "MADV_HUGEPAGE"
    if hasattr(m, "madvise") and hasattr(mmap, advice):
        try:
            m.madvise(getattr(mmap, advice))
        except OSError:   # a kernel without THP: 4 KiB pages, same bytes
            pass
    base = np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data
    return m, (-base) % HUGE


class _Chunk:
    def __init__(self):
        self.map, self.next = _mapping(CHUNK)
        self.end = self.next + CHUNK

    def take(self, n: int) -> np.ndarray | None:
        if self.next + n > self.end:
            return None
        out = np.frombuffer(self.map, dtype=np.uint8, count=n, offset=self.next)
        self.next += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        return out


_lock = threading.Lock()
_current: list[_Chunk] = []


def aligned_bytes(n: int) -> np.ndarray:
    """A zeroed uint8 buffer of n bytes whose data pointer is 64-byte aligned."""
    if n < SMALL:
        raw = np.zeros(n + _ALIGN, dtype=np.uint8)
        off = (-raw.ctypes.data) % _ALIGN
        return raw[off:off + n]
    if n > CHUNK // 2:
        m, off = _mapping(n)
        return np.frombuffer(m, dtype=np.uint8, count=n, offset=off)
    with _lock:
        out = _current[0].take(n) if _current else None
        if out is None:
            # the old chunk lives on in the buffers carved from it
            _current[:] = [_Chunk()]
            out = _current[0].take(n)
    return out
