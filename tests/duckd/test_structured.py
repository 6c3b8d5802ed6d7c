"""Structured output and tool calls through the OpenAI API of the shared real daemon (SmolLM2, a
local fleet), with real clients: the `openai` client (sync, async, streamed,
chat.completions.parse with a pydantic model) and the OpenAI Agents SDK's tool-calling loop.
response_format's JSON object and schema, duckd's regex and grammar; forced tool calls (required,
a named function, one or parallel) whose arguments always parse and follow the schema, whole and
as delta.tool_calls; a tool's result fed back; bad formats and tools are 400s naming the field."""
from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from tests.duckd.test_http_api import client, model  # noqa: F401 - the fixtures: the openai client, the model

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
MOVIE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                          "year": {"type": "integer", "minimum": 1880, "maximum": 2030},
                                          "genres": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                     "maxItems": 3}},
         "required": ["title", "year", "genres"], "additionalProperties": False}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_object_and_schema_whole_and_streamed(client, model):
    ask = [{"role": "user", "content": "Describe a famous movie as JSON."}]
    obj = client.chat.completions.create(model=model, messages=ask, max_tokens=120, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert obj.choices[0].finish_reason == "stop"
    whole = client.chat.completions.create(model=model, messages=ask, max_tokens=120, temperature=0,
                                           response_format=_schema_format(MOVIE))
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), MOVIE)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=ask, max_tokens=120, temperature=0, response_format=_schema_format(MOVIE),
        stream=True) if c.choices)
    assert streamed == text
    sampled = client.chat.completions.create(model=model, messages=ask, max_tokens=120, temperature=1.0, seed=3,
                                             n=3, response_format=_schema_format(MOVIE))
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), MOVIE)


def test_parse_with_a_pydantic_model_and_the_async_client(duckd_daemon, client, model):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=40)
        country: str = Field(max_length=40)
        founded: int = Field(ge=0, le=2100)

    done = client.chat.completions.parse(model=model, max_tokens=80, temperature=0, response_format=City,
                                         messages=[{"role": "user", "content": "Which city is the capital of "
                                                                               "France? Answer as JSON."}])
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.city

    async def streamed() -> str:
        aclient = openai.AsyncOpenAI(base_url=f"http://{duckd_daemon.http_address}/v1",
                                     api_key=duckd_daemon.token, max_retries=0, timeout=180)
        try:
            out = []
            async for chunk in await aclient.chat.completions.create(
                    model=model, max_tokens=80, temperature=0, stream=True,
                    response_format=_schema_format(City.model_json_schema()),
                    messages=[{"role": "user", "content": "Which city is the capital of France? Answer as JSON."}]):
                out += [chunk.choices[0].delta.content or ""] if chunk.choices else []
            return "".join(out)
        finally:
            await aclient.close()

    assert City.model_validate_json(asyncio.run(streamed())) == city


def test_regex_and_grammar_extensions(client, model):
    date = client.chat.completions.create(model=model, max_tokens=20, temperature=0,
                                          messages=[{"role": "user", "content": "When did WW2 end?"}],
                                          response_format={"type": "regex", "regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].message.content)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    yes_no = client.completions.create(model=model, prompt="Is Paris in France?", max_tokens=12, temperature=0,
                                       extra_body={"response_format": {"type": "grammar", "grammar": lark}})
    assert yes_no.choices[0].text in ("The answer is yes.", "The answer is no.")


def _check_call(call, tools=(WEATHER,)):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_forced_tool_calls_parse_whole_and_streamed_and_the_result_feeds_back(client, model):
    forced = client.chat.completions.create(model=model, messages=PARIS, max_tokens=200, temperature=0,
                                            tools=[WEATHER, TIME], tool_choice="required")
    message = forced.choices[0].message
    assert forced.choices[0].finish_reason == "tool_calls" and message.tool_calls and not message.content
    for call in message.tool_calls:
        _check_call(call, (WEATHER, TIME))
    named = client.chat.completions.create(model=model, messages=PARIS, max_tokens=200, temperature=0,
                                           tools=[WEATHER, TIME], parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    _check_call(calls[0], (TIME,))
    chunks = list(client.chat.completions.create(model=model, messages=PARIS, max_tokens=200, temperature=0,
                                                 tools=[WEATHER], tool_choice="required", stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == list(range(len(deltas))) and deltas
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in client.chat.completions.create(
            model=model, messages=PARIS, max_tokens=200, temperature=0, tools=[WEATHER],
            tool_choice="required").choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    history = [*PARIS, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})}]
    answer = client.chat.completions.create(model=model, messages=history, max_tokens=40, temperature=0,
                                            tools=[WEATHER, TIME], tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
     "response_format"),
    ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*PARIS, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
])
def test_bad_formats_and_tools_are_400_naming_the_field(client, model, kwargs, param):
    args = {"model": model, "messages": PARIS, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body


def test_an_agent_frameworks_tool_loop(duckd_daemon, model):
    """The OpenAI Agents SDK against the daemon, as its users point it at a local server: the agent
    must call the tool (tool_choice required for its first turn), gets the result, and answers."""
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        seen.append(city)
        return f"It is 18 degrees and sunny in {city}."

    aclient = openai.AsyncOpenAI(base_url=f"http://{duckd_daemon.http_address}/v1", api_key=duckd_daemon.token,
                                 max_retries=0, timeout=180)
    agent = Agent(name="weather", instructions="You answer questions about the weather with the tool.",
                  model=OpenAIChatCompletionsModel(model=model, openai_client=aclient), tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))

    async def run():
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await aclient.close()

    result = asyncio.run(run())
    assert seen and isinstance(seen[0], str) and seen[0]
    assert isinstance(result.final_output, str) and result.final_output
    assert agents.__name__ == "agents"
