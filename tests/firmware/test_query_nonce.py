"""The query nonce of read-only requests (wire ABI 8; docs/wire.md, Authentication,
Read-only requests): a fleet-MACed HELLO, STATS or CACHE_QUERY names the duck's
current query nonce, which any hello hands out. A captured one replayed after the
nonce changed and its period of grace passed, or after the duck restarted, gets
nothing of the duck (STATS and CACHE_QUERY: STALE; HELLO: the unauthenticated
form) and is counted as `replayed`; the nonce before the current one is still
taken for a period; two hosts asking one duck both work while its nonce changes
under them; a peer of ABI 7 is refused by name. Ducks run with a short
--query-period-ms so that nothing waits long."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from native._native import ffi, lib
from native.transport import DuckError, Fleet
from tests.firmware.test_malformed import exchange
from tests.firmware.test_wire import seal
from tests.transport.ducks import Ducks

PERIOD_MS = 400
HEADER = struct.Struct("<IBBHIIHHIII")   # wire_header


def _hello(body: bytes):
    hr = ffi.new("wire_hello_reply *")
    ffi.memmove(hr, body, min(len(body), ffi.sizeof("wire_hello_reply")))
    return hr


def query(port: int, key: bytes, sequence: int) -> tuple[bytes, int]:
    """The duck's current query nonce and how long it takes it (ms), from an unauthenticated hello."""
    status, body, _ = exchange(port, seal(b"", None, mtype=lib.WIRE_T_HELLO, sequence=sequence), key)
    hr = _hello(body)
    assert status == lib.WIRE_OK and not hr.flags & lib.WIRE_HELLO_FULL and any(hr.query)
    return bytes(hr.query), hr.query_ms


def captured(q: bytes, key: bytes, sequence: int) -> dict[int, bytes]:
    """A host's fleet-MACed read-only requests naming query nonce q, as an attacker on the path keeps them."""
    one_digest = (1).to_bytes(4, "little") + bytes(16)
    return {lib.WIRE_T_STATS: seal(q, key, mtype=lib.WIRE_T_STATS, sequence=sequence),
            lib.WIRE_T_CACHE_QUERY: seal(q + one_digest, key, mtype=lib.WIRE_T_CACHE_QUERY, sequence=sequence + 1),
            lib.WIRE_T_HELLO: seal(q, key, mtype=lib.WIRE_T_HELLO, sequence=sequence + 2)}


def answered(port: int, key: bytes, requests: dict[int, bytes]) -> None:
    """Each request gets what it asks: the duck's counters, the cache bitmap, the whole hello."""
    status, body, _ = exchange(port, requests[lib.WIRE_T_STATS], key)
    assert status == lib.WIRE_OK and len(body) == ffi.sizeof("wire_stats")
    status, body, _ = exchange(port, requests[lib.WIRE_T_CACHE_QUERY], key)
    assert status == lib.WIRE_OK and body[:4] == (1).to_bytes(4, "little")
    status, body, _ = exchange(port, requests[lib.WIRE_T_HELLO], key)
    hr = _hello(body)
    assert status == lib.WIRE_OK and hr.flags & lib.WIRE_HELLO_FULL and hr.cache_capacity > 0


def refused(port: int, key: bytes, requests: dict[int, bytes]) -> None:
    """Each request, sent again from another address, gets nothing of the duck: STATS and
    CACHE_QUERY are answered STALE, HELLO with its unauthenticated form (and a new nonce)."""
    for mtype in (lib.WIRE_T_STATS, lib.WIRE_T_CACHE_QUERY):
        status, body, _ = exchange(port, requests[mtype], key)
        assert status == lib.WIRE_E_STALE and b"query nonce" in body, (mtype, status, body)
    status, body, _ = exchange(port, requests[lib.WIRE_T_HELLO], key)
    hr = _hello(body)
    assert status == lib.WIRE_OK and not hr.flags & lib.WIRE_HELLO_FULL
    assert (hr.cache_capacity, hr.session, bytes(hr.challenge)) == (0, 0, bytes(16))


def test_captured_read_only_requests_are_refused_after_the_nonce_changed_and_after_a_restart(tmp_path):
    with Ducks(1, tmp_path, args=["--query-period-ms", str(PERIOD_MS)]) as ducks:
        port, key, fleet = ducks[0].port, ducks.key, ducks.fleet
        fleet.hello()
        session = fleet.open_session({0: [[]]}, 64)
        q, left_ms = query(port, key, 100)
        assert PERIOD_MS - 50 <= left_ms <= 2 * PERIOD_MS   # the rest of its period and the next
        old = captured(q, key, 200)
        answered(port, key, old)

        # the nonce changed and the period of grace passed: each replay is refused and counted
        time.sleep(left_ms / 1000 + 0.05)
        before = fleet.stats()[0]
        refused(port, key, old)
        after = fleet.stats()[0]
        assert after["replayed"] - before["replayed"] == 3, (before["replayed"], after["replayed"])
        assert query(port, key, 300)[0] != q
        assert fleet.hello_only()[0].session == session.id   # the host asks again and gets everything

        # the duck restarted: a nonce it handed out a moment before is forgotten
        q, _ = query(port, key, 400)
        fresh = captured(q, key, 500)
        answered(port, key, fresh)
        ducks[0].stop()
        ducks[0].start()
        refused(port, key, fresh)
        assert fleet.stats()[0]["replayed"] >= 3   # the fleet's own nonce, if it still held it, counts too
        refused_before = fleet.stats()[0]["replayed"]
        refused(port, key, fresh)
        assert fleet.stats()[0]["replayed"] - refused_before == 3


