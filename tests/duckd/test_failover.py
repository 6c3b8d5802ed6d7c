"""A duck killed with SIGKILL: FAILED with a reason within 2 s, chats fail
with UNAVAILABLE naming it when the host may not cover it (host_cover_mb = 0;
tests/duckd/test_lost_duck.py has the cover), the daemon restarts it and it
serves again from its cache (no upload)."""
import os
import signal
import time

import grpc
import pytest

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from tests.duckd_fixture import RunningDaemon, write_config


@pytest.fixture
def daemon(tmp_path):
    state = tmp_path / "duck"
    # a slow restart leaves a window in which the duck is known to be down
    d = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=3, restart_delay_s=4.0,
                                    host_cover_mb=0), state).start()
    yield d
    d.stop()


def test_kill9_fails_the_duck_then_it_recovers_from_its_cache(daemon):
    events = []
    watch = rpc.FleetStub(daemon.channel()).Watch(pb.WatchRequest(interval_s=0.2), timeout=120)
    daemon.kill_duck(1)
    t0 = time.monotonic()
    failed = daemon.wait_duck(1, pb.FAILED, timeout=2.0)
    assert time.monotonic() - t0 <= 2.0
    assert "SIGKILL" in failed.reason or "answer" in failed.reason, failed.reason

    with pytest.raises(grpc.RpcError) as e:
        daemon.chat("Hello", max_tokens=4, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "duck 1" in e.value.details()
    assert daemon.proc.poll() is None                        # the daemon keeps running

    back = daemon.wait_duck(1, pb.SERVING, timeout=30)
    assert back.restarts == 1 and back.cache_hits > 0
    for snap in watch:
        events += [ev.message for ev in snap.events if ev.duck_id == 1]
        if any("cache hit" in m for m in events):
            break
    watch.cancel()
    assert any("cache hit: nothing to upload" in m for m in events), events
    text, stats = daemon.chat("Which city is the capital of France?", max_tokens=12)
    assert "Paris" in text and stats.output_len > 0


def test_a_hung_duck_is_failed_for_silence(daemon):
    os.kill(daemon.duck_pid(2), signal.SIGSTOP)       # alive, but answers nothing
    t0 = time.monotonic()
    failed = daemon.wait_duck(2, pb.FAILED, timeout=2.0)
    assert time.monotonic() - t0 <= 2.0
    assert "stopped answering: no answer to health pings" in failed.reason, failed.reason
    assert daemon.wait_duck(2, pb.SERVING, timeout=40).restarts == 1   # the driver replaced it
