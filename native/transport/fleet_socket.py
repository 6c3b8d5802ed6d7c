"""One socket to N ducks (native/transport/transport.c, GIL released): requests,
hello (and the datagram size agreed with each duck), ping, stats, cache queries
and invalidation, uploads and sessions."""
from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np

from native._native import ffi, lib
from native.fp9 import Fp9Tensor, SynthTensor
from native.kernels import ExpertSlice
from native.transport import session as _session
from native.transport import upload as _upload
from native.transport.errors import ClosedError, DuckError, DuckTimeout

log = logging.getLogger("duck.transport")

# A probe's payload is this much below the agreed size, so that the request
# (28 + 32 + payload) and its echo (28 + 32 + 8 + payload, room for a MAC
# kept) are one datagram each, within 24 bytes of the size.
_PROBE_ROOM = lib.WIRE_IP_UDP_BYTES + lib.WIRE_HEADER_BYTES + lib.WIRE_MAC_BYTES + ffi.sizeof("wire_reply_head")


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
    mtu: int                 # the largest datagram the duck takes and sends
    data_mac: bool
    fault_injection: bool
    max_tokens: int          # tokens one forward may carry to it
    run_ours: bool = False   # the duck holds this Fleet's run (its link key); else hello() opens it
    challenge: bytes = b""   # what the duck's next RUN_OPEN must name


def _struct_dict(cdata) -> dict:
    return {name: getattr(cdata, name) for name, _ in ffi.typeof(cdata).item.fields if not name.startswith("reserved")}


