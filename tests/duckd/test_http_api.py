"""The OpenAI-compatible HTTP API and /metrics on the shared real daemon, through the
official `openai` client: chat (streamed and whole), completions, models, usage, stop;
a wrong token is 401 and bad parameters are 400 naming the field, in OpenAI's error
shape; /metrics parses with prometheus_client and carries every duck."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.test_deepseek_mtp import mtp_checkpoint  # noqa: F401 (fixture: tiny DeepSeek-V3 + nextn layer)

QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]


@pytest.fixture(scope="module")
def client(duckd_daemon):
    return openai.OpenAI(base_url=f"http://{duckd_daemon.http_address}/v1", api_key=duckd_daemon.token,
                         max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _get(daemon, path: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{daemon.http_address}{path}",
                                 headers={"Authorization": f"Bearer {token or daemon.token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] and model.endswith(".gguf") and models[0].owned_by == "duck"


def test_chat_whole_and_streamed_agree(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.choices[0].message.role == "assistant"
    assert whole.object == "chat.completion" and whole.usage.prompt_tokens > 0
    assert whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text, "greedy: the stream carries the same text"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_and_length(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_seeded_sampling_repeats(client, model):
    a, b = (client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0.9,
                                           top_p=0.9, seed=7).choices[0].message.content for _ in range(2))
    assert a == b


def test_the_next_turn_of_a_chat_reads_only_its_new_tokens(duckd_daemon, client, model):
    """The prefix cache (engine.batch): a chat's second turn finds its first turn (prompt and
    answer) in the slot that turn left, says so in usage.prompt_tokens_details.cached_tokens
    and /metrics, and reads only what is new."""
    history = [{"role": "system", "content": "You answer in one short sentence. " * 8}, *QUESTION]
    first = client.chat.completions.create(model=model, messages=history, max_tokens=16, temperature=0)
    answer = first.choices[0].message.content
    history += [{"role": "assistant", "content": answer},
                {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens, (first.usage, second.usage)
    assert "Rome" in second.choices[0].message.content
    _, body = _get(duckd_daemon, "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert [s.value for s in families["duck_prompt_tokens_cached"].samples if s.name.endswith("_total")][0] >= cached


def test_logprobs_whole_and_streamed_agree_and_describe_the_text(client, model):
    """logprobs + top_logprobs on chat (whole and streamed: the same entries, the tokens spelling
    the text, greedy tokens their own top alternative) and logprobs on completions (OpenAI's
    legacy shape, offsets into the text)."""
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    text = whole.choices[0].message.content
    assert len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    assert "".join(c.token for c in content).strip() == text.strip()
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                                      logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == plain.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) <= 2 and max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3).choices[0].logprobs is None


def test_n_choices_whole_and_streamed(client, model):
    """n: each choice a sequence of the batch, the prompt read once (the others copy it: the usage
    counts it once, and every choice's own prompt reading shows in /metrics' cached tokens);
    greedy choices are the single answer, sampled ones follow seed, seed + 1, ..."""
    one = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    three = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    sampled = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0,
                                             seed=7, n=2)
    alone = [client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0,
                                            seed=s).choices[0].message.content for s in (7, 8)]
    assert [c.message.content for c in sampled.choices] == alone
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
    assert sum(1 for ch in chunks for c in ch.choices if c.finish_reason) == 2
    assert chunks[-1].usage.completion_tokens == 2 * one.usage.completion_tokens


def test_frequency_and_presence_penalties_change_a_repetitive_answer(client, model):
    ask = [{"role": "user", "content": "Repeat the word duck twenty times."}]
    base = client.chat.completions.create(model=model, messages=ask, max_tokens=24, temperature=0)
    pen = client.chat.completions.create(model=model, messages=ask, max_tokens=24, temperature=0,
                                         frequency_penalty=2.0, presence_penalty=1.0)
    text, other = base.choices[0].message.content, pen.choices[0].message.content
    assert text != other and text.lower().count("duck") > other.lower().count("duck"), (text, other)


def test_wrong_token_is_401_in_openai_shape(duckd_daemon, model):
    bad = openai.OpenAI(base_url=f"http://{duckd_daemon.http_address}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    status, body = _get(duckd_daemon, "/metrics", token="nope")
    assert status == 401 and json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 7}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 9}, "n"),
    ({"n": 0}, "n"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "messages[1].role"),
    ({"messages": []}, "messages"),
])
def test_bad_parameters_are_400_naming_the_field(client, model, kwargs, param):
    args = {"model": model, "messages": QUESTION, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and param.split("[")[0] in e.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=2)
    assert "gpt-9" in e.value.body["message"]


def test_metrics_parse_and_carry_every_duck(duckd_daemon, client, model):
    client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, temperature=0)
    status, body = _get(duckd_daemon, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    ducks = {s.labels["duck"] for s in families["duck_state"].samples}
    assert ducks == {str(d.id) for d in duckd_daemon.ducks()}
    serving = {s.labels["duck"] for s in families["duck_state"].samples
               if s.labels["state"] == "SERVING" and s.value == 1}
    assert serving, "some duck is SERVING"
    for name in ("duck_read_gbps", "duck_rtt_seconds", "duck_errors", "duck_retransmits", "duck_restarts",
                 "duck_bytes_streamed", "duck_requests_queued", "duck_requests_running",
                 "duck_time_to_first_token_seconds", "duck_time_per_output_token_seconds", "duck_request_seconds",
                 "duck_prompt_tokens", "duck_generated_tokens", "duck_requests", "duck_host_retransmits",
                 "duck_host_timeouts", "duck_host_sent_twice", "duck_host_lossy_verdicts"):
        assert name in families, name
    out = [s.value for s in families["duck_generated_tokens"].samples if s.name.endswith("_total")]
    assert out and out[0] >= 3
    # loopback loses nothing: no link was found lossy (one decode forward in 16 went twice, a probe)
    assert [s.value for s in families["duck_host_lossy_verdicts"].samples if s.name.endswith("_total")] == [0]
    assert [s.value for s in families["duck_host_sent_twice"].samples if s.name.endswith("_total")][0] > 0


def test_a_full_queue_answers_429_and_the_rest_complete(tmp_path):
    """max_queued = 1, one sequence at a time: of six concurrent streams, the ones beyond the
    running one and the one queued get 429 with OpenAI's error shape; every accepted one completes."""
    import asyncio

    from tests.duckd_fixture import RunningDaemon, write_config

    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, model={"max_queued": 1, "max_seqs": 1}), state,
                           env={"XDG_STATE_HOME": str(tmp_path)}).start()
    try:
        client = openai.AsyncOpenAI(base_url=f"http://{daemon.http_address}/v1", api_key=daemon.token,
                                    max_retries=0, timeout=180)

        async def one(i: int):
            try:
                r = await client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                    max_tokens=24, temperature=0)
                return r.usage.completion_tokens
            except openai.RateLimitError as e:
                assert e.status_code == 429 and "max_queued" in e.body["message"], e.body
                return "busy"

        async def all_of_them():
            return await asyncio.gather(*(one(i) for i in range(6)))

        results = asyncio.run(all_of_them())
        assert "busy" in results, results
        assert any(r != "busy" for r in results) and all(r == "busy" or r > 0 for r in results), results
    finally:
        daemon.stop()


