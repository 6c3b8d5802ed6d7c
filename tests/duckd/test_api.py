"""duckd end to end on the shared daemon: duckctl chat, Watch bandwidth,
auth, health, cache and model info; structured output and tool calls over gRPC
and duckctl chat. Real duckd, real duckfw, real gRPC."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from duck_proto.client import Endpoint, sync_channel


def duckctl(daemon, *args, env=None, timeout=180, input=None):
    return subprocess.run([sys.executable, "-m", "duckd.ctl", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, input=input)


def test_duckctl_chat_answers_paris_and_prints_stats(duckd_daemon):
    # no --address/--token: found from the running daemon's runtime file
    r = duckctl(duckd_daemon, "chat", "--greedy", "Which city is the capital of France?",
                env={"XDG_STATE_HOME": str(duckd_daemon.state_dir.parent)})
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Generation stats: time " in r.stdout and "decode " in r.stdout


def test_duckctl_chat_json_and_multi_turn_from_stdin(duckd_daemon):
    r = subprocess.run([sys.executable, "-m", "duckd.ctl", "--address", duckd_daemon.address, "--token",
                        duckd_daemon.token, "chat", "--greedy", "--json", "--max-tokens", "8"],
                       input="Hello!\nAnd what is your name?\n", capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    finals = [json.loads(line) for line in r.stdout.splitlines() if '"stats"' in line]
    assert len(finals) == 2                         # one per turn
    assert finals[1]["stats"]["inputLen"] > finals[0]["stats"]["inputLen"]   # history was sent


def test_duckctl_status_lists_every_duck_serving(duckd_daemon):
    r = duckctl(duckd_daemon, "--config", str(duckd_daemon.config), "status", "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert [d["state"] for d in status["ducks"]] == ["SERVING"] * 4
    assert status["model"]["backend"] == "fleet" and status["model"]["tp"] == 4


def test_watch_shows_bandwidth_of_every_duck_during_a_chat(duckd_daemon):
    """...and the chat itself among the requests, running with its tokens counted."""
    ch = duckd_daemon.channel()
    seen, requests = {}, []
    done = threading.Event()

    def watch():
        for snap in rpc.FleetStub(ch).Watch(pb.WatchRequest(interval_s=0.2), timeout=120):
            for d in snap.ducks:
                seen[d.id] = max(seen.get(d.id, 0.0), d.gbps)
            requests.extend(snap.requests)
            if done.is_set():
                return
    t = threading.Thread(target=watch)
    t.start()
    time.sleep(0.5)
    text, stats = duckd_daemon.chat("Tell me about ducks.", max_tokens=40)
    time.sleep(1.0)
    done.set()
    t.join(30)
    assert stats.output_len > 0
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(v > 0 for v in seen.values()), seen
    running = [r for r in requests if r.state == "running" and r.generated_tokens > 0]
    assert running and running[-1].prompt_tokens == stats.input_len and running[-1].age_s > 0, requests


def test_wrong_token_is_unauthenticated_and_health_needs_none(duckd_daemon):
    bad = sync_channel(Endpoint(duckd_daemon.address, "not-the-token", "test"))
    with pytest.raises(grpc.RpcError) as e:
        rpc.FleetStub(bad).List(pb.ListDucksRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        list(rpc.ChatStub(grpc.insecure_channel(duckd_daemon.address)).Chat(
            pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(duckd_daemon.address))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_bad_requests_get_invalid_argument_naming_the_field(duckd_daemon):
    chat = rpc.ChatStub(duckd_daemon.channel())
    cases = [(pb.ChatRequest(), "messages is empty"),
             (pb.ChatRequest(messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role = 'robot'"),
             (pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="x")], top_p=2), "top_p = 2")]
    for req, want in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(chat.Chat(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        rpc.FleetStub(duckd_daemon.channel()).Restart(pb.RestartDuckRequest(id=99), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "duck 99" in e.value.details()


def test_a_malformed_request_is_invalid_argument(duckd_daemon):
    """Bytes that are not a protobuf message (sent with the channel's raw codec)."""
    ch = duckd_daemon.channel()
    for method, stream in (("/duck.v1.Chat/Chat", True), ("/duck.v1.Fleet/Restart", False)):
        call = (ch.unary_stream if stream else ch.unary_unary)(method, request_serializer=None,
                                                              response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            result = call(b"\xff\xff\xff\xff not protobuf", timeout=10)
            if stream:
                list(result)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
        assert method in e.value.details() and "not a valid protobuf message" in e.value.details()


def test_cache_lists_every_ducks_slices_and_model_info(duckd_daemon):
    cache = rpc.CacheStub(duckd_daemon.channel()).List(pb.CacheListRequest(all_ducks=True), timeout=30)
    info = rpc.ModelStub(duckd_daemon.channel()).Info(pb.ModelInfoRequest(), timeout=10)
    assert info.layers == 30 and info.architecture == "llama"
    # 30 dense MLPs x 2 tensors (gate_up, down) on each of 4 ducks
    assert len(cache.entries) == 30 * 2 * 4
    assert all(len(e.ducks) == 1 and e.bytes > 0 for e in cache.entries)
    assert cache.host_cache_bytes > 0
    assert info.ffn_bytes_per_token > 0


def test_cache_invalidate_keeps_what_the_session_uses(duckd_daemon):
    r = duckctl(duckd_daemon, "--address", duckd_daemon.address, "--token", duckd_daemon.token,
                "cache", "invalidate", "--duck", "0")
    # every entry of a serving duck belongs to the open session: the duck keeps them and says so
    assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr and "used by the open session" in r.stderr
    r = duckctl(duckd_daemon, "--address", duckd_daemon.address, "--token", duckd_daemon.token,
                "cache", "invalidate", "--model", "no-such-model")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "no-such-model" in r.stderr
    text, _ = duckd_daemon.chat("Which city is the capital of France?", max_tokens=12)
    assert "Paris" in text                                               # still serving


def test_refused_datagrams_show_as_errors_and_drops_in_status(duckd_daemon):
    """Forged FORWARD fragments (valid CRC, no MAC, a session that is not open) are dropped by
    the duck unanswered (unauthenticated: forwards need the link MAC), and `duckctl status`
    counts them in the duck's errors and drops (every drop reason summed), in its table and
    its --json (a flood was once invisible there)."""
    import socket

    from native._native import lib
    from tests.firmware.test_wire import seal

    duck = duckd_daemon.ducks()[0]
    host, port = duck.address.rsplit(":", 1)
    before = duck.drops
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(40):
            s.sendto(seal(b"\0" * 64, None, mtype=lib.WIRE_T_FORWARD, session=0x5EED, sequence=1000 + i,
                          frag_count=2, total=128), (host, int(port)))
    deadline = time.monotonic() + 10
    while duckd_daemon.ducks()[0].drops < before + 40:
        assert time.monotonic() < deadline, f"drops {duckd_daemon.ducks()[0].drops}, were {before}"
        time.sleep(0.2)
    assert duckd_daemon.ducks()[0].errors >= before + 40
    args = ("--address", duckd_daemon.address, "--token", duckd_daemon.token, "status")
    listed = json.loads(duckctl(duckd_daemon, *args, "--json").stdout)["ducks"][0]
    assert int(listed["drops"]) >= before + 40
    table = duckctl(duckd_daemon, *args).stdout.splitlines()
    header = next(line for line in table if line.split()[:2] == ["id", "address"])
    assert "drops" in header.split(), table


def test_duckctl_bench_e2e_with_concurrent_streams(duckd_daemon):
    """`duckctl bench e2e --streams N --json`: one stream's decode, then N at once, every token counted."""
    r = duckctl(duckd_daemon, "--address", duckd_daemon.address, "--token", duckd_daemon.token,
                "bench", "e2e", "--runs", "1", "--tokens", "8", "--streams", "4", "--rounds", "2", "--json")
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)["concurrent"]
    assert c["streams"] == 4 and c["errors"] == 0 and c["tokens_out"] > 4
    assert c["aggregate_tok_s"] > 0 and c["sum_of_stream_decode_tok_s"] > 0 and 0 < c["ttft_p50_s"] <= c["ttft_p99_s"]
    assert "all_decoding_tok_s" in c and "all_decoding_over_one_stream" in c
    # two rounds of (one stream, then four): each ratio over its own round's one stream; the median round reported
    rounds = c["rounds"]["aggregate_over_one_stream"]
    assert len(rounds) == 2 and c["aggregate_over_one_stream"] in rounds
    assert c["aggregate_over_one_stream"] == pytest.approx(c["aggregate_tok_s"] / c["one_stream_decode_tok_s"])
    bad = duckctl(duckd_daemon, "--address", duckd_daemon.address, "--token", duckd_daemon.token,
                  "bench", "e2e", "--streams", "4", "--rounds", "0")
    assert bad.returncode == 2 and "--rounds must be positive" in bad.stderr


def test_a_damaged_cache_entry_shows_in_status_and_metrics(tmp_path):
    """A duck that finds a damaged entry when it opens its cache drops it and counts it; the
    operator sees the count in `duckctl status` (its table and --json) and /metrics, and the
    daemon uploads the entry again."""
    import urllib.request

    from tests.duckd_fixture import RunningDaemon, write_config
    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, restart_delay_s=0.5), state).start()
    try:
        victim = sorted((state / "ducks" / "1" / "cache").glob("*.fp9"))[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
        daemon.kill_duck(1)                          # restarted by the daemon: it opens its cache again
        deadline = time.monotonic() + 60
        while daemon.ducks()[1].cache_corrupt < 1 or daemon.ducks()[1].state != pb.SERVING:
            assert time.monotonic() < deadline, daemon.ducks()[1]
            time.sleep(0.2)
        args = ("--address", daemon.address, "--token", daemon.token, "status")
        assert int(json.loads(duckctl(daemon, *args, "--json").stdout)["ducks"][1]["cacheCorrupt"]) == 1
        table = duckctl(daemon, *args).stdout.splitlines()
        header = next(line for line in table if line.split()[:2] == ["id", "address"])
        assert "corrupt" in header.split()
        req = urllib.request.Request(f"http://{daemon.http_address}/metrics",
                                     headers={"Authorization": f"Bearer {daemon.token}"})
        text = urllib.request.urlopen(req, timeout=10).read().decode()
        assert 'duck_cache_corrupt_total{duck="1"} 1.0' in text
        assert victim.exists()                       # uploaded again by the resync
    finally:
        daemon.stop()


def test_refused_calls_are_logged_at_a_bounded_rate(duckd_daemon):
    """100 calls with a wrong token: each refused, the log says so for the first 10 and then at
    powers of two, with the count so far."""
    stub = rpc.FleetStub(sync_channel(Endpoint(duckd_daemon.address, "wrong", "test")))
    for _ in range(100):
        with pytest.raises(grpc.RpcError) as e:
            stub.List(pb.ListDucksRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    lines = [line for line in duckd_daemon.log_path.read_text().splitlines() if "missing or wrong bearer token (" in line]
    assert len(lines) <= 10 + 7, len(lines)          # 1..10, then 16, 32, 64, 128 ... of every refusal so far
    assert lines and "so far)" in lines[-1]


# -- structured output and tool calls over gRPC and duckctl chat ---------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"], "additionalProperties": False}
PARIS_WEATHER = "What is the weather in Paris?"
CAPITAL_JSON = "Which city is the capital of France? Answer as JSON."


def _chat(daemon, messages, **fields):
    """A greedy gRPC Chat: (its text, its ToolCall events, its stats), and the events' kinds in order."""
    messages = [pb.ChatMessage(role="user", content=m) if isinstance(m, str) else m for m in messages]
    events = list(rpc.ChatStub(daemon.channel()).Chat(pb.ChatRequest(messages=messages, temperature=0, **fields),
                                                      timeout=180))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-1] == "stats" and kinds.count("stats") == 1, kinds
    return ("".join(e.token for e in events if e.HasField("token")),
            [e.tool_call for e in events if e.HasField("tool_call")], events[-1].stats, kinds)


def test_chat_response_format_json_schema_answers_json_that_follows_it(duckd_daemon):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    text, calls, stats, _ = _chat(duckd_daemon, [CAPITAL_JSON], max_tokens=64, response_format=json.dumps(fmt))
    jsonschema.validate(json.loads(text), CITY)
    assert not calls and stats.finish_reason in ("eos", "stop")
    text, _, _, _ = _chat(duckd_daemon, [CAPITAL_JSON], max_tokens=64, response_format='{"type": "json_object"}')
    assert isinstance(json.loads(text), dict)


def test_chat_forced_tool_calls_come_as_events_and_the_result_feeds_back(duckd_daemon):
    jsonschema = pytest.importorskip("jsonschema")
    params = WEATHER["function"]["parameters"]
    text, calls, stats, kinds = _chat(duckd_daemon, [PARIS_WEATHER], max_tokens=96, tools=json.dumps([WEATHER]),
                                      tool_choice="required")
    assert calls, (text, kinds)
    assert stats.finish_reason == "tool_calls"
    assert kinds.index("tool_call") > max((i for i, k in enumerate(kinds) if k == "token"), default=-1)
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), params)
    # a tool named as the choice, one call only
    _, named, named_stats, _ = _chat(duckd_daemon, [PARIS_WEATHER], max_tokens=96, tools=json.dumps([WEATHER]),
                                     tool_choice="get_weather", parallel_tool_calls=False)
    assert len(named) == 1 and named[0].name == "get_weather" and named_stats.finish_reason == "tool_calls"
    # the result fed back: the assistant's calls and the tool's message render, and the model answers in text
    history = [pb.ChatMessage(role="user", content=PARIS_WEATHER),
               pb.ChatMessage(role="assistant", content=text, tool_calls=calls[:1]),
               pb.ChatMessage(role="tool", tool_call_id=calls[0].id,
                              content=json.dumps({"temperature_c": 18, "sky": "clear"}))]
    answer, more, answer_stats, _ = _chat(duckd_daemon, history, max_tokens=48, tools=json.dumps([WEATHER]),
                                          tool_choice="none")
    assert answer.strip() and not more
    assert answer_stats.finish_reason in ("eos", "stop", "length")
    _, _, bare, _ = _chat(duckd_daemon, [PARIS_WEATHER], max_tokens=1)
    assert answer_stats.input_len > bare.input_len + 10   # the call and its result were rendered


