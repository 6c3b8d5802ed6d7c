"""Lifecycle: sd_notify to a real NOTIFY_SOCKET, SIGTERM during a chat ends
the stream cleanly and exits 0, an invalid config names the field."""
import signal
import socket
import subprocess
import sys
import threading
import time

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from tests.duckd_fixture import RunningDaemon, write_config


def test_sigterm_during_chat_ends_the_stream_cleanly_and_exits_0(tmp_path):
    notify_path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(1.0)
    messages = []

    def collect():
        while True:
            try:
                messages.append(listener.recv(4096).decode())
            except socket.timeout:
                if stop.is_set():
                    return
    stop = threading.Event()
    t = threading.Thread(target=collect)
    t.start()
    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2), state,
                           env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "2000000"}).start()
    try:
        deadline = time.monotonic() + 10      # sent as the API turns SERVING: the collector may read it a bit later
        while not any("READY=1" in m for m in messages) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("READY=1" in m for m in messages), messages
        # SIGHUP reloads what can change safely
        daemon.config.write_text(daemon.config.read_text().replace("max_tokens = 48", "max_tokens = 5"))
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "configuration reloaded" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "SIGHUP: configuration reloaded" in daemon.log()
        _, short = daemon.chat("Tell me a long story.", max_tokens=0)       # 0: the daemon's (new) default
        assert short.output_len <= 5 and short.finish_reason == "length"
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Write a long story about a duck.")],
                             max_tokens=400, temperature=0.0)
        stream = rpc.ChatStub(daemon.channel()).Chat(req, timeout=120)
        tokens, stats = 0, None
        for ev in stream:
            if ev.WhichOneof("event") == "token":
                tokens += 1
                if tokens == 3:
                    daemon.proc.terminate()           # SIGTERM mid-stream
            else:
                stats = ev.stats
        assert stats is not None and stats.output_len >= 3   # the stream ended with its stats, no error
        assert daemon.proc.wait(60) == 0
    finally:
        daemon.stop()
        stop.set()
        t.join()
    joined = "\n".join(messages)
    assert "WATCHDOG=1" in joined and "STOPPING=1" in joined
    assert joined.index("READY=1") < joined.index("STOPPING=1")


def test_invalid_config_fails_at_start_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    for text, field in [("[fleet]\nducks = 0\n", "fleet.ducks = 0"),
                        ('[fleet]\ndriver = "ssh"\n', "fleet.driver = 'ssh'"),
                        ("[model]\nbackend = 3\n", "model.backend = 3"),
                        ("[fleet]\nspeed = 1\n", "fleet.speed: unknown field"),
                        ('[daemon]\nlisten = "0.0.0.0:1"\n', "not a loopback address"),
                        ("[fleet\n", "not valid TOML")]:
        bad.write_text(text)
        r = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(bad)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and field in r.stderr, (text, r.stderr)


def _duckfw_pids(session_of: int | None = None) -> set[int]:
    """The duckfw processes of this machine; session_of: only those in that process's session
    (another test run on the machine starts ducks of its own)."""
    import os
    out = subprocess.run(["pgrep", "-x", "duckfw"], capture_output=True, text=True).stdout
    pids = {int(p) for p in out.split()}
    if session_of is None:
        return pids
    mine = set()
    for pid in pids:
        try:
            if os.getsid(pid) == os.getsid(session_of):
                mine.add(pid)
        except ProcessLookupError:   # gone since pgrep saw it
            pass
    return mine


