"""duckd under load, real daemon and ducks, one sequence at a time (model.max_seqs = 1: a batch of one slot;
tests/duckd/test_batching.py has the batch): waiting chats hold no thread, so the health
monitor sees a killed duck within 2 s while 32 chats are queued, and the queued ones
then fail fast (with the host's cover off); a queued request whose client goes away leaves the queue at once and
runs no prefill; a chat whose stop string holds all text back still ends on cancel."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from tests.duckd_fixture import RunningDaemon, write_config

LONG = "Write a very long story about a duck who learns to compute."


@pytest.fixture
def daemon(tmp_path):
    state = tmp_path / "duck"
    # host_cover_mb = 0: a lost duck's slices are not computed on the host, so the waiting chats fail fast
    # (tests/duckd/test_lost_duck.py has them survive)
    d = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, restart=False, host_cover_mb=0,
                                   model={"max_tokens": 200, "max_seqs": 1}), state, env={"XDG_STATE_HOME": str(tmp_path)}).start()
    yield d
    d.stop()


def _chat(daemon, text: str, max_tokens: int, **kw) -> grpc.Future:
    req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=text)], max_tokens=max_tokens,
                         temperature=0.0, **kw)
    return rpc.ChatStub(daemon.channel()).Chat(req, timeout=300)


def _queued_and_running(daemon) -> tuple[int, int]:
    snap = next(iter(rpc.FleetStub(daemon.channel()).Watch(pb.WatchRequest(interval_s=0.05), timeout=10)))
    return (sum(r.state == "queued" for r in snap.requests), sum(r.state == "running" for r in snap.requests))


@pytest.mark.alone   # a bound on time or loss: not beside another test
def test_a_killed_duck_is_seen_within_2_s_while_32_chats_wait(daemon):
    outcomes: list[str] = []

    def one(i: int):
        try:
            for _ in _chat(daemon, f"{LONG} ({i})", 200):
                pass
            outcomes.append("ok")
        except grpc.RpcError as e:
            outcomes.append(e.code().name)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while _queued_and_running(daemon)[0] < 20:
        assert time.monotonic() < deadline, "the chats did not queue up"
        time.sleep(0.1)
    daemon.kill_duck(1)
    t0 = time.monotonic()
    daemon.wait_duck(1, pb.FAILED, timeout=2.0)
    seen = time.monotonic() - t0
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "queued chats hang after a duck failed"
    assert seen <= 2.0
    # the running chat and the queued ones end with UNAVAILABLE (naming the duck), none hangs
    assert outcomes.count("UNAVAILABLE") >= 30, outcomes


def test_a_queued_request_whose_client_left_runs_nothing(daemon):
    long_one = _chat(daemon, LONG, 150)
    first = next(long_one)                                     # running now
    assert first.token
    abandoned = [_chat(daemon, f"{LONG} {'and more ' * 60}", 150) for _ in range(6)]
    deadline = time.monotonic() + 10
    while _queued_and_running(daemon) != (6, 1):
        assert time.monotonic() < deadline, _queued_and_running(daemon)
        time.sleep(0.05)
    for call in abandoned:
        call.cancel()
    deadline = time.monotonic() + 2
    while _queued_and_running(daemon) != (0, 1):
        assert time.monotonic() < deadline, f"cancelled requests still queued: {_queued_and_running(daemon)}"
        time.sleep(0.05)
    long_one.cancel()
    t0 = time.monotonic()
    events = list(_chat(daemon, "Which city is the capital of France?", 8))
    ttft_wall = time.monotonic() - t0
    assert events[-1].stats.output_len > 0 and ttft_wall < 10, "the next chat waited for abandoned prefills"


def test_held_back_text_does_not_block_cancel(daemon):
    """A stop string longer than the whole answer holds every character back: no text is
    sent, yet a cancelled chat ends at its next token and the next one starts."""
    held = _chat(daemon, LONG, 1900, stop=["q" * 8000])     # 1900 tokens: tens of seconds if it ran on
    deadline = time.monotonic() + 10
    while _queued_and_running(daemon) != (0, 1):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    held.cancel()
    t0 = time.monotonic()
    events = list(_chat(daemon, "Which city is the capital of France?", 8))
    assert events[-1].stats.output_len > 0 and time.monotonic() - t0 < 5
