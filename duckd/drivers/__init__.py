"""Boot drivers: how ducks are started, restarted and stopped.

    local  duckfw processes on this host (the embedded default)
    netns  duckfw in network namespaces behind veth pairs and per-subnet bridges
    wol    real hardware woken by a Wake-on-LAN magic packet
    pxe    bare hardware (or VMs) network-booted from duckd with the duck boot image
"""
from __future__ import annotations

from pathlib import Path

from duckd.drivers.base import DuckSpec, Driver

__all__ = ["DuckSpec", "Driver", "make_driver"]


def make_driver(cfg, state_dir: Path, key_file: Path) -> Driver:
    if cfg.driver == "local":
        from duckd.drivers.local import LocalDriver
        return LocalDriver(cfg, state_dir, key_file)
    if cfg.driver == "netns":
        from duckd.drivers.netns import NetnsDriver
        return NetnsDriver(cfg, state_dir, key_file)
    if cfg.driver == "wol":
        from duckd.drivers.wol import WolDriver
        return WolDriver(cfg, state_dir, key_file)
    if cfg.driver == "pxe":
        from duckd.drivers.pxe import PxeDriver
        return PxeDriver(cfg, state_dir, key_file)
    raise ValueError(f"fleet.driver = {cfg.driver!r}: expected local, netns, wol or pxe")
