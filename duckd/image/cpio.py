"""A reproducible initramfs archive: cpio "newc" (the format the kernel unpacks), written here
rather than by cpio(1) so that nothing of the build machine leaks in. Entries are sorted by
path, owned by root, numbered from 1, and all carry one fixed mtime; the gzip stream has no
name and mtime 0. Same entries in, same bytes out.
"""
from __future__ import annotations

import gzip
import io
import stat
from dataclasses import dataclass

TRAILER = "TRAILER!!!"


@dataclass(frozen=True, slots=True)
class Entry:
    """One archive member; path without a leading slash, e.g. "bin/duckfw"."""
    path: str
    mode: int                      # type and permission bits, e.g. stat.S_IFREG | 0o755
    data: bytes = b""              # file contents, or a symlink's target
    rdev: tuple[int, int] = (0, 0)  # (major, minor) of a device node

    def __post_init__(self):
        if not self.path or self.path.startswith("/") or ".." in self.path.split("/"):
            raise ValueError(f"cpio entry {self.path!r}: expected a relative path without '..'")
        if stat.S_IFMT(self.mode) not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR):
            raise ValueError(f"cpio entry {self.path!r}: unsupported file type {oct(self.mode)}")


def directory(path: str, perm: int = 0o755) -> Entry:
    return Entry(path, stat.S_IFDIR | perm)


def file(path: str, data: bytes, perm: int = 0o644) -> Entry:
    return Entry(path, stat.S_IFREG | perm, data)


def symlink(path: str, target: str) -> Entry:
    return Entry(path, stat.S_IFLNK | 0o777, target.encode())


def char_device(path: str, major: int, minor: int, perm: int = 0o600) -> Entry:
    return Entry(path, stat.S_IFCHR | perm, rdev=(major, minor))


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


def _member(out: io.BytesIO, ino: int, e: Entry | None, mtime: int) -> None:
    name = (e.path if e else TRAILER).encode() + b"\0"
    mode, data, (rmaj, rmin) = (e.mode, e.data, e.rdev) if e else (0, b"", (0, 0))
    nlink = 2 if stat.S_ISDIR(mode) else 1
    fields = (ino, mode, 0, 0, nlink, mtime if e else 0, len(data), 0, 0, rmaj, rmin, len(name), 0)
    header = b"070701" + b"".join(b"%08X" % f for f in fields)
    out.write(header + name + _pad4(len(header) + len(name)))
    out.write(data + _pad4(len(data)))


def archive(entries: list[Entry], mtime: int = 0) -> bytes:
    """The uncompressed newc archive; every parent directory must be among the entries."""
    by_path: dict[str, Entry] = {}
    for e in entries:
        if e.path in by_path and by_path[e.path] != e:
            raise ValueError(f"cpio entry {e.path!r} given twice with different contents")
        by_path[e.path] = e
    for path in by_path:
        parent = path.rpartition("/")[0]
        if parent and not stat.S_ISDIR(by_path.get(parent, Entry(parent, stat.S_IFREG)).mode):
            raise ValueError(f"cpio entry {path!r}: its folder {parent!r} is not in the archive")
    out = io.BytesIO()
    for ino, path in enumerate(sorted(by_path), start=1):
        _member(out, ino, by_path[path], mtime)
    _member(out, 0, None, 0)
    return out.getvalue()


def gzip_reproducible(data: bytes, level: int = 9) -> bytes:
    """gzip with no file name and mtime 0 in its header."""
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=level, fileobj=out, mtime=0) as gz:
        gz.write(data)
    return out.getvalue()
