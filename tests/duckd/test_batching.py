"""Continuous batching in the daemon (embedded default, real ducks, the official openai
client): concurrent streams each get exactly what they get alone, status answers during
the load, a flood beyond max_seqs + max_queued gets 429 and nothing hangs, a queued
request whose client left runs nothing."""
from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from tests.duckd_fixture import RunningDaemon, write_config

TOPICS = ["ducks", "rivers", "bread", "the moon", "trains", "music", "snow", "bees", "clocks", "tea", "maps",
          "boats", "paper", "stars", "salt", "glass"]


def _prompt(i: int) -> str:
    return f"Write one sentence about {TOPICS[i % len(TOPICS)]} and the number {i}."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batching")
    state = tmp / "duck"
    d = RunningDaemon(write_config(tmp / "duckd.toml", state, ducks=2, model={"max_seqs": 8, "max_queued": 16}),
                      state, env={"XDG_STATE_HOME": str(tmp)}).start()
    yield d
    d.stop()


def _client(daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{daemon.http_address}/v1", api_key=daemon.token, max_retries=0,
                              timeout=300)


async def _chat(client, i: int, max_tokens: int = 20):
    stream = await client.chat.completions.create(model="default", messages=[{"role": "user", "content": _prompt(i)}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def test_concurrent_streams_get_what_they_get_alone(daemon):
    n = 12   # more than max_seqs: some wait for a slot
    status_s = []

    async def one_by_one():
        async with _client(daemon) as client:
            return [await _chat(client, i) for i in range(n)]

    async def together():
        async with _client(daemon) as client:
            tasks = [asyncio.create_task(_chat(client, i)) for i in range(n)]
            while not all(t.done() for t in tasks):   # the daemon answers `duckctl status` while it decodes
                t0 = time.monotonic()
                await asyncio.to_thread(rpc.FleetStub(daemon.channel()).List, pb.ListDucksRequest(), timeout=10)
                status_s.append(time.monotonic() - t0)
                await asyncio.sleep(0.2)
            return [t.result() for t in tasks]

    alone = asyncio.run(one_by_one())
    assert asyncio.run(together()) == alone
    assert all(alone) and max(status_s) < 5, status_s


def test_a_flood_completes_or_gets_429_and_nothing_hangs(daemon):
    async def one(client, i):
        try:
            return len(await _chat(client, i, 8)) > 0
        except openai.RateLimitError as e:
            assert e.status_code == 429 and "max_queued" in e.body["message"], e.body
            return "busy"

    async def flood():
        async with _client(daemon) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(48))), 300)

    results = asyncio.run(flood())
    assert results.count(True) >= 8 + 16 and set(results) <= {True, "busy"}, results
    assert "busy" in results


def test_a_queued_request_whose_client_left_runs_nothing(daemon):
    chat = rpc.ChatStub(daemon.channel())

    def req(i, tokens):
        return chat.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=_prompt(i))],
                                        max_tokens=tokens, temperature=0.0), timeout=300)

    def counts():
        snap = next(iter(rpc.FleetStub(daemon.channel()).Watch(pb.WatchRequest(interval_s=0.05), timeout=10)))
        return (sum(r.state == "queued" for r in snap.requests), sum(r.state == "running" for r in snap.requests))

    running = [req(i, 400) for i in range(8)]
    for call in running:
        next(call)                              # all 8 slots busy
    waiting = [req(100 + i, 400) for i in range(5)]
    deadline = time.monotonic() + 10
    while counts() != (5, 8):
        assert time.monotonic() < deadline, counts()
        time.sleep(0.05)
    for call in waiting:
        call.cancel()
    deadline = time.monotonic() + 2
    while counts()[0]:
        assert time.monotonic() < deadline, f"cancelled requests still queued: {counts()}"
        time.sleep(0.05)
    for call in running:
        call.cancel()
    deadline = time.monotonic() + 10
    while counts() != (0, 0):
        assert time.monotonic() < deadline, f"cancelled sequences still hold slots: {counts()}"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as e:     # a cancelled stream raises on its next read
        next(waiting[0])
    assert e.value.code() == grpc.StatusCode.CANCELLED


def test_the_torch_path_batches_in_the_daemon(tmp_path):
    """With DUCK_CPU_NATIVE=0 the daemon batches through the model's torch modules (the
    path every GPU host takes): concurrent streams still get exactly
    what they get alone."""
    state = tmp_path / "duck"
    d = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, model={"max_seqs": 4, "max_queued": 8}),
                      state, env={"XDG_STATE_HOME": str(tmp_path), "DUCK_CPU_NATIVE": "0"}).start()
    try:
        async def one_by_one():
            async with _client(d) as client:
                return [await _chat(client, i, 12) for i in range(6)]

        async def together():
            async with _client(d) as client:
                return await asyncio.gather(*(_chat(client, i, 12) for i in range(6)))

        alone = asyncio.run(one_by_one())
        assert asyncio.run(together()) == alone and all(alone)
        assert "continuous batching (torch path, prefix cache)" in d.log_path.read_text(errors="replace")
    finally:
        d.stop()


def test_duckctl_bench_e2e_through_the_openai_client(daemon):
    """`duckctl bench e2e --api openai`: the serving bar's benchmark (texts together equal
    texts alone, the ratio while all decode, a flood past max_seqs + max_queued that
    completes or gets 429), daemon and HTTP address found from the runtime file."""
    import json
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "duckd.ctl", "bench", "e2e", "--api", "openai", "--streams", "4",
                        "--tokens", "8", "--runs", "1", "--rounds", "1", "--flood", "30", "--json"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XDG_STATE_HOME": str(daemon.state_dir.parent)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["api"] == "openai" and out["all_identical"] and out["alone"]["prompts"] == 4
    (c,) = out["rounds"]
    assert c["identical_to_alone"] == 4 and c["errors"] == 0 and c["differ"] == [] and c["tokens_out"] > 4
    assert 0 < c["ttft_p50_s"] <= c["ttft_p99_s"] and c["one_stream_decode_tok_s"] > 0
    f = out["flood"]   # max_seqs 8 + max_queued 16: at least 24 complete, the rest get 429
    assert not f["hung"] and f["other"] == 0 and f["completed"] + f["busy_429"] == 30 and f["completed"] >= 24
    bad = subprocess.run([sys.executable, "-m", "duckd.ctl", "--address", daemon.address, "--token", daemon.token,
                          "bench", "e2e", "--api", "openai", "--tokens", "1"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--tokens must be at least 2" in bad.stderr
