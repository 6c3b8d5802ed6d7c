"""The pxe driver: bare boxes (or VMs) that network-boot the duck boot image from duckd.

At the first boot the driver builds the image (duckd/image: kernel, initramfs with a static
duckfw, the fleet key and fleet.pxe's settings) into <state_dir>/pxe/tftp, starts dnsmasq on
fleet.pxe.interface (a fixed address per duck MAC, TFTP of the image, DNS off), then powers each
duck on (a Wake-on-LAN packet on that interface, or fleet.pxe.power_on) and waits for its
hello. A duck that does not answer within boot_timeout_s fails with how far its boot got, from
dnsmasq's log: "DHCP offered 10.0.0.11, boot script, kernel, initrd fetched by TFTP, Linux leased
its address, no hello in 180 s".

With fleet.pxe.power_cycle the driver can restart a duck (IPMI, a smart plug, a VM monitor);
without it a duck that stops answering is FAILED and asked for its hello until it boots again.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from pathlib import Path

from duckd.drivers.base import DuckSpec, Driver
from duckd.drivers.dnsmasq import Dnsmasq, boot_script, config_text, find_dnsmasq, interface_network, stages
from duckd.drivers.wol import magic_packet

log = logging.getLogger("duckd.driver.pxe")


def image_settings(fleet_cfg):
    """The image's duck settings from the fleet config (shared with `duckctl image build`)."""
    from duckd.image import DEFAULT_MODULES, ImageSettings

    p = fleet_cfg.pxe
    return ImageSettings(port=p.port, threads=p.threads, cache=p.cache, cache_capacity_mb=fleet_cfg.cache_capacity_mb,
                         idle="spin" if fleet_cfg.spin else "block", spin_us=fleet_cfg.spin_us, data_mac=fleet_cfg.data_mac,
                         modules=tuple(dict.fromkeys(DEFAULT_MODULES + tuple(p.modules))), kernel=p.kernel,
                         busybox=p.busybox)


