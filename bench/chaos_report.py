"""What bench.chaos reports: each chat classified against its undisturbed run,
counted overall and under each kind of fault that struck while it ran, the
longest stalls, the failures with their errors and delays, and the verdict."""
from __future__ import annotations

from bench.chaos_faults import FaultRecord
from bench.chaos_load import Stream
from bench.live_daemon import max_gap

CLEAR_CODES = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION",
               "INVALID_ARGUMENT", "ABORTED", "INTERNAL"}


def classify(s: Stream, reference: list[str]) -> str:
    """identical, different (silently: completed with other tokens, or failed after tokens that were not
    the undisturbed ones), failed, hung."""
    if s.hung or s.end is None:           # the watchdog ended it, or it still ran when the harness stopped waiting
        return "hung"
    if s.error or s.finish_reason in ("", "cancelled"):
        return "failed" if s.tokens == reference[:len(s.tokens)] else "different"
    return "identical" if s.tokens == reference else "different"


def failure_message(s: Stream) -> str:
    return s.error or ("finish_reason cancelled: duckd ended the chat" if s.finish_reason == "cancelled"
                       else "the stream ended without a result")


def is_clear(message: str) -> bool:
    code, _, text = message.partition(": ")
    return (code in CLEAR_CODES or code == "finish_reason cancelled") and len(text.strip()) > 3


def _events(faults: list[FaultRecord]) -> list[tuple[float, FaultRecord, str]]:
    return sorted((t, f, what) for f in faults for t, what in f.events)


def _nearest_before(events, t: float):
    """The last fault event at or before t: (time, fault, what), or None."""
    best = None
    for e in events:
        if e[0] > t + 0.01:
            break
        best = e
    return best


def _met(s: Stream, faults: list[FaultRecord]) -> set[str]:
    """The kinds of fault that struck while the chat ran (from a fault's first event to its last)."""
    end = s.end if s.end is not None else float("inf")
    return {f.kind for f in faults if f.events and f.events[0][0] <= end and f.events[-1][0] >= s.start}


def _counts(rows: list[dict]) -> dict:
    out = {"chats": len(rows)}
    for outcome in ("identical", "different", "failed", "hung"):
        out[outcome] = sum(r["outcome"] == outcome for r in rows)
    out["completed"] = out["identical"] + sum(r["outcome"] == "different" and r["completed"] for r in rows)
    out["silently_different"] = out.pop("different")
    out["identical_fraction"] = round(out["identical"] / len(rows), 4) if rows else 1.0
    out["longest_stream_gap_s"] = round(max((r["gap"] for r in rows), default=0.0), 3)
    delays = [r["delay"] for r in rows if r["outcome"] == "failed" and r["delay"] is not None]
    out["latest_failure_s"] = round(max(delays), 3) if delays else None
    return out


def _longest_stall(streams: list[Stream], faults: list[FaultRecord]) -> tuple[float, str]:
    """The longest time no chat got a token while chats were running and duckd was up (a daemon being
    restarted by a sigterm fault is not a stall of it), and the fault event nearest before it."""
    down = [(f.events[0][0], f.events[-1][0]) for f in faults if f.kind == "sigterm" and f.events]
    arrivals = sorted(t for s in streams if s.kind != "slowclient" for t in s.times)
    events, best, where = _events(faults), 0.0, ""
    for a, b in zip(arrivals, arrivals[1:]):
        if b - a > best and not any(d0 < b and a < d1 for d0, d1 in down):
            best = b - a
            near = _nearest_before(events, a)
            where = f"{near[1].kind} (fault {near[1].n}, {a - near[0]:.1f} s after it)" if near else "no fault before"
    return round(best, 3), where


