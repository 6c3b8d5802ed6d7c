"""Hostile datagrams to the ASan/UBSan build of duckfw: truncated, oversized,
garbage, forged (wrong key, missing MAC), replies and broken fragments, and
bad values in the fields of wire ABI 3 (partial dtype, reply datagram size,
ping sizes), and ABI 6's forwards held for one pass (WIRE_FWD_HOLD). Wire ABI 4 (messages of up to WIRE_MAX_MESSAGE, each duck's
tokens per forward in HELLO): a forward of more tokens than the duck announced,
or than the wire allows, gets an error that says so, and so does a malformed
multi-megabyte forward; a large message that is not a forward of the open
session is dropped at its first fragment; a flood of first fragments that
claim 64 MiB messages stays within the reassembly budget (firmware/reasm.c).
The duck must keep serving, count each refusal, and end with no sanitizer
report (leaks included) when stopped."""
import os
import socket

import numpy as np
import pytest

from native._native import ffi, lib
from native.kernels import MAX_TOKENS as KERNEL_MAX_TOKENS
from native.transport import DuckError, split_experts
from tests.firmware.test_wire import seal, wire_key
from tests.transport.ducks import Ducks, sanitizer_binary, sanitizer_report


@pytest.fixture(scope="module")
def asan_duck(tmp_path_factory):
    with Ducks(1, tmp_path_factory.mktemp("asan"), binary=sanitizer_binary(), deadline_ms=5000) as ducks:
        yield ducks


def blast(port: int, datagrams) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in datagrams:
            s.sendto(d, ("127.0.0.1", port))


def test_hostile_datagrams_are_counted_and_dropped(asan_duck):
    fleet, duck = asan_duck.fleet, asan_duck[0]
    before = fleet.stats()[0]
    rng = np.random.default_rng(7)
    key = asan_duck.key
    good = seal(b"\0" * 8, key)
    truncated = [good[:n] for n in (0, 1, 16, 31, 33, len(good) - 1)]
    oversized = [os.urandom(60000), good[:32] + os.urandom(20000)]
    garbage = [rng.integers(0, 256, int(rng.integers(1, 1500)), dtype=np.uint8).tobytes() for _ in range(50)]
    broken_fragments = [seal(b"p" * 8, key, frag_index=2, frag_count=2), seal(b"p" * 8, key, frag_count=3, total=99)]
    blast(duck.port, truncated[1:] + oversized + garbage + broken_fragments)
    blast(duck.port, [b""])   # a zero-length datagram
    # forged: control messages with another key, or without any MAC
    forged = [seal(b"\0" * 8, os.urandom(32), mtype=lib.WIRE_T_SHUTDOWN),
              seal(b"\0" * 24, os.urandom(32), mtype=lib.WIRE_T_CACHE_INVALIDATE)]
    unsigned = [seal(b"\0" * 8, None, mtype=lib.WIRE_T_SHUTDOWN), seal(b"\0" * 8, None, mtype=lib.WIRE_T_SESSION_OPEN)]
    reply = [seal(b"\0" * 8, key, flags=lib.WIRE_F_REPLY)]
    blast(duck.port, forged + unsigned + reply)

    info = fleet.hello()[0]            # still serving, and the shutdown was not obeyed
    assert info.duck_id == 0
    after = fleet.stats()[0]
    n_malformed = len(truncated) + len(oversized) + len(garbage) + len(broken_fragments) + len(reply)
    assert after["malformed"] - before["malformed"] >= n_malformed - 5   # a garbage blob may be counted as MAC
    assert after["unauthenticated"] - before["unauthenticated"] >= len(forged) + len(unsigned)
    assert duck.proc.poll() is None


