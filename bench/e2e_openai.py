"""`duckctl bench e2e --api openai`: the serving bar as a user meets it, through the
official `openai` client on the daemon's OpenAI-compatible HTTP API.

    1. every prompt alone, one after another (greedy, `--tokens` each): the texts the
       concurrent run must reproduce, and one stream's decode rate;
    2. `--rounds` times: a few single streams (this round's one-stream rate), then
       all `--streams` prompts at once: texts compared with the alone pass, the rate
       while all decode (bench.e2e.all_decoding) over the round's one-stream rate,
       TTFT quantiles, the slowest `status` (gRPC ListDucks, every 0.2 s) meanwhile;
    3. with `--flood N`: N streams at once, each must complete or get 429 (the bounded
       queue), within `--flood-timeout` seconds: nothing hangs, nothing is lost.

With `--structured N` instead: structured output and forced tool calls (bench/e2e_structured.py).

With `--turns N` instead: the prefix cache as a chat meets it. `--rounds` chats of two
turns, each on a document of its own of about N prompt tokens: the second turn (the
first's answer, then a short question) streamed after the first, its TTFT over the
first's, and the prompt tokens the daemon says it found cached
(usage.prompt_tokens_details.cached_tokens). Run it against a daemon with
`model.prefix_cache = false` for the figures without the cache.

A stream's decode rate is measured by the client: (completion tokens - 1) over the time
from its first content chunk to its last. Exit status 3 when a concurrent text differs
from its alone text, a stream failed, or the flood lost or hung a request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from bench.e2e import all_decoding
from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc

TOPICS = ["ducks", "rivers", "bread", "the moon", "trains", "music", "snow", "bees", "clocks", "tea", "maps",
          "boats", "paper", "stars", "salt", "glass"]


def prompt(i: int) -> str:
    return f"Write a short story about {TOPICS[i % len(TOPICS)]} and the number {i}."


def _quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


async def _stream(client, model: str, i: int | list[dict], tokens: int) -> dict:
    """One greedy streamed chat (prompt(i), or the messages i): its text, chunk times, TTFT,
    client-side decode rate and usage."""
    messages = [{"role": "user", "content": prompt(i)}] if isinstance(i, int) else i
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    parts, stamps, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    n = usage.completion_tokens if usage is not None else len(stamps)
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    details = getattr(usage, "prompt_tokens_details", None)
    return {"text": "".join(parts), "stamps": stamps, "tokens": n, "ttft_s": stamps[0] - t0 if stamps else None,
            "decode_tok_s": (n - 1) / span if span > 0 else None,
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details is not None else None}


def document(n_tokens: int, seed: int) -> str:
    """A made-up ledger of about n_tokens tokens (~19 a line in a BPE vocabulary), different for every seed."""
    lines = []
    for i in range(max(1, n_tokens // 19)):
        k = seed * 7919 + i
        lines.append(f"Row {i}: {TOPICS[k % len(TOPICS)]}, {k * 37 % 1009} units, shelf {k % 97}.")
    return "\n".join(lines)


async def _turns(client, model: str, n_tokens: int, tokens: int, rounds: int) -> dict:
    """--turns: two-turn chats on long documents; the second turn's TTFT over the first's."""
    chats, run = [], time.time_ns() % 1_000_003   # documents of this run only: no earlier run's cache helps
    for r in range(rounds):
        history = [{"role": "user", "content": f"Here is ledger {run}-{r}.\n" + document(n_tokens, run + r)
                    + "\nWhich topic appears in row 3?"}]
        first = await _stream(client, model, history, tokens)
        history += [{"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": "And in row 5?"}]
        second = await _stream(client, model, history, tokens)
        chat = {"first_prompt_tokens": first["prompt_tokens"], "first_ttft_s": first["ttft_s"],
                "second_prompt_tokens": second["prompt_tokens"], "second_cached_tokens": second["cached_tokens"],
                "second_ttft_s": second["ttft_s"], "ttft_ratio": second["ttft_s"] / first["ttft_s"]}
        chats.append(chat)
        print(f"chat {r + 1}: first turn {chat['first_prompt_tokens']} prompt tokens, TTFT {chat['first_ttft_s']:.3f} s;"
              f" second {chat['second_prompt_tokens']} ({chat['second_cached_tokens']} cached), TTFT "
              f"{chat['second_ttft_s']:.3f} s = {chat['ttft_ratio']:.3f}x", file=sys.stderr)
    return {"chats": chats, "ttft_ratio_median": statistics.median(c["ttft_ratio"] for c in chats)}


async def _status_while(fleet, tasks) -> list[float]:
    """Times `status` (ListDucks over gRPC) every 0.2 s until the tasks are done."""
    times = []
    while not all(t.done() for t in tasks):
        s0 = time.perf_counter()
        await asyncio.to_thread(fleet.List, pb.ListDucksRequest(), timeout=30)
        times.append(time.perf_counter() - s0)
        await asyncio.sleep(0.2)
    return times


async def _concurrent(client, model: str, fleet, n: int, tokens: int, alone: list[str]) -> dict:
    tasks = [asyncio.create_task(_stream(client, model, i, tokens)) for i in range(n)]
    t0 = time.perf_counter()
    status = await _status_while(fleet, tasks)
    wall = time.perf_counter() - t0
    done = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [f"{type(r).__name__}: {str(r)[:200]}" for r in done if isinstance(r, BaseException)]
    ok = [r for r in done if not isinstance(r, BaseException)]
    differ = [i for i, r in enumerate(done) if isinstance(r, BaseException) or r["text"] != alone[i]]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens_out = sum(r["tokens"] for r in ok)
    return {"streams": n, "wall_s": wall, "tokens_out": tokens_out, "aggregate_tok_s": tokens_out / wall,
            **all_decoding([r["stamps"] for r in ok] if not errors else [[] for _ in done]),
            "identical_to_alone": n - len(differ), "differ": differ,
            "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p99_s": _quantile(ttfts, 0.99),
            "errors": len(errors), "error_examples": errors[:3], "status_max_s": max(status, default=0.0)}


async def _flood(client, model: str, n: int, tokens: int, timeout: float) -> dict:
    import openai

    async def one(i: int) -> str:
        try:
            r = await _stream(client, model, i, tokens)
            return "completed" if r["tokens"] > 0 else "empty"
        except openai.RateLimitError:
            return "busy"
        except Exception as e:  # noqa: BLE001 - counted and reported
            return f"error: {type(e).__name__}: {str(e)[:160]}"
    t0 = time.perf_counter()
    try:
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout)
        hung = False
    except asyncio.TimeoutError:
        results, hung = [], True
    other = [r for r in results if r not in ("completed", "busy")]
    return {"streams": n, "completed": results.count("completed"), "busy_429": results.count("busy"),
            "other": len(other), "other_examples": other[:3], "hung": hung, "wall_s": time.perf_counter() - t0}


def _ready(endpoint) -> bool:
    import urllib.error
    import urllib.request

    ctx = endpoint.tls.ssl_context() if endpoint.tls else None
    try:
        with urllib.request.urlopen(f"{endpoint.http_url}/health", timeout=5, context=ctx) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):   # 503 while the fleet or the model loads, or not listening yet
        return False


async def _wait_ready(endpoint, timeout: float) -> None:
    """Until duckd's /health says ready."""
    deadline, said = time.monotonic() + timeout, False
    while not await asyncio.to_thread(_ready, endpoint):
        if time.monotonic() > deadline:
            raise TimeoutError(f"duckd at {endpoint.http_url} was not ready within {timeout:.0f} s")
        if not said:
            print("waiting for duckd to be ready (fleet, model)", file=sys.stderr)
            said = True
        await asyncio.sleep(0.5)


