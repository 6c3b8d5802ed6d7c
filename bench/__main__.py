"""The benchmarks' front door: `python -m bench WHAT [args...]`; `duckctl bench WHAT` runs it in a
process of its own, so the daemon's client imports nothing of the benchmarks.

    kernels                   the ducks' native kernels on this host (bench/kernels.py)
    transport                 the wire on this host or an emulated LAN (bench/transport.py)
    e2e                       decode through the running daemon (bench/e2e.py);
    e2e --api openai          the serving bar through the openai client (bench/e2e_openai.py;
                              --structured N: JSON schemas and forced tool calls, bench/e2e_structured.py);
    e2e --synthetic NAME      a synthetic model at real widths on local ducks (bench/e2e_synthetic.py)
    chaos                     faults under load on a daemon of its own (bench/chaos.py)
    loop                      the batch loop against the one-request path (bench/loop_compare.py)
    prefill                   prefill against the GPU alone and the ducks alone (bench/prefill_compare.py)
    grammar                   the structured-output grammar libraries' costs on this CPU (bench/grammar.py)
    long_context              DeepSeek-V3.2's decode at 1k / 32k / 128k context and a 32k prefill, synthetic,
                              on local ducks (bench/long_context.py)

e2e through a daemon finds it as duckctl does: --address, --token, --config, --ca, --fingerprint,
else the running daemon's runtime file (duck_proto.client); the other benchmarks take none of those.
"""
from __future__ import annotations

import argparse
import sys

WHATS = ("kernels", "transport", "e2e", "chaos", "loop", "prefill", "grammar", "long_context")


def _daemon(argv: list[str]):
    """(the connection arguments' endpoint, the rest of argv)."""
    from duck_proto.client import add_connection_arguments, discover_from, join_option_values
    ap = argparse.ArgumentParser(add_help=False)
    add_connection_arguments(ap)
    conn, rest = ap.parse_known_args(join_option_values(argv))
    return discover_from(conn), rest


def _e2e(argv: list[str]) -> int:
    if any(a == "--synthetic" or a.startswith("--synthetic=") for a in argv):
        from bench.e2e_synthetic import main
        return main(argv)
    import grpc

    from duck_proto.client import DiscoveryError, sync_channel
    from duck_proto.tls import explain
    endpoint = None
    try:
        endpoint, rest = _daemon(argv)
        if any(a == "--api" or a.startswith("--api=") for a in rest):
            from bench.e2e_openai import main
            return main(rest, endpoint, sync_channel(endpoint))
        from bench.e2e import main
        return main(rest, sync_channel(endpoint))
    except DiscoveryError as e:
        print(f"bench e2e: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        words = explain(e.details(), endpoint.tls, endpoint.address) if endpoint else None
        print(f"bench e2e: {words or f'{e.code().name}: {e.details()}'}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in WHATS:
        print(__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    what, rest = argv[0], argv[1:]
    if what == "e2e":
        return _e2e(rest)
    if what == "kernels":
        from bench.kernels import main as run
    elif what == "transport":
        from bench.transport import main as run
    elif what == "chaos":
        from bench.chaos import main as run
    elif what == "loop":
        from bench.loop_compare import main as run
    elif what == "grammar":
        from bench.grammar import main as run
    elif what == "long_context":
        from bench.long_context import main as run
    else:
        from bench.prefill_compare import main as run
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
