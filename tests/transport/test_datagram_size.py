"""The datagram size agreed with each duck at hello, with real ducks: 64 KiB
on loopback (one datagram per layer and duck each way), the fleet's ceiling
and the duck's own --mtu respected, the reply cut to what the host states;
a size the path drops (a relay standing for a smaller MTU) is found at
hello or mid-run and falls back to 1500 within the deadline, never hangs.
And the retransmit timer, which follows a slow duck's round trip."""
import logging
import time

import numpy as np
import pytest

from native._native import lib
from native.transport import Fleet, split_experts
from native.transport.session import BF16, F32, forward_plan
from tests.transport.ducks import Ducks
from tests.transport.relay import Relay
from tests.transport.test_forward import flat, local_reference, make_layer, routing

NO_EXPERT = (np.full((1, 1), -1, np.int32), np.zeros((1, 1), np.float32))


def one_layer(rng, n_ducks, hidden, n_experts=2):
    return split_experts(make_layer(rng, n_experts, 64 * n_ducks, hidden), tp=n_ducks)


def datagrams(fleet: Fleet, fn) -> tuple[int, int]:
    """(sent, received) by the host while fn runs."""
    before = fleet.transport_stats()
    fn()
    after = fleet.transport_stats()
    return after["datagrams_tx"] - before["datagrams_tx"], after["datagrams_rx"] - before["datagrams_rx"]