async def run(args, endpoint, fleet) -> dict:
    import openai

    await _wait_ready(endpoint, args.ready_timeout)
    # with TLS, the daemon's certificate as the client's trust (openai's HTTP client takes verify=)
    tls = {"http_client": openai.DefaultAsyncHttpxClient(verify=endpoint.tls.ssl_context())} if endpoint.tls else {}
    async with openai.AsyncOpenAI(base_url=f"{endpoint.http_url}/v1", api_key=endpoint.token,
                                  max_retries=0, timeout=args.flood_timeout, **tls) as client:
        model = (await client.models.list()).data[0].id
        if args.structured:
            from bench.e2e_structured import run as structured
            print(f"{model} at {endpoint.http_url}/v1: {5 * args.structured} schema requests, as many forced tool "
                  f"calls, {args.runs} decode rates with and without a schema", file=sys.stderr)
            return {"api": "openai", "model": model, **await structured(
                client, model, args.structured, args.runs, min(args.streams, 8),
                lambda line: print(line, file=sys.stderr), args.tokens)}
        if args.turns:
            print(f"{model} at {endpoint.http_url}/v1: {args.rounds} chats of two turns, the first on ~{args.turns} "
                  "prompt tokens", file=sys.stderr)
            return {"api": "openai", "model": model, "tokens": args.tokens, "turns": args.turns,
                    **await _turns(client, model, args.turns, args.tokens, args.rounds)}
        print(f"{model} at {endpoint.http_url}/v1: {args.streams} prompts alone, then together "
              f"({args.rounds} rounds of {args.runs} single streams + {args.streams} at once)", file=sys.stderr)
        alone = [await _stream(client, model, i, args.tokens) for i in range(args.streams)]
        texts = [r["text"] for r in alone]
        result = {"api": "openai", "model": model, "tokens": args.tokens,
                  "alone": {"prompts": len(alone),
                            "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in alone
                                                                     if r["decode_tok_s"]),
                            "ttft_s_median": statistics.median(r["ttft_s"] for r in alone if r["ttft_s"])}}
        rounds = []
        for _ in range(args.rounds):
            singles = [await _stream(client, model, i, args.tokens) for i in range(args.runs)]
            one = statistics.median(r["decode_tok_s"] for r in singles if r["decode_tok_s"])
            c = await _concurrent(client, model, fleet, args.streams, args.tokens, texts)
            c["one_stream_decode_tok_s"] = one
            both = c["all_decoding_tok_s"]
            c["all_decoding_over_one_stream"] = both / one if both is not None else None
            c["aggregate_over_one_stream"] = c["aggregate_tok_s"] / one
            rounds.append(c)
            print(f"round {len(rounds)}: one stream {one:.1f} tok/s; {args.streams} at once: "
                  f"{c['identical_to_alone']}/{args.streams} identical to alone, while all decode "
                  + (f"{both:.1f} tok/s ({c['all_decoding_over_one_stream']:.2f}x)" if both else "(no overlap)")
                  + f", TTFT p99 {c['ttft_p99_s']:.2f} s, status <= {c['status_max_s']:.3f} s, "
                  f"{c['errors']} errors", file=sys.stderr)
        result["rounds"] = rounds
        ratios = [c["all_decoding_over_one_stream"] for c in rounds if c["all_decoding_over_one_stream"]]
        result["median_all_decoding_over_one_stream"] = statistics.median(ratios) if ratios else None
        result["all_identical"] = all(c["identical_to_alone"] == args.streams for c in rounds)
        if args.flood:
            f = result["flood"] = await _flood(client, model, args.flood, args.tokens, args.flood_timeout)
            print(f"flood of {args.flood}: {f['completed']} completed, {f['busy_429']} got 429, {f['other']} other"
                  f"{', HUNG' if f['hung'] else ''} ({f['wall_s']:.1f} s)", file=sys.stderr)
    return result


