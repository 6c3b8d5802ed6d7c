"""A real duckd with a local fleet, for the tests and the benchmarks that run against the
daemon as an operator would: the `duckd` process with real duckfw processes on loopback,
gRPC and HTTP on free ports, state in a folder of the caller's; and the few client helpers
both use (all ducks serving again, the longest gap of a stream, a raw HTTP post)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from duck_proto.client import Endpoint, discover, sync_channel

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, state_dir: Path, ducks: int = 4, model: dict | None = None, daemon: dict | None = None,
                 **fleet) -> Path:
    """A duckd config on loopback ports picked by the system; fleet settings as keywords
    (a dict value is a [fleet.<key>] table), model settings beside max_tokens = 48, daemon
    settings beside shutdown_grace_s = 6."""
    lines = ["[daemon]", 'listen = "127.0.0.1:0"', 'http_listen = "127.0.0.1:0"', f'state_dir = "{state_dir}"',
             *(f"{k} = {json.dumps(v)}" for k, v in {"shutdown_grace_s": 6.0, **(daemon or {})}.items()), "", "[model]",
             *(f"{k} = {json.dumps(v)}" for k, v in {"max_tokens": 48, **(model or {})}.items()), "", "[fleet]",
             f"ducks = {ducks}"]
    fleet = {"fail_after_s": 1.0, "health_interval_s": 0.25, **fleet}
    for k, v in fleet.items():
        if isinstance(v, dict):
            continue
        lines.append(f"{k} = {json.dumps(v)}")
    for k, v in fleet.items():
        if isinstance(v, dict):
            lines += ["", f"[fleet.{k}]"] + [f"{kk} = {json.dumps(vv)}" for kk, vv in v.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class RunningDaemon:
    """duckd started with a config; .address/.token once ready."""

    def __init__(self, config: Path, state_dir: Path, env: dict | None = None):
        self.config, self.state_dir = config, state_dir
        self.log_path = state_dir.parent / f"duckd-{state_dir.name}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.address = self.token = self.http_address = ""
        self.tls = None      # duck_proto.tls.ClientTls: the certificate the runtime file names (daemon.tls)

    def start(self, timeout: float = 180.0, wait_ready: bool = True) -> "RunningDaemon":
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "duckd.main", "--config", str(self.config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        runtime = self.state_dir / "duckd.json"
        deadline = time.monotonic() + timeout
        while not runtime.exists():
            self._alive_or_fail(deadline)
            time.sleep(0.05)
        info = json.loads(runtime.read_text())
        self.address, self.token = info["address"], Path(info["token_file"]).read_text().strip()
        self.http_address = info.get("http_address", "")
        self.tls = discover(state_dir=self.state_dir).tls
        if wait_ready:
            self.wait_ready(deadline)
        return self

    def _alive_or_fail(self, deadline: float) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"duckd exited with {self.proc.returncode}:\n{self.log()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"duckd not ready in time:\n{self.log()}")

    def wait_ready(self, deadline: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        stub = health_pb2_grpc.HealthStub(self.channel())
        while True:
            self._alive_or_fail(deadline)
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.address, self.token, "test", self.http_address, self.tls)

    def channel(self) -> grpc.Channel:
        return sync_channel(self.endpoint)

    def ducks(self) -> list[pb.DuckStatus]:
        return list(rpc.FleetStub(self.channel()).List(pb.ListDucksRequest(), timeout=10).ducks)

    def duck_pid(self, i: int) -> int:
        return int((self.state_dir / "ducks" / str(i) / "pid").read_text())

    def kill_duck(self, i: int) -> int:
        pid = self.duck_pid(i)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_duck(self, i: int, state: int, timeout: float) -> pb.DuckStatus:
        deadline = time.monotonic() + timeout
        while True:
            d = self.ducks()[i]
            if d.state == state:
                return d
            if time.monotonic() > deadline:
                raise AssertionError(f"duck {i} is {pb.DuckState.Name(d.state)} ({d.reason}), "
                                     f"not {pb.DuckState.Name(state)} after {timeout} s")
            time.sleep(0.05)

    def chat(self, text: str, max_tokens: int = 24, timeout: float = 120):
        req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=text)], max_tokens=max_tokens,
                             temperature=0.0)
        tokens, stats = [], None
        for ev in rpc.ChatStub(self.channel()).Chat(req, timeout=timeout):
            if ev.WhichOneof("event") == "token":
                tokens.append(ev.token)
            else:
                stats = ev.stats
        return "".join(tokens), stats

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def all_serving(daemon: RunningDaemon, timeout: float = 60) -> None:
    for i in range(len(daemon.ducks())):
        daemon.wait_duck(i, pb.SERVING, timeout=timeout)


def max_gap(times: list[float]) -> float:
    """The longest wait between two arrivals (0 for fewer than two)."""
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def raw_post(http_address: str, token: str, head: bytes, body_parts, timeout: float = 30) -> tuple[int, bytes]:
    """POST /v1/chat/completions by hand: the headers, then the body parts until the server answers
    (or they run out); the status and the answer's body. A server that refuses a body early
    answers before it is all sent, which a plain HTTP client would not wait to read."""
    host, port = http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: duck\r\nAuthorization: Bearer "
                  + token.encode() + b"\r\nContent-Type: application/json\r\n" + head + b"\r\n")
        answer = b""
        for part in body_parts:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
            s.setblocking(False)
            try:
                answer += s.recv(65536)
            except BlockingIOError:
                pass
            s.setblocking(True)
            if answer:
                break
        s.settimeout(timeout)
        while True:
            head_end = answer.find(b"\r\n\r\n")
            if head_end >= 0:
                length = [int(line.split(b":")[1]) for line in answer[:head_end].split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(answer) >= head_end + 4 + length[0]:
                    break
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer.split(b"\r\n\r\n", 1)[1]
