"""The fault harness's short schedule (seed 8), against the real daemon and real ducks: 8 greedy chats
at once under kill -9, SIGSTOP, Fleet.Restart and an oversized body, one at a time. No chat
hangs, none completes with other tokens than its undisturbed run, a failure is a clear error
soon after its fault; and the harness's verdict does catch a difference and a hang."""
from __future__ import annotations

import pytest

from bench.chaos import parse_args, run
from bench.chaos_faults import FAULTS, schedule
from bench.chaos_load import Stream
from bench.chaos_report import summarize


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    state = tmp_path_factory.mktemp("chaos") / "duck"
    args = parse_args(["--chats", "8", "--tokens", "32", "--count", "6", "--seed", "8", "--gap", "1,3",
                       "--sigstop-s", "3", "--faults", "kill,sigstop,restart,oversize", "--state-dir", str(state)])
    return run(args)


def test_the_short_schedule_holds_the_invariants(report):
    o = report["overall"]
    assert o["hung"] == 0, report["failures"]
    assert o["silently_different"] == 0, report["failures"]
    assert o["chats"] >= 16 and o["identical_fraction"] >= 0.9, o
    assert all(f["clear"] and f["after_fault_s"] is not None and f["after_fault_s"] <= 5.0
               for f in report["failures"]), report["failures"]
    assert all(f["ok"] for f in report["faults"]), report["faults"]
    assert report["fleet_whole_after_s"] is not None
    assert report["pass"], report["why"]


def test_every_fault_of_the_seeded_schedule_struck(report):
    kinds = [p["kind"] for p in report["schedule"]]
    assert kinds == [f["kind"] for f in report["faults"]] and len(kinds) == 6
    assert set(kinds) >= {"kill", "sigstop", "restart", "oversize"}, kinds
    assert all(f["events"] for f in report["faults"])
    assert set(report["by_kind"]) >= set(kinds)


def test_the_schedule_is_the_seeds():
    a = schedule(list(FAULTS), 20, 5, (2, 10), 4)
    assert a == schedule(list(FAULTS), 20, 5, (2, 10), 4) != schedule(list(FAULTS), 20, 6, (2, 10), 4)
    assert all(2 <= p.gap_s <= 10 and 0 <= p.duck < 4 for p in a)


def _stream(i, tokens, t, **kw):
    s = Stream(i, 0, "load", t, list(tokens), [t + 0.1 * k for k in range(len(tokens))], t + 0.1 * len(tokens), **kw)
    return s


def test_the_verdict_catches_a_difference_a_hang_and_a_late_or_unclear_failure():
    ref = [["a", "b", "c"]]
    good = summarize([_stream(0, "abc", 0.0, finish_reason="length")], [], ref, 5.0, 0.95, 1.0)
    assert good["pass"] and good["overall"]["identical"] == 1
    different = summarize([_stream(0, "abd", 0.0, finish_reason="length")], [], ref, 5.0, 0.0, 1.0)
    assert not different["pass"] and different["overall"]["silently_different"] == 1
    wrong_prefix = summarize([_stream(0, "x", 0.0, error="UNAVAILABLE: the fleet failed")], [], ref, 5.0, 0.0, 1.0)
    assert wrong_prefix["overall"]["silently_different"] == 1
    hung = summarize([_stream(0, "a", 0.0, hung=True, error="hung")], [], ref, 5.0, 0.0, 1.0)
    assert not hung["pass"] and hung["overall"]["hung"] == 1
    no_fault = summarize([_stream(0, "ab", 0.0, error="UNAVAILABLE: the fleet failed during the chat")], [], ref,
                         5.0, 0.0, 1.0)
    assert not no_fault["pass"] and "later than 5 s" in no_fault["why"][0]
    unclear = summarize([_stream(0, "ab", 0.0)], [], ref, 5.0, 0.0, 1.0)
    assert any("without a clear error" in w for w in unclear["why"])


def test_loss_is_the_ducks_fault_injection_and_a_bad_rate_is_refused():
    assert parse_args(["--loss", "0.05"]).loss == 0.05
    for bad in ("1", "-0.1"):
        with pytest.raises(SystemExit) as e:
            parse_args(["--loss", bad])
        assert e.value.code == 2