def test_mtp_in_serving_is_greedy_identical_and_reports_acceptance(tmp_path, mtp_checkpoint):
    """A tiny DeepSeek-V3 with an MTP head on a 2-duck fleet, served (continuous batching) with
    model.mtp true and false: the same greedy completion; acceptance in the stats and /metrics."""
    from tests.duckd_fixture import RunningDaemon, write_config

    texts, stats = {}, {}
    for mtp in (True, False):
        state = tmp_path / f"mtp-{mtp}"
        daemon = RunningDaemon(write_config(tmp_path / f"duckd-{mtp}.toml", state, ducks=2,
                                            model={"path": str(mtp_checkpoint), "mtp": mtp, "device": "cpu"}),
                               state, env={"XDG_STATE_HOME": str(tmp_path)}).start()
        try:
            client = openai.OpenAI(base_url=f"http://{daemon.http_address}/v1", api_key=daemon.token, max_retries=0)
            r = client.completions.create(model="default", prompt="w5 w9 w12 w33 w7", max_tokens=24, temperature=0)
            texts[mtp] = r.choices[0].text
            status, body = _get(daemon, "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(body.decode())}
            stats[mtp] = [s.value for s in families["duck_mtp_drafts_verified"].samples if s.name.endswith("_total")]
            # served by the batch (max_seqs 32), which drafts with the MTP layer when mtp is on
            assert f"continuous batching (torch path{', MTP drafts' if mtp else ''}, prefix cache)" in daemon.log()
            # a healthy fleet shows no errors: the host's early resends (its timer running out while a duck
            # stores an upload) are the ducks' early_resends, not drops
            assert [(d.errors, d.drops) for d in daemon.ducks()] == [(0, 0)] * 2, daemon.ducks()
        finally:
            daemon.stop()
    assert texts[True] == texts[False] and texts[True]
    assert stats[True][0] > 0 and stats[False][0] == 0


def test_requests_without_sampling_settings_take_the_checkpoints(tmp_path, mtp_checkpoint):
    """generation_config.json (greedy with a repetition penalty) is what a request naming no
    sampling settings gets; one that names them gets its own."""
    import json
    import shutil

    from engine.generate import generate
    from engine.tokens import SamplingParams
    from engine.loader import load_model
    from tests.duckd_fixture import RunningDaemon, write_config

    folder = tmp_path / "ckpt"
    shutil.copytree(mtp_checkpoint, folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 1.8}))
    lm = load_model(folder, device="cpu")
    prompt = "w5 w9 w12 w33 w7"
    ids = lm.tokenizer.encode(prompt, add_special_tokens=True)
    want = {pen: generate(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=16, repetition_penalty=pen)).text
            for pen in (1.8, 1.0)}
    assert want[1.8] != want[1.0], "the penalty changes nothing here: pick another prompt"
    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2,
                                        model={"path": str(folder), "device": "cpu", "mtp": False}),
                           state, env={"XDG_STATE_HOME": str(tmp_path)}).start()
    try:
        client = openai.OpenAI(base_url=f"http://{daemon.http_address}/v1", api_key=daemon.token, max_retries=0)
        got = client.completions.create(model="default", prompt=prompt, max_tokens=16).choices[0].text
        mine = client.completions.create(model="default", prompt=prompt, max_tokens=16,
                                         extra_body={"repetition_penalty": 1.0}).choices[0].text
    finally:
        daemon.stop()
    assert got == want[1.8] and mine == want[1.0]