class Fleet:
    """One socket to N ducks. Not for concurrent use from several threads
    (calls are serialized by a lock); the C releases the GIL while waiting.

    mtu: a ceiling on the datagram size (IP and UDP headers counted); 0: none.
    Datagrams are WIRE_MTU_DEFAULT (1500) bytes until hello() agrees a size with
    each duck: the smallest of what it announces, the path MTU to it and mtu
    (64 KiB on loopback: one datagram per layer and duck instead of twenty).
    retransmit_ms: the least silence before a retransmit, and the timer until a
    duck's round trip is measured (then srtt + 4 rttvar; doubles, up to 8x);
    deadline_ms: silence after which a duck has failed (DuckTimeout names it).
    spin_us: poll for replies this long before blocking (a dedicated host).
    rcvbuf: the socket receive buffer to ask for (0: 64 MiB); a forward's requests
    and the requests in flight are sized so that all ducks' replies fit it.
    mac_data: MAC forwards and their partials (the default); False only on trusted
    links, with ducks started --no-data-mac.
    workers: threads (this one counted) that seal and check the datagrams of a
    large message and sum its partials: a prefill chunk is megabytes per duck,
    every byte of which the host MACs, checksums and copies (0: as many as this
    process may run on, at most 8; 1: this thread alone).
    twice: a forward of a few datagrams (decode) sent twice, and its reply: 0 to a
    duck whose link is found lossy (transport_timing.c), 1 always, -1 never.
    Each Fleet is a run (docs/wire.md, Authentication): hello() opens it on every
    duck that does not hold it, and state-changing messages and forwards carry
    MACs under that duck's link key, each taken once. Read-only requests (hello,
    stats, cache queries) name the duck's query nonce, which its hello gives; one
    refused as stale (the duck drew a new nonce, or restarted) is asked again once
    with the nonce its hello gives then.
    """

    def __init__(self, addresses, key: bytes, *, mtu: int = 0, retransmit_ms: float = 10.0,
                 deadline_ms: float = 1000.0, mac_data: bool = True, spin_us: int = 0, rcvbuf: int = 0,
                 workers: int = 0, twice: int = 0):
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
        cfg.rcvbuf = rcvbuf
        cfg.workers = workers
        cfg.twice = twice
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
        self._cover = None       # a HostCover the C transport calls into (native/transport/cover.py)
        self.lost_changed = False
        self._last_stats: dict = {}   # transport_stats' last reading
        self._challenge: list[bytes] = [bytes(16)] * len(self.addresses)
        self._query: list[bytes] = [b""] * len(self.addresses)   # each duck's query nonce; b"": not known yet
        self._query_until = [0.0] * len(self.addresses)          # time.monotonic() when to ask for a new one

    @property
    def n_ducks(self) -> int:
        return len(self.addresses)

    def name(self, d: int) -> str:
        host, port = self.addresses[d]
        ident = f" id {self.infos[d].duck_id}" if d < len(self.infos) else ""
        return f"duck {d}{ident} ({host}:{port})"

    def close(self) -> None:
        """Closes the socket; waits for a call in flight (another thread's) to return first."""
        with self._lock:
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
        Raises DuckTimeout / DuckError naming the first duck that failed. A duck that
        does not answer a state-changing message may have restarted (it holds no run and
        drops it unanswered): its hello tells, and then the run is opened again and the
        call made once more."""
        try:
            return self._call(requests, session, check)
        except DuckTimeout as e:
            linked = [r for r in requests if r[0] == e.duck and lib.wire_mac_kind(r[1]) == lib.WIRE_MAC_LINK]
            if not linked or self.hello_only([e.duck])[0].run_ours:
                raise
            log.warning("%s holds no run of this host (it restarted, or another host opened one): opening ours "
                        "again", self.name(e.duck))
            return self._call(requests, session, check)

    def _call(self, requests, session: int, check: bool) -> list[tuple[int, bytes]]:
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
        unlinked = sorted({duck for duck, mtype, _, _ in requests if lib.wire_mac_kind(mtype) == lib.WIRE_MAC_LINK
                           and (mtype != lib.WIRE_T_FORWARD or self.mac_data) and not self._linked(duck)})
        if unlinked:   # state-changing messages need the duck's link key: open the run there first
            self._open_runs(self.hello_only(unlinked))
        with self._lock:
            lib.duck_transport_run(self._open(), calls, n)
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
            if c.result == lib.DUCK_T_ENORUN:
                raise DuckError(f"{self.name(duck)} holds no run of this host (it restarted): {what} needs "
                                "the run opened on it again (Fleet.open_run)", duck)
            if c.result != lib.DUCK_T_OK:
                raise DuckError(f"{self.name(duck)}: {what} failed with transport error {c.result}", duck)
            head = ffi.cast("wire_reply_head *", c.reply)
            body = bytes(ffi.buffer(c.reply, c.reply_len)[ffi.sizeof("wire_reply_head"):])
            if check and head.status != lib.WIRE_OK:
                raise self._refused(duck, mtype, head.status, body)
            out.append((head.status, body))
        return out

    def _refused(self, duck: int, mtype: int, status: int, body: bytes) -> DuckError:
        what = ffi.string(lib.wire_type_str(mtype)).decode()
        return DuckError(f"{self.name(duck)} refused {what}: {body.decode(errors='replace')}", duck, status)

    # -- read-only requests: the query nonce (docs/wire.md, Authentication) ----
    def _read(self, requests) -> list[tuple[int, bytes]]:
        """Read-only requests [(duck, type, payload, reply_cap)] (STATS, CACHE_QUERY), each sent
        with the duck's query nonce first. One the duck refuses as stale (it drew a new nonce
        since, or restarted) is sent once more with the nonce its hello gives now."""
        unknown = sorted({d for d, *_ in requests if not self._query_known(d)})
        if unknown:
            self._fetch_query(unknown)
        out = self.call([(d, t, self._query[d] + p, cap) for d, t, p, cap in requests], check=False)
        stale = [i for i, (status, _) in enumerate(out) if status == lib.WIRE_E_STALE]
        if stale:
            ducks = sorted({requests[i][0] for i in stale})
            log.info("%s refused this host's query nonce as stale (restarted?): asking again with the current one",
                     ", ".join(self.name(d) for d in ducks))
            self._fetch_query(ducks)
            again = self.call([(d, t, self._query[d] + p, cap) for d, t, p, cap in (requests[i] for i in stale)],
                              check=False)
            for i, r in zip(stale, again):
                out[i] = r
        for (d, t, _, _), (status, body) in zip(requests, out):
            if status != lib.WIRE_OK:
                raise self._refused(d, t, status, body)
        return out

    def _fetch_query(self, ducks: list[int]) -> None:
        """Each duck's current query nonce, from a hello that names none (answered in the
        unauthenticated form, which carries it)."""
        cap, t0 = ffi.sizeof("wire_hello_reply"), time.monotonic()
        for d, (_, body) in zip(ducks, self.call([(d, lib.WIRE_T_HELLO, b"", cap) for d in ducks])):
            self._hello_reply(d, body, t0)

    def _query_known(self, d: int) -> bool:
        """Whether this host holds duck d's query nonce and the duck still takes it."""
        return bool(self._query[d]) and time.monotonic() < self._query_until[d]

    def _hello_reply(self, d: int, body: bytes, t0: float):
        """A hello reply as a wire_hello_reply (an older duck's is shorter: the rest zero); keeps
        the query nonce it carries and when to ask for a new one: within the time the duck takes
        it from its reply (which came after t0, when the hello was sent), less a tenth for the
        requests that name it to arrive."""
        h = ffi.new("wire_hello_reply *")
        ffi.memmove(h, body, min(len(body), ffi.sizeof("wire_hello_reply")))
        if h.abi == lib.WIRE_ABI:
            self._query[d] = bytes(h.query)
            self._query_until[d] = t0 + 0.9 * h.query_ms / 1000.0
        return h

    def _hellos(self, ducks: list[int]) -> list:
        """Each duck's whole hello (WIRE_HELLO_FULL), asked with its query nonce; a duck that
        answers the bare form (the nonce was stale, or not known yet) carries its current nonce
        there and is asked once more. A duck of another ABI is answered as it answers (the
        caller names the mismatch)."""
        cap, t0 = ffi.sizeof("wire_hello_reply"), time.monotonic()
        asked = [(d, lib.WIRE_T_HELLO, self._query[d] if self._query_known(d) else b"", cap) for d in ducks]
        hellos = [self._hello_reply(d, body, t0) for d, (_, body) in zip(ducks, self.call(asked))]
        bare = [i for i, h in enumerate(hellos) if h.abi == lib.WIRE_ABI and not h.flags & lib.WIRE_HELLO_FULL]
        if bare:
            t0 = time.monotonic()
            again = self.call([(ducks[i], lib.WIRE_T_HELLO, self._query[ducks[i]], cap) for i in bare])
            for i, (_, body) in zip(bare, again):
                hellos[i] = self._hello_reply(ducks[i], body, t0)
                if not hellos[i].flags & lib.WIRE_HELLO_FULL:
                    raise DuckError(f"{self.name(ducks[i])} did not take the query nonce its hello just gave "
                                    "(it restarted, or draws new ones faster than a round trip)", ducks[i])
        return hellos

    def _all(self, mtype, payload=b"", cap=256, ducks=None, session=0):
        ducks = range(self.n_ducks) if ducks is None else ducks
        return self.call([(d, mtype, payload, cap) for d in ducks], session)

    def hello(self) -> list[DuckInfo]:
        """Asks every duck who it is; also the link check (a duck that is down raises
        DuckTimeout). Agrees the datagram size with each duck and proves it with a
        ping of that size both ways (a size the path drops falls back to 1500)."""
        infos = self._checked_hello()
        self.infos = infos
        self._open_runs(infos)
        self._agree()
        return infos

    def open_run(self, ducks: list[int]) -> None:
        """This Fleet's run on these ducks where they do not hold it (a duck that restarted, or
        that another host took), by their hello's challenge; the other ducks are not asked."""
        self._open_runs(self._checked_hello(ducks))

    def _checked_hello(self, ducks=None) -> list[DuckInfo]:
        infos = self.hello_only(ducks)
        for info in infos:
            d = info.index
            if info.abi != lib.WIRE_ABI:
                raise DuckError(f"{self.name(d)} speaks wire ABI {info.abi}, this host {lib.WIRE_ABI}; "
                                "update its firmware", d)
            if info.data_mac and not self.mac_data:
                raise DuckError(f"{self.name(d)} requires a MAC on forwards (started without --no-data-mac); "
                                "open the Fleet with mac_data=True", d)
        return infos

    def hello_only(self, ducks=None) -> list[DuckInfo]:
        """Each duck's hello, nothing more (no run opened, no size agreed)."""
        ducks = list(range(self.n_ducks) if ducks is None else ducks)
        run = self.run_nonce()
        infos = []
        for d, h in zip(ducks, self._hellos(ducks)):
            self._challenge[d] = bytes(h.challenge)
            ours = bytes(h.run) == run
            if not ours and self._linked(d):
                with self._lock:   # the duck restarted or another host opened its run: our link is gone
                    lib.duck_transport_unlink(self._open(), d)
            infos.append(DuckInfo(d, self.addresses[d], h.duck_id, ffi.string(h.name).decode(errors="replace"),
                                  h.abi, h.cores, h.threads, h.mem_bytes, h.cache_bytes, h.cache_capacity,
                                  h.cache_entries, h.session, h.mtu, bool(h.flags & lib.WIRE_HELLO_DATA_MAC),
                                  bool(h.flags & lib.WIRE_HELLO_FAULTS), h.max_tokens, ours,
                                  bytes(h.challenge)))
        return infos

    def run_nonce(self) -> bytes:
        """This Fleet's run: random, new per Fleet (so per daemon start)."""
        out = ffi.new("uint8_t[]", lib.WIRE_NONCE_BYTES)
        with self._lock:
            lib.duck_transport_run_nonce(self._open(), out)
        return bytes(out)

    def link_key(self, d: int):
        """A copy of duck d's wire_key (the fleet key and its link): for tests that craft
        datagrams as this host would."""
        out = ffi.new("wire_key *")
        with self._lock:
            lib.duck_transport_key(self._open(), d, out)
        return out

    def take_sequence(self) -> int:
        """A sequence number of this run that no call of this Fleet will use (tests)."""
        with self._lock:
            return lib.duck_transport_take_sequence(self._open())

    def _linked(self, d: int) -> bool:
        with self._lock:
            return bool(lib.duck_transport_linked(self._open(), d))

    def _open_runs(self, infos: list[DuckInfo]) -> None:
        """RUN_OPEN on every duck that does not hold this run, bound to the challenge its
        hello just gave; then that duck's link key is made here too."""
        todo = [i.index for i in infos if not i.run_ours or not self._linked(i.index)]
        if not todo:
            return
        ro = ffi.new("wire_run_open *")
        ro.run = list(self.run_nonce())
        reqs = []
        for d in todo:
            ro.challenge = list(self._challenge[d])
            reqs.append((d, lib.WIRE_T_RUN_OPEN, bytes(ffi.buffer(ro)), 0))
        self.call(reqs)
        with self._lock:
            for d in todo:
                lib.duck_transport_link(self._open(), d, self._challenge[d])
        log.info("run %s opened on %s", self.run_nonce()[:4].hex(), ", ".join(self.name(d) for d in todo))

    def _agree(self) -> None:
        """Each duck's datagram size; a size above 1500 that is new is proven by a ping of
        that size both ways (a size that fell back is tried again: the path may be fixed)."""
        before = self.datagram_sizes()
        with self._lock:
            agreed = [lib.duck_transport_agree(self._open(), d, info.mtu) for d, info in enumerate(self.infos)]
        probes = [(d, lib.WIRE_T_PING, self._ping_payload(m - _PROBE_ROOM), m - _PROBE_ROOM)
                  for d, m in enumerate(agreed) if m > lib.WIRE_MTU_DEFAULT and m != before[d]]
        if probes:
            self.call(probes)
        now_sizes = self.datagram_sizes()
        for d, m in enumerate(agreed):
            now = now_sizes[d]
            if now != m:
                with self._lock:
                    path = lib.duck_transport_path_mtu(self._open(), d)
                log.warning("%s: datagrams of %d bytes did not get through (the duck announced %d, the route "
                            "to it %d); using %d: check the MTU of the path, or set the fleet's mtu", self.name(d), m,
                            self.infos[d].mtu, path, now)
        log.debug("datagram sizes: %s", self.datagram_sizes())

    @property
    def workers(self) -> int:
        """Threads that sealed, checked and summed the large messages so far (1 until the first)."""
        return int(lib.duck_transport_workers(self._open()))

    def datagram_sizes(self) -> list[int]:
        """The datagram size (an MTU: IP and UDP headers counted) used with each duck now."""
        with self._lock:
            return [lib.duck_transport_mtu(self._open(), d) for d in range(self.n_ducks)]

    def _open(self):
        """The C transport, for a caller that holds the lock; a closed one is an error, not a crash."""
        if self._t is None:
            raise ClosedError("the fleet transport is closed")
        return self._t

    @staticmethod
    def _ping_payload(size: int = 0) -> bytes:
        p = ffi.new("wire_ping *")
        p.t_ns = time.monotonic_ns()     # reply_mtu: the transport states the agreed size
        head = bytes(ffi.buffer(p))
        return head + bytes(max(0, size - len(head)))

    def ping(self) -> list[float]:
        """Round trip to every duck (all at once), in microseconds."""
        self._all(lib.WIRE_T_PING, self._ping_payload(), cap=ffi.sizeof("wire_ping"))
        return list(self.last_rtt_us)

    def stats(self) -> list[dict]:
        """Each duck's counters (wire_stats field names)."""
        cap = ffi.sizeof("wire_stats")
        return [_struct_dict(ffi.cast("wire_stats *", ffi.from_buffer(body)))
                for _, body in self._read([(d, lib.WIRE_T_STATS, b"", cap) for d in range(self.n_ducks)])]

    def transport_stats(self, wait: float | None = None) -> dict:
        """The host transport's counters (duck_transport_stats field names). wait: seconds to wait
        for a call in flight (an upload takes minutes) before the last reading is returned
        instead ({} before the first), as it is once the transport is closed; None: as long as
        it takes."""
        s = ffi.new("duck_transport_stats *")
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            return dict(self._last_stats)
        try:
            if self._t is None and wait is not None:
                return dict(self._last_stats)
            lib.duck_transport_stats_get(self._open(), s)
        finally:
            self._lock.release()
        self._last_stats = _struct_dict(s)
        return dict(self._last_stats)

    def cache_query(self, digests_per_duck: list[list[str]]) -> list[set[str]]:
        """For each duck, which of the given hex digests its cache holds."""
        reqs = []
        for d, digests in enumerate(digests_per_duck):
            if digests:   # a duck asked nothing is not asked (it may be down)
                payload = len(digests).to_bytes(4, "little") + b"".join(bytes.fromhex(h) for h in digests)
                reqs.append((d, lib.WIRE_T_CACHE_QUERY, payload, 4 + len(digests) // 8 + 1))
        out: list[set[str]] = [set() for _ in digests_per_duck]
        for (d, *_), (_, body) in zip(reqs, self._read(reqs) if reqs else []):
            bits = np.unpackbits(np.frombuffer(body[4:], np.uint8), bitorder="little")
            out[d] = {h for i, h in enumerate(digests_per_duck[d]) if bits[i]}
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

    def upload(self, tensors_per_duck: list[list[Fp9Tensor | SynthTensor]]) -> dict:
        """Uploads each duck's tensors it does not hold yet, all ducks at once,
        in parts; an interrupted upload resumes where the duck says it stopped.
        SynthTensors are not sent: the ducks generate them (wire SYNTH).
        Returns {'uploaded': n, 'skipped': n, 'bytes': n, 'synthesized': n,
        'synth_bytes': n, 'seconds': s}."""
        return _upload.upload(self, tensors_per_duck)

    # -- lost ducks (native/transport/cover.py) -------------------------------
    def set_lost(self, duck: int, lost: bool) -> None:
        """Marks a duck lost (its slices go to a replica or this host) or gives it its slices
        back. Raises DuckError when what is lost can no longer be computed (the duck stays marked)."""
        err = ffi.new("char[256]")
        with self._lock:
            rc = lib.duck_transport_set_lost(self._open(), duck, int(lost), err, 256)
            self.lost_changed = True   # the next forward reports who computes what (Session.on_lost)
        if rc == lib.DUCK_T_EARG:
            raise ValueError(ffi.string(err).decode())
        if rc != 0:
            raise DuckError(ffi.string(err).decode(), duck)

    def hint_lost(self, duck: int) -> None:
        """The caller knows this duck is gone (its process exited, its health checks failed): a
        forward in flight on another thread gives up on it within 50 ms and its slices go elsewhere,
        as set_lost(duck, True) does between forwards. Takes no lock (a forward may hold it for long)."""
        if not 0 <= duck < self.n_ducks:
            raise ValueError(f"no duck {duck} (the fleet has {self.n_ducks})")
        lib.duck_transport_hint_lost(self._open(), duck)

    def progress(self) -> int:
        """A count that moves at every reply and every run's end, read without the lock (duckd's health)."""
        return int(lib.duck_transport_progress(self._open()))

    def lost(self) -> list[int]:
        """The ducks marked lost now. Reads flags only, without waiting for a forward in flight
        (the health checks ask often, from the daemon's event loop)."""
        t = self._open()
        return [d for d in range(self.n_ducks) if lib.duck_transport_lost(t, d)]

    def routes(self) -> list[int]:
        """Who computes each slice now: a duck index, HOST (-1) or NOBODY (-2). Like lost(), read
        without waiting for a forward in flight (routes change in place, under the lock)."""
        t = self._open()
        return [lib.duck_transport_route(t, d) for d in range(self.n_ducks)]

    def cover_error(self) -> str:
        """Why some slice has no route now (the ducks lost, the memory their slices need, the
        cover budget), or "" while every slice has one; read like routes()."""
        return ffi.string(lib.duck_transport_cover_error(self._open())).decode(errors="replace")

    def lost_after_ms(self, duck: int, ntok: int = 1) -> float:
        """The silence after which a forward of ntok tokens marks this duck lost now."""
        with self._lock:
            return lib.duck_transport_lost_after_us(self._open(), duck, ntok) / 1000.0

    def open_session(self, layers: dict[int, list[list[ExpertSlice]]], hidden: int,
                     session_id: int | None = None, **options) -> _session.Session:
        """Makes the layer plans resident on every duck: layers[layer][duck] is
        that duck's list of expert slices (split_experts' result), already uploaded.
        Says hello first if this Fleet has not (the datagram sizes are agreed there).
        options: Session's request_tokens and pipeline."""
        if not self.infos:
            self.hello()
        return _session.open_session(self, layers, hidden, session_id or (secrets.randbits(32) or 1), **options)
