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