class PxeDriver(Driver):
    name = "pxe"

    def __init__(self, cfg, state_dir: Path, key_file: Path):
        super().__init__(cfg, state_dir, key_file)
        self.p = cfg.pxe
        self.folder = state_dir / "pxe"
        self.tftp = self.folder / "tftp"
        self.dnsmasq: Dnsmasq | None = None
        self.image = None
        self._serving = asyncio.Lock()
        self._powered: set[int] = set()

    @property
    def can_restart(self) -> bool:
        return bool(self.p.power_cycle)

    def specs(self) -> list[DuckSpec]:
        try:
            subnet = f"{interface_network(self.p.interface).network} ({self.p.interface})"
        except RuntimeError:      # said at the first boot, with what to do
            subnet = self.p.interface
        return [DuckSpec(i, subnet=subnet, address=(d.address, self.p.port), notes={"mac": d.mac})
                for i, d in enumerate(self.p.ducks)]

    # -- the boot server -------------------------------------------------------
    async def _serve(self) -> None:
        async with self._serving:
            if self.dnsmasq is not None and self.dnsmasq.alive():
                return
            await asyncio.to_thread(self._start_server)

    def _start_server(self) -> None:
        from duckd.image import build_image

        binary = find_dnsmasq(self.p.dnsmasq)
        net = interface_network(self.p.interface)
        self.tftp.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.image = build_image(self.tftp, self.key_file, image_settings(self.cfg))
        log.info("duck boot image %s: %.1f MB, digest %s, built in %.1f s", self.tftp, self.image.size / 1e6,
                 self.image.digest[:16], time.monotonic() - t0)
        for i in range(len(self.p.ducks)):
            (self.tftp / f"duck-{i}.ipxe").write_text(boot_script(i))
        undionly = Path("/usr/lib/ipxe/undionly.kpxe")
        if undionly.exists():
            (self.tftp / undionly.name).write_bytes(undionly.read_bytes())
        else:
            log.info("no %s (package ipxe): only iPXE boot ROMs (QEMU's, iPXE-flashed NICs) can boot", undionly)
        for f in self.tftp.iterdir():    # dnsmasq as root serves world-readable files only; the folder
            f.chmod(0o644)               # above, duckd's state folder, is 0700: no other local user reads them
        ducks = [(d.mac, d.address) for d in self.p.ducks]
        self.dnsmasq = Dnsmasq(binary, self.folder)
        self.dnsmasq.start(config_text(self.p.interface, net, ducks, self.tftp, self.dnsmasq.log_file,
                                       self.folder / "leases", self.p.lease_s))
        (self.folder / "image.json").write_text(json.dumps({"digest": self.image.digest, "size": self.image.size}))

    # -- power -----------------------------------------------------------------
    async def _run_power(self, argv: list[str], duck: DuckSpec, what: str) -> None:
        args = [a.format(index=duck.index, mac=duck.notes["mac"], address=duck.address[0]) for a in argv]
        proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        except asyncio.TimeoutError:
            proc.kill()
            raise RuntimeError(f"fleet.pxe.{what} {args}: still running after 60 s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"fleet.pxe.{what} {args} exited with {proc.returncode}: "
                               f"{out.decode(errors='replace').strip()[-500:]}")
        log.info("duck %d: %s: %s", duck.index, what, " ".join(args))

    def _wake(self, duck: DuckSpec) -> None:
        net = interface_network(self.p.interface)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, self.p.interface.encode())
            s.sendto(magic_packet(duck.notes["mac"]), (str(net.network.broadcast_address), 9))
        log.info("duck %d: magic packet for %s on %s", duck.index, duck.notes["mac"], self.p.interface)

    async def _power_on(self, duck: DuckSpec) -> None:
        if duck.index in self._powered and self.p.power_cycle:
            await self._run_power(self.p.power_cycle, duck, "power_cycle")
        elif self.p.power == "command":
            await self._run_power(self.p.power_on, duck, "power_on")
        else:
            await asyncio.to_thread(self._wake, duck)
        self._powered.add(duck.index)

    # -- boot ------------------------------------------------------------------
    async def boot(self, duck: DuckSpec) -> None:
        await self._serve()
        mark = self.dnsmasq.log_size()
        t0 = time.monotonic()
        await self._power_on(duck)
        await self._await_hello(duck, mark, t0)
        duck.notes["boot_s"] = round(time.monotonic() - t0, 1)
        log.info("duck %d: booted over the network and said hello in %.1f s", duck.index, duck.notes["boot_s"])

    async def _await_hello(self, duck: DuckSpec, mark: int, t0: float) -> None:
        from native.transport import DuckError, Fleet, read_key_file

        probe = Fleet([duck.address], read_key_file(self.key_file), mtu=self.cfg.mtu, retransmit_ms=100,
                      deadline_ms=1000)
        reported = t0
        try:
            while True:
                try:
                    await asyncio.to_thread(probe.hello_only)
                    return
                except DuckError:
                    pass
                if time.monotonic() - reported >= 10:     # a boot takes a while: say how far it got
                    reported = time.monotonic()
                    log.info("duck %d: booting for %.0f s: %s", duck.index, reported - t0, self.boot_progress(duck, mark))
                if not self.dnsmasq.alive():
                    raise RuntimeError(f"dnsmasq exited (status {self.dnsmasq.proc.returncode}); see "
                                       f"{self.folder / 'dnsmasq.err'}")
                if time.monotonic() - t0 > self.p.boot_timeout_s:
                    raise RuntimeError(self.boot_progress(duck, mark) +
                                       f", no hello in {self.p.boot_timeout_s:.0f} s at {duck.address[0]}:{duck.address[1]}")
                await asyncio.sleep(1.0)
        finally:
            probe.close()

    def boot_progress(self, duck: DuckSpec, mark: int = 0) -> str:
        return stages(self.dnsmasq.log_since(mark), duck.notes["mac"], duck.address[0],
                      f"duck-{duck.index}.ipxe").describe()

    async def close(self) -> None:
        if self.dnsmasq is not None:
            await asyncio.to_thread(self.dnsmasq.stop)
            log.info("dnsmasq stopped")
