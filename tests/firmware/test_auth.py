"""The authenticated data path of wire ABI 5 (docs/wire.md, Authentication),
against a real duckfw: a forward without a valid link MAC gets no answer at all
and is counted by reason; a message is taken once whatever address it comes
from (a copy's reply goes to where the first went); a sequence below the replay
window, a run open for an old challenge and a forged fragment flood are refused
and counted."""
import os
import socket
import time

import numpy as np
import pytest

from native._native import ffi, lib
from tests.firmware.test_malformed import exchange, forward_payload
from tests.firmware.test_wire import seal
from tests.transport.ducks import Ducks

HIDDEN = 64


@pytest.fixture(scope="module")
def ducks(tmp_path_factory):
    with Ducks(1, tmp_path_factory.mktemp("auth")) as d:
        yield d


def silent(port: int, dgram: bytes, wait: float = 0.4) -> bool:
    """True when nothing at all comes back to the sender."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(wait)
        s.sendto(dgram, ("127.0.0.1", port))
        try:
            s.recv(65535)
            return False
        except TimeoutError:
            return True


def test_a_forward_without_the_key_gets_no_answer(ducks):
    fleet, duck = ducks.fleet, ducks[0]
    session = fleet.open_session({0: [[]]}, HIDDEN)
    try:
        before = fleet.stats()[0]
        payload = forward_payload(hidden=HIDDEN)
        no_mac = seal(payload, None, mtype=lib.WIRE_T_FORWARD, session=session.id, sequence=fleet.take_sequence())
        stranger = ffi.new("wire_key *")   # a link of another fleet key
        stranger.bytes[0:32], stranger.len = os.urandom(32), 32
        lib.wire_link_set(stranger, os.urandom(16), os.urandom(16))
        forged = seal(payload, stranger, mtype=lib.WIRE_T_FORWARD, session=session.id, sequence=fleet.take_sequence())
        fleet_only = seal(payload, ducks.key, mtype=lib.WIRE_T_FORWARD, session=session.id,
                          sequence=fleet.take_sequence())   # the fleet key alone makes no link MAC: none sent
        assert silent(duck.port, no_mac) and silent(duck.port, forged) and silent(duck.port, fleet_only)
        after = fleet.stats()[0]
        assert after["unauthenticated"] - before["unauthenticated"] == 2
        assert after["bad_mac"] - before["bad_mac"] == 1
        assert after["forwards"] == before["forwards"] and after["errors"] == before["errors"]
        # the real link key's forward is answered
        lk = fleet.link_key(0)
        status, _, _ = exchange(duck.port, seal(payload, lk, mtype=lib.WIRE_T_FORWARD, session=session.id,
                                                sequence=fleet.take_sequence()), lk)
        assert status == 0
    finally:
        session.close()


def test_a_message_is_taken_once_from_any_address(ducks):
    fleet, duck = ducks.fleet, ducks[0]
    session = fleet.open_session({0: [[]]}, HIDDEN)
    try:
        lk = fleet.link_key(0)
        dgram = seal(forward_payload(hidden=HIDDEN), lk, mtype=lib.WIRE_T_FORWARD, session=session.id,
                     sequence=fleet.take_sequence())
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as first:
            first.settimeout(2)
            first.sendto(dgram, duck.address)
            first.recv(65535)
            before = fleet.stats()[0]
            assert silent(duck.port, dgram)              # a copy from elsewhere: answered to the first sender
            first.recv(65535)
            assert fleet.stats()[0]["duplicates"] == before["duplicates"] + 1
        for _ in range(3):   # other requests push its reply out of the last-reply cache (8 slots)
            for _ in range(4):
                session.forward(0, np.ones((1, HIDDEN), np.float32), np.full((1, 1), -1, np.int32),
                                np.zeros((1, 1), np.float32))
        before = fleet.stats()[0]
        assert silent(duck.port, dgram)                  # now a replay of a sequence already taken
        below = seal(forward_payload(hidden=HIDDEN), lk, mtype=lib.WIRE_T_FORWARD, session=session.id,
                     sequence=fleet.take_sequence() - 2 * lib.WIRE_REPLAY_WINDOW)
        assert silent(duck.port, below)                  # below the window: never taken, still refused
        after = fleet.stats()[0]
        assert after["replayed"] - before["replayed"] == 2 and after["forwards"] == before["forwards"]
    finally:
        session.close()


def test_a_run_open_for_an_old_challenge_is_refused(ducks):
    fleet, duck = ducks.fleet, ducks[0]
    old = fleet.hello_only()[0].challenge
    with type(fleet)([duck.address], ducks.key) as other:   # another host opens its run: the challenge is used
        other.hello()
        assert other.hello_only()[0].run_ours and other.hello_only()[0].challenge != old
    before = fleet.stats()[0]
    ro = ffi.new("wire_run_open *")
    ro.run, ro.challenge = list(fleet.run_nonce()), list(old)
    status, body, _ = exchange(duck.port, seal(bytes(ffi.buffer(ro)), ducks.key, mtype=lib.WIRE_T_RUN_OPEN,
                                               session=0, sequence=fleet.take_sequence()), ducks.key)
    assert status == lib.WIRE_E_STALE and "not this duck's current one" in body.decode(), body
    assert fleet.stats()[0]["replayed"] == before["replayed"] + 1
    assert not fleet.hello_only()[0].run_ours
    fleet.hello()                                             # opens this fleet's run again
    assert fleet.hello_only()[0].run_ours


def test_forged_fragments_are_dropped_before_reassembly(ducks):
    """First fragments with a wrong MAC that claim large forwards of the open session:
    dropped one by one (bad_mac), none held (no stale evictions)."""
    fleet, duck = ducks.fleet, ducks[0]
    session = fleet.open_session({0: [[]]}, HIDDEN)
    try:
        stranger = ffi.new("wire_key *")
        stranger.bytes[0:32], stranger.len = os.urandom(32), 32
        lib.wire_link_set(stranger, os.urandom(16), os.urandom(16))
        before = fleet.stats()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for i in range(200):
                s.sendto(seal(bytes(1400), stranger, mtype=lib.WIRE_T_FORWARD, session=session.id,
                              sequence=fleet.take_sequence(), frag_count=40, total=40 * 1400), duck.address)
        time.sleep(0.2)
        after = fleet.stats()[0]
        assert after["bad_mac"] - before["bad_mac"] == 200 and after["stale"] == before["stale"]
    finally:
        session.close()
