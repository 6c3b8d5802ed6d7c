"""The netns driver: each duck in its own network namespace, behind a veth
pair on one of several per-subnet bridges, as a real LAN of ducks would be
(the seeds ran 4 broadcast domains of 8). Needs root and iproute2. The
driver removes every namespace, veth and bridge it made."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
from pathlib import Path

from duckd.drivers import DuckSpec, Driver
from duckd.drivers.local import duckfw_command, exit_reason, spawn_duck, stop_process, wait_port_file

log = logging.getLogger("duckd.driver.netns")

DUCK_PORT = 7700


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


class NetnsDriver(Driver):
    name = "netns"
    can_restart = True

    def __init__(self, cfg, state_dir: Path, key_file: Path):
        super().__init__(cfg, state_dir, key_file)
        self.n = cfg.netns
        self._made_bridges: list[str] = []
        self._made_netns: list[str] = []
        self._made_links: list[str] = []
        self._lock = threading.Lock()       # ducks boot concurrently; bridges are shared

    def _subnet(self, i: int) -> int:
        return i % self.n.subnets

    def specs(self) -> list[DuckSpec]:
        return [DuckSpec(i, subnet=f"{self.n.prefix}.{self._subnet(i) + 1}.0/24") for i in range(self.cfg.ducks)]

    def _bridge(self, s: int) -> str:
        name = f"{self.n.name}br{s}"
        if name not in self._made_bridges:
            _ip("link", "del", name, check=False)        # a leftover of a crashed run
            _ip("link", "add", name, "type", "bridge")
            self._made_bridges.append(name)
            _ip("addr", "add", f"{self.n.prefix}.{s + 1}.1/24", "dev", name)
            _ip("link", "set", name, "up")
        return name

    def _plumb(self, duck: DuckSpec) -> str:
        with self._lock:
            return self._plumb_locked(duck)

    def _plumb_locked(self, duck: DuckSpec) -> str:
        i, s = duck.index, self._subnet(duck.index)
        ns, host_end, duck_end = f"{self.n.name}{i}", f"{self.n.name}h{i}", f"{self.n.name}d{i}"
        ip = f"{self.n.prefix}.{s + 1}.{10 + i}"
        if ns not in self._made_netns:
            bridge = self._bridge(s)
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", host_end, check=False)
            _ip("netns", "add", ns)
            self._made_netns.append(ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", duck_end)
            self._made_links.append(host_end)
            _ip("link", "set", duck_end, "netns", ns)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", duck_end)
            _ip("-n", ns, "link", "set", duck_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            log.info("duck %d: namespace %s, %s/24 on bridge %s", i, ns, ip, bridge)
        return ip

    async def boot(self, duck: DuckSpec) -> None:
        ip = await asyncio.to_thread(self._plumb, duck)
        workdir = self.state_dir / "ducks" / str(duck.index)
        (workdir / "cache").mkdir(parents=True, exist_ok=True)
        (workdir / "port").unlink(missing_ok=True)
        cmd = ["ip", "netns", "exec", f"{self.n.name}{duck.index}"] + \
            duckfw_command(self.cfg, duck.index, ip, DUCK_PORT, workdir, self.key_file)
        duck.handle = spawn_duck(cmd, workdir / "duck.log")
        (workdir / "pid").write_text(f"{duck.handle.pid}\n")
        port = await wait_port_file(duck.handle, workdir / "port", self.cfg.link_timeout_s, f"duck {duck.index}")
        duck.address = (ip, port)

    def exited(self, duck: DuckSpec) -> str | None:
        return exit_reason(duck.handle)

    async def stop(self, duck: DuckSpec) -> None:
        await stop_process(duck.handle)

    async def close(self) -> None:
        for ns in self._made_netns:
            _ip("netns", "del", ns, check=False)
        for link in self._made_links + self._made_bridges:
            _ip("link", "del", link, check=False)
        log.info("removed %d namespaces and %d bridges", len(self._made_netns), len(self._made_bridges))
        self._made_netns, self._made_links, self._made_bridges = [], [], []
