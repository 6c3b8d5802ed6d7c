"""A stream that survives a lost duck, against the real daemon and real ducks:
kill -9 or SIGSTOP of one duck mid-chat, two ducks killed one after the other,
5 % datagram loss on every duck, a replica taking over: the greedy stream
completes with the tokens of an undisturbed run and no long gap, and the
ducks serve again afterwards. Past the host's cover budget the chat ends
naming the ducks and the memory, and the daemon serves once they are back.

Timing bars hold on a loaded 2-core machine with margins (the bars in
brackets are what a dedicated run is measured against)."""
import os
import signal
import threading
import time

import grpc
import pytest

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from tests.duckd_fixture import RunningDaemon, all_serving, max_gap, write_config

PROMPT = "Write a long story about a duck who learns to fly."
TOKENS = 200
AT_TOKEN = 20
MAX_GAP_S = 3.0          # [1.5 s]


def start(tmp_path, name="duck", ducks=4, **fleet):
    state = tmp_path / name
    config = write_config(tmp_path / f"{name}.toml", state, ducks=ducks, model={"max_tokens": TOKENS}, **fleet)
    return RunningDaemon(config, state).start()


def stream(daemon, at_token=None, action=None):
    """A greedy chat of TOKENS tokens: (tokens, arrival times, stats); action() runs in a thread
    when token at_token arrives."""
    req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=PROMPT)], max_tokens=TOKENS, temperature=0.0)
    tokens, times, stats, worker = [], [], None, None
    for ev in rpc.ChatStub(daemon.channel()).Chat(req, timeout=300):
        if ev.WhichOneof("event") == "token":
            tokens.append(ev.token)
            times.append(time.monotonic())
            if action is not None and len(tokens) == at_token:
                worker = threading.Thread(target=action)
                worker.start()
        else:
            stats = ev.stats
    if worker is not None:
        worker.join()
    return tokens, times, stats


def rate(times, first, last=None):
    """Tokens per second between token `first` and `last`."""
    last = len(times) - 1 if last is None else last
    return (last - first) / (times[last] - times[first])


def events(daemon, kind="lost"):
    snap = next(iter(rpc.FleetStub(daemon.channel()).Watch(pb.WatchRequest(interval_s=0.2, with_history=True), timeout=10)))
    return [(ev.duck_id, ev.message) for ev in snap.events if ev.kind == kind]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = start(tmp_path_factory.mktemp("lost"))
    undisturbed = stream(d)
    yield d, undisturbed
    d.stop()


def test_the_undisturbed_stream_is_long_enough(fleet):
    _, (tokens, times, stats) = fleet
    assert len(tokens) == TOKENS and stats.finish_reason == "length"


def test_kill9_mid_stream_the_host_covers_it(fleet):
    daemon, (ref, ref_times, _) = fleet
    tokens, times, stats = stream(daemon, AT_TOKEN, lambda: daemon.kill_duck(2))
    assert tokens == ref
    assert max_gap(times) <= MAX_GAP_S, max_gap(times)
    lost = [m for d, m in events(daemon) if d == 2]
    assert any(m.startswith("duck 2 lost: host computing its slices (") and "ms per layer)" in m for m in lost), lost
    back = daemon.wait_duck(2, pb.SERVING, timeout=60)
    assert back.restarts >= 1
    assert stream(daemon)[0] == ref                     # its slices back: the same again


@pytest.mark.alone   # a bound on time or loss: not beside another test
def test_sigstop_for_10s_the_host_covers_it(fleet):
    daemon, (ref, _, _) = fleet
    pid = daemon.duck_pid(1)

    def stop_then_continue():
        os.kill(pid, signal.SIGSTOP)
        time.sleep(10)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:      # the driver replaced it meanwhile
            pass

    tokens, times, _ = stream(daemon, AT_TOKEN, stop_then_continue)
    assert tokens == ref
    assert max_gap(times) <= MAX_GAP_S, max_gap(times)
    all_serving(daemon)
    assert stream(daemon)[0] == ref


def test_two_ducks_killed_one_after_the_other(fleet):
    daemon, (ref, _, _) = fleet
    all_serving(daemon)

    def kill_two():
        daemon.kill_duck(0)
        time.sleep(1.0)
        daemon.kill_duck(3)

    tokens, times, _ = stream(daemon, AT_TOKEN, kill_two)
    assert tokens == ref
    assert max_gap(times) <= MAX_GAP_S, max_gap(times)
    all_serving(daemon)


def test_five_percent_loss_on_every_duck(tmp_path, fleet):
    _, (ref, ref_times, ref_stats) = fleet
    daemon = start(tmp_path, "lossy", fault_drop_rate=0.05)
    try:
        tokens, times, stats = stream(daemon)
        drops = sum(d.drops for d in daemon.ducks())
        lost = events(daemon)
    finally:
        daemon.stop()
    assert tokens == ref
    assert drops > 0
    assert not lost, lost                       # a lossy link is retransmitted to, not declared lost
    assert max_gap(times) <= MAX_GAP_S, max_gap(times)
    # Each lost datagram costs its duck's retransmit timer (srtt + 4 rttvar), which a loaded
    # machine's scheduling noise stretches several times: CI measured 0.19x once, where a quiet
    # run gives 0.4-0.6x. The rate bar is bench/lost_duck.py's (loss5); here only a floor that
    # a drop waiting for the failure deadline would break.
    assert stats.decode_tok_s >= 0.1 * ref_stats.decode_tok_s, (stats.decode_tok_s, ref_stats.decode_tok_s)  # [0.5x]


