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


def main(argv: list[str], channel) -> int:
    ap = argparse.ArgumentParser(prog="duckctl bench e2e")
    ap.add_argument("--tokens", type=int, default=64, help="tokens to generate per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    chat, model = rpc.ChatStub(channel), rpc.ModelStub(channel)
    info = model.Info(pb.ModelInfoRequest(), timeout=30)
    runs = []
    for _ in range(args.runs):
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=args.prompt)], max_tokens=args.tokens,
                             temperature=0.0)   # greedy: the same answer every run
        stats = None
        for ev in chat.Chat(req):
            if ev.WhichOneof("event") == "stats":
                stats = ev.stats
        runs.append(stats)
        print(stats.line, file=sys.stderr)
    med = lambda f: statistics.median(getattr(s, f) for s in runs)  # noqa: E731
    result = {"model": MessageToDict(info), "runs": [MessageToDict(s) for s in runs],
              "decode_tok_s": med("decode_tok_s"), "ttft_s": med("ttft_s"), "prefill_tok_s": med("prefill_tok_s"),
              "output_len": med("output_len")}
    if info.ffn_bytes_per_token:
        result["fleet_gbps_at_decode"] = result["decode_tok_s"] * info.ffn_bytes_per_token / 1e9
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{info.name} via {info.backend}: decode {result['decode_tok_s']:.2f} tok/s, ttft {result['ttft_s']:.3f} s, "
              f"prefill {result['prefill_tok_s']:.1f} tok/s (median of {args.runs}, {args.tokens} tokens)")
    return 0
