"""The wol driver: real ducks woken by a Wake-on-LAN magic packet (6 x 0xFF,
then the MAC 16 times) sent over UDP to the configured broadcast address;
the duck is up when it answers at its configured address."""
from __future__ import annotations

import logging
import socket

from duckd.drivers.base import DuckSpec, Driver

log = logging.getLogger("duckd.driver.wol")


def magic_packet(mac: str) -> bytes:
    raw = bytes.fromhex(mac.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(f"MAC {mac!r}: expected 6 octets")
    return b"\xff" * 6 + raw * 16


class WolDriver(Driver):
    name = "wol"
    can_restart = False     # a hung board needs hands or a smart plug

    def specs(self) -> list[DuckSpec]:
        out = []
        for i, d in enumerate(self.cfg.wol.ducks):
            host, _, port = d.address.rpartition(":")
            out.append(DuckSpec(i, subnet=host.rsplit(".", 1)[0] + ".0/24", address=(host, int(port)),
                                notes={"mac": d.mac}))
        return out

    async def boot(self, duck: DuckSpec) -> None:
        host, _, port = self.cfg.wol.broadcast.rpartition(":")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            s.sendto(magic_packet(duck.notes["mac"]), (host, int(port)))
        log.info("duck %d: magic packet for %s sent to %s", duck.index, duck.notes["mac"], self.cfg.wol.broadcast)
