"""The netns driver: each duck in its own network namespace, behind a veth
pair on one of several per-subnet bridges, as a real LAN of ducks would be
(the seeds ran 4 broadcast domains of 8). Needs root and iproute2. The
driver removes every namespace, veth and bridge it made.

Each subnet reaches the host through a port of its own: a veth pair whose
host end holds <prefix>.<s+1>.1 and whose other end is on the subnet's
bridge, so a host port has a rate of its own (fleet.netns.port_rate_mbit,
the seeds' 25GbE) apart from the ducks' links (duck_rate_mbit, their
2.5GbE); duckd/drivers/links.py shapes both directions of each."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
from pathlib import Path

from duckd.drivers.base import DuckSpec, Driver
from duckd.drivers.links import Shape, Shaper
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
        self.shaper = Shaper(self.n.link_mtu)
        self.duck_shape = Shape(self.n.duck_rate_mbit, self.n.duck_delay_us, self.n.duck_jitter_us, self.n.duck_loss)
        self.port_shape = Shape(self.n.port_rate_mbit, self.n.port_delay_us)

    def _subnet(self, i: int) -> int:
        return i % self.n.subnets

    def specs(self) -> list[DuckSpec]:
        return [DuckSpec(i, subnet=f"{self.n.prefix}.{self._subnet(i) + 1}.0/24") for i in range(self.cfg.ducks)]

    def _bridge(self, s: int) -> str:
        """The subnet's bridge and the host's port on it (made once)."""
        name = f"{self.n.name}br{s}"
        if name not in self._made_bridges:
            port, port_peer = f"{self.n.name}p{s}", f"{self.n.name}q{s}"
            for leftover in (name, port):             # of a crashed run
                _ip("link", "del", leftover, check=False)
            _ip("link", "add", name, "type", "bridge")
            self._made_bridges.append(name)
            _ip("link", "set", name, "up")
            _ip("link", "add", port, "mtu", str(self.n.link_mtu), "type", "veth", "peer", "name", port_peer,
                "mtu", str(self.n.link_mtu))
            self._made_links.append(port)
            _ip("link", "set", port_peer, "master", name)
            _ip("link", "set", port_peer, "up")
            _ip("addr", "add", f"{self.n.prefix}.{s + 1}.1/24", "dev", port)
            _ip("link", "set", port, "up")
            self.shaper.apply(port, self.port_shape)          # host -> subnet
            self.shaper.apply(port_peer, self.port_shape)     # subnet -> host
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
            _ip("link", "add", host_end, "mtu", str(self.n.link_mtu), "type", "veth", "peer", "name", duck_end,
                "mtu", str(self.n.link_mtu))
            self._made_links.append(host_end)
            _ip("link", "set", duck_end, "netns", ns)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", duck_end)
            _ip("-n", ns, "link", "set", duck_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.shaper.apply(duck_end, self.duck_shape, ns=ns)   # duck -> switch
            self.shaper.apply(host_end, self.duck_shape)          # switch -> duck
            log.info("duck %d: namespace %s, %s/24 on bridge %s", i, ns, ip, bridge)
        return ip

    async def boot(self, duck: DuckSpec) -> None:
        ip = await asyncio.to_thread(self._plumb, duck)
        workdir = self.state_dir / "ducks" / str(duck.index)
        (workdir / "cache").mkdir(parents=True, exist_ok=True)
        (workdir / "port").unlink(missing_ok=True)
        cmd = duckfw_command(self.cfg, duck.index, ip, DUCK_PORT, workdir, self.key_file)
        extra = self.shaper.duck_fallback(self.duck_shape, self.port_shape)
        if "--enable-fault-injection" in cmd:
            extra = [a for a in extra if a != "--enable-fault-injection"]
        cmd = ["ip", "netns", "exec", f"{self.n.name}{duck.index}"] + cmd + extra
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
        log.info("removed %d namespaces, %d veth pairs and %d bridges", len(self._made_netns),
                 len(self._made_links), len(self._made_bridges))
        self._made_netns, self._made_links, self._made_bridges = [], [], []
