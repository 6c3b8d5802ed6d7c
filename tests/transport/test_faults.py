"""Faults with real ducks: 5 % datagram loss in both directions gives the same
outputs; a duck killed with SIGKILL mid-forward is named within the failure
deadline and the fleet recovers once it is back; a dead address is named."""
import os
import socket
import threading
import time

import numpy as np
import pytest

from native._native import lib
from native.transport import DuckError, DuckTimeout, Fleet, split_experts
from tests.transport.ducks import Ducks, sanitizer_binary, sanitizer_report
from tests.transport.test_forward import (SUMMATION_ORDER_RTOL, assert_close, flat, local_reference, make_layer,
                                          routing)


@pytest.mark.parametrize("build", ["release", "asan"])
def test_five_percent_loss_gives_the_same_outputs(tmp_path, build):
    """Reassembly, RESEND and NACK under loss; the ASan/UBSan build runs it too. The 160-token
    forwards (640 KiB each way per duck) go through the helper threads of the host and of the
    ducks (two workers each): sealed, checked, resent and summed there under loss too."""
    rng = np.random.default_rng(21)
    n, hidden, n_experts = 3, 1024, 4
    experts = make_layer(rng, n_experts, 64 * n, hidden)
    per_duck = split_experts(experts, tp=n)
    lossy = {i: ["--enable-fault-injection", "--drop-rate", "0.05", "--fault-seed", str(i + 1), "--threads", "2"]
             for i in range(n)}
    binary = sanitizer_binary() if build == "asan" else None
    with Ducks(n, tmp_path, binary=binary, per_duck_args=lossy, retransmit_ms=5, deadline_ms=5000) as ducks:
        assert all(info.fault_injection for info in ducks.fleet.hello())
        ducks.fleet.upload(flat(per_duck))                 # 100+ fragments per part: NACK/RESEND paths
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        for step, ntok in enumerate([1, 8, 1, 33, 160, 1, 8] * 3):
            x = (rng.standard_normal((ntok, hidden)) * 0.1).astype(np.float32)
            ids, w = routing(rng, ntok, 2, n_experts)
            y = session.forward(0, x, ids, w)
            assert_close(y, local_reference(per_duck, hidden, x, ids, w), SUMMATION_ORDER_RTOL, f"step {step}")
        stats = ducks.fleet.stats()
        assert all(s["injected_drops"] > 0 for s in stats)
        assert sum(s["resends"] + s["duplicates"] for s in stats) > 0
        t = ducks.fleet.transport_stats()
        assert t["retransmits"] > 0 and t["timeouts"] == 0 and t["nacks"] > 0
        # a call silent after most of its step's ducks answered is retransmitted before its timer
        assert 0 < t["early_retransmits"] <= t["retransmits"], t
        assert ducks.fleet.workers > 1 or len(os.sched_getaffinity(0)) == 1
    for duck in ducks.ducks:
        assert not sanitizer_report(duck.log()), duck.log()[-3000:]


def test_kill9_mid_forward_names_the_duck_within_the_deadline(tmp_path):
    hidden, deadline_ms = 256, 1000
    slow = {1: ["--enable-fault-injection", "--delay-us", "200000"]}    # its forwards are in flight a while
    with Ducks(3, tmp_path, per_duck_args=slow, retransmit_ms=20, deadline_ms=deadline_ms) as ducks:
        session = ducks.fleet.open_session({0: [[], [], []]}, hidden)   # no experts: overhead only
        x = np.ones((1, hidden), np.float32)
        no_expert = (np.full((1, 1), -1, np.int32), np.zeros((1, 1), np.float32))
        assert not session.forward(0, x, *no_expert).any()
        killer = threading.Timer(0.1, ducks[1].kill9)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(DuckTimeout, match=r"duck 1 .*127\.0\.0\.1:\d+.* did not answer forward") as e:
            session.forward(0, x, *no_expert)
        elapsed = time.monotonic() - t0
        killer.join()
        assert e.value.duck == 1
        assert deadline_ms / 1000 <= elapsed <= deadline_ms / 1000 + 0.5, elapsed

        ducks[1].start()                                   # same port, same cache dir
        # recovery is not about timing: a patient fleet, so a loaded CI machine cannot fail it
        fleet = Fleet([d.address for d in ducks.ducks], ducks.key, retransmit_ms=50, deadline_ms=10000)
        fleet.hello()
        with pytest.raises(DuckError, match="duck 1 .*no open session"):
            session.fleet = fleet
            session.forward(0, x, *no_expert)
        session = fleet.open_session({0: [[], [], []]}, hidden)
        assert not session.forward(0, x, *no_expert).any()
        fleet.close()


