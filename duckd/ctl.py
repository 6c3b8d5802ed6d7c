"""`duckctl`: the command-line client of duckd.

    duckctl status [--json]
    duckctl chat [PROMPT] [--json] [--temperature T | --greedy] [--max-tokens N] [--system TEXT]
                 [--json-schema FILE] [--tools FILE [--tool-choice auto|none|required|NAME]] [--logprobs N]
                                                  (--json-schema: the answer is JSON that follows the
                                                   schema in FILE; --tools: OpenAI's tools list in
                                                   FILE, each call the model makes printed as a line
                                                   "tool call: NAME(ARGUMENTS)" after the text)
    duckctl cache ls [--duck N] [--json] | cache invalidate (--duck N | --model NAME | --all)
    duckctl placement [--budget B] [--by-routing] [--json]
                                                  (what the GPU computes beside the ducks, placed again
                                                   without a restart: docs/gpu.md, Placement)
    duckctl bench kernels|transport [args...]     (the native benchmarks, on this host)
    duckctl bench e2e [--json] [--tokens N]       (decode tok/s through the daemon)
    duckctl bench e2e --api openai [--streams N] [--flood N] [--structured N] [--json]
                                                  (the serving bar through the openai client:
                                                   bench/e2e_openai.py)
    duckctl bench e2e --synthetic NAME [args...]  (a synthetic model at real shapes on local ducks,
                                                   against the GPU-only and torch CPU baselines)
    duckctl bench chaos [--chats N] [--faults LIST] [--count N] [--seed S] [--json [PATH]]
                                                  (faults under load on a daemon of its own:
                                                   bench/chaos.py, docs/faults.md)
    duckctl bench loop|prefill --synthetic NAME [args...]
                                                  (the batch loop against one request; prefill against
                                                   the GPU alone and the ducks alone: a GPU host's)
    duckctl bench grammar [--json]                (the structured-output grammar libraries on this CPU)
    The benchmarks run as `python -m bench WHAT` (bench/__main__.py), a process of their own.
    duckctl plan MODEL [args...] | plan --validate  (predicted tok/s of a fleet: duckd/plan/cli.py)
    duckctl image build [--out DIR] [--kernel PATH] [--busybox PATH] [--json]
                                                  (the duck boot image, from duckd's config; docs/boot.md)

With no --address/--token it finds the running daemon (see duck_proto.client), and with
TLS trusts the certificate that daemon announces; --ca FILE / --fingerprint SHA256 for
a daemon elsewhere (duck_proto.tls).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from duck_proto.client import DiscoveryError, add_connection_arguments, discover_from, join_option_values, sync_channel
from duck_proto.tls import explain

STATES = {v: k for k, v in pb.DuckState.items()}


def _endpoint(args):
    args.endpoint = discover_from(args)     # kept for the error message of a failed call
    return args.endpoint


def _stubs(args):
    ch = sync_channel(_endpoint(args))
    return ch


def cmd_status(args) -> int:
    ch = _stubs(args)
    ducks = rpc.FleetStub(ch).List(pb.ListDucksRequest(), timeout=10).ducks
    try:
        info = rpc.ModelStub(ch).Info(pb.ModelInfoRequest(), timeout=10)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        info = None
    if args.json:
        print(json.dumps({"model": MessageToDict(info) if info else None,
                          "ducks": [MessageToDict(d, always_print_fields_with_no_presence=True) for d in ducks]},
                         indent=2))
        return 0
    if info:
        print(f"model {info.name} ({info.architecture}, {info.layers} layers), backend {info.backend}, "
              f"tp {info.tp}, multiple_of {info.multiple_of}")
        print(_placement_line(info))
    else:
        print("model: loading")
    print(f"{'id':>3} {'address':21} {'state':10} {'link ms':>8} {'rtt us':>8} {'GB/s':>7} {'kern ms':>8} "
          f"{'cache':>6} {'hits':>5} {'corrupt':>7} {'errors':>6} {'drops':>6}  reason")
    for d in ducks:
        print(f"{d.id:>3} {d.address:21} {STATES[d.state]:10} {d.time_to_link_ms:8.0f} {d.rtt_us:8.0f} "
              f"{d.gbps:7.2f} {d.kernel_ms:8.2f} {d.cache_entries:6d} {d.cache_hits:5d} {d.cache_corrupt:7d} "
              f"{d.errors:6d} {d.drops:6d}  "
              f"{d.reason}")
    return 0


class UsageError(Exception):
    """A bad option or file: duckctl says why and exits 2."""


def _json_file(path: str, what: str):
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise UsageError(f"{what} {path}: not JSON ({e})") from None


def _chat_options(args) -> dict:
    """--json-schema, --tools and --tool-choice as ChatRequest fields (JSON text), checked here."""
    out = {}
    if args.json_schema:
        schema = _json_file(args.json_schema, "--json-schema")
        if not isinstance(schema, dict):
            raise UsageError(f"--json-schema {args.json_schema}: expected a JSON schema object, "
                             f"not a {type(schema).__name__}")
        name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(args.json_schema).stem)[:64] or "answer"
        out["response_format"] = json.dumps({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    names = []
    if args.tools:
        from duckd.tool_calls import ToolFormatError, check_tools
        tools = _json_file(args.tools, "--tools")
        try:
            names = [t["function"]["name"] for t in check_tools(tools)]
        except ToolFormatError as e:
            raise UsageError(f"--tools {args.tools}: {e} (expected OpenAI's tools list: "
                             '[{"type": "function", "function": {"name", "description", "parameters"}}])') from None
        out["tools"] = json.dumps(tools)
    if args.tool_choice:
        if not args.tools and args.tool_choice != "none":
            raise UsageError(f"--tool-choice {args.tool_choice} needs --tools FILE")
        if args.tool_choice not in ("auto", "none", "required") and args.tool_choice not in names:
            raise UsageError(f"--tool-choice {args.tool_choice}: expected auto, none, required or a tool of "
                             f"{args.tools} ({', '.join(names) or 'none'})")
        out["tool_choice"] = args.tool_choice
    if args.json_schema and args.tool_choice not in (None, "auto", "none"):
        raise UsageError(f"--json-schema and --tool-choice {args.tool_choice} each set the answer's form: "
                         "give one")
    return out


def _chat_once(stub, messages, args, out, options=None) -> tuple[str, list, pb.GenerationStats | None]:
    """One answer, streamed to out: (its text, its tool calls (pb.ToolCall), its stats)."""
    sampling = {"temperature": 0.0} if args.greedy else {}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if args.logprobs is not None:
        sampling["logprobs"] = args.logprobs
    req = pb.ChatRequest(messages=messages, max_tokens=args.max_tokens, seed=args.seed, **sampling,
                         **(options or {}))
    text, calls, stats, read = [], [], None, []
    at_line_start = True
    for ev in stub.Chat(req):
        kind = ev.WhichOneof("event")
        if kind == "token":
            text.append(ev.token)
            if args.json:
                out.write(json.dumps({"token": ev.token}) + "\n")
            elif ev.token:
                out.write(ev.token)
                at_line_start = ev.token.endswith("\n")
            out.flush()
        elif kind == "tool_call":
            calls.append(ev.tool_call)
            if args.json:
                out.write(json.dumps({"tool_call": _call_dict(ev.tool_call)}) + "\n")
            else:
                call = ev.tool_call
                out.write(("" if at_line_start else "\n") + f"tool call: {call.name}({call.arguments})\n")
                at_line_start = True
            out.flush()
        elif kind == "logprobs":
            entries = [{"token": e.token, "logprob": e.logprob, "top": [[t.token, t.logprob] for t in e.top]}
                       for e in ev.logprobs.entries]
            read.extend(entries)
            if args.json:
                out.write(json.dumps({"logprobs": entries}) + "\n")
        elif kind == "stats":
            stats = ev.stats
    if read and not args.json:   # one line per token, after the answer
        out.write(("" if at_line_start else "\n") + "".join(
            f"{e['token']!r} {e['logprob']:.4f}" + (" [" + ", ".join(f"{t!r} {lp:.4f}" for t, lp in e["top"]) + "]"
                                                    if e["top"] else "") + "\n" for e in read))
        at_line_start = True
    if args.json:
        out.write(json.dumps({"text": "".join(text), "tool_calls": [_call_dict(c) for c in calls],
                              "stats": MessageToDict(stats) if stats else None}) + "\n")
    elif stats is not None:
        out.write(("" if at_line_start and calls else "\n") + stats.line + "\n")
    out.flush()
    return "".join(text), calls, stats


def _call_dict(call: pb.ToolCall) -> dict:
    return {"id": call.id, "name": call.name, "arguments": call.arguments}


def cmd_chat(args) -> int:
    options = _chat_options(args)
    stub = rpc.ChatStub(_stubs(args))
    history = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    prompts = [args.prompt] if args.prompt else None
    interactive = prompts is None and sys.stdin.isatty()
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            line = prompts.pop(0)
        else:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\n")
            if not line.strip():
                continue
        history.append(pb.ChatMessage(role="user", content=line))
        answer, calls, _ = _chat_once(stub, history, args, sys.stdout, options)
        history.append(pb.ChatMessage(role="assistant", content=answer, tool_calls=calls))


def _placement_line(info) -> str:
    return (f"placement: {info.gpu_ffn_gb:.2f} GB of FFN weights on the GPU ({info.gpu_layers_whole} layers whole, "
            f"{info.gpu_experts} experts), {info.duck_gb_per_token:.3f} GB per token from the ducks in "
            f"{info.duck_calls_per_token} calls")


def cmd_placement(args) -> int:
    info = rpc.ModelStub(_stubs(args)).Place(pb.PlaceRequest(budget=args.budget, by_routing=args.by_routing),
                                             timeout=600)
    print(json.dumps(MessageToDict(info), indent=2) if args.json else _placement_line(info))
    return 0


def cmd_cache(args) -> int:
    stub = rpc.CacheStub(_stubs(args))
    if args.action == "ls":
        req = pb.CacheListRequest(duck_id=args.duck) if args.duck is not None else pb.CacheListRequest(all_ducks=True)
        resp = stub.List(req, timeout=30)
        if args.json:
            print(json.dumps(MessageToDict(resp), indent=2))
        else:
            for e in resp.entries:
                print(f"{e.digest}  {e.bytes:>10d}  ducks {','.join(map(str, e.ducks)):12s} {e.name}")
            print(f"{len(resp.entries)} entries; host pack cache {resp.host_cache_bytes / 1e6:.1f} MB")
        return 0
    if args.duck is not None:
        req = pb.InvalidateRequest(duck_id=args.duck)
    elif args.model:
        req = pb.InvalidateRequest(model=args.model)
    elif args.all:
        req = pb.InvalidateRequest(all=True)
    else:
        print("duckctl: cache invalidate needs --duck N, --model NAME or --all", file=sys.stderr)
        return 2
    print(stub.Invalidate(req, timeout=60).message)
    return 0


def cmd_bench(args, rest: list[str]) -> int:
    """The benchmarks' front door (`python -m bench`, bench/__main__.py) in a process of its own,
    with the connection arguments given here (e2e through the daemon reads them)."""
    import subprocess
    conn = [f"--{name}={value}" for name in ("address", "token", "config", "ca", "fingerprint")
            if (value := getattr(args, name, None))] if args.what == "e2e" else []
    return subprocess.call([sys.executable, "-m", "bench", args.what, *conn, *rest])


def cmd_image(args) -> int:
    """Builds the duck boot image on this host (no daemon needed): the fleet key and fleet.pxe's
    settings come from --config (else the embedded default's)."""
    import logging

    from duckd.config import ConfigError, load
    from duckd.drivers.pxe import image_settings
    from duckd.image import ImageError, build_image

    logging.basicConfig(level=logging.INFO, format="duckctl image: %(message)s", stream=sys.stderr)
    try:
        cfg = load(args.config)
        settings = image_settings(cfg.fleet)
        if args.kernel or args.busybox:
            from dataclasses import replace
            settings = replace(settings, kernel=args.kernel or settings.kernel, busybox=args.busybox or settings.busybox)
        state = cfg.state_path
        key_file = state / "fleet.key"
        if not key_file.exists():
            from native.transport import write_key_file
            state.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_key_file(key_file)
            logging.getLogger("duckd.image").info("made a new fleet key %s (duckd uses it from now on)", key_file)
        out = Path(args.out) if args.out else state / "image"
        image = build_image(out, key_file, settings)
    except (ConfigError, ImageError) as e:
        print(f"duckctl: {e}", file=sys.stderr)
        return 2
    files = {name: str(out / name) for name in image.manifest["files"]}
    if args.json:
        print(json.dumps({"path": str(out), "digest": image.digest, "size": image.size, "files": files,
                          "sha256": image.manifest["files"], "kernel_version": image.manifest["kernel_version"],
                          "modules": len(image.manifest["modules"])}, indent=2))
        return 0
    print(f"image   {out}")
    for name, path in files.items():
        print(f"  {name:11} {Path(path).stat().st_size / 1e6:6.1f} MB  sha256 {image.manifest['files'][name]}")
    print(f"size    {image.size / 1e6:.1f} MB ({image.size} bytes)")
    print(f"digest  {image.digest}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="duckctl", description="Client of duckd: fleet status, chat, cache, benchmarks.")
    add_connection_arguments(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="the fleet and the model")
    s.add_argument("--json", action="store_true")
    c = sub.add_parser("chat", help="chat with the model (multi-turn from stdin when no PROMPT)")
    c.add_argument("prompt", nargs="?")
    c.add_argument("--json", action="store_true", help="JSON lines: tokens, then text and stats")
    c.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the daemon's, from its config or the checkpoint)")
    c.add_argument("--greedy", action="store_true", help="greedy decoding (temperature 0)")
    c.add_argument("--max-tokens", type=int, default=0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--system", default="")
    c.add_argument("--json-schema", metavar="FILE",
                   help="a JSON schema file: the answer is JSON that follows it (response_format json_schema)")
    c.add_argument("--tools", metavar="FILE", help="a JSON file holding OpenAI's tools list: the model may call "
                                                   "them, each call printed as 'tool call: NAME(ARGUMENTS)'")
    c.add_argument("--logprobs", type=int, metavar="N", choices=range(0, 21),
                   help="each token's log-probability and the N likeliest (0 .. 20), a line per token after the "
                        "answer (with --json: a {\"logprobs\": [...]} line after each text)")
    c.add_argument("--tool-choice", metavar="{auto,none,required,NAME}",
                   help="auto (the default with --tools), none, required (at least one call), or a tool's name "
                        "(a call of that one)")
    k = sub.add_parser("cache", help="weight cache: ls, invalidate")
    k.add_argument("action", choices=["ls", "invalidate"])
    k.add_argument("--duck", type=int)
    k.add_argument("--model")
    k.add_argument("--all", action="store_true")
    k.add_argument("--json", action="store_true")
    pl = sub.add_parser("placement", help="place the FFNs on the GPU again: another budget, or by the routing "
                                          "counted while serving (no restart, nothing uploaded)")
    pl.add_argument("--budget", default="", help="as model.gpu_ffn_budget: auto, bytes (24G, 512M, 0), a fraction "
                                                  "of auto (0.5); default: the current one")
    pl.add_argument("--by-routing", action="store_true", help="each layer's experts by how often they were chosen")
    pl.add_argument("--json", action="store_true")
    b = sub.add_parser("bench", help="benchmarks: kernels, transport (this host), e2e (through the daemon), "
                                     "chaos (faults under load, on a daemon of its own), loop, prefill and long_context "
                                     "(a synthetic model on local ducks); `duckctl bench WHAT --help`",
                       add_help=False)   # --help goes to the benchmark named
    b.add_argument("what", choices=["kernels", "transport", "e2e", "chaos", "loop", "prefill", "grammar",
                                    "long_context"])
    sub.add_parser("plan", help="predict a fleet's tok/s for a model (no daemon): duckctl plan --help",
                   add_help=False)
    im = sub.add_parser("image", help="the duck boot image (kernel + initramfs) for network-booted ducks")
    im.add_argument("action", choices=["build"])
    im.add_argument("--out", help="folder of the image (default: <state_dir>/image)")
    im.add_argument("--kernel", help="the vmlinuz to use (default: the newest /boot/vmlinuz-*)")
    im.add_argument("--busybox", help="a static busybox (default: /bin/busybox from busybox-static)")
    im.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(join_option_values(sys.argv[1:] if argv is None else argv))
    if args.cmd == "plan":
        from duckd.plan.cli import main as plan_main
        return plan_main(rest)
    if rest and args.cmd != "bench":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "status":
            return cmd_status(args)
        if args.cmd == "chat":
            return cmd_chat(args)
        if args.cmd == "cache":
            return cmd_cache(args)
        if args.cmd == "placement":
            return cmd_placement(args)
        if args.cmd == "image":
            return cmd_image(args)
        return cmd_bench(args, rest)
    except UsageError as e:
        print(f"duckctl: {e}", file=sys.stderr)
        return 2
    except DiscoveryError as e:
        print(f"duckctl: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        ep = getattr(args, "endpoint", None)
        tls_words = explain(e.details(), ep.tls, ep.address) if ep else None
        print(f"duckctl: {tls_words or f'{e.code().name}: {e.details()}'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:          # `duckctl status | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
