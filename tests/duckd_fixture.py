"""A real duckd for tests: the `duckd` process with a local fleet of real
duckfw processes on loopback, gRPC on a free port, state in a temp folder."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from duck_proto.client import Endpoint, sync_channel

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, state_dir: Path, ducks: int = 4, model: dict | None = None, **fleet) -> Path:
    """A duckd config on loopback ports picked by the system; fleet settings as keywords
    (a dict value is a [fleet.<key>] table), model settings beside max_tokens = 48."""
    lines = ["[daemon]", 'listen = "127.0.0.1:0"', 'http_listen = "127.0.0.1:0"', f'state_dir = "{state_dir}"',
             "shutdown_grace_s = 6.0", "", "[model]",
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
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(self.address))
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
        return Endpoint(self.address, self.token, "test")

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