def test_silent_address_is_named(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:   # bound, never answers
        s.bind(("127.0.0.1", 0))
        fleet = Fleet([s.getsockname()], b"k" * 32, retransmit_ms=20, deadline_ms=300)
        t0 = time.monotonic()
        with pytest.raises(DuckTimeout, match=r"duck 0 \(127\.0\.0\.1:\d+\) did not answer hello within 300 ms"):
            fleet.hello()
        assert time.monotonic() - t0 < 0.8
        fleet.close()


def test_the_retransmit_timer_does_not_climb_on_a_lossy_link(tmp_path):
    """5 % loss and forwards of ten 64 KB fragments each way: most calls retransmit. Karn's floor
    (the interval a retransmitted call completed in) is bounded by twice the measured timer, so
    the timer stays near the link's round trip; bounded by twice the timer each call started
    with, it compounded call after call up to its ceiling, a quarter of the deadline (2 s here),
    and every lost datagram then waited that long (duckd under 5 % loss: a step per 4 s)."""
    rng = np.random.default_rng(5)
    hidden, ntok = 1024, 160
    experts = make_layer(rng, 2, 64, hidden)
    lossy = ["--enable-fault-injection", "--drop-rate", "0.05", "--fault-seed", "3"]
    with Ducks(1, tmp_path, args=lossy, retransmit_ms=2, deadline_ms=8000) as ducks:
        per_duck = split_experts(experts, tp=1)
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        timers = []
        for _ in range(40):
            x = (rng.standard_normal((ntok, hidden)) * 0.1).astype(np.float32)
            session.forward(0, x, *routing(rng, ntok, 1, 2))
            timers.append(lib.duck_transport_rto_us(ducks.fleet._t, 0))
        assert ducks.fleet.transport_stats()["retransmits"] >= 10
        assert max(timers[10:]) < 250_000, timers          # the ceiling: 2,000,000


def _decode_steps(ducks, rng, per_duck, hidden, steps):
    """single-token forwards (a decode step's datagram each way per duck), each checked"""
    session = ducks.fleet.open_session({0: per_duck}, hidden)
    for step in range(steps):
        x = (rng.standard_normal((1, hidden)) * 0.1).astype(np.float32)
        ids, w = routing(rng, 1, 2, 4)
        assert_close(session.forward(0, x, ids, w), local_reference(per_duck, hidden, x, ids, w),
                     SUMMATION_ORDER_RTOL, f"step {step}")
    return ducks.fleet.transport_stats()


@pytest.mark.alone   # a bound on time or loss: not beside another test
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_a_lossy_link_sends_decode_forwards_twice(tmp_path, loss):
    """`send_twice` auto (transport_timing.c): one decode forward in 16 goes twice (WIRE_F_TWICE), and
    the duck's reply twice, flagged alike; the reply copies that do not arrive are the link's loss.
    At 5 % the host finds each duck's link lossy and sends it every decode forward twice:
    retransmits become rare. A lossless link is never found lossy; it pays the probes alone."""
    rng = np.random.default_rng(8)
    n, hidden = 3, 256
    per_duck = split_experts(make_layer(rng, 4, 64 * n, hidden), tp=n)
    args = {i: ["--enable-fault-injection", "--drop-rate", str(loss), "--fault-seed", str(i + 1)] for i in range(n)}
    with Ducks(n, tmp_path, per_duck_args=args, retransmit_ms=2, deadline_ms=5000) as ducks:
        ducks.fleet.upload(flat(per_duck))
        steps = 0
        while steps < (8000 if loss else 2500):   # a verdict per 64 probes of a duck: about 1,100 steps
            first = _decode_steps(ducks, rng, per_duck, hidden, 500)
            steps += 500
            if first["twice_starts"] >= n:
                break
        t = _decode_steps(ducks, rng, per_duck, hidden, 300)
        if not loss:
            assert t["twice_starts"] == 0, t
            # the probes: the first 64 forwards to a duck, then one in 16
            assert t["twice_calls"] == (64 + len(range(64, steps + 300, 16))) * n, t
            return
        assert first["twice_starts"] >= n, first                                     # each link found lossy
        twice = t["twice_calls"] - first["twice_calls"]
        assert twice > 0.8 * 300 * n, (first, t)                                  # then (nearly) every forward twice
        # a call is lost now only when both copies of a datagram are (0.25 % each): retransmits are a
        # small fraction of what a lossy link without copies needs (a call in 7 at 3 datagrams)
        assert t["retransmits"] - first["retransmits"] < 0.05 * 300 * n, (first, t)
        assert sum(s["duplicates"] for s in ducks.fleet.stats()) > 0                 # the ducks got both copies


def test_send_twice_always_and_never(tmp_path):
    """`always`: every forward of a few datagrams goes twice on a lossless link, and gives the same
    sums; `never`: not one goes twice on a lossy one."""
    rng = np.random.default_rng(9)
    n, hidden = 2, 256
    per_duck = split_experts(make_layer(rng, 4, 64 * n, hidden), tp=n)
    with Ducks(n, tmp_path, retransmit_ms=2, deadline_ms=5000, twice=1) as ducks:
        ducks.fleet.upload(flat(per_duck))
        t = _decode_steps(ducks, rng, per_duck, hidden, 20)
        assert t["twice_calls"] == 20 * n and t["twice_starts"] == 0, t
    lossy = ["--enable-fault-injection", "--drop-rate", "0.05", "--fault-seed", "4"]
    with Ducks(n, tmp_path / "never", args=lossy, retransmit_ms=2, deadline_ms=5000, twice=-1) as ducks:
        ducks.fleet.upload(flat(per_duck))
        t = _decode_steps(ducks, rng, per_duck, hidden, 200)
        assert t["twice_calls"] == t["twice_starts"] == 0 and t["retransmits"] > 0, t