def test_bad_requests_get_clear_errors_and_the_duck_serves_on(asan_duck):
    fleet = asan_duck.fleet
    hidden = 256
    rng = np.random.default_rng(3)
    experts = [(rng.standard_normal((64, hidden)).astype(np.float32), rng.standard_normal((64, hidden)).astype(np.float32),
                rng.standard_normal((hidden, 64)).astype(np.float32)) for _ in range(2)]
    per_duck = split_experts(experts, tp=1)
    fleet.upload([[t for e in per_duck[0] for t in (e.gate_up, e.down)]])
    session = fleet.open_session({3: per_duck}, hidden)
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    with pytest.raises(DuckError, match="layer 9 has no plan"):
        session.forward(9, x, [[0], [1]], [[1.0], [1.0]])
    with pytest.raises(DuckError, match="expert id 5 out of range"):
        session.forward(3, x, [[5], [1]], [[1.0], [1.0]])
    y = session.forward(3, x, [[0, 1], [1, -1]], [[0.5, 0.5], [1.0, 0.0]])   # the compute path under ASan
    assert np.isfinite(y).all() and np.abs(y).max() > 0
    yb = session.forward(3, x, [[0, 1], [1, -1]], [[0.5, 0.5], [1.0, 0.0]], out=np.empty((2, hidden), np.uint16))
    assert np.abs((yb.astype(np.uint32) << 16).view(np.float32) - y).max() <= np.abs(y).max() * 2.0 ** -8
    with pytest.raises(DuckError, match="not in the cache"):
        from native.fp9 import Fp9Tensor
        stranger = Fp9Tensor.from_float(np.ones((128, hidden), np.float32))
        bogus = [[type(per_duck[0][0])(stranger, per_duck[0][0].down)]]
        fleet.open_session({0: bogus}, hidden, session_id=session.id)
    session.close()
    assert fleet.stats()[0]["errors"] >= 3


def exchange(port: int, dgram: bytes | list[bytes], key) -> tuple[int, bytes, list[int]]:
    """Sends one datagram (or a message's fragments), gathers the reply's fragments:
    (status, body, datagram sizes). key: the fleet key, or a wire_key with the link
    (Fleet.link_key) for the replies of state-changing messages and forwards."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(2.0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        for d in [dgram] if isinstance(dgram, bytes) else dgram:
            s.sendto(d, ("127.0.0.1", port))
        parts, sizes = {}, []
        while True:
            data = s.recv(65535)
            h = ffi.new("wire_header *")
            p = ffi.new("const uint8_t **")
            assert lib.wire_check(data, len(data), wire_key(key), 0, h, p) == lib.WIRE_CHECK_OK
            sizes.append(len(data) + lib.WIRE_IP_UDP_BYTES)
            parts[h.frag_index] = data[32:32 + h.payload_len]
            if len(parts) == h.frag_count:
                break
    payload = b"".join(parts[i] for i in range(len(parts)))
    return int.from_bytes(payload[:4], "little", signed=True), payload[8:], sizes


def ping(size: int, reply_mtu: int) -> bytes:
    p = ffi.new("wire_ping *")
    p.reply_mtu = reply_mtu
    head = bytes(ffi.buffer(p))
    return head + os.urandom(max(0, size - len(head)))


def forward_payload(hidden=64, ntok=1, x_dtype=0, y_dtype=0, flags=0, reply_mtu=0, layer=0) -> bytes:
    f = ffi.new("wire_forward *")
    f.layer, f.ntok, f.topk, f.x_dtype, f.hidden, f.y_dtype, f.reply_mtu = layer, ntok, 1, x_dtype, hidden, y_dtype, reply_mtu
    f.flags = flags
    head = bytearray(ffi.buffer(f))
    xsize = 2 if x_dtype == 1 else 4
    return bytes(head) + (-1).to_bytes(4, "little", signed=True) * ntok + bytes(4 * ntok) + bytes(xsize * ntok * hidden)


def test_new_fields_are_checked_and_replies_keep_to_the_stated_size(asan_duck):
    """ABI 3: a forward's partial dtype, reserved byte and reply datagram size, a
    ping's size and echo: refused by name when wrong; replies cut as stated."""
    fleet, duck, key = asan_duck.fleet, asan_duck[0], asan_duck.key
    session = fleet.open_session({0: [[]]}, 64)
    lk = fleet.link_key(0)   # forwards carry the link MAC, each under a sequence of its own
    errors = fleet.stats()[0]["errors"]
    for payload, text in [(forward_payload(y_dtype=2), "dtype 0 -> 2"),
                          (forward_payload(flags=2), "flags 2"),
                          (forward_payload(reply_mtu=100), "reply datagrams 100"),
                          (forward_payload(x_dtype=3), "dtype 3 -> 0")]:
        status, body, _ = exchange(duck.port, seal(payload, lk, mtype=lib.WIRE_T_FORWARD, session=session.id,
                                                   sequence=fleet.take_sequence()), lk)
        assert status == lib.WIRE_E_MALFORMED and text in body.decode(), body
    status, body, _ = exchange(duck.port, seal(forward_payload(ntok=3, y_dtype=1, reply_mtu=1280), lk,
                                               mtype=lib.WIRE_T_FORWARD, session=session.id,
                                               sequence=fleet.take_sequence()), lk)
    assert status == 0 and len(body) == ffi.sizeof("wire_forward_reply")        # nothing routed: R_ZERO
    for payload, text in [(bytes(8), "ping payload is 8 bytes, expected 16..65535"),
                          (ping(64, 1000), "below the minimum 1280")]:
        status, body, _ = exchange(duck.port, seal(payload, key), key)
        assert status == lib.WIRE_E_MALFORMED and text in body.decode(), body
    for size, reply_mtu, limit, count in [(5000, 1280, 1280, 5), (5000, 0, 1500, 4), (60000, 65535, 65535, 1),
                                          (60000, 9000, 9000, 7)]:
        payload = ping(size, reply_mtu)
        status, body, sizes = exchange(duck.port, seal(payload, key), key)
        assert status == 0 and body == payload
        assert max(sizes) <= limit and len(sizes) == count, (size, reply_mtu, sizes)
    with pytest.raises(DuckError, match="ping payload is 70000 bytes"):
        fleet.call([(0, lib.WIRE_T_PING, ping(70000, 0), 70000)])
    assert fleet.stats()[0]["errors"] - errors == 7
    assert duck.proc.poll() is None
    session.close()