def summarize(streams: list[Stream], faults: list[FaultRecord], reference: list[list[str]], late_s: float,
              min_identical: float, load_s: float) -> dict:
    events, rows, failures = _events(faults), [], []
    for s in streams:
        outcome = classify(s, reference[s.prompt])
        near = _nearest_before(events, s.end) if s.end is not None else None
        row = {"outcome": outcome, "completed": not (s.hung or s.error or s.finish_reason in ("", "cancelled")),
               "gap": max_gap(s.times) if s.kind != "slowclient" else 0.0, "met": _met(s, faults) or {"none"},
               "delay": s.end - near[0] if near else None}
        rows.append(row)
        if outcome in ("failed", "hung") or (outcome == "different" and not row["completed"]):
            msg = failure_message(s)
            failures.append({"chat": s.id, "prompt": s.prompt, "tokens": len(s.tokens), "outcome": outcome,
                             "error": msg, "clear": is_clear(msg),
                             "fault": f"{near[1].kind} (fault {near[1].n}: {near[2]})" if near else None,
                             "after_fault_s": round(row["delay"], 3) if near else None})
    overall = _counts(rows)
    overall["longest_stall_s"], overall["longest_stall_near"] = _longest_stall(streams, faults)
    overall["load_s"] = round(load_s, 1)
    overall["tokens"] = sum(len(s.tokens) for s in streams)
    kinds = sorted({k for r in rows for k in r["met"]} | {f.kind for f in faults})
    by_kind = {k: {"faults": sum(f.kind == k for f in faults), **_counts([r for r in rows if k in r["met"]])}
               for k in kinds}
    why = []
    if overall["hung"]:
        why.append(f"{overall['hung']} chats hung (no token for the deadline)")
    if overall["silently_different"]:
        why.append(f"{overall['silently_different']} chats silently different from their undisturbed run")
    if overall["identical_fraction"] < min_identical:
        why.append(f"{overall['identical_fraction']:.1%} of the chats identical, below {min_identical:.0%}")
    late = [f for f in failures if f["outcome"] == "failed" and (f["after_fault_s"] is None or f["after_fault_s"] > late_s)]
    if late:
        why.append(f"{len(late)} failures later than {late_s:g} s after a fault (or with none before them)")
    unclear = [f for f in failures if f["outcome"] == "failed" and not f["clear"]]
    if unclear:
        why.append(f"{len(unclear)} failures without a clear error")
    broken = [f for f in faults if not f.ok]
    if broken:
        why.append(f"{len(broken)} faults whose own check failed: " + "; ".join(f"{f.n} {f.kind}: {f.detail}" for f in broken[:5]))
    t0 = min((s.start for s in streams), default=0.0)
    return {"pass": not why, "why": why, "overall": overall, "by_kind": by_kind, "failures": failures,
            "faults": [{"n": f.n, "kind": f.kind, "target": f.target, "ok": f.ok, "detail": f.detail,
                        "events": [[round(t - t0, 3), what] for t, what in f.events]} for f in faults]}


def print_report(report: dict) -> None:
    """The human form, for the CLI."""
    o = report["overall"]
    print(f"chaos: {len(report['faults'])} faults over {o['load_s']:.0f} s, {o['chats']} chats, {o['tokens']} tokens")
    head = f"  {'':14}{'faults':>7}{'chats':>7}{'done':>7}{'same':>7}{'failed':>7}{'hung':>6}{'diff':>6}" \
           f"{'gap s':>8}{'late s':>8}"
    print(head)
    for name, c in [("overall", {"faults": len(report["faults"]), **o})] + list(report["by_kind"].items()):
        late = "-" if c["latest_failure_s"] is None else f"{c['latest_failure_s']:.2f}"
        print(f"  {name:14}{c['faults']:>7}{c['chats']:>7}{c['completed']:>7}{c['identical']:>7}{c['failed']:>7}"
              f"{c['hung']:>6}{c['silently_different']:>6}{c['longest_stream_gap_s']:>8.2f}{late:>8}")
    print(f"  identical {o['identical_fraction']:.1%}; longest stall {o['longest_stall_s']:.2f} s "
          f"(after {o['longest_stall_near'] or '-'}); fleet whole {report.get('fleet_whole_after_s')} s after")
    errors: dict[str, int] = {}
    for f in report["failures"]:
        errors[f["error"][:160]] = errors.get(f["error"][:160], 0) + 1
    for msg, n in sorted(errors.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:4d} x {msg}")
    for k, why in report.get("skipped", {}).items():
        print(f"  skipped {k}: {why}")
    print("PASS" if report["pass"] else "FAIL: " + "; ".join(report["why"]))
