"""duckd's pack cache (the host's fp9 packs kept between starts): a pack written and read back is
the same tensors; a damaged one is repacked; a write the file system refuses (here: past the
process's file-size limit, EFBIG, in a child process) removes its partial file, says which path
and why, and stops writing for the run, without failing the load."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from duckd.packcache import PackCache
from native.kernels import ExpertSlice
from native.fp9 import Fp9Tensor

ROOT = Path(__file__).resolve().parents[2]


def _slices(n: int = 2, seed: int = 0) -> list[ExpertSlice]:
    rng = np.random.default_rng(seed)
    make = lambda r, c: Fp9Tensor.from_float(rng.standard_normal((r, c)).astype(np.float32))  # noqa: E731
    return [ExpertSlice(make(128, 256), make(256, 64)) for _ in range(n)]


def test_a_pack_reads_back_and_a_damaged_one_is_repacked(tmp_path):
    cache = PackCache(tmp_path, "key")
    slices = _slices()
    cache.store(3, 1, slices)
    back = cache.load(3, 1, "layer3")
    assert [t.digest() for e in back for t in (e.gate_up, e.down)] == \
        [t.digest() for e in slices for t in (e.gate_up, e.down)]
    path = next(tmp_path.rglob("*.pack"))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cache.load(3, 1, "layer3") is None and not path.exists() and cache.misses == 1


def test_a_refused_write_names_the_path_and_leaves_no_partial_file(tmp_path):
    script = textwrap.dedent(f"""
        import logging, resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.duckd.test_packcache import _slices
        from duckd.packcache import PackCache
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # EFBIG instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        cache = PackCache(__import__("pathlib").Path({str(tmp_path)!r}), "key")
        cache.store(0, 0, _slices(n=8))                          # ~400 KB: past the limit
        cache.store(1, 0, _slices(n=1))                          # not tried again this run
        print("writable", cache.writable)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pack cache: cannot write" in out.stdout and "layer0000.rank000.tmp" in out.stdout, out.stdout
    assert "File too large" in out.stdout and "writable False" in out.stdout
    assert list(tmp_path.rglob("*.tmp")) == [] and list(tmp_path.rglob("*.pack")) == []