FRAGMENT = 60000          # payload bytes per datagram, below loopback's 65459
CONTROL_MESSAGE_MAX = 2 << 20   # firmware/duckfw.h: larger messages must be forwards of the open session


def fragments(payload: bytes, key, mtype: int, session: int, sequence: int, total: int | None = None,
              count: int | None = None, only: range | None = None) -> list[bytes]:
    """A message cut as the wire cuts it (every fragment but the last ceil(total / count)
    bytes); total and count may claim more than the payload holds (only: which to make)."""
    total = len(payload) if total is None else total
    count = count or -(-total // FRAGMENT)
    size = -(-total // count)
    return [seal(payload[i * size:(i + 1) * size], key, mtype=mtype, frag_index=i, frag_count=count, total=total,
                 session=session, sequence=sequence) for i in (only or range(count))]


def replies(s: socket.socket, key, wait: float) -> dict[int, tuple[int, bytes]]:
    """Every one-datagram reply that reaches s within wait seconds: {sequence: (status, body)}."""
    out, s_timeout = {}, s.gettimeout()
    s.settimeout(wait)
    try:
        while True:
            data = s.recv(65535)
            h, p = ffi.new("wire_header *"), ffi.new("const uint8_t **")
            assert lib.wire_check(data, len(data), wire_key(key), 0, h, p) == lib.WIRE_CHECK_OK
            assert h.frag_count == 1
            body = data[32:32 + h.payload_len]
            out[h.sequence] = (int.from_bytes(body[:4], "little", signed=True), body[8:])
    except TimeoutError:
        return out
    finally:
        s.settimeout(s_timeout)


def test_held_forwards_are_answered_with_their_pass(asan_duck):
    """ABI 6: a forward flagged HOLD gets no reply until one of its layer without the flag
    comes; then both are answered (each its own sequence) from one pass. A copy of a held
    forward (its host still waits: the group's last request was lost or came first) runs
    what is held at once; so does a forward of another layer. A flag the ABI does not
    know is malformed (test above)."""
    fleet, duck = asan_duck.fleet, asan_duck[0]
    session = fleet.open_session({0: [[]], 1: [[]]}, 64)
    lk = fleet.link_key(0)
    before = fleet.stats()[0]

    def send(s, payload, seq=None):
        seq = seq or fleet.take_sequence()
        s.sendto(seal(payload, lk, mtype=lib.WIRE_T_FORWARD, session=session.id, sequence=seq),
                 ("127.0.0.1", duck.port))
        return seq

    def groups(got):
        assert all(status == 0 for status, _ in got.values()), got
        return {seq: tuple(getattr(ffi.cast("wire_forward_reply *", ffi.from_buffer(body)), n)
                           for n in ("layer", "ntok", "group_ntok")) for seq, (_, body) in got.items()}

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        held = send(s, forward_payload(ntok=2, flags=lib.WIRE_FWD_HOLD))
        assert replies(s, lk, 0.3) == {}                                   # held: no answer yet
        last = send(s, forward_payload(ntok=3))
        assert groups(replies(s, lk, 1.0)) == {held: (0, 2, 5), last: (0, 3, 5)}   # one pass over 5 tokens
        lone = send(s, forward_payload(ntok=2, flags=lib.WIRE_FWD_HOLD))
        assert replies(s, lk, 0.3) == {}
        send(s, forward_payload(ntok=2, flags=lib.WIRE_FWD_HOLD), seq=lone)   # its copy: the pass runs now
        assert groups(replies(s, lk, 1.0)) == {lone: (0, 2, 2)}
        other = send(s, forward_payload(ntok=1, flags=lib.WIRE_FWD_HOLD))   # layer 0, held
        layer1 = send(s, forward_payload(ntok=4, layer=1))                  # another layer: the held one alone first
        assert groups(replies(s, lk, 1.0)) == {other: (0, 1, 1), layer1: (1, 4, 4)}
    after = fleet.stats()[0]
    assert after["duplicates"] - before["duplicates"] >= 1 and after["forwards"] - before["forwards"] == 5


def test_hello_announces_the_kernels_limit_and_more_tokens_are_refused(asan_duck):
    fleet, duck = asan_duck.fleet, asan_duck[0]
    assert fleet.hello()[0].max_tokens == KERNEL_MAX_TOKENS
    session = fleet.open_session({0: [[]]}, 64)
    try:
        assert session.duck_max_tokens == KERNEL_MAX_TOKENS
        lk = fleet.link_key(0)
        over = seal(forward_payload(hidden=1, ntok=KERNEL_MAX_TOKENS + 1), lk, mtype=lib.WIRE_T_FORWARD,
                    session=session.id, sequence=fleet.take_sequence())   # hidden 1: one datagram; tokens first
        status, body, _ = exchange(duck.port, over, lk)
        assert status == lib.WIRE_E_RANGE, body
        assert f"forward of {KERNEL_MAX_TOKENS + 1} tokens: this duck takes at most {KERNEL_MAX_TOKENS}" in body.decode()
        beyond = seal(forward_payload(hidden=1, ntok=lib.WIRE_MAX_TOKENS + 1), lk, mtype=lib.WIRE_T_FORWARD,
                      session=session.id, sequence=fleet.take_sequence())
        status, body, _ = exchange(duck.port, beyond, lk)
        assert status == lib.WIRE_E_MALFORMED and f"(at most {lib.WIRE_MAX_TOKENS})" in body.decode(), body
        # the host's session cuts a forward by the announced limit, however many tokens it is given
        session.request_tokens = 10 * KERNEL_MAX_TOKENS
        x = np.ones((3 * KERNEL_MAX_TOKENS, 64), np.float32)
        session.forward(0, x, np.full((len(x), 1), -1, np.int32), np.zeros((len(x), 1), np.float32))
        assert (session.last_requests, session.last_request_tokens) == (3, KERNEL_MAX_TOKENS)
    finally:
        session.close()


def test_a_malformed_large_forward_gets_an_error(asan_duck):
    """3 MB in 53 datagrams that claim 64 tokens of hidden 8192 but hold 3 bytes too many."""
    fleet, duck = asan_duck.fleet, asan_duck[0]
    session = fleet.open_session({0: [[]]}, 8192)
    try:
        errors = fleet.stats()[0]["errors"]
        payload = forward_payload(hidden=8192, ntok=64) + b"xyz"
        assert len(payload) > CONTROL_MESSAGE_MAX
        lk = fleet.link_key(0)
        status, body, _ = exchange(duck.port, fragments(payload, lk, lib.WIRE_T_FORWARD, session.id,
                                                        fleet.take_sequence()), lk)
        assert status == lib.WIRE_E_MALFORMED and "does not match ntok 64" in body.decode(), body
        assert fleet.stats()[0]["errors"] == errors + 1
    finally:
        session.close()


def test_large_messages_that_are_not_forwards_of_the_open_session_are_dropped_at_once(asan_duck):
    fleet, duck = asan_duck.fleet, asan_duck[0]
    session = fleet.open_session({0: [[]]}, 64)
    try:
        before = fleet.stats()[0]
        big = CONTROL_MESSAGE_MAX + 1
        lk = fleet.link_key(0)
        first = [fragments(b"\0" * FRAGMENT, lk, lib.WIRE_T_UPLOAD, 0, fleet.take_sequence(), total=big,
                           only=range(1))[0],
                 fragments(b"\0" * FRAGMENT, None, lib.WIRE_T_PING, 0, 2002, total=big, only=range(1))[0],
                 fragments(b"\0" * FRAGMENT, lk, lib.WIRE_T_FORWARD, session.id ^ 1, fleet.take_sequence(),
                           total=big, only=range(1))[0]]
        blast(duck.port, first)
        fleet.hello()
        after = fleet.stats()[0]
        assert after["malformed"] - before["malformed"] == len(first)
        assert after["stale"] == before["stale"]          # nothing was held, so nothing was evicted
    finally:
        session.close()


def test_a_flood_of_huge_claims_stays_within_the_reassembly_budget(asan_duck):
    """First fragments of 64 forwards of the open session, each claiming a 64 MiB message:
    the duck holds at most REASM_BUDGET (2 x 64 MiB) of them, drops the oldest (counted as
    stale), and still answers a real forward afterwards, and a large one in full."""
    fleet, duck = asan_duck.fleet, asan_duck[0]
    hidden = 4096
    session = fleet.open_session({0: [[]]}, hidden)
    try:
        before = fleet.stats()[0]
        lk = fleet.link_key(0)   # authentic fragments: a forged one is dropped before reassembly
        claims = [fragments(b"\0" * FRAGMENT, lk, lib.WIRE_T_FORWARD, session.id, fleet.take_sequence(),
                            total=lib.WIRE_MAX_MESSAGE, only=range(1))[0] for i in range(64)]
        blast(duck.port, claims)
        fleet.hello()
        after = fleet.stats()[0]
        assert after["stale"] - before["stale"] >= 64 - 4      # REASM_SLOTS at most are kept
        rss_kib = int(next(line.split()[1] for line in open(f"/proc/{duck.proc.pid}/status")
                           if line.startswith("VmRSS")))
        assert rss_kib < 1 << 20, f"duck holds {rss_kib} KiB after the flood"
        x = np.ones((64, hidden), np.float32)    # 1 MiB each way: 17 datagrams
        y = session.forward(0, x, np.full((len(x), 1), -1, np.int32), np.zeros((len(x), 1), np.float32))
        assert np.array_equal(y, np.zeros_like(x))
        assert duck.proc.poll() is None
    finally:
        session.close()


def test_no_sanitizer_report_after_clean_stop(asan_duck):
    duck = asan_duck[0]
    asan_duck.fleet.hello()
    rc = duck.stop()
    report = sanitizer_report(duck.log())
    assert rc == 0 and not report, "\n".join(report) or duck.log()[-3000:]
    duck.start()      # the module fixture's teardown stops it again
