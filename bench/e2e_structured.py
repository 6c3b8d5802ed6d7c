"""`duckctl bench e2e --api openai --structured N`: structured output and tool calls as a client
meets them, through the official `openai` client on the daemon's HTTP API.

    1. validity: N prompts for each of 5 JSON schemas sent as OpenAI's strict json_schema (5N
       requests, the daemon's default sampling, a few at a time, `--tokens` max_tokens each): the
       share of outputs that parse and validate under `jsonschema` (the others' reasons listed);
    2. forced tool calls: 5N requests with tool_choice required or a named function over 5 tool
       sets: the share whose every call names a given tool with arguments valid under its schema;
    3. cost: decode tok/s of one greedy stream with a schema active over one without (the same
       prompt, alternated `--runs` times; medians), measured by the client from the first content
       chunk to the last;
    4. n = 4 choices of one request against one choice (a ~400-token prompt, sampled, 48 tokens
       each, alternated `--runs` times): the request's wall time over one choice's (medians), and
       the prompt tokens the daemon read (from /metrics: prompt tokens less those found cached)
       over the prompt's length.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time

STRING = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": STRING, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 130},
                                                "email": STRING}, "required": ["name", "age"],
               "additionalProperties": False},
    "movie": {"type": "object", "properties": {"title": STRING, "year": {"type": "integer", "minimum": 1880,
                                                                         "maximum": 2030},
                                               "genres": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 20},
                                                          "maxItems": 3}},
              "required": ["title", "year", "genres"], "additionalProperties": False},
    "recipe": {"type": "object", "properties": {"dish": STRING, "servings": {"type": "integer", "minimum": 1,
                                                                             "maximum": 20},
                                                "ingredients": {"type": "array", "maxItems": 6, "items": {
                                                    "type": "object", "properties": {"item": STRING,
                                                                                     "grams": {"type": "number"}},
                                                    "required": ["item", "grams"]}}},
               "required": ["dish", "servings", "ingredients"]},
    "weather": {"type": "object", "properties": {"city": STRING, "celsius": {"type": "number"},
                                                 "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
                "required": ["city", "celsius", "sky"], "additionalProperties": False},
    "answer": {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 120},
                                                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                                "sources": {"type": "array", "items": STRING, "maxItems": 2}},
               "required": ["answer", "confidence"]},
}
SUBJECTS = ["a scientist", "a famous film", "a dessert", "Paris in spring", "the tallest mountain", "a jazz album",
            "a river in Africa", "a chess champion", "a soup", "Tokyo in winter"]


def _tool(name: str, description: str, **properties) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


TOOLS = [
    [_tool("get_weather", "The weather of a city.", city=STRING, unit={"enum": ["celsius", "fahrenheit"]})],
    [_tool("search", "Searches the web.", query=STRING), _tool("open_url", "Opens a page.", url=STRING)],
    [_tool("add", "Adds two numbers.", a={"type": "number"}, b={"type": "number"})],
    [_tool("book_table", "Books a restaurant table.", restaurant=STRING, people={"type": "integer", "minimum": 1,
                                                                                 "maximum": 12}, time=STRING)],
    [_tool("send_email", "Sends an email.", to=STRING, subject=STRING, body={"type": "string", "maxLength": 120})],
]
TOOL_ASKS = ["What is the weather in {}?", "Find something about {}.", "What is 17 plus {}?",
             "Book a table for {} people tonight.", "Email Ann about {}."]


def _valid(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


async def _validity(client, model: str, n: int, parallel: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(parallel)
    failed = []

    async def one(name: str, i: int) -> bool:
        async with gate:
            r = await client.chat.completions.create(
                model=model, max_tokens=max_tokens, messages=[{"role": "user", "content": f"Describe "
                                                               f"{SUBJECTS[i % 10]} as JSON ({name})."}],
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                        "strict": True}})
        ok = _valid(r.choices[0].message.content, SCHEMAS[name])
        if not ok:
            failed.append({"schema": name, "finish_reason": r.choices[0].finish_reason,
                           "text": r.choices[0].message.content[:160]})
        return ok

    done = await asyncio.gather(*(one(name, i) for name in SCHEMAS for i in range(n)))
    return {"requests": len(done), "valid": sum(done), "max_tokens": max_tokens, "failed": failed}


async def _tool_calls(client, model: str, n: int, parallel: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(parallel)
    failed = []

    async def one(k: int, i: int) -> bool:
        tools = TOOLS[k]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
        async with gate:
            r = await client.chat.completions.create(
                model=model, max_tokens=max_tokens, tools=tools, tool_choice=choice,
                messages=[{"role": "user", "content": TOOL_ASKS[k].format(SUBJECTS[i % 10] if k != 2 else i)}])
        message = r.choices[0].message
        calls = message.tool_calls or []
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        ok = bool(calls) and all(c.function.name in schemas and _valid(c.function.arguments,
                                                                        schemas[c.function.name]) for c in calls)
        if not ok:
            failed.append({"tools": k, "finish_reason": r.choices[0].finish_reason, "calls": len(calls),
                           "content": (message.content or "")[:160]})
        return ok

    done = await asyncio.gather(*(one(k, i) for k in range(len(TOOLS)) for i in range(n)))
    return {"requests": len(done), "parsed": sum(done), "max_tokens": max_tokens, "failed": failed}


async def _rate(client, model: str, schema: dict | None, tokens: int) -> float:
    """One greedy stream's decode tok/s, measured by the client."""
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}} \
        if schema else {}
    stream = await client.chat.completions.create(
        model=model, max_tokens=tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Describe a recipe for a soup with its ingredients and their grams."}],
        **extra)
    stamps, usage = [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return (usage.completion_tokens - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def _metric(client, name: str) -> float:
    """A counter of the daemon's /metrics (the client's base URL and token)."""
    import urllib.request
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {client.api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(f"{name} is not in {url}")


async def _choices(client, model: str, runs: int) -> dict:
    """n = 4 against n = 1 on one prompt: wall time and prompt tokens read."""
    facts = " ".join(f"Fact {i}: the {SUBJECTS[i % 10]} number {i} is {i * 37 % 101}." for i in range(30))
    wall = {1: [], 4: []}
    read = []
    for r in range(runs):
        for n in (4, 1):   # each its own prompt: nothing of it in the prefix cache before
            messages = [{"role": "user", "content": f"Request {r}.{n}. {facts}\nWrite one sentence about fact 7."}]
            before = [await asyncio.to_thread(_metric, client, m) for m in
                      ("duck_prompt_tokens_total", "duck_prompt_tokens_cached_total")]
            t0 = time.perf_counter()
            out = await client.chat.completions.create(model=model, messages=messages, max_tokens=48, n=n,
                                                       temperature=0.8, seed=100 + r)
            wall[n].append(time.perf_counter() - t0)
            after = [await asyncio.to_thread(_metric, client, m) for m in
                     ("duck_prompt_tokens_total", "duck_prompt_tokens_cached_total")]
            if n == 4:
                assert len(out.choices) == 4
                read.append(((after[0] - before[0]) - (after[1] - before[1])) / out.usage.prompt_tokens)
    one, four = statistics.median(wall[1]), statistics.median(wall[4])
    return {"prompt_tokens": out.usage.prompt_tokens, "wall_s": {"n1": wall[1], "n4": wall[4]},
            "n4_over_n1": four / one, "n4_prompt_reads": read}


async def run(client, model: str, n: int, runs: int, parallel: int, log, max_tokens: int = 512) -> dict:
    t0 = time.perf_counter()
    valid = await _validity(client, model, n, parallel, max_tokens)
    log(f"schemas: {valid['valid']}/{valid['requests']} outputs valid ({time.perf_counter() - t0:.0f} s)")
    t0 = time.perf_counter()
    calls = await _tool_calls(client, model, n, parallel, max_tokens)
    log(f"forced tool calls: {calls['parsed']}/{calls['requests']} parse and follow their schemas "
        f"({time.perf_counter() - t0:.0f} s)")
    plain, schema = [], []
    recipe = {**SCHEMAS["recipe"], "properties": {**SCHEMAS["recipe"]["properties"], "ingredients": {
        **SCHEMAS["recipe"]["properties"]["ingredients"], "maxItems": 40}}}
    for _ in range(runs):
        plain.append(await _rate(client, model, None, 160))
        schema.append(await _rate(client, model, recipe, 160))
    ratio = statistics.median(schema) / statistics.median(plain)
    log(f"decode: {statistics.median(schema):.1f} tok/s with a schema, {statistics.median(plain):.1f} without "
        f"({ratio:.3f}x)")
    choices = await _choices(client, model, runs)
    log(f"n = 4: {choices['n4_over_n1']:.2f}x one choice's time; prompt read "
        f"{statistics.median(choices['n4_prompt_reads']):.2f} times ({choices['prompt_tokens']} tokens)")
    return {"structured": {"schemas": valid, "tool_calls": calls,
                           "decode_tok_s": {"schema": schema, "plain": plain},
                           "decode_schema_over_plain": ratio, "choices": choices}}
