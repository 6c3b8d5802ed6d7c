"""The fault harness: a seeded schedule of faults against the real daemon
(the embedded default model, SmolLM2-135M, on local ducks) while N greedy
chats run at once, each re-issued as it ends so the load stays constant.
Every prompt is first run undisturbed; a chat under faults must give the
same tokens, or fail with a clear error soon after a fault.

    python -m bench.chaos --chats 48 --faults kill,sigstop,restart --count 100 --json /tmp/chaos.json
    duckctl bench chaos --count 20 --json

Faults (--faults, comma-separated; the schedule picks one at a time, --gap
seconds apart): kill (kill -9 of a duck), sigstop (a duck stopped for
--sigstop-s, then continued), restart (Fleet.Restart of a duck), cachecorrupt
(a byte of a duck's cache entry flipped, then the duck killed), diskfull (the
state folder's filesystem, a tmpfs of the harness's own, full for --diskfull-s
while a duck that must store a cache entry again restarts, then restarted once
space is back; needs root, skipped without), slowclient (a chat read slowly),
oversize (an HTTP body past daemon.max_request_mb: 413), sighup and sigterm of
the daemon (started again after it ends); loss, delay, reorder, duplicate (tc
netem on one duck's link for --netem-s: the fleet then runs in network
namespaces, which needs root). --loss RATE drops that fraction
of datagrams on every duck's link, both ways, for the whole run (duckfw's fault
injection, fleet.fault_drop_rate: no netem needed); the undisturbed runs are
then lossy too, and a lossy link must change no token.

Reported overall and per fault kind (a chat counts under each kind of fault
that struck while it ran): chats completed, identical to their undisturbed
run, failed with a clear error (its gRPC status and message, and the time
since the nearest fault event before it), hung (no token for --deadline-s),
silently different (completed, or failed after tokens that were not the
undisturbed ones), and the longest stall (the longest time no stream got a
token, and the longest gap inside one stream). The exit status is 1 on a hang,
a silent difference, fewer than --min-identical of the chats identical, a
failure later than --late-s after its fault or without a clear error, or a
fault whose own check failed (see bench/chaos_faults.py); 2 on bad arguments."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.chaos_faults import (FAULTS, NETEM, FaultRecord, Planned, StateFs, diskfull_available, netem_available,
                                schedule)
from bench.chaos_load import Load, Target, prompts
from bench.chaos_report import print_report, summarize
from bench.live_daemon import RunningDaemon, all_serving, write_config

log = logging.getLogger("duck.bench_chaos")

NETNS_NAME = "chaos"          # namespaces chaos0.., veths chaosh0/chaosd0.., bridges chaosbr0..
NETNS_PREFIX = "10.79"


@dataclass
class Harness:
    """What the faults act on."""
    daemon: RunningDaemon
    target: Target
    load: Load
    sigstop_s: float
    netem_s: float
    grace_s: float
    max_request_mb: float
    netns_name: str = NETNS_NAME
    diskfull_s: float = 5.0
    state_fs: StateFs | None = None          # the state folder's own tmpfs (diskfull)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=48, help="greedy chats at once (default 48)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per chat (default 64)")
    ap.add_argument("--prompts", type=int, default=0, help="distinct prompts (default: --chats)")
    ap.add_argument("--faults", default="kill,sigstop,restart",
                    help=f"comma-separated, of: {', '.join(FAULTS)} (default kill,sigstop,restart)")
    ap.add_argument("--count", type=int, default=20, help="faults in the schedule (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gap", default="2,10", help="MIN,MAX seconds between two faults (default 2,10)")
    ap.add_argument("--sigstop-s", type=float, default=10.0, help="how long sigstop keeps a duck stopped")
    ap.add_argument("--netem-s", type=float, default=5.0, help="how long a link fault lasts")
    ap.add_argument("--diskfull-s", type=float, default=5.0,
                    help="how long diskfull keeps the state folder's filesystem full (at least until the "
                         "restarted duck has failed)")
    ap.add_argument("--deadline-s", type=float, default=30.0, help="a chat with no token this long is hung")
    ap.add_argument("--min-identical", type=float, default=0.95, help="fraction of chats that must be identical")
    ap.add_argument("--late-s", type=float, default=5.0, help="a failure this long after its fault fails the run")
    ap.add_argument("--loss", type=float, default=0.0,
                    help="fraction of datagrams every duck drops, in and out, all run long (default 0)")
    ap.add_argument("--ducks", type=int, default=4)
    ap.add_argument("--grace-s", type=float, default=3.0, help="the daemon's shutdown_grace_s (sigterm)")
    ap.add_argument("--max-request-mb", type=float, default=4.0, help="the daemon's max_request_mb (oversize)")
    ap.add_argument("--state-dir", help="the daemon's state folder (default: a new temporary one)")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH", help="the report as JSON, to PATH or stdout")
    args = ap.parse_args(argv)
    try:
        lo, hi = (float(x) for x in args.gap.split(","))
    except ValueError:
        ap.error(f"--gap {args.gap!r}: expected MIN,MAX seconds, e.g. 2,10")
    if not 0 <= lo <= hi:
        ap.error(f"--gap {args.gap!r}: expected 0 <= MIN <= MAX")
    args.gap = (lo, hi)
    args.faults = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = [k for k in args.faults if k not in FAULTS]
    if unknown or not args.faults:
        ap.error(f"--faults: unknown {', '.join(unknown) or '(none given)'}; expected some of {', '.join(FAULTS)}")
    for name in ("chats", "tokens", "ducks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: expected at least 1")
    if not 0 <= args.loss < 1:
        ap.error(f"--loss {args.loss}: expected 0 <= RATE < 1")
    if args.diskfull_s < 0:
        ap.error(f"--diskfull-s {args.diskfull_s}: expected >= 0")
    if args.count < 0 or not 0 <= args.min_identical <= 1 or args.deadline_s <= 0:
        ap.error("--count >= 0, 0 <= --min-identical <= 1 and --deadline-s > 0 expected")
    return args


def run(args: argparse.Namespace) -> dict:
    """The whole harness: daemon up, reference texts, the schedule under load, the report (a dict)."""
    kinds, skipped = list(args.faults), {}
    netem_kinds = [k for k in kinds if k in NETEM]
    why_not = netem_available() if netem_kinds else None
    if why_not:
        skipped = {k: why_not for k in netem_kinds}
        kinds = [k for k in kinds if k not in NETEM]
        log.warning("link faults %s skipped: %s", ", ".join(netem_kinds), why_not)
    why_disk = diskfull_available() if "diskfull" in kinds else None
    if why_disk:
        skipped["diskfull"] = why_disk
        kinds.remove("diskfull")
        log.warning("diskfull skipped: %s", why_disk)
    if not kinds:
        raise SystemExit(f"bench.chaos: no fault left to run ({'; '.join(sorted(set(skipped.values())))})")
    plan = schedule(kinds, args.count, args.seed, args.gap, args.ducks)
    state = Path(args.state_dir or tempfile.mkdtemp(prefix="duck-chaos-"))
    state_fs = StateFs(state).mount() if "diskfull" in kinds else None
    try:
        report = _run(args, plan, state, state_fs, bool(netem_kinds and not why_not))
    finally:
        if state_fs is not None:
            state_fs.unmount()
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "state_dir")} | {
        "fleet": "netns" if netem_kinds and not why_not else "local", "state_dir": str(state),
        "state_fs": "tmpfs (unmounted after the run)" if state_fs is not None else "as given"}
    report["skipped"] = skipped
    report["schedule"] = [asdict(p) for p in plan]
    return report


def _run(args: argparse.Namespace, plan: list[Planned], state: Path, state_fs: StateFs | None, netns: bool) -> dict:
    """run()'s daemon, load and schedule, on a state folder ready for it."""
    fleet = {"fail_after_s": 1.5, "health_interval_s": 0.5}        # the daemon's defaults
    if args.loss:
        fleet["fault_drop_rate"] = args.loss
    if netns:
        fleet |= {"driver": "netns", "netns": {"name": NETNS_NAME, "prefix": NETNS_PREFIX, "subnets": 2}}
    config = write_config(state.parent / f"{state.name}.toml", state, ducks=args.ducks,
                          model={"max_tokens": args.tokens},
                          daemon={"shutdown_grace_s": args.grace_s, "max_request_mb": args.max_request_mb}, **fleet)
    log.info("starting duckd (%d %s ducks, state %s%s)", args.ducks, fleet.get("driver", "local"), state,
             " on a tmpfs of its own" if state_fs else "")
    daemon = RunningDaemon(config, state)
    try:
        daemon.start()
    except BaseException:
        if daemon.proc is not None and daemon.proc.poll() is None:   # not left holding the state folder
            daemon.stop(timeout=30)
        raise
    target = Target(daemon)
    load = Load(target, prompts(args.prompts or args.chats), args.tokens, args.deadline_s)
    h = Harness(daemon, target, load, args.sigstop_s, args.netem_s, args.grace_s, args.max_request_mb,
                diskfull_s=args.diskfull_s, state_fs=state_fs)
    records: list[FaultRecord] = []
    try:
        t0 = time.monotonic()
        reference = load.reference(args.chats)
        log.info("undisturbed run: %d prompts in %.1f s", len(reference), time.monotonic() - t0)
        load.start(args.chats)
        t_load = time.monotonic()
        for n, p in enumerate(plan, 1):
            time.sleep(p.gap_s)
            rec = FaultRecord(n, p.kind, "daemon" if p.kind in ("sighup", "sigterm") else
                              "client" if p.kind in ("slowclient", "oversize") else f"duck {p.duck}")
            _strike(h, p, rec)
            records.append(rec)
            log.info("fault %d/%d %s on %s at %.1f s%s%s", n, len(plan), p.kind, rec.target,
                     (rec.events[0][0] if rec.events else time.monotonic()) - t_load,
                     f": {rec.detail}" if rec.detail else "", "" if rec.ok else " (ITS CHECK FAILED)")
        time.sleep(args.gap[0])
        load.stop(timeout=args.deadline_s + 60)
        t_end = time.monotonic()
        whole = _fleet_whole(daemon)
        report = summarize(load.streams, records, reference, args.late_s, args.min_identical, t_end - t_load)
        report["fleet_whole_after_s"] = whole
        if whole is None:
            report["pass"] = False
            report["why"].append("the fleet was not all SERVING 120 s after the schedule")
    finally:
        load.close()
        daemon.stop()
    return report


def _strike(h: Harness, p: Planned, rec: FaultRecord) -> None:
    try:
        FAULTS[p.kind](h, p, rec)
    except Exception as e:        # the harness goes on; the fault's record says what broke
        log.exception("fault %d (%s) raised", rec.n, p.kind)
        rec.ok, rec.detail = False, f"{type(e).__name__}: {e}"
        if not h.target.up.is_set() and h.daemon.proc.poll() is None:
            h.target.attach()


def _fleet_whole(daemon: RunningDaemon) -> float | None:
    """Seconds until every duck serves again after the schedule (None: not within 120 s)."""
    t0 = time.monotonic()
    try:
        all_serving(daemon, timeout=120)
    except AssertionError as e:
        log.error("%s", e)
        return None
    return round(time.monotonic() - t0, 2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s chaos: %(message)s")
    report = run(args)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print_report(report)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
