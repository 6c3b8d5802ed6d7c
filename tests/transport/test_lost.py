"""Lost ducks with real ducks: a duck killed or stopped mid-session has its
slice computed by the host (native/transport/cover.py) or by its replica,
and the forward's sum is the same bits as the undisturbed run's, whoever
computed each slice; past the host's budget the forward fails naming the
ducks and the memory; a duck given its slices back computes them again; a
forward's lost deadline follows the duck's measured times."""
import os
import signal
import time

import numpy as np
import pytest

from native._native import lib
from native.transport import DuckError, split_experts
from native.transport.cover import HostCover
from native.transport.session import REPLICA_LAYER_OFFSET
from tests.transport.ducks import Ducks
from tests.transport.test_forward import flat, make_layer, routing

HIDDEN, N_EXPERTS, LAYERS = 256, 4, (0, 1, 2)
HOST, NOBODY = lib.DUCK_ROUTE_HOST, lib.DUCK_ROUTE_NONE


def _model(n, seed=5):
    rng = np.random.default_rng(seed)
    return {layer: split_experts(make_layer(rng, N_EXPERTS, 64 * n, HIDDEN), tp=n) for layer in LAYERS}


def _inputs(seed, ntok=(1, 5, 1, 40)):
    rng = np.random.default_rng(seed)
    out = []
    for t in ntok:
        ids, w = routing(rng, t, 2, N_EXPERTS)
        out.append(((rng.standard_normal((t, HIDDEN)) * 0.1).astype(np.float32), ids, w))
    return out


def _run(session, inputs, out_dtype=np.float32):
    """Every layer of every input, as the bits of the outputs."""
    ys = []
    for x, ids, w in inputs:
        for layer in LAYERS:
            out = np.empty((x.shape[0], HIDDEN), out_dtype)
            session.forward(layer, x if out_dtype == np.float32 else _bf16(x), ids, w, out=out)
            ys.append(out.view(np.uint32 if out_dtype == np.float32 else np.uint16).copy())
    return ys


def _bf16(x):
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def _same_bits(a, b):
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _open(ducks, layers, budget=1 << 30, replicas=None):
    fleet = ducks.fleet
    files = [[t for layer in layers.values() for e in layer[d] for t in (e.gate_up, e.down)] for d in range(len(ducks.ducks))]
    if replicas:
        for d, r in enumerate(replicas):
            files[r] += [t for layer in layers.values() for e in layer[d] for t in (e.gate_up, e.down)]
    fleet.upload(files)
    session = fleet.open_session(layers, HIDDEN, replicas=replicas)
    cover = HostCover(fleet, layers, HIDDEN, budget, replicas=replicas, replica_layer_offset=REPLICA_LAYER_OFFSET)
    return session, cover


@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16], ids=["fp32", "bf16"])
def test_a_killed_duck_is_covered_by_the_host_with_the_same_bits(tmp_path, out_dtype):
    layers, inputs = _model(3), _inputs(11)
    with Ducks(3, tmp_path, retransmit_ms=5, deadline_ms=3000) as ducks:
        session, _ = _open(ducks, layers)
        undisturbed = _run(session, inputs, out_dtype)
        ducks[1].kill9()
        seen = []
        session.on_lost = lambda lost, host_ms: seen.append((lost, host_ms))
        t0 = time.monotonic()
        covered = _run(session, inputs, out_dtype)
        assert time.monotonic() - t0 < 2.0                 # caught well inside the 3 s deadline
        _same_bits(covered, undisturbed)
        assert ducks.fleet.lost() == [1] and ducks.fleet.routes() == [0, HOST, 2]
        assert seen and seen[0][0] == [1] and seen[0][1] > 0
        assert session.host_forwards == len(covered) and session.host_ms_per_forward > 0