def test_the_nonce_before_is_taken_for_a_period_after_it_changed(tmp_path):
    period_ms = 500
    with Ducks(1, tmp_path, args=["--query-period-ms", str(period_ms)]) as ducks:
        port, key = ducks[0].port, ducks.key
        q, _ = query(port, key, 100)
        deadline = time.monotonic() + 3 * period_ms / 1000
        seq = 101
        while (now := query(port, key, seq))[0] == q:   # a request in flight while the duck draws a new one
            assert time.monotonic() < deadline, "the query nonce did not change"
            seq += 1
            time.sleep(0.01)
        answered(port, key, captured(q, key, 1000))        # the one before: still taken
        answered(port, key, captured(now[0], key, 2000))   # the current one
        time.sleep(period_ms / 1000 + 0.05)
        refused(port, key, captured(q, key, 3000))         # a period later: no longer


def test_two_hosts_asking_one_duck_both_work_while_its_nonce_changes(tmp_path):
    period_ms = 300
    with Ducks(1, tmp_path, args=["--query-period-ms", str(period_ms)]) as ducks:
        daemon = ducks.fleet
        daemon.hello()                                          # the run is the daemon's
        with Fleet([ducks[0].address], ducks.key) as probe:     # another host: reads only
            seen = set()
            end = time.monotonic() + 6 * period_ms / 1000
            while time.monotonic() < end:
                for fleet in (daemon, probe):
                    info = fleet.hello_only()[0]
                    assert info.cache_capacity > 0 and info.abi == lib.WIRE_ABI   # the whole hello
                    assert fleet.stats()[0]["datagrams_rx"] > 0
                    assert fleet.cache_query([[bytes(16).hex()]]) == [set()]
                    seen.add(fleet._query[0])
                time.sleep(0.03)
            assert len(seen) >= 4, "the query nonce did not change under the hosts"
            assert daemon.hello_only()[0].run_ours and not probe.hello_only()[0].run_ours


def test_a_host_of_abi_7_is_told_the_ducks_abi(tmp_path):
    """What a host of ABI 7 sends: a MACed HELLO without a query nonce gets the unauthenticated form,
    whose first 96 bytes keep their layout (its ABI check reads abi there and names the mismatch);
    a STATS without the nonce is refused, saying why."""
    with Ducks(1, tmp_path) as ducks:
        port, key = ducks[0].port, ducks.key
        status, body, _ = exchange(port, seal(b"", key, mtype=lib.WIRE_T_HELLO, sequence=100), key)
        assert status == lib.WIRE_OK and struct.unpack_from("<I", body, 8)[0] == lib.WIRE_ABI == 9
        status, body, _ = exchange(port, seal(b"", key, mtype=lib.WIRE_T_STATS, sequence=101), key)
        assert status == lib.WIRE_E_MALFORMED and b"query nonce (wire ABI 8 and later; this duck's is 9)" in body, body


class Abi7Duck:
    """A duck of ABI 7 on loopback: its 128-byte hello, with the fleet MAC, to any HELLO."""

    def __init__(self, key: bytes):
        self.key = key
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def _serve(self) -> None:
        hr = ffi.new("wire_hello_reply *")
        hr.abi, hr.mtu, hr.max_tokens, hr.fw_version = 7, 1500, 64, 1 << 16
        hr.name = b"duckfw 0.9"
        body = bytes(8) + bytes(ffi.buffer(hr))[:128]   # wire_reply_head, then the hello of ABI 7
        while not self.stop.is_set():
            try:
                data, peer = self.sock.recvfrom(65535)
            except socket.timeout:
                continue
            _, _, mtype, _, session, sequence, *_ = HEADER.unpack_from(data)
            if mtype == lib.WIRE_T_HELLO:
                self.sock.sendto(seal(body, self.key, mtype=mtype, flags=lib.WIRE_F_REPLY, session=session,
                                      sequence=sequence), peer)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def test_a_duck_of_abi_7_is_refused_by_name():
    key = bytes(range(32))
    old = Abi7Duck(key)
    try:
        with Fleet([old.address], key, deadline_ms=2000) as fleet:
            with pytest.raises(DuckError, match=r"speaks wire ABI 7, this host 9"):
                fleet.hello()
    finally:
        old.close()
