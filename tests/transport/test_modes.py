"""Options of the transport and the firmware: MACs on forwards (the default) or not, spin-then-block
idling, and the GIL released while a forward waits on the ducks."""
import threading
import time

import numpy as np
import pytest

from native.transport import DuckError, Fleet
from tests.transport.ducks import Ducks

HIDDEN = 128
NO_EXPERT = (np.full((1, 1), -1, np.int32), np.zeros((1, 1), np.float32))


def test_data_mac_is_the_default_and_required(tmp_path):
    with Ducks(2, tmp_path) as ducks:
        assert all(i.data_mac for i in ducks.fleet.hello())
        session = ducks.fleet.open_session({0: [[], []]}, HIDDEN)
        assert not session.forward(0, np.ones((1, HIDDEN), np.float32), *NO_EXPERT).any()
        plain = Fleet([d.address for d in ducks.ducks], ducks.key, mac_data=False)
        with pytest.raises(DuckError, match=r"requires a MAC on forwards .*mac_data=True"):
            plain.hello()
        plain.close()


def test_no_data_mac_for_trusted_links(tmp_path):
    """duckfw --no-data-mac and Fleet(mac_data=False): forwards and partials without a
    MAC; the control messages keep theirs."""
    with Ducks(1, tmp_path, args=["--no-data-mac"], mac_data=False) as ducks:
        assert not ducks.fleet.hello()[0].data_mac
        session = ducks.fleet.open_session({0: [[]]}, HIDDEN)
        assert not session.forward(0, np.ones((1, HIDDEN), np.float32), *NO_EXPERT).any()
        assert "forwards and their partials travel without a MAC" in ducks[0].log()


def test_spin_then_block_idle(tmp_path):
    with Ducks(1, tmp_path, args=["--idle", "spin", "--spin-us", "20"]) as ducks:
        rtts = [ducks.fleet.ping()[0] for _ in range(20)]
        assert min(rtts) > 0
        assert "idle spin-then-block (20 us)" in ducks[0].log()


def test_sigterm_while_spinning_stops_the_duck(tmp_path):
    """A signal that lands in the spin (outside any system call) must not leave the
    duck blocked in its socket for ever."""
    with Ducks(1, tmp_path, args=["--idle", "spin", "--spin-us", "1000000"]) as ducks:
        ducks.fleet.ping()
        time.sleep(0.05)                         # the duck is in its one-second spin now
        t0 = time.monotonic()
        rc = ducks[0].stop(timeout=5)
        assert rc == 0 and time.monotonic() - t0 < 2, rc


@pytest.mark.parametrize("idle", [["--idle", "block"], ["--idle", "spin", "--spin-us", "200"]])
def test_the_ducks_wake_up_is_reported(tmp_path, idle):
    """Arrival of a forward at the duck (kernel timestamp) to its kernel's start:
    per call (the slowest duck) and summed in the duck's stats."""
    with Ducks(2, tmp_path, args=idle) as ducks:
        session = ducks.fleet.open_session({0: [[], []]}, HIDDEN)
        wakes = []
        for _ in range(20):
            session.forward(0, np.ones((1, HIDDEN), np.float32), *NO_EXPERT)
            wakes.append(session.wake_ns_max)
        assert min(wakes) > 0 and max(wakes) < 1e9
        stats = ducks.fleet.stats()
        assert all(s["wake_ns"] >= s["forwards"] * 100 for s in stats)   # at least 0.1 us each


def test_forward_releases_the_gil(tmp_path):
    slow = {0: ["--enable-fault-injection", "--delay-us", "150000"]}
    with Ducks(1, tmp_path, per_duck_args=slow, retransmit_ms=400, deadline_ms=3000) as ducks:
        session = ducks.fleet.open_session({0: [[]]}, HIDDEN)
        worker = threading.Thread(target=session.forward, args=(0, np.ones((1, HIDDEN), np.float32), *NO_EXPERT))
        spins = 0
        worker.start()
        t0 = time.monotonic()
        while worker.is_alive():
            spins += 1
        assert time.monotonic() - t0 > 0.1
        assert spins > 10_000, f"the main thread ran only {spins} loops while a forward waited"
