"""Virtual ducks for the pxe driver's tests: a bridge and one tap per VM made here, QEMU VMs that
network-boot from it (their NIC ROM is iPXE), a monitor socket per VM for system_reset, and
everything removed again. The host packages come from apt when they are missing (a fresh CI
machine: about two minutes)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

PACKAGES = ["qemu-system-x86", "ipxe-qemu", "dnsmasq-base", "busybox-static", "linux-image-amd64"]


def missing_tools() -> list[str]:
    need = {"qemu-system-x86_64": shutil.which("qemu-system-x86_64"),
            "dnsmasq": shutil.which("dnsmasq") or Path("/usr/sbin/dnsmasq").exists(),
            "static busybox": Path("/bin/busybox").exists() and b"ld-linux" not in Path("/bin/busybox").read_bytes()[:4096],
            "/boot/vmlinuz-*": any(Path("/boot").glob("vmlinuz-*")),
            "iPXE ROM": Path("/usr/share/qemu/efi-virtio.rom").exists() or Path("/usr/lib/ipxe/qemu/efi-virtio.rom").exists()}
    return [name for name, ok in need.items() if not ok]


def install_tools() -> str:
    """Installs what is missing with apt-get; returns "" or why it could not."""
    if not shutil.which("apt-get"):
        return "no apt-get on this machine: install " + " ".join(PACKAGES)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            return f"{' '.join(cmd)} failed: {(r.stderr or r.stdout)[-800:]}"
    return ""


@pytest.fixture(scope="session")
def boot_host_tools():
    """The host packages of network boot, installed with apt-get when missing (root), else a skip
    that names what is missing."""
    missing = missing_tools()
    if missing:
        if os.geteuid() != 0:
            pytest.skip(f"network boot needs {', '.join(missing)} (apt-get install -y {' '.join(PACKAGES)}, as root)")
        t0 = time.monotonic()
        why = install_tools()
        missing = missing_tools()
        if why or missing:
            pytest.skip(f"network boot needs {', '.join(missing)}: {why or 'still missing after apt-get'}")
        print(f"\ninstalled {' '.join(PACKAGES)} in {time.monotonic() - t0:.0f} s")


def _ip(*args: str, check: bool = True) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class VirtualFleet:
    """A bridge <name>br with the host at <prefix>.1/24 and taps <name>t<i>; VMs started by the
    script at .power_on (duckd's fleet.pxe.power_on runs it with the duck's index and MAC)."""

    def __init__(self, folder: Path, name: str, prefix: str, vms: int, accel: str = "tcg", memory_mb: int = 512,
                 disks: dict[int, Path] | None = None):
        self.folder, self.name, self.prefix, self.vms = folder, name, prefix, vms
        self.bridge = f"{name}br"
        self.taps = [f"{name}t{i}" for i in range(vms)]
        self.macs = [f"52:54:00:d0:0c:{i + 1:02x}" for i in range(vms)]
        self.addresses = [f"{prefix}.{10 + i}" for i in range(vms)]
        self.accel, self.memory_mb = accel, memory_mb
        self.power_on = folder / "vm-power-on.sh"
        self.disks = disks or {}     # VM index -> a raw disk image (virtio)

    def __enter__(self) -> "VirtualFleet":
        _ip("link", "del", self.bridge, check=False)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for tap in self.taps:
            _ip("link", "del", tap, check=False)
            _ip("tuntap", "add", "dev", tap, "mode", "tap")
            _ip("link", "set", tap, "master", self.bridge)
            _ip("link", "set", tap, "up")
        cpu = "-cpu host" if self.accel == "kvm" else ""
        taps = " ".join(self.taps)
        disks = "".join(f"    {i}) disk='-drive file={p},if=virtio,format=raw' ;;\n" for i, p in self.disks.items())
        self.power_on.write_text(f"""#!/bin/sh
# power_on for duck $1 (MAC $2): its VM boots from the network (iPXE ROM of its virtio NIC)
set -e
i=$1; mac=$2; set -- {taps}; shift $i; tap=$1
d={self.folder}
disk=""
case $i in
{disks}esac
exec qemu-system-x86_64 -name duck$i -accel {self.accel} {cpu} -m {self.memory_mb} -smp 1 -nodefaults \\
    -display none -daemonize -pidfile $d/vm$i.pid -serial file:$d/vm$i.serial \\
    -monitor unix:$d/vm$i.mon,server,nowait -boot n \\
    -netdev tap,id=n0,ifname=$tap,script=no,downscript=no -device virtio-net-pci,netdev=n0,mac=$mac $disk
""")
        self.power_on.chmod(0o755)
        return self

    def serial(self, i: int) -> str:
        p = self.folder / f"vm{i}.serial"
        return p.read_text(errors="replace") if p.exists() else ""

    def monitor(self, i: int, command: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.folder / f"vm{i}.mon"))
            time.sleep(0.2)
            s.sendall(command.encode() + b"\n")
            time.sleep(0.3)
            return s.recv(65536).decode(errors="replace")

    def stop_vm(self, i: int) -> None:
        pid_file = self.folder / f"vm{i}.pid"
        if not pid_file.exists():
            return
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, 15)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(pid, 9)

    def __exit__(self, *exc) -> None:
        for i in range(self.vms):
            self.stop_vm(i)
        for tap in self.taps:
            _ip("link", "del", tap, check=False)
        _ip("link", "del", self.bridge, check=False)