def test_every_duck_lost_the_host_computes_all_with_the_same_bits(tmp_path):
    """The host's kernel against the ducks' on the same requests: the host cover is the
    duck's computation, and the thread count (2 here, 1 on the ducks) changes no bit."""
    layers, inputs = _model(2, seed=8), _inputs(12)
    with Ducks(2, tmp_path) as ducks:
        session, cover = _open(ducks, layers)
        undisturbed = _run(session, inputs)
        cover.detach()
        HostCover(ducks.fleet, layers, HIDDEN, 1 << 30, threads=2)
        for d in range(2):
            ducks.fleet.set_lost(d, True)
        assert ducks.fleet.routes() == [HOST, HOST]
        _same_bits(_run(session, inputs), undisturbed)


def test_past_the_budget_the_forward_names_the_ducks_and_the_memory(tmp_path):
    layers, inputs = _model(3), _inputs(13, ntok=(1,))
    with Ducks(3, tmp_path, retransmit_ms=5, deadline_ms=3000) as ducks:
        session, cover = _open(ducks, layers, budget=0)
        slice_mb = cover.slice_bytes[0] / 2**20
        cover.detach()
        session, cover = _open(ducks, layers, budget=int(cover.slice_bytes[0] * 1.5))   # one slice, not two
        undisturbed = _run(session, inputs)
        ducks[0].kill9()
        ducks[2].kill9()
        with pytest.raises(DuckError) as e:
            _run(session, inputs)
        msg = str(e.value)
        assert "ducks 0, 2 lost" in msg and f"{2 * slice_mb:.1f} MiB" in msg and "cover budget" in msg, msg
        with pytest.raises(DuckError, match="ducks 0, 2 lost"):    # at once now, no deadline waited for
            _run(session, inputs)
        assert ducks.fleet.cover_error() == msg                # what a daemon's ready check says meanwhile
        for d in (0, 2):                                        # back, with their caches: the session again
            ducks[d].start()
        ducks.fleet.hello()
        for d in (0, 2):
            session.reopen_duck(d)
            ducks.fleet.set_lost(d, False)
        assert ducks.fleet.routes() == [0, 1, 2] and ducks.fleet.cover_error() == ""
        _same_bits(_run(session, inputs), undisturbed)


def test_a_stopped_duck_is_covered_then_takes_its_slices_back(tmp_path):
    layers, inputs = _model(3), _inputs(14)
    with Ducks(3, tmp_path, retransmit_ms=5, deadline_ms=3000) as ducks:
        session, _ = _open(ducks, layers)
        undisturbed = _run(session, inputs)
        os.kill(ducks[2].proc.pid, signal.SIGSTOP)
        try:
            _same_bits(_run(session, inputs), undisturbed)
            assert ducks.fleet.lost() == [2]
        finally:
            os.kill(ducks[2].proc.pid, signal.SIGCONT)
        session.reopen_duck(2)
        ducks.fleet.set_lost(2, False)
        before = session.host_forwards
        _same_bits(_run(session, inputs), undisturbed)
        assert session.host_forwards == before and ducks.fleet.lost() == []


def test_a_replica_computes_the_lost_slice_before_the_host(tmp_path):
    layers, inputs = _model(3, seed=9), _inputs(15)
    replicas = [1, 2, 0]
    with Ducks(3, tmp_path, retransmit_ms=5, deadline_ms=3000) as ducks:
        session, _ = _open(ducks, layers, budget=0, replicas=replicas)   # no host: replicas alone
        undisturbed = _run(session, inputs)
        ducks[1].kill9()
        _same_bits(_run(session, inputs), undisturbed)
        assert ducks.fleet.routes() == [0, 2, 2] and session.host_forwards == 0
        ducks[2].kill9()                                    # slice 1's replica too: nobody, and the host may not
        with pytest.raises(DuckError, match="ducks 1, 2 lost"):
            _run(session, inputs)


