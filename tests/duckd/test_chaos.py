"""The fault harness's short schedule (seed 8), against the real daemon and real ducks: 8 greedy chats
at once under kill -9, SIGSTOP, Fleet.Restart, an oversized body and, as root, a full disk (the
state folder's own tmpfs filled while a duck that must store a cache entry restarts), one at a
time. No chat hangs, none completes with other tokens than its undisturbed run, a failure is a
clear error soon after its fault, the full disk's write fails naming its path and ENOSPC and the
duck is whole after the next restart; and the harness's verdict does catch a difference and a hang."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from bench.chaos import parse_args, run
from bench.chaos_faults import ENOSPC_TEXT, FAULTS, StateFs, _verify_state, diskfull_available, schedule
from bench.chaos_load import Stream
from bench.chaos_report import summarize
from bench.live_daemon import ROOT, write_config

SHORT = ["kill", "sigstop", "restart", "oversize"]


@pytest.fixture(scope="module")
def short_kinds():
    """The short schedule's faults: diskfull too where it can run (root); seed 8 gives every kind either way."""
    return SHORT + ["diskfull"] if diskfull_available() is None else SHORT


@pytest.fixture(scope="module")
def report(tmp_path_factory, short_kinds):
    state = tmp_path_factory.mktemp("chaos") / "duck"
    args = parse_args(["--chats", "8", "--tokens", "32", "--count", "6", "--seed", "8", "--gap", "1,3",
                       "--sigstop-s", "3", "--diskfull-s", "2", "--faults", ",".join(short_kinds),
                       "--state-dir", str(state)])
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


def test_every_fault_of_the_seeded_schedule_struck(report, short_kinds):
    kinds = [p["kind"] for p in report["schedule"]]
    assert kinds == [f["kind"] for f in report["faults"]] and len(kinds) == 6
    assert set(kinds) == set(short_kinds), kinds
    assert all(f["events"] for f in report["faults"])
    assert set(report["by_kind"]) >= set(kinds)


def test_a_full_disk_fails_the_duck_that_must_write_clearly_and_the_next_restart_makes_it_whole(report):
    if "diskfull" in report["skipped"]:
        pytest.skip(report["skipped"]["diskfull"])
    [f] = [f for f in report["faults"] if f["kind"] == "diskfull"]
    what = [e[1] for e in f["events"]]
    assert f["ok"], f
    assert what[0].startswith("disk full") and what[1].startswith("SIGKILL") and "space back" in what, what
    failed = next(w for w in what if w.startswith("duck FAILED"))
    assert ENOSPC_TEXT in failed and f"{report['config']['state_dir']}/ducks/" in failed, failed
    assert what[-1] == "Fleet.Restart: SERVING", what
    c = report["by_kind"]["diskfull"]
    assert c["chats"] and c["hung"] == 0 and c["silently_different"] == 0, c


def test_the_full_disk_check_finds_a_partial_file_a_damaged_entry_and_a_missing_one(tmp_path):
    cache = tmp_path / "ducks" / "0" / "cache"
    cache.mkdir(parents=True)
    good = b"a packed slice"
    entry = cache / f"{hashlib.blake2b(good, digest_size=16).hexdigest()}.fp9"
    entry.write_bytes(good)
    runtime = b'{"address": "127.0.0.1:1"}'
    (tmp_path / "duckd.json").write_bytes(runtime)
    assert _verify_state(tmp_path, cache, 1, entry, len(good), {}, runtime) == []
    (tmp_path / "ducks" / "0" / "port.tmp").write_bytes(b"")
    entry.write_bytes(b"A packed slice")
    problems = _verify_state(tmp_path, cache, 2, entry, len(good), {}, runtime)
    assert any("do not hash to their names" in p for p in problems), problems
    assert any("1 cache entries" in p and "expected 2" in p for p in problems), problems
    assert any("partial files left: ducks/0/port.tmp" in p for p in problems), problems


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


def test_duckd_restarted_on_a_full_disk_names_the_runtime_file_and_leaves_no_partial_one(tmp_path):
    """The one write of a restart that a full disk refuses (the files duckd rewrites in place reuse
    their own room; the runtime file was removed at the last stop): an error naming it and ENOSPC,
    exit status 1, and no empty duckd.json for a client to trip on (it used to be left)."""
    why = diskfull_available()
    if why:
        pytest.skip(why)
    from native.transport import write_key_file

    state = tmp_path / "duck"
    fs = StateFs(state).mount()
    try:
        (state / "duckd.lock").write_text("1\n")      # what an earlier duckd left: lock, token, key
        (state / "token").write_text("t" * 48 + "\n")
        (state / "token").chmod(0o600)
        write_key_file(state / "fleet.key")
        config = write_config(tmp_path / "duck.toml", state, ducks=1)
        fs.fill(leave=0)
        assert fs.free_bytes() == 0
        out = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr[-3000:]
        assert f"cannot write the runtime file {state}/duckd.json: {ENOSPC_TEXT}" in out.stderr, out.stderr[-3000:]
        assert not (state / "duckd.json").exists() and list(state.rglob("*.tmp")) == []
    finally:
        fs.unmount()