def test_bad_formats_and_tools_are_invalid_argument_naming_the_field(duckd_daemon):
    chat = rpc.ChatStub(duckd_daemon.channel())
    user = [pb.ChatMessage(role="user", content="hi")]
    tools = json.dumps([WEATHER])
    cases = [(dict(response_format="{not json"), "response_format: not JSON text"),
             (dict(response_format="[]"), "response_format = []"),
             (dict(response_format='{"type": "xml"}'), "response_format.type"),
             (dict(tools="[{"), "tools: not JSON text"),
             (dict(tools='[{"type": "function", "function": {}}]'), "tools[0].function.name"),
             (dict(tool_choice="required"), "needs tools"),
             (dict(tools=tools, tool_choice="get_time"), "tool_choice names 'get_time'"),
             (dict(tools=tools, tool_choice="required", response_format='{"type": "json_object"}'),
              "response_format and a forced tool call"),
             (dict(messages=[*user, pb.ChatMessage(role="tool", content="18 C")]), "messages[1].tool_call_id"),
             (dict(messages=[pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(name="f")])]),
              "messages[0].tool_calls")]
    for fields, want in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(chat.Chat(pb.ChatRequest(**{"messages": user, "max_tokens": 8, **fields}), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.value.details(), \
            (fields, e.value.details())


def _ctl(daemon, *args, **kw):
    return duckctl(daemon, "--address", daemon.address, "--token", daemon.token, "chat", "--greedy", *args, **kw)


def test_duckctl_chat_json_schema_prints_json(duckd_daemon, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    r = _ctl(duckd_daemon, "--max-tokens", "64", "--json-schema", str(schema), CAPITAL_JSON)
    assert r.returncode == 0, r.stderr
    text, _, stats = r.stdout.rpartition("\nGeneration stats: ")
    assert stats, r.stdout
    jsonschema.validate(json.loads(text), CITY)


def test_duckctl_chat_tools_prints_each_call_and_keeps_them_in_the_history(duckd_daemon, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    r = _ctl(duckd_daemon, "--max-tokens", "96", "--tools", str(tools), "--tool-choice", "required", PARIS_WEATHER)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    calls = [re.fullmatch(r"tool call: get_weather\((.*)\)", line) for line in lines if line.startswith("tool call:")]
    assert calls and all(calls), r.stdout
    assert all(isinstance(json.loads(m.group(1)), dict) for m in calls)
    assert lines[-1].startswith("Generation stats: ")
    # two turns from stdin: the first answer's calls go back with the second question
    r = _ctl(duckd_daemon, "--json", "--max-tokens", "96", "--tools", str(tools), "--tool-choice", "required",
             input=f"{PARIS_WEATHER}\nAnd in Rome?\n")
    assert r.returncode == 0, r.stderr
    finals = [json.loads(line) for line in r.stdout.splitlines() if '"stats"' in line]
    assert len(finals) == 2 and all(f["tool_calls"] for f in finals), finals
    assert finals[0]["stats"]["finishReason"] == "tool_calls"
    streamed = [json.loads(line)["tool_call"] for line in r.stdout.splitlines() if line.startswith('{"tool_call"')]
    assert streamed == finals[0]["tool_calls"] + finals[1]["tool_calls"]
    # the second prompt holds the first turn's call: more than its question and the answer's text
    first = finals[0]["stats"]
    assert finals[1]["stats"]["inputLen"] >= first["inputLen"] + first["outputLen"], finals


def test_duckctl_chat_bad_files_are_usage_errors(duckd_daemon, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    cases = [(("--json-schema", str(tmp_path / "missing.json")), f"--json-schema {tmp_path / 'missing.json'}: "
                                                                 "cannot read it"),
             (("--json-schema", str(bad)), f"--json-schema {bad}: not JSON"),
             (("--json-schema", str(listed)), "expected a JSON schema object"),
             (("--tools", str(bad)), f"--tools {bad}: not JSON"),
             (("--tools", str(listed)), f"--tools {listed}: tools[0]"),
             (("--tool-choice", "required"), "needs --tools FILE"),
             (("--tools", str(tools), "--tool-choice", "get_time"), "get_time: expected auto, none, required"),
             (("--tools", str(tools), "--tool-choice", "required", "--json-schema", str(schema)), "give one")]
    for args, want in cases:
        r = _ctl(duckd_daemon, *args, "hi")
        assert r.returncode == 2 and want in r.stderr, (args, r.stderr)


def test_grpc_logprobs_describe_the_text_and_duckctl_prints_them(duckd_daemon):
    """ChatRequest.logprobs: after each text, the log-probabilities of its tokens; greedy, each chosen
    token is the likeliest of its alternatives, and the tokens spell the answer."""
    messages = [pb.ChatMessage(role="user", content="Which city is the capital of France?")]
    events = list(rpc.ChatStub(duckd_daemon.channel()).Chat(
        pb.ChatRequest(messages=messages, temperature=0, max_tokens=12, logprobs=3), timeout=180))
    text = "".join(e.token for e in events if e.WhichOneof("event") == "token")
    entries = [x for e in events if e.WhichOneof("event") == "logprobs" for x in e.logprobs.entries]
    assert "Paris" in text and "".join(x.token for x in entries) == text
    for x in entries:
        assert len(x.top) == 3 and x.logprob <= 0 and abs(x.logprob - max(t.logprob for t in x.top)) < 1e-4
    stats = events[-1].stats
    assert len(entries) == stats.output_len - (stats.finish_reason == "eos")
    r = duckctl(duckd_daemon, "--address", duckd_daemon.address, "--token", duckd_daemon.token, "chat", "--greedy",
                "--max-tokens", "6", "--logprobs", "2", "--json", "Which city is the capital of France?")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    read = [x for line in lines if "logprobs" in line for x in line["logprobs"]]
    assert len(read) == 6 and all(len(x["top"]) == 2 for x in read)
    r = duckctl(duckd_daemon, "--address", duckd_daemon.address, "--token", duckd_daemon.token, "chat", "--greedy",
                "--logprobs", "21", "hi")
    assert r.returncode == 2 and "--logprobs" in r.stderr