def test_the_lost_deadline_follows_the_measured_times(tmp_path):
    """A duck 30 ms slow on every request is measured as such and never dropped; the
    others' deadline is a few of their own (short) steps: far below the configured one."""
    layers, inputs = _model(3), _inputs(16, ntok=(1,) * 6)
    slow = {2: ["--enable-fault-injection", "--delay-us", "30000"]}
    with Ducks(3, tmp_path, per_duck_args=slow, retransmit_ms=5, deadline_ms=5000) as ducks:
        session, _ = _open(ducks, layers)
        assert ducks.fleet.lost_after_ms(0) >= 5000          # nothing measured: the configured deadline
        _run(session, inputs)
        assert ducks.fleet.lost() == []
        fast, slow_ms = ducks.fleet.lost_after_ms(0), ducks.fleet.lost_after_ms(2)
        assert 100 <= fast < 2000, fast                      # the floor .. well below the deadline
        assert slow_ms >= 3 * len(LAYERS) * 30, slow_ms      # 3 steps of its own 30 ms calls


def test_bad_cover_settings_are_refused(tmp_path):
    layers = _model(2)
    with Ducks(2, tmp_path) as ducks:
        with pytest.raises(ValueError, match="replica of slice 0 is duck 0"):
            HostCover(ducks.fleet, layers, HIDDEN, 0, replicas=[0, 1], replica_layer_offset=REPLICA_LAYER_OFFSET)
        with pytest.raises(ValueError, match="no cover is set"):
            ducks.fleet.set_lost(0, True)
        with pytest.raises(ValueError, match="3 slices"):
            HostCover(ducks.fleet, _model(3), HIDDEN, 0)


def test_a_restarted_duck_is_lost_at_its_first_nack_not_retried_for_ever(tmp_path):
    """A duck restarted between two forwards holds no run: every fragment of a multi-datagram
    request is dropped there (no_run), and its NACK to the host's RESEND says so. The call
    ends at that NACK (the duck lost, the host covers it), instead of "send it all again" for
    ever, a NACK counted as life each time: the wedge of a batched daemon."""
    layers, inputs = _model(3, seed=21), _inputs(22, ntok=(40, 1, 3))   # a multi-datagram request first
    with Ducks(3, tmp_path, mtu=1500, retransmit_ms=5, deadline_ms=20000) as ducks:
        session, _ = _open(ducks, layers)
        undisturbed = _run(session, inputs)
        ducks[1].kill9()
        ducks[1].start()                                     # the same port, a new challenge, no run
        t0 = time.monotonic()
        _same_bits(_run(session, inputs), undisturbed)
        assert time.monotonic() - t0 < 5.0                  # the first lost verdict; the deadline is 20 s
        assert ducks.fleet.lost() == [1]
        assert ducks.fleet.transport_stats()["no_run"] >= 1
        ducks.fleet.hello()                                  # opens a run on it again
        session.reopen_duck(1)
        ducks.fleet.set_lost(1, False)
        _same_bits(_run(session, inputs), undisturbed)
        assert ducks.fleet.lost() == []


def test_a_lost_hint_ends_the_forward_in_flight(tmp_path):
    """The daemon knows a duck is gone (its process exited) while a forward waits on it: the
    hint, taken without the fleet's lock, ends that forward's calls to it at once, long before
    the configured deadline, and its slice is covered with the same bits."""
    import threading
    layers, inputs = _model(3, seed=23), _inputs(24, ntok=(1, 40))
    with Ducks(3, tmp_path, retransmit_ms=5, deadline_ms=20000) as ducks:
        session, _ = _open(ducks, layers)
        undisturbed = _run(session, inputs)
        os.kill(ducks[2].proc.pid, signal.SIGSTOP)          # silent, its lost deadline far away: stopped
        try:                                                 # before a measured lost deadline could pass
            result, t0 = {}, time.monotonic()
            worker = threading.Thread(target=lambda: result.update(y=_run(session, inputs)))
            worker.start()
            time.sleep(0.05)
            ducks.fleet.hint_lost(2)
            worker.join(10)
            assert not worker.is_alive() and time.monotonic() - t0 < 5.0
        finally:
            os.kill(ducks[2].proc.pid, signal.SIGCONT)
        _same_bits(result["y"], undisturbed)
        assert ducks.fleet.lost() == [2]
        ducks.fleet.set_lost(2, False)                       # clears the hint: its slices back
        _same_bits(_run(session, inputs), undisturbed)
        assert ducks.fleet.lost() == []
