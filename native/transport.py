"""Host transport to a fleet of ducks (the C in native/transport.c, GIL
released) and the tensor-parallel split that is its contract with the engine.

Typical use (the engine's FFN backend)::

    fleet = Fleet([("127.0.0.1", port), ...], key)          # one socket, N ducks
    fleet.hello()                                           # link check, ABI check
    per_duck = split_experts([(gate, up, down), ...], tp=fleet.n_ducks)   # [duck][expert]
    fleet.upload([[t for e in s for t in (e.gate_up, e.down)] for s in per_duck])
    session = fleet.open_session({layer: per_duck}, hidden)
    y = session.forward(layer, x, expert_ids, expert_weights)   # [T, H] fp32, all partials summed

Every call returns within the failure deadline: a duck that does not answer
raises DuckTimeout naming it. The wire format is native/wire.h (docs/wire.md);
all constants below come from that header through the compiled module.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from native._native import ffi, lib
from native.fp9 import Fp9Error, Fp9Tensor, _to_numpy, pack_gate_up
from native.kernels import ExpertSlice, ffn_inputs

log = logging.getLogger("duck.transport")

MAX_TOKENS = lib.WIRE_MAX_TOKENS

__all__ = ["DuckError", "DuckTimeout", "DuckInfo", "Fleet", "Session", "duckfw_path", "read_key_file",
           "split_expert", "split_experts", "slice_width"]


class DuckError(RuntimeError):
    """A duck failed a request; .duck is its index in the fleet, .status its wire status (0 if none)."""

    def __init__(self, message: str, duck: int | None = None, status: int = 0):
        super().__init__(message)
        self.duck, self.status = duck, status


class DuckTimeout(DuckError):
    """A duck did not answer within the failure deadline."""


def duckfw_path() -> Path:
    """The firmware binary built by the install (DUCKFW in the environment overrides)."""
    env = os.environ.get("DUCKFW")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
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


# --- the tensor-parallel split: the contract with the engine ---------------

def slice_width(intermediate: int, tp: int, multiple_of: int = 64) -> int:
    """S, the intermediate units per duck: ceil(I / (tp * multiple_of)) * multiple_of."""
    if intermediate <= 0 or tp <= 0 or multiple_of <= 0 or multiple_of % 2:
        raise ValueError(f"intermediate {intermediate}, tp {tp} and an even multiple_of {multiple_of} must be > 0")
    return -(-intermediate // (tp * multiple_of)) * multiple_of


def split_expert(gate, up, down, tp: int, multiple_of: int = 64, name: str = "expert") -> list[ExpertSlice]:
    """Splits one expert (or a dense MLP) into tp tensor-parallel fp9 slices.

    gate, up: [I, H]; down: [H, I] (torch or numpy; fp32, fp16 or bf16; for fp8
    checkpoints dequantize to fp32 first, which is exact for power-of-two
    block scales). With S = slice_width(I, tp, multiple_of), duck d gets the
    intermediate units [d*S, (d+1)*S), zero-padded past I:
      gate_up [2S, H], rows interleaved gate_0, up_0, gate_1, up_1, ...
      down    [H, S]
    so that sum over d of MoeSlice(duck d).forward(x) = down(silu(gate x) * up x)
    up to fp9 rounding of the weights and fp32 summation order.
    """
    g, u, dn = (_to_numpy(t) for t in (gate, up, down))
    if g.ndim != 2 or g.shape != u.shape or dn.shape != (g.shape[1], g.shape[0]):
        raise Fp9Error(f"{name}: gate {g.shape}, up {u.shape}, down {dn.shape} are not [I, H], [I, H], [H, I]")
    inter, hidden = g.shape
    s = slice_width(inter, tp, multiple_of)
    pad = tp * s - inter
    if pad:
        g = np.concatenate([g, np.zeros((pad, hidden), g.dtype)])
        u = np.concatenate([u, np.zeros((pad, hidden), u.dtype)])
        dn = np.concatenate([dn, np.zeros((hidden, pad), dn.dtype)], axis=1)
    out = []
    for d in range(tp):
        rows = slice(d * s, (d + 1) * s)
        gu = pack_gate_up(g[rows], u[rows], f"{name}.gate_up")
        out.append(ExpertSlice(Fp9Tensor.from_float(gu, f"{name}.gate_up[{d}/{tp}]"),
                               Fp9Tensor.from_float(np.ascontiguousarray(dn[:, rows]), f"{name}.down[{d}/{tp}]")))
    return out


def split_experts(experts, tp: int, multiple_of: int = 64, name: str = "layer") -> list[list[ExpertSlice]]:
    """A layer's experts [(gate, up, down), ...] -> per duck, its slice of every expert:
    result[d][e] for duck d and expert e (expert ids on the wire index this list)."""
    per_expert = [split_expert(g, u, dn, tp, multiple_of, f"{name}.expert{e}") for e, (g, u, dn) in enumerate(experts)]
    return [[per_expert[e][d] for e in range(len(per_expert))] for d in range(tp)]


# --- the fleet ---------------------------------------------------------------

@dataclass(frozen=True)
class DuckInfo:
    """What a duck says in its hello."""
    index: int
    address: tuple[str, int]
    duck_id: int
    firmware: str
    abi: int
    cores: int
    threads: int
    mem_bytes: int
    cache_bytes: int
    cache_capacity: int
    cache_entries: int
    session: int
    mtu: int
    data_mac: bool
    fault_injection: bool


def _struct_dict(cdata) -> dict:
    return {name: getattr(cdata, name) for name, _ in ffi.typeof(cdata).item.fields if not name.startswith("reserved")}


class Fleet:
    """One socket to N ducks. Not for concurrent use from several threads
    (calls are serialized by a lock); the C releases the GIL while waiting.

    retransmit_ms: silence before the first retransmit (doubles, up to 8x);
    deadline_ms: silence after which a duck has failed (DuckTimeout names it).
    """

    def __init__(self, addresses, key: bytes, *, mtu: int = 1500, retransmit_ms: float = 10.0,
                 deadline_ms: float = 1000.0, mac_data: bool = False, spin_us: int = 0):
        self.addresses = [(str(h), int(p)) for h, p in addresses]
        if not self.addresses:
            raise ValueError("a fleet needs at least one duck address")
        cfg = ffi.new("duck_transport_config *")
        self._keep = [ffi.new("uint32_t[]", [int.from_bytes(socket.inet_aton(h), "little") for h, _ in self.addresses]),
                      ffi.new("uint16_t[]", [p for _, p in self.addresses]), ffi.new("uint8_t[]", bytes(key))]
        cfg.n_ducks = len(self.addresses)
        cfg.addrs, cfg.ports, cfg.key = self._keep
        cfg.key_len = len(key)
        cfg.mtu = mtu
        cfg.retransmit_us = int(retransmit_ms * 1000)
        cfg.deadline_us = int(deadline_ms * 1000)
        cfg.mac_data = int(mac_data)
        cfg.spin_us = spin_us
        err = ffi.new("char[256]")
        ptr = lib.duck_transport_create(cfg, err, 256)
        if ptr == ffi.NULL:
            raise ValueError(f"cannot open the fleet transport: {ffi.string(err).decode()}")
        self._t = ffi.gc(ptr, lib.duck_transport_destroy)
        self.deadline_ms = deadline_ms
        self.mac_data = mac_data
        self._lock = threading.Lock()
        self.infos: list[DuckInfo] = []
        self.last_rtt_us: list[float] = []

    @property
    def n_ducks(self) -> int:
        return len(self.addresses)

    def name(self, d: int) -> str:
        host, port = self.addresses[d]
        ident = f" id {self.infos[d].duck_id}" if d < len(self.infos) else ""
        return f"duck {d}{ident} ({host}:{port})"

    def close(self) -> None:
        if self._t is not None:
            ffi.release(self._t)   # runs duck_transport_destroy now
            self._t = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests -------------------------------------------------------------
    def call(self, requests, session: int = 0, check: bool = True) -> list[tuple[int, bytes]]:
        """Runs [(duck, type, payload, reply_cap)] concurrently; returns [(status, body)].
        Raises DuckTimeout / DuckError naming the first duck that failed."""
        n = len(requests)
        calls = ffi.new("duck_call[]", n)
        keep = []
        for i, (duck, mtype, payload, cap) in enumerate(requests):
            buf = ffi.from_buffer(payload) if len(payload) else ffi.NULL
            reply = ffi.new("uint8_t[]", max(cap, lib.WIRE_MAX_ERROR_TEXT) + ffi.sizeof("wire_reply_head"))
            keep += [payload, buf, reply]
            c = calls[i]
            c.duck, c.type, c.session = duck, mtype, session
            c.payload, c.payload_len = buf, len(payload)
            c.reply, c.reply_cap = reply, len(reply)
        with self._lock:
            if self._t is None:
                raise RuntimeError("the fleet transport is closed")
            lib.duck_transport_run(self._t, calls, n)
        self.last_rtt_us = [calls[i].rtt_ns / 1000.0 for i in range(n)]
        out = []
        for i in range(n):
            c, duck, mtype = calls[i], requests[i][0], requests[i][1]
            what = ffi.string(lib.wire_type_str(mtype)).decode()
            if c.result == lib.DUCK_T_ETIMEOUT:
                st = self.transport_stats()
                raise DuckTimeout(f"{self.name(duck)} did not answer {what} within {self.deadline_ms:.0f} ms "
                                  f"({c.retransmits} retransmits; host saw {st['stale']} stale, "
                                  f"{st['malformed']} malformed, {st['unauthenticated']} unauthenticated "
                                  "datagrams in all)", duck)
            if c.result != lib.DUCK_T_OK:
                raise DuckError(f"{self.name(duck)}: {what} failed with transport error {c.result}", duck)
            head = ffi.cast("wire_reply_head *", c.reply)
            body = bytes(ffi.buffer(c.reply, c.reply_len)[ffi.sizeof("wire_reply_head"):])
            if check and head.status != lib.WIRE_OK:
                raise DuckError(f"{self.name(duck)} refused {what}: {body.decode(errors='replace')}", duck,
                                head.status)
            out.append((head.status, body))
        return out

    def _all(self, mtype, payload=b"", cap=256, ducks=None, session=0):
        ducks = range(self.n_ducks) if ducks is None else ducks
        return self.call([(d, mtype, payload, cap) for d in ducks], session)

    def hello(self) -> list[DuckInfo]:
        """Asks every duck who it is; also the link check (a duck that is down raises DuckTimeout)."""
        infos = []
        for d, (_, body) in enumerate(self._all(lib.WIRE_T_HELLO, cap=ffi.sizeof("wire_hello_reply"))):
            h = ffi.cast("wire_hello_reply *", ffi.from_buffer(body))
            infos.append(DuckInfo(d, self.addresses[d], h.duck_id, ffi.string(h.name).decode(errors="replace"),
                                  h.abi, h.cores, h.threads, h.mem_bytes, h.cache_bytes, h.cache_capacity,
                                  h.cache_entries, h.session, h.mtu, bool(h.flags & lib.WIRE_HELLO_DATA_MAC),
                                  bool(h.flags & lib.WIRE_HELLO_FAULTS)))
            if h.abi != lib.WIRE_ABI:
                raise DuckError(f"{self.name(d)} speaks wire ABI {h.abi}, this host {lib.WIRE_ABI}; "
                                "update its firmware", d)
            if h.flags & lib.WIRE_HELLO_DATA_MAC and not self.mac_data:
                raise DuckError(f"{self.name(d)} requires a MAC on forwards (duckfw --data-mac); "
                                "open the Fleet with mac_data=True", d)
        self.infos = infos
        return infos

    def ping(self) -> list[float]:
        """Round trip to every duck (all at once), in microseconds."""
        p = ffi.new("wire_ping *")
        p.t_ns = time.monotonic_ns()
        self._all(lib.WIRE_T_PING, bytes(ffi.buffer(p)), cap=ffi.sizeof("wire_ping"))
        return list(self.last_rtt_us)

    def stats(self) -> list[dict]:
        """Each duck's counters (wire_stats field names)."""
        return [_struct_dict(ffi.cast("wire_stats *", ffi.from_buffer(body)))
                for _, body in self._all(lib.WIRE_T_STATS, cap=ffi.sizeof("wire_stats"))]

    def transport_stats(self) -> dict:
        s = ffi.new("duck_transport_stats *")
        lib.duck_transport_stats_get(self._t, s)
        return _struct_dict(s)

    def cache_query(self, digests_per_duck: list[list[str]]) -> list[set[str]]:
        """For each duck, which of the given hex digests its cache holds."""
        reqs = []
        for d, digests in enumerate(digests_per_duck):
            payload = len(digests).to_bytes(4, "little") + b"".join(bytes.fromhex(h) for h in digests)
            reqs.append((d, lib.WIRE_T_CACHE_QUERY, payload, 4 + len(digests) // 8 + 1))
        out = []
        for (_, body), digests in zip(self.call(reqs), digests_per_duck):
            bits = np.unpackbits(np.frombuffer(body[4:], np.uint8), bitorder="little")
            out.append({h for i, h in enumerate(digests) if bits[i]})
        return out

    def invalidate(self, digest: str | None = None, ducks=None) -> list[int]:
        """Drops one entry (hex digest) or, with None, everything not in use; returns counts per duck."""
        inv = ffi.new("wire_invalidate *")
        if digest is None:
            inv.flags = lib.WIRE_INVALIDATE_ALL
        else:
            inv.digest = list(bytes.fromhex(digest))
        body = bytes(ffi.buffer(inv))
        return [int.from_bytes(b[:4], "little") for _, b in self._all(lib.WIRE_T_CACHE_INVALIDATE, body, ducks=ducks)]

    def shutdown(self, ducks=None) -> None:
        self._all(lib.WIRE_T_SHUTDOWN, ducks=ducks)

    def upload(self, tensors_per_duck: list[list[Fp9Tensor]]) -> dict:
        """Uploads each duck's tensors it does not hold yet, all ducks at once,
        in parts; an interrupted upload resumes where the duck says it stopped.
        Returns {'uploaded': n, 'skipped': n, 'bytes': n}."""
        from native.transport_upload import upload
        return upload(self, tensors_per_duck)

    def open_session(self, layers: dict[int, list[list[ExpertSlice]]], hidden: int,
                     session_id: int | None = None) -> "Session":
        """Makes the layer plans resident on every duck: layers[layer][duck] is
        that duck's list of expert slices (split_experts' result), already uploaded."""
        from native.transport_upload import open_session
        return open_session(self, layers, hidden, session_id or (secrets.randbits(32) or 1))


class Session:
    """A persistent session: forward() per layer, plans resident on the ducks."""

    def __init__(self, fleet: Fleet, session_id: int, hidden: int, layers: set[int]):
        self.fleet, self.id, self.hidden, self.layers = fleet, session_id, hidden, set(layers)
        self._args = ffi.new("duck_forward_args *")
        self._args.session, self._args.hidden = session_id, hidden
        self._res = ffi.new("duck_forward_result *")
        self.bytes_streamed = 0
        self.kernel_us_max = 0
        self.retransmits = 0

    def forward(self, layer: int, x, expert_ids, expert_weights, out: np.ndarray | None = None) -> np.ndarray:
        """x [T, H] (fp32 numpy, or torch fp32/bf16 on the CPU), expert_ids / weights [T, k]
        -> [T, H] fp32: the sum of every duck's partial. T is any count (chunks of 64).
        Raises DuckTimeout naming a duck that did not answer within the deadline,
        DuckError for a duck that refused (unknown layer, expert id out of range)."""
        xn, bf16, ids, wts = ffn_inputs(x, expert_ids, expert_weights)
        ntok = xn.shape[0]
        if xn.ndim != 2 or xn.shape[1] != self.hidden:
            raise ValueError(f"forward layer {layer}: activation {xn.shape} does not have hidden size {self.hidden}")
        if ids.shape[1] > lib.WIRE_MAX_TOPK:
            raise ValueError(f"forward layer {layer}: {ids.shape[1]} experts per token, at most {lib.WIRE_MAX_TOPK}")
        y = out if out is not None else np.empty((ntok, self.hidden), dtype=np.float32)
        if y.shape != (ntok, self.hidden) or y.dtype != np.float32 or not y.flags.c_contiguous:
            raise ValueError(f"forward layer {layer}: out must be a contiguous float32 array of {(ntok, self.hidden)}")
        a, res = self._args, self._res
        a.layer, a.topk, a.x_is_bf16 = layer, ids.shape[1], int(bf16)
        step = MAX_TOKENS
        for t0 in range(0, ntok, step):
            if ntok <= step:
                xs, ys, si, sw = xn, y, ids, wts
            else:
                xs, ys, si, sw = xn[t0:t0 + step], y[t0:t0 + step], ids[t0:t0 + step], wts[t0:t0 + step]
            a.ntok = xs.shape[0]
            a.expert_ids = ffi.from_buffer("int32_t[]", si)
            a.expert_weights = ffi.from_buffer("float[]", sw)
            a.x = ffi.from_buffer(xs)
            a.y = ffi.from_buffer("float[]", ys, require_writable=True)
            with self.fleet._lock:
                rc = lib.duck_transport_forward(self.fleet._t, a, res)
            self.retransmits += res.retransmits
            if rc != lib.DUCK_T_OK:
                self._raise(rc, res)
            self.bytes_streamed += res.bytes_streamed
            if res.kernel_us_max > self.kernel_us_max:
                self.kernel_us_max = res.kernel_us_max
        return y

    def _raise(self, rc: int, res) -> None:
        msg = ffi.string(res.message).decode(errors="replace")
        d = res.failed_duck
        if d >= 0:
            msg = msg.replace(f"duck {d}", self.fleet.name(d), 1)
        cls = DuckTimeout if rc == lib.DUCK_T_ETIMEOUT else DuckError
        raise cls(msg, d if d >= 0 else None, res.duck_status)

    def close(self) -> None:
        """Releases the plans on every duck (their cache entries stay)."""
        self.fleet._all(lib.WIRE_T_SESSION_CLOSE, session=self.id)
