"""`duckctl bench e2e`: decode speed through the running daemon (the product
path: gRPC, engine, fleet). Greedy chats of a fixed prompt; medians."""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from google.protobuf.json_format import MessageToDict

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc

PROMPT = "Write a short story about a duck who learns to compute."


def all_decoding(stamps: list[list[float]]) -> dict:
    """The streams' decode rate while every one of them decodes: the window from the last
    stream's first token to the first stream's last, and the token events of all streams
    inside it per second (an event carries one token's text, or a few tokens' where the
    text was held back: it counts them as one, so this errs low). None when the window is
    shorter than 0.5 s (streams that did not overlap enough)."""
    live = [s for s in stamps if len(s) >= 2]
    if len(live) != len(stamps) or not live:
        return {"all_decoding_window_s": 0.0, "all_decoding_tok_s": None}
    lo, hi = max(s[0] for s in live), min(s[-1] for s in live)
    if hi - lo < 0.5:
        return {"all_decoding_window_s": max(hi - lo, 0.0), "all_decoding_tok_s": None}
    events = sum(sum(1 for t in s if lo < t <= hi) for s in live)
    return {"all_decoding_window_s": hi - lo, "all_decoding_tok_s": events / (hi - lo)}


def concurrent(chat, fleet, n: int, tokens: int) -> dict:
    """n greedy chats at once, each its own prompt: wall time, tokens out, TTFT quantiles, and the
    slowest answer to a status call (ListDucks) made every 0.2 s meanwhile."""
    import threading
    import time

    ttfts, outs, errors, decode = [], [], [], []
    stamps: list[list[float]] = [[] for _ in range(n)]   # each stream's token events (perf_counter)

    def one(i: int) -> None:
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=f"{PROMPT} Call the duck number {i}.")],
                             max_tokens=tokens, temperature=0.0)
        t0, first = time.perf_counter(), True
        try:
            for ev in chat.Chat(req, timeout=600):
                kind = ev.WhichOneof("event")
                if kind == "stats":
                    outs.append(ev.stats.output_len)
                    decode.append(ev.stats.decode_tok_s)
                    continue
                stamps[i].append(time.perf_counter())
                if first:
                    first = False
                    ttfts.append(stamps[i][-1] - t0)
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors.append(str(e)[:200])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    status = []
    while any(t.is_alive() for t in threads):
        s0 = time.perf_counter()
        fleet.List(pb.ListDucksRequest(), timeout=30)
        status.append(time.perf_counter() - s0)
        time.sleep(0.2)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts.sort()
    q = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else 0.0  # noqa: E731
    return {"streams": n, "wall_s": wall, "tokens_out": sum(outs), "aggregate_tok_s": sum(outs) / wall,
            "sum_of_stream_decode_tok_s": sum(decode),   # each stream's decode rate (after its first token), summed
            **all_decoding(stamps),
            "ttft_p50_s": q(0.5), "ttft_p99_s": q(0.99), "errors": len(errors), "error_examples": errors[:3],
            "status_max_s": max(status, default=0.0)}


def main(argv: list[str], channel) -> int:
    ap = argparse.ArgumentParser(prog="duckctl bench e2e")
    ap.add_argument("--tokens", type=int, default=64, help="tokens to generate per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--streams", type=int, default=0,
                    help="also run this many concurrent chats (different prompts): aggregate tok/s, TTFT p50/p99")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --streams: one stream, then all of them, this many times in turn; the ratios "
                         "are each round's (its own one-stream rate) and their medians (a shared machine drifts)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.streams < 0:
        ap.error("--runs and --rounds must be positive, --streams not negative")
    chat, model = rpc.ChatStub(channel), rpc.ModelStub(channel)
    info = model.Info(pb.ModelInfoRequest(), timeout=30)
    def one_run():
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=args.prompt)], max_tokens=args.tokens,
                             temperature=0.0)   # greedy: the same answer every run
        stats = None
        for ev in chat.Chat(req):
            if ev.WhichOneof("event") == "stats":
                stats = ev.stats
        print(stats.line, file=sys.stderr)
        return stats

    runs = [one_run() for _ in range(args.runs)]
    med = lambda f: statistics.median(getattr(s, f) for s in runs)  # noqa: E731
    result = {"model": MessageToDict(info), "runs": [MessageToDict(s) for s in runs],
              "decode_tok_s": med("decode_tok_s"), "ttft_s": med("ttft_s"), "prefill_tok_s": med("prefill_tok_s"),
              "output_len": med("output_len")}
    if info.ffn_bytes_per_token:
        result["fleet_gbps_at_decode"] = result["decode_tok_s"] * info.ffn_bytes_per_token / 1e9
    if args.streams:
        rounds = []
        for r in range(args.rounds):
            one = result["decode_tok_s"] if r == 0 else one_run().decode_tok_s   # round 0: the runs above
            c = concurrent(chat, rpc.FleetStub(channel), args.streams, args.tokens)
            c["one_stream_decode_tok_s"] = one
            c["aggregate_over_one_stream"] = c["aggregate_tok_s"] / one
            c["stream_decode_sum_over_one_stream"] = c["sum_of_stream_decode_tok_s"] / one
            both = c["all_decoding_tok_s"]
            c["all_decoding_over_one_stream"] = both / one if both is not None else None
            rounds.append(c)
        # the round whose wall-clock ratio is the median; every round's ratios beside it
        c = result["concurrent"] = dict(sorted(rounds, key=lambda x: x["aggregate_over_one_stream"])[len(rounds) // 2])
        if len(rounds) > 1:
            ratios = {k: [x[k] for x in rounds] for k in ("aggregate_over_one_stream", "all_decoding_over_one_stream",
                                                          "stream_decode_sum_over_one_stream")}
            c["rounds"] = ratios
            decoding = [v for v in ratios["all_decoding_over_one_stream"] if v is not None]
            c["median_all_decoding_over_one_stream"] = statistics.median(decoding) if decoding else None
        both = c["all_decoding_tok_s"]
        if both is not None:
            print(f"while all {args.streams} decode ({c['all_decoding_window_s']:.2f} s): {both:.1f} tok/s "
                  f"({c['all_decoding_over_one_stream']:.2f}x one stream's decode)", file=sys.stderr)
        if len(rounds) > 1:
            print(f"{len(rounds)} rounds: wall-clock ratios {[round(v, 2) for v in c['rounds']['aggregate_over_one_stream']]}"
                  f", all-decoding ratios {[v if v is None else round(v, 2) for v in c['rounds']['all_decoding_over_one_stream']]}"
                  f"; the median round below", file=sys.stderr)
        print(f"{args.streams} concurrent streams: {c['aggregate_tok_s']:.1f} tok/s in all, prefills included "
              f"({c['aggregate_over_one_stream']:.2f}x one stream's decode); their decode rates sum to "
              f"{c['sum_of_stream_decode_tok_s']:.1f} tok/s ({c['stream_decode_sum_over_one_stream']:.2f}x); "
              f"TTFT p50 {c['ttft_p50_s']:.2f} s, "
              f"p99 {c['ttft_p99_s']:.2f} s, {c['errors']} errors; status answered in {c['status_max_s']:.3f} s "
              f"at most", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{info.name} via {info.backend}: decode {result['decode_tok_s']:.2f} tok/s, ttft {result['ttft_s']:.3f} s, "
              f"prefill {result['prefill_tok_s']:.1f} tok/s (median of {args.runs}, {args.tokens} tokens)")
    return 0
