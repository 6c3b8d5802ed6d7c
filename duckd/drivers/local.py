"""The local driver: duckfw processes on this host, on loopback. Each duck
keeps its port and its cache folder across restarts, so a restarted duck
finds its weights."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from duckd.drivers.base import DuckSpec, Driver

log = logging.getLogger("duckd.driver.local")


def duckfw_command(cfg, duck_id: int, bind: str, port: int, workdir: Path, key_file: Path) -> list[str]:
    from native.transport import duckfw_path

    cmd = [str(duckfw_path()), "--bind", bind, "--port", str(port), "--port-file", str(workdir / "port"),
           "--id", str(duck_id), "--cache-dir", str(workdir / "cache"), "--key-file", str(key_file),
           "--threads", str(cfg.threads_per_duck), "--mtu", str(cfg.mtu or "auto")]
    # spin-then-block keeps a duck awake for the next layer; on a shared host block (the default)
    cmd += ["--idle", "spin", "--spin-us", str(cfg.spin_us)] if cfg.spin else ["--idle", "block"]
    if cfg.cache_capacity_mb:
        cmd += ["--cache-capacity", f"{cfg.cache_capacity_mb}M"]
    if cfg.fault_drop_rate:   # tests: datagram loss on every duck, a pattern of its own
        cmd += ["--enable-fault-injection", "--drop-rate", str(cfg.fault_drop_rate), "--fault-seed", str(duck_id + 1)]
    if not cfg.data_mac:
        cmd += ["--no-data-mac"]   # fleet.data_mac = false: trusted links only
    return cmd


async def wait_port_file(proc: subprocess.Popen, port_file: Path, timeout: float, what: str) -> int:
    deadline = time.monotonic() + timeout
    while True:
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text.isdigit():
            return int(text)
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start listening within {timeout:.0f} s")
        await asyncio.sleep(0.01)


def spawn_duck(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """A duck process that logs to log_path and dies with duckd: duckfw --parent-pid asks
    the kernel for a SIGTERM when the duckd thread that started it ends (duckd spawns
    from its event loop's thread, which lives as long as duckd; SIGKILL of duckd too).

    The duck gets a process group of its own (a terminal's Ctrl-C reaches duckd, which
    stops its ducks in order) but stays in duckd's session: Linux's autogroup scheduling
    (on in most distributions) makes each session a group of its own, and a duck per group
    cost the host/duck handoffs of every layer their wake-up preemption. On the 2-core
    development VM a step of 32 sequences took 100 ms with a session per duck, 85 ms in
    duckd's (docs/serving.md)."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd + ["--parent-pid", str(os.getpid())], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0)


def exit_reason(proc: subprocess.Popen | None) -> str | None:
    if proc is None or proc.poll() is None:
        return None
    rc = proc.returncode
    if rc < 0:
        try:
            return f"process exited on signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"process exited on signal {-rc}"
    return f"process exited with status {rc}"


async def stop_process(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        await asyncio.to_thread(proc.wait, grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        await asyncio.to_thread(proc.wait)


class LocalDriver(Driver):
    name = "local"
    can_restart = True

    async def boot(self, duck: DuckSpec) -> None:
        workdir = self.state_dir / "ducks" / str(duck.index)
        (workdir / "cache").mkdir(parents=True, exist_ok=True)
        port_file = workdir / "port"
        port = duck.address[1] if duck.address else 0
        port_file.unlink(missing_ok=True)
        cmd = duckfw_command(self.cfg, duck.index, "127.0.0.1", port, workdir, self.key_file)
        duck.handle = spawn_duck(cmd, workdir / "duck.log")
        (workdir / "pid").write_text(f"{duck.handle.pid}\n")
        port = await wait_port_file(duck.handle, port_file, self.cfg.link_timeout_s, f"duck {duck.index}")
        duck.address = ("127.0.0.1", port)
        duck.notes["log"] = str(workdir / "duck.log")
        log.debug("duck %d: pid %d on 127.0.0.1:%d", duck.index, duck.handle.pid, port)

    def exited(self, duck: DuckSpec) -> str | None:
        return exit_reason(duck.handle)

    async def stop(self, duck: DuckSpec) -> None:
        await stop_process(duck.handle)