def test_replicas_fail_over_before_the_host(tmp_path, fleet):
    _, (ref, _, _) = fleet
    daemon = start(tmp_path, "replicas", replicas=2, host_cover_mb=0)
    try:
        tokens, times, stats = stream(daemon, AT_TOKEN, lambda: daemon.kill_duck(1))
        lost = [m for d, m in events(daemon) if d == 1]
        holders = {e.name: list(e.ducks) for e in rpc.CacheStub(daemon.channel()).List(
            pb.CacheListRequest(all_ducks=True), timeout=10).entries}
    finally:
        daemon.stop()
    assert tokens == ref
    assert any("duck 1 lost: duck 2 computing its slices" in m for m in lost), lost
    before, after = rate(times, 2, AT_TOKEN), rate(times, AT_TOKEN + 10)
    assert after >= 0.5 * before, (after, before)                                    # [0.8x]
    assert holders and all(len(h) == 2 for h in holders.values()), holders


def test_past_the_cover_budget_the_chat_names_the_ducks_and_the_memory(tmp_path):
    daemon = start(tmp_path, "budget", ducks=4, host_cover_mb=30, restart_delay_s=3.0)   # one duck's ~22 MB
    try:
        daemon.kill_duck(0)
        daemon.kill_duck(1)
        with pytest.raises(grpc.RpcError) as e:
            stream(daemon)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        msg = e.value.details()
        assert "ducks 0, 1 lost" in msg and "MiB" in msg and "fleet.host_cover_mb" in msg, msg
        with pytest.raises(grpc.RpcError) as again:   # while they are down: refused up front, in the same words
            stream(daemon)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
        msg = again.value.details()
        assert msg.startswith("the fleet cannot serve: ducks 0, 1 lost") and "fleet.host_cover_mb" in msg, msg
        all_serving(daemon)
        text, stats = daemon.chat("Which city is the capital of France?", max_tokens=12)
        assert "Paris" in text
    finally:
        daemon.stop()


def _chats_at_once(daemon, prompts, tokens, at=None, action=None):
    """Greedy chats of `tokens` tokens, all at once: per prompt (tokens, error), and every token's arrival
    time over all of them; action() runs in a thread `at` seconds after they start."""
    out, arrivals = [None] * len(prompts), []

    def one(i):
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=prompts[i])], max_tokens=tokens,
                             temperature=0.0)
        got = []
        try:
            for ev in rpc.ChatStub(daemon.channel()).Chat(req, timeout=240):
                if ev.WhichOneof("event") == "token":
                    got.append(ev.token)
                    arrivals.append(time.monotonic())
            out[i] = (got, None)
        except grpc.RpcError as e:
            out[i] = (got, f"{e.code().name}: {e.details()}")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    if action is not None:
        time.sleep(at)
        action()
    for t in threads:
        t.join()
    return out, sorted(arrivals)


def test_kill9_during_a_batch_of_48_chats_wedges_nothing(tmp_path):
    """The wedge of a batched daemon: 48 chats at once (32 decoding, 16 queued), a duck killed
    2 s in, with the daemon's own timings (a failed duck restarts within ~2.5 s, often before a
    prefill chunk's forward would have declared it lost). Its restarted self holds no run and
    NACKs the forward's RESEND with NO_RUN: the forward covers it at once and the resync opens
    a run on it between two steps. Every chat completes with the tokens of the undisturbed run;
    tokens never stop for long, so the health checks have nothing to hide."""
    state = tmp_path / "wedge"
    config = write_config(tmp_path / "wedge.toml", state, ducks=4, model={"max_tokens": 48},
                          fail_after_s=1.5, health_interval_s=0.5)
    daemon = RunningDaemon(config, state).start()
    prompts = [f"Tell story number {i} about a duck in three sentences." for i in range(48)]
    try:
        ref, _ = _chats_at_once(daemon, prompts, 48)
        assert [e for _, e in ref if e] == [] and sum(len(toks) for toks, _ in ref) > 40 * 48 // 2
        got, arrivals = _chats_at_once(daemon, prompts, 48, at=2.0, action=lambda: daemon.kill_duck(1))
        restarts = daemon.ducks()[1].restarts
        all_serving(daemon)
    finally:
        daemon.stop()
    assert [e for _, e in got if e] == []
    assert [toks for toks, _ in got] == [toks for toks, _ in ref]
    assert max(b - a for a, b in zip(arrivals, arrivals[1:])) < 5.0
    assert restarts >= 1
