"""What a host needs besides the socket: the firmware binary and the fleet's shared key files."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from native._native import lib


def duckfw_path() -> Path:
    """The firmware binary built by the install (DUCKFW in the environment overrides)."""
    env = os.environ.get("DUCKFW")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent.parent   # native/
    candidates += [here / "bin" / "duckfw", here.parent / "build" / "firmware" / "duckfw-release"]
    for p in candidates:
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise FileNotFoundError(f"duckfw not found (looked at {', '.join(map(str, candidates))}); "
                            "reinstall with `pip install -e .` or run `python firmware/build.py`")


def read_key_file(path: str | os.PathLike) -> bytes:
    """The shared key exactly as duckfw reads it: the bytes, one trailing newline dropped."""
    data = Path(path).read_bytes()
    if data.endswith(b"\n"):
        data = data[:-1]
    if not lib.WIRE_KEY_MIN <= len(data) <= lib.WIRE_KEY_MAX:
        raise ValueError(f"key file {path} holds {len(data)} bytes; a key is "
                         f"{lib.WIRE_KEY_MIN}..{lib.WIRE_KEY_MAX} bytes")
    return data


def write_key_file(path: str | os.PathLike) -> bytes:
    """Makes a new shared key file (64 hex characters and a newline, mode 0600)
    and returns the key as duckfw will read it. Text, not raw random bytes: a
    raw key that happened to end in a newline byte would lose it on reading."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return read_key_file(path)