# a value of each refused field that asks for something duckd does not serve, and one that asks for nothing
ASKS = {"functions": ([{"name": "f", "parameters": {"type": "object"}}], []),
        "function_call": ({"name": "f"}, "none"),
        "logit_bias": ({"42": 5}, {}), "modalities": (["text", "audio"], ["text"]),
        "audio": ({"voice": "alloy", "format": "wav"}, None), "prediction": ({"type": "content", "content": "x"}, None),
        "reasoning_effort": ("high", None), "web_search_options": ({}, None), "verbosity": ("low", None),
        "moderation": ({"model": "m"}, None), "prompt_cache_retention": ("24h", None),
        "prompt_cache_options": ({"ttl": 1}, None), "store": (True, False), "metadata": ({"k": "v"}, {}),
        "service_tier": ("flex", "auto"), "echo": (True, False), "best_of": (2, 1), "suffix": ("end", None)}


def test_every_openai_request_field_is_honoured_or_refused_by_name(client, model):
    """Walks the request fields of the installed openai client's chat and completions params: each
    is one duckd reads, or one it accepts only when it asks for nothing, a 400 naming it otherwise.
    A field a newer client adds fails here until it is placed in one of the two."""
    from openai.types import completion_create_params as plain
    from openai.types.chat import completion_create_params as chat

    from duckd.openai_request import HONOURED, OFF_ONLY
    fields = {"chat": set(chat.CompletionCreateParamsBase.__annotations__),
              "completions": set(plain.CompletionCreateParamsBase.__annotations__)}
    unplaced = (fields["chat"] | fields["completions"]) - HONOURED - set(OFF_ONLY)
    assert not unplaced, f"OpenAI request fields duckd neither serves nor refuses: {sorted(unplaced)}"
    assert set(ASKS) == set(OFF_ONLY)
    for kind, names in fields.items():
        for name in sorted(names & set(OFF_ONLY)):
            asks, nothing = ASKS[name]
            base = ({"messages": QUESTION} if kind == "chat" else {"prompt": "The capital of France is"})
            create = client.chat.completions.create if kind == "chat" else client.completions.create
            with pytest.raises(openai.BadRequestError) as e:
                create(model=model, max_tokens=2, extra_body={name: asks}, **base)
            assert e.value.param == name and name in e.value.body["message"], (kind, name, e.value.body)
            out = create(model=model, max_tokens=2, extra_body={name: nothing}, **base)
            assert out.choices and out.usage.completion_tokens >= 1, (kind, name)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, extra_body={"min_p": 0.1})
    assert e.value.param == "min_p" and "refused rather than ignored" in e.value.body["message"]


def test_a_bad_message_field_is_refused_and_developer_is_the_system_role(client, model):
    call = {"role": "user", "content": "x",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=2, messages=[*QUESTION, call])
    assert e.value.param == "messages[1].tool_calls", e.value.body   # a user's message makes no calls
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=2, messages=[{**QUESTION[0], "audio": {"id": "a"}}])
    assert e.value.param == "messages[0].audio", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=2, messages=QUESTION,
                                       stream=True, stream_options={"include_usage": True, "extra": 1})
    assert e.value.param == "stream_options.extra", e.value.body
    out = client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                         messages=[{"role": "developer", "content": "Answer briefly."}, *QUESTION])
    ref = client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                         messages=[{"role": "system", "content": "Answer briefly."}, *QUESTION])
    assert out.choices[0].message.content == ref.choices[0].message.content
