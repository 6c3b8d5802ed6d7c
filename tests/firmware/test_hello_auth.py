"""What a duck tells a peer without the fleet key: an unauthenticated HELLO gets the
version, ABI and datagram size a link check needs and the query nonce, nothing else
(no duck id, memory, cache or session); so does a MACed HELLO that names no query
nonce (ABI 8); STATS and CACHE_QUERY without a MAC get no answer and are counted as
unauthenticated. The fleet (with the key and the nonce) still sees everything."""
from __future__ import annotations

import socket

from native._native import ffi, lib
from tests.firmware.test_malformed import exchange
from tests.firmware.test_wire import seal
from tests.transport.ducks import Ducks


def _hello_reply(body: bytes):
    hr = ffi.new("wire_hello_reply *")
    ffi.memmove(hr, body, ffi.sizeof("wire_hello_reply"))
    return hr


def test_an_unauthenticated_hello_reveals_nothing_but_the_link_check(tmp_path):
    with Ducks(1, tmp_path) as ducks:
        full = ducks.fleet.hello()[0]
        session = ducks.fleet.open_session({0: [[]]}, 64)
        port = ducks[0].address[1]
        status, body, _ = exchange(port, seal(b"", None, mtype=lib.WIRE_T_HELLO, sequence=901), ducks.key)
        hr = _hello_reply(body)
        assert status == lib.WIRE_OK and hr.abi == lib.WIRE_ABI and hr.mtu == full.mtu
        assert hr.max_tokens == full.max_tokens and hr.fw_version
        assert (hr.session, hr.duck_id, hr.mem_bytes, hr.cache_entries, hr.cache_bytes, hr.cores) == (0, 0, 0, 0, 0, 0)
        assert not hr.flags & lib.WIRE_HELLO_FULL and bytes(hr.challenge) == bytes(16) and any(hr.query)
        query = bytes(hr.query)
        status, body, _ = exchange(port, seal(b"", ducks.key, mtype=lib.WIRE_T_HELLO, sequence=902), ducks.key)
        bare = _hello_reply(body)   # the key but no query nonce: what anyone gets, and the nonce
        assert status == lib.WIRE_OK and (bare.session, bare.duck_id, bytes(bare.query)) == (0, 0, query)
        status, body, _ = exchange(port, seal(query, ducks.key, mtype=lib.WIRE_T_HELLO, sequence=904), ducks.key)
        hr = _hello_reply(body)
        assert status == lib.WIRE_OK and hr.session == session.id and hr.flags & lib.WIRE_HELLO_FULL   # everything
        before = ducks.fleet.stats()[0]["unauthenticated"]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.5)
            for i, mtype in enumerate((lib.WIRE_T_STATS, lib.WIRE_T_CACHE_QUERY)):
                s.sendto(seal(b"\0" * 4, None, mtype=mtype, sequence=905 + i), ("127.0.0.1", port))
                try:
                    s.recv(65535)
                    raise AssertionError(f"type {mtype} without a MAC was answered")
                except socket.timeout:
                    pass
        assert ducks.fleet.stats()[0]["unauthenticated"] == before + 2
        session.close()