def test_loopback_carries_a_layer_in_one_datagram_each_way(tmp_path):
    rng = np.random.default_rng(1)
    n, hidden = 2, 7168
    per_duck = one_layer(rng, n, hidden)
    x = (rng.standard_normal((1, hidden)) * 0.1).astype(np.float32)
    ids, w = routing(rng, 1, 2, 2)
    with Ducks(n, tmp_path, twice=-1) as ducks:   # datagrams counted: no decode forward sent twice
        infos = ducks.fleet.hello()
        assert [i.mtu for i in infos] == [65535] * n and "mtu 65535 of lo" in ducks[0].log()
        assert ducks.fleet.datagram_sizes() == [65535] * n
        assert datagrams(ducks.fleet, ducks.fleet.hello) == (n, n)          # proven once: no second probe
        assert lib.duck_transport_path_mtu(ducks.fleet._t, 0) >= 65535        # the route: IP_MTU
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        y = session.forward(0, x, ids, w)     # 28 KB out and back per duck
        assert datagrams(ducks.fleet, lambda: session.forward(0, x, ids, w)) == (n, n)
        assert np.array_equal(y, local_reference(per_duck, hidden, x, ids, w))
        # a ceiling of 1500: the fragments of an Ethernet path, both ways, and the same bits
        with Fleet([d.address for d in ducks.ducks], ducks.key, mtu=1500, twice=-1) as narrow:
            narrow.hello()
            assert narrow.datagram_sizes() == [1500] * n
            s2 = narrow.open_session({0: per_duck}, hidden)
            frags = -(-(16 + 8 * 2 + 4 * hidden) // (1500 - 76))          # 21
            assert datagrams(narrow, lambda: s2.forward(0, x, ids, w)) == (n * frags, n * frags)
            assert np.array_equal(s2.forward(0, x, ids, w), y)


def test_the_duck_announces_its_own_size(tmp_path):
    rng = np.random.default_rng(2)
    hidden = 7168
    per_duck = one_layer(rng, 1, hidden, n_experts=1)
    with Ducks(1, tmp_path, args=["--mtu", "9000"], twice=-1) as ducks:
        assert ducks.fleet.hello()[0].mtu == 9000 and ducks.fleet.datagram_sizes() == [9000]
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        x = np.ones((1, hidden), np.float32)
        frags = -(-(8 + 32 + 4 * hidden) // (9000 - 76))                     # 4
        assert datagrams(ducks.fleet, lambda: session.forward(0, x, [[0]], [[1.0]])) == (frags, frags)


def test_a_size_the_path_drops_falls_back_at_hello(tmp_path, caplog):
    with Ducks(1, tmp_path) as ducks, Relay(ducks[0].address, to_duck=1500, to_host=1500) as path:
        with Fleet([path.address], ducks.key, deadline_ms=400) as fleet, caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            assert fleet.hello()[0].mtu == 65535
            elapsed = time.monotonic() - t0
            assert fleet.datagram_sizes() == [1500]
            assert 0.1 <= elapsed < 0.4, elapsed                    # a quarter of the deadline, not all of it
            assert "datagrams of 65535 bytes did not get through" in caplog.text
            assert fleet.transport_stats()["mtu_fallbacks"] == 1 and path.dropped["to_duck"] >= 1
            session = fleet.open_session({0: [[]]}, 7168)
            assert not session.forward(0, np.ones((1, 7168), np.float32), *NO_EXPERT).any()


@pytest.mark.parametrize("way", ["to_duck", "to_host"])
def test_a_route_that_shrinks_mid_run_falls_back_within_the_deadline(tmp_path, caplog, way):
    rng = np.random.default_rng(3)
    hidden, deadline_ms = 1024, 1000             # 4 KB out, 4 KB back: above 1500 both ways
    per_duck = one_layer(rng, 1, hidden)
    x = (rng.standard_normal((1, hidden)) * 0.1).astype(np.float32)
    ids, w = routing(rng, 1, 2, 2)
    with Ducks(1, tmp_path) as ducks, Relay(ducks[0].address) as path:
        with Fleet([path.address], ducks.key, deadline_ms=deadline_ms) as fleet:
            fleet.upload(flat(per_duck))
            session = fleet.open_session({0: per_duck}, hidden)
            assert fleet.datagram_sizes() == [65535]
            y = session.forward(0, x, ids, w)
            setattr(path, way, 1500)
            with caplog.at_level(logging.WARNING):
                t0 = time.monotonic()
                y2 = session.forward(0, x, ids, w)
                elapsed = time.monotonic() - t0
            assert np.array_equal(y, y2) and fleet.datagram_sizes() == [1500]
            assert deadline_ms / 4000 <= elapsed < deadline_ms / 1000, elapsed
            assert path.dropped[way] > 0 and "fell back" in caplog.text
            t0 = time.monotonic()
            assert np.array_equal(session.forward(0, x, ids, w), y)
            assert time.monotonic() - t0 < deadline_ms / 4000       # no second fallback


def test_receive_buffer_and_datagram_size_bound_the_requests():
    """The cut of a forward (nothing sent): every duck's replies to the requests in
    flight fit half the receive buffer; a request and its reply fit WIRE_MAX_FRAGMENTS
    datagrams of the agreed size and of the fallback size (a NACK names every fragment
    of a message that falls back: ~11.6 MB, whatever the path); requests are
    made even; fewer in flight before fewer tokens per request."""
    key = bytes(range(32))
    addresses = [("127.0.0.1", 9)] * 8
    with Fleet(addresses, key) as fleet:
        room = lib.duck_transport_rcvbuf(fleet._t) // 2
        plan = forward_plan(fleet, 4096, 7168)
        assert plan["request_tokens"] == lib.WIRE_TOKENS_DEFAULT and plan["requests"] == 4096 // lib.WIRE_TOKENS_DEFAULT
        assert plan["pipeline"] * 8 * (64 + 64 * 7168 * 4) <= room and not plan["rcvbuf_short"]
        assert forward_plan(fleet, 100, 64)["request_tokens"] == 50          # 100 at 64: 50 + 50
        assert forward_plan(fleet, 100, 64, request_tokens=7)["requests"] == 15
        assert forward_plan(fleet, 1, 64, pipeline=4)["pipeline"] == 1
        assert forward_plan(fleet, 4096, 64, request_tokens=1024)["request_tokens"] == 1024   # ducks that take 1024
        assert forward_plan(fleet, 9000, 64, request_tokens=10000)["requests"] == 3   # 4096 at most: 3 x 3000
    with Fleet(addresses[:1], key) as one:                                   # 256 KiB per token each way
        assert one.datagram_sizes() == [lib.WIRE_MTU_DEFAULT]
        fits = (lib.WIRE_MAX_FRAGMENTS * (1500 - 28 - 32 - 16) - 64) // (65536 * 4)   # 51 tokens in 13.5 MB
        assert forward_plan(one, 64, 65536)["request_tokens"] == -(-64 // -(-64 // fits)) == 32
        lib.duck_transport_agree(one._t, 0, 65535)                           # loopback datagrams, and yet:
        assert forward_plan(one, 64, 65536)["request_tokens"] == 32          # a message must fit the fallback size
    with Fleet(addresses, key, rcvbuf=1 << 20) as small:
        room = lib.duck_transport_rcvbuf(small._t) // 2
        plan = forward_plan(small, 256, 7168, pipeline=2)
        assert plan["pipeline"] == 1 and 8 * (64 + plan["request_tokens"] * 7168 * 4) <= room
        assert forward_plan(small, 256, 7168, y_dtype=BF16)["request_tokens"] >= 2 * plan["request_tokens"] - 1
        assert forward_plan(small, 1, 65536)["rcvbuf_short"]                  # warned about by Session.forward


def test_retransmit_timer_learns_a_slow_duck(tmp_path):
    """A duck that takes 30 ms for every request: the first calls retransmit while
    the timer sits at its 5 ms floor; once its round trips are seen, none do."""
    slow = ["--enable-fault-injection", "--delay-us", "30000"]
    with Ducks(1, tmp_path, args=slow, retransmit_ms=5, deadline_ms=3000) as ducks:
        fleet = ducks.fleet
        assert lib.duck_transport_rto_us(fleet._t, 0) == 5000          # nothing measured yet
        fleet.hello()
        assert fleet.transport_stats()["retransmits"] > 0
        session = fleet.open_session({0: [[]]}, 128)
        assert lib.duck_transport_rto_us(fleet._t, 0) >= 30000
        before = fleet.transport_stats()["retransmits"]
        for _ in range(5):
            session.forward(0, np.ones((1, 128), np.float32), *NO_EXPERT)
        assert fleet.transport_stats()["retransmits"] == before and session.retransmits == 0


def test_a_resend_that_comes_before_the_reply_is_no_drop(tmp_path):
    """A duck that takes 40 ms per request, a host whose timer is capped at 30 ms (a quarter of
    its 120 ms deadline): the uploads' RESENDs come while the duck still works. The duck counts
    them as early_resends, not as drops (stale): duckctl status shows no errors for them. (At
    20 and 60 ms a 2-core machine busy with the rest of the suite once stalled the duck's reply
    past the deadline.)"""
    from native.fp9 import Fp9Tensor
    from native.transport.upload import upload

    slow = ["--enable-fault-injection", "--delay-us", "40000"]
    with Ducks(1, tmp_path, args=slow, retransmit_ms=2, deadline_ms=120) as ducks:
        fleet = ducks.fleet
        fleet.hello()
        t = Fp9Tensor.from_float(np.random.default_rng(0).standard_normal((1024, 2048)).astype(np.float32), "w")
        assert upload(fleet, [[t]])["uploaded"] == 1
        assert fleet.transport_stats()["resend_requests"] > 0
        duck = fleet.stats()[0]
        assert duck["early_resends"] > 0 and duck["stale"] == 0, duck
