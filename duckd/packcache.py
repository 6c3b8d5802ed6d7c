"""The host's fp9 pack cache: each FFN layer's tensor-parallel slices, packed
once and kept on disk, so a restarted daemon does not repack. A file per
(layer, rank); its header lists each tensor's length and content hash, which
are checked on load (a damaged file is repacked, never used)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from pathlib import Path

from native.fp9 import Fp9Error, Fp9Tensor
from native.kernels import ExpertSlice

log = logging.getLogger("duckd.packcache")

MAGIC = b"DUCKPACK"
FORMAT = 1


def model_key(path: Path, tp: int, multiple_of: int, abi: int) -> str:
    """Identity of what the cache holds: the checkpoint's files (path, size,
    mtime), the split and the wire/fp9 ABI. Any change gives a new key."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.blake2b(digest_size=12)
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(f"tp={tp}|multiple_of={multiple_of}|abi={abi}|format={FORMAT}".encode())
    return h.hexdigest()


class PackCache:
    def __init__(self, root: Path, key: str):
        self.root, self.key = root, key
        self.dir = root / key
        self.hits = self.misses = 0
        self.writable = True

    def _file(self, layer: int, rank: int) -> Path:
        return self.dir / f"layer{layer:04d}.rank{rank:03d}.pack"

    def load(self, layer: int, rank: int, name: str) -> list[ExpertSlice] | None:
        path = self._file(layer, rank)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        try:
            slices = _decode(data, f"{name}[{rank}]")
        except (Fp9Error, ValueError, struct.error) as e:
            log.warning("pack cache %s is damaged (%s); repacking", path, e)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        return slices

    def store(self, layer: int, rank: int, slices: list[ExpertSlice]) -> None:
        """Keeps a layer's packs for the next start. A cache that cannot be written (a full disk)
        is not an error of the load: the partial file goes, a warning names the path, and nothing
        more is written this run."""
        if not self.writable:
            return
        tensors = [t for e in slices for t in (e.gate_up, e.down)]
        header = json.dumps([[t.nbytes, t.digest()] for t in tensors]).encode()
        tmp = self._file(layer, rank).with_suffix(".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<II", FORMAT, len(header)) + header)
                for t in tensors:
                    f.write(memoryview(t.buf))
            os.replace(tmp, self._file(layer, rank))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.writable = False
            log.warning("pack cache: cannot write %s (%s); the model loads without it, and the next start packs "
                        "again: free space there or move daemon.state_dir", tmp, e.strerror or e)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*.pack")) if self.root.exists() else 0

    def drop_others(self) -> int:
        """Removes the packs of every other key (another model, tp or ABI)."""
        removed = 0
        if self.root.exists():
            for d in self.root.iterdir():
                if d.is_dir() and d.name != self.key:
                    shutil.rmtree(d, ignore_errors=True)
                    removed += 1
        return removed

    def drop_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _decode(data: bytes, name: str) -> list[ExpertSlice]:
    if data[:8] != MAGIC:
        raise ValueError("bad magic")
    fmt, hlen = struct.unpack_from("<II", data, 8)
    if fmt != FORMAT:
        raise ValueError(f"format {fmt}")
    entries = json.loads(data[16:16 + hlen])
    off, tensors = 16 + hlen, []
    for i, (n, digest) in enumerate(entries):
        t = Fp9Tensor.from_bytes(data[off:off + n], f"{name}.{i}")
        if t.digest() != digest:
            raise ValueError(f"tensor {i}: content hash mismatch")
        tensors.append(t)
        off += n
    if off != len(data) or len(tensors) % 2:
        raise ValueError("length mismatch")
    return [ExpertSlice(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]
