"""Host weight memory (native.fp9.memory): zeroed, 64-byte aligned, writable
buffers that never overlap, small ones from numpy, large ones from huge-page
chunks or a mapping of their own; a chunk outlives only its buffers."""
import gc
import weakref

import numpy as np

from native.fp9 import memory


def test_buffers_are_zeroed_aligned_and_apart():
    sizes = [1, 100, memory.SMALL - 1, memory.SMALL, 1 << 20, 3 << 20 | 7, memory.CHUNK // 2 + 1]
    bufs = [memory.aligned_bytes(n) for n in sizes]
    spans = []
    for n, b in zip(sizes, bufs):
        assert b.size == n and b.dtype == np.uint8 and b.flags.writeable and b.flags.c_contiguous
        assert b.ctypes.data % 64 == 0 and not b.any()
        b[:] = 0xA5
        spans.append((b.ctypes.data, b.ctypes.data + n))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all((b == 0xA5).all() for b in bufs)


def test_a_chunk_goes_when_its_last_buffer_goes():
    a = memory.aligned_bytes(1 << 20)
    b = memory.aligned_bytes(1 << 20)
    mapping = weakref.ref(memory._current[0].map)
    memory._current.clear()                     # as if the next allocation had opened a new chunk
    del a
    gc.collect()
    assert mapping() is not None and not b.any()   # b still holds it
    del b
    gc.collect()
    assert mapping() is None


def test_huge_pages_mode_reads_the_kernel_setting():
    assert memory.huge_pages_mode() in ("always", "madvise", "never", "unknown")