def test_one_daemon_per_state_folder_and_private_files(tmp_path):
    """A second duckd on the same state folder is refused with a line that names the first,
    which duckctl still finds; the folder is 0700, the token, key and duck caches 0600."""
    import os
    import stat

    state = tmp_path / "duck"
    cfg = write_config(tmp_path / "duckd.toml", state, ducks=2)
    first = RunningDaemon(cfg, state, env={"XDG_STATE_HOME": str(tmp_path)}).start()
    try:
        r = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(cfg)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and f"another duckd (pid {first.proc.pid}) uses the state folder" in r.stderr, \
            r.stderr
        status = subprocess.run([sys.executable, "-m", "duckd.ctl", "--config", str(cfg), "status"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "SERVING" in status.stdout, status.stderr
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        for path in [state / "token", state / "fleet.key", *(state / "ducks").rglob("*.fp9")]:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    finally:
        first.stop()


def test_the_ducks_die_with_a_killed_daemon(tmp_path):
    """...and live in the daemon's session, each in a process group of its own: a session
    per duck is an autogroup per duck for the kernel's scheduler, which cost a step of 32
    sequences 18 % on the development VM (duckd/drivers/local.py spawn_duck)."""
    import os

    state = tmp_path / "duck"
    before = _duckfw_pids()
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=3), state).start()
    mine = _duckfw_pids() - before
    try:   # a failed check still kills the daemon (its ducks follow it)
        assert len(mine) == 3
        for pid in mine:
            assert os.getsid(pid) == os.getsid(daemon.proc.pid), f"duck {pid} is in a session of its own"
            assert os.getpgid(pid) == pid, f"duck {pid} shares the process group {os.getpgid(pid)}"
    finally:
        daemon.stop(signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while mine & _duckfw_pids():
        assert time.monotonic() < deadline, f"ducks {mine & _duckfw_pids()} outlived their SIGKILLed daemon"
        time.sleep(0.05)


def test_sigterm_at_any_moment_of_the_start_exits_0(tmp_path):
    """SIGTERM during boot, weight upload or model load: a clean exit 0, every time."""
    import random

    rng = random.Random(7)
    for trial in range(10):
        state = tmp_path / f"duck{trial}"    # a fresh state: the ducks' caches are empty, the weights uploaded
        daemon = RunningDaemon(write_config(tmp_path / f"duckd{trial}.toml", state, ducks=2), state)
        daemon.start(wait_ready=False)
        time.sleep(rng.uniform(0.0, 3.0))
        code = daemon.stop()
        assert code == 0, f"trial {trial}: exit {code}\n{daemon.log()}"
        assert "Traceback" not in daemon.log(), daemon.log()


def test_an_unwritable_state_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = tmp_path / "duckd.toml"
    cfg.write_text(f'[daemon]\nlisten = "127.0.0.1:0"\nhttp_listen = ""\nstate_dir = "{blocker / "duck"}"\n')
    r = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and f"state folder {blocker / 'duck'}" in r.stderr and "Traceback" not in r.stderr, \
        r.stderr


def test_a_host_backend_starts_no_ducks(tmp_path):
    state = tmp_path / "duck"
    before = _duckfw_pids()
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, model={"backend": "torch"}),
                           state).start()
    try:
        assert _duckfw_pids(daemon.proc.pid) - before == set(), "ducks started for a model that runs on the host"
        assert all(d.state == pb.OFFLINE for d in daemon.ducks())
        text, stats = daemon.chat("Which city is the capital of France?", max_tokens=8)
        assert "Paris" in text and stats.output_len > 0
    finally:
        daemon.stop()


def test_a_second_sigterm_ends_the_process_within_its_bound(tmp_path):
    """Two SIGTERMs while 8 chats decode and every duck is stopped (SIGSTOP: the step waits on
    them): the process is gone within main.FORCED_EXIT_S (+1 s for the interpreter's exit)."""
    import os

    from duckd.main import FORCED_EXIT_S
    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, model={"max_tokens": 400}),
                           state).start()
    req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Write a long story about a duck.")],
                         max_tokens=400, temperature=0.0)
    started = threading.Barrier(9)

    def chat():
        try:
            stream = rpc.ChatStub(daemon.channel()).Chat(req, timeout=60)
            next(stream)
            started.wait(30)
            for _ in stream:
                pass
        except Exception:
            pass
    threads = [threading.Thread(target=chat, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    pids = [daemon.duck_pid(i) for i in range(2)]
    try:
        started.wait(60)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.proc.wait(FORCED_EXIT_S + 5)
        assert time.monotonic() - t0 <= FORCED_EXIT_S + 1.0
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        daemon.stop()
    assert "second SIGTERM: forcing shutdown" in daemon.log()


def test_a_chat_ended_by_the_drain_reports_the_tokens_it_made(tmp_path):
    """SIGTERM with a short grace ends a long chat whose stop string holds all its text back: the
    stream's stats and the daemon's log give the tokens it made, not the text deltas sent (one
    here, the held text flushed at the end: the log said "cancelled after 1 tokens" after ~300)."""
    import re
    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, daemon={"shutdown_grace_s": 0.5}),
                           state).start()
    try:
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Write a long story about a duck.")],
                             max_tokens=1900, temperature=0.0, stop=["q" * 8000])
        events = []
        reader = threading.Thread(target=lambda: events.extend(rpc.ChatStub(daemon.channel()).Chat(req, timeout=120)))
        reader.start()
        time.sleep(5)                           # tens of tokens made, none sent
        daemon.proc.terminate()
        reader.join(60)
        kinds = [ev.WhichOneof("event") for ev in events]
        assert kinds in (["stats"], ["token", "stats"]), kinds     # the held text is flushed at the end
        done = events[-1].stats
        assert done.finish_reason == "cancelled" and done.output_len >= 10, done
        assert daemon.proc.wait(60) == 0
        logged = re.findall(r"chat cancelled after (\d+) tokens \(daemon stopping\)", daemon.log())
        assert logged == [str(done.output_len)], daemon.log()[-2000:]
    finally:
        daemon.stop()
