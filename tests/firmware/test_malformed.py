"""Hostile datagrams to the ASan/UBSan build of duckfw: truncated, oversized,
garbage, forged (wrong key, missing MAC), replies and broken fragments.
The duck must keep serving, count each refusal, and end with no sanitizer
report (leaks included) when stopped."""
import os
import socket

import numpy as np
import pytest

from native._native import lib
from native.transport import DuckError, split_experts
from tests.firmware.test_wire import seal
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
    with pytest.raises(DuckError, match="not in the cache"):
        from native.fp9 import Fp9Tensor
        stranger = Fp9Tensor.from_float(np.ones((128, hidden), np.float32))
        bogus = [[type(per_duck[0][0])(stranger, per_duck[0][0].down)]]
        fleet.open_session({0: bogus}, hidden, session_id=session.id)
    session.close()
    assert fleet.stats()[0]["errors"] >= 3


def test_no_sanitizer_report_after_clean_stop(asan_duck):
    duck = asan_duck[0]
    asan_duck.fleet.hello()
    rc = duck.stop()
    report = sanitizer_report(duck.log())
    assert rc == 0 and not report, "\n".join(report) or duck.log()[-3000:]
    duck.start()      # the module fixture's teardown stops it again