def main(argv: list[str], endpoint, channel) -> int:
    ap = argparse.ArgumentParser(prog="duckctl bench e2e --api openai")
    ap.add_argument("--api", choices=["openai"], required=True)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams, each its own prompt")
    ap.add_argument("--runs", type=int, default=3, help="single streams a round, for its one-stream rate")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=0, metavar="N",
                    help="instead: --rounds two-turn chats on ~N-token documents (the prefix cache's TTFT)")
    ap.add_argument("--structured", type=int, default=0, metavar="N",
                    help="instead: N prompts for each of 5 JSON schemas, as many forced tool calls, and decode "
                         "with a schema over without (bench/e2e_structured.py)")
    ap.add_argument("--flood", type=int, default=0, help="then this many streams at once: completed or 429")
    ap.add_argument("--flood-timeout", type=float, default=600.0, help="seconds before the flood counts as hung")
    ap.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for a starting daemon to be ready")
    ap.add_argument("--http", help="the daemon's HTTP address host:port (default: from its runtime file)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.streams < 1 or args.runs < 1 or args.rounds < 1 or args.flood < 0:
        ap.error("--tokens must be at least 2, --streams, --runs and --rounds positive, --flood not negative")
    try:
        import openai  # noqa: F401
    except ImportError:
        print("duckctl: bench e2e --api openai needs the openai package (pip install openai)", file=sys.stderr)
        return 1
    if args.http:
        endpoint.http_address = args.http
    if not endpoint.http_address:
        print("duckctl: the daemon's HTTP address is unknown (no runtime file names it): pass --http HOST:PORT",
              file=sys.stderr)
        return 1
    try:
        result = asyncio.run(run(args, endpoint, rpc.FleetStub(channel)))
    except TimeoutError as e:
        print(f"duckctl: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    if args.structured:
        s = result["structured"]
        if not args.json:
            print(f"{result['model']} via openai: schemas {s['schemas']['valid']}/{s['schemas']['requests']} valid, "
                  f"forced tool calls {s['tool_calls']['parsed']}/{s['tool_calls']['requests']} parse, decode with a "
                  f"schema {s['decode_schema_over_plain']:.3f}x without")
        whole = s["schemas"]["valid"] == s["schemas"]["requests"] and \
            s["tool_calls"]["parsed"] == s["tool_calls"]["requests"]
        return 0 if whole else 3
    if args.turns and not args.json:
        print(f"{result['model']} via openai: second turn's TTFT / first's, median of {args.rounds} chats: "
              f"{result['ttft_ratio_median']:.3f}")
    if args.turns:
        return 0
    if not args.json:
        r = result["median_all_decoding_over_one_stream"]
        print(f"{result['model']} via openai: {args.streams} streams, all identical to alone: "
              f"{result['all_identical']}; " + (f"median ratio while all decode {r:.2f}x one stream" if r
                                                 else "no round overlapped enough for a ratio"))
    ok = result["all_identical"] and not any(c["errors"] for c in result["rounds"])
    if args.flood:
        f = result["flood"]
        ok = ok and not f["hung"] and f["completed"] + f["busy_429"] == args.flood
    return 0 if ok else 3
