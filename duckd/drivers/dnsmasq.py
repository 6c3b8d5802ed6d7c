"""dnsmasq as the fleet's boot server: DHCP (a fixed address per duck MAC) and TFTP of the duck
boot image, on one interface, DNS off. QEMU's NIC ROMs and iPXE-flashed boxes get the duck's iPXE
script at once; a plain PXE ROM gets undionly.kpxe (Debian package ipxe) first, which then asks
again as iPXE.

Its log tells how far each duck's boot got (stages()), which names the reason of a duck that
never says hello: "DHCP offered 10.0.0.11, boot script, kernel and initrd fetched, Linux leased
its address".
"""
from __future__ import annotations

import ipaddress
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("duckd.driver.pxe")

UNDIONLY = Path("/usr/lib/ipxe/undionly.kpxe")
_DHCP = re.compile(r"DHCP(DISCOVER|OFFER|REQUEST|ACK|NAK)\(\S+\) (?:(\d+\.\d+\.\d+\.\d+) )?([0-9a-f]{2}(?::[0-9a-f]{2}){5})")
_TFTP_SENT = re.compile(r"dnsmasq-tftp\[\d+\]: (sent|failed sending) (\S+) to (\d+\.\d+\.\d+\.\d+)")
# refusals name the file, not the client
_TFTP_REFUSED = re.compile(r"dnsmasq-tftp\[\d+\]: (?:cannot access (\S+): (.*)|file (\S+) not found)")


def interface_network(name: str) -> ipaddress.IPv4Interface:
    """The first IPv4 address of an interface, with its prefix (ip -4 -o addr show)."""
    r = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", name], capture_output=True, text=True)
    m = re.search(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", r.stdout)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"fleet.pxe.interface = {name!r}: no such interface or it has no IPv4 address "
                           f"({(r.stderr or 'no inet address').strip()}); give it the fleet subnet's host address")
    return ipaddress.IPv4Interface(m.group(1))


def boot_script(index: int, kernel_args: str = "") -> str:
    """The iPXE script of one duck: the image from the same TFTP server, the duck's id on the
    kernel command line, and the MAC iPXE booted from (the duck's NIC among several)."""
    return ("#!ipxe\n"
            f"kernel vmlinuz duck.id={index} duck.mac=${{mac}} console=tty0 console=ttyS0,115200 {kernel_args}\n"
            "initrd initrd.img\nboot\n")


def config_text(interface: str, net: ipaddress.IPv4Interface, ducks: list[tuple[str, str]], tftp_root: Path,
                log_file: Path, lease_file: Path, lease_s: int) -> str:
    """dnsmasq.conf: ducks are (mac, address) in duck order; only they get leases (static)."""
    lines = ["port=0", f"interface={interface}", "bind-interfaces", "no-resolv", "no-hosts",
             f"log-facility={log_file}", f"dhcp-leasefile={lease_file}",
             f"dhcp-range={net.network.network_address},static,{net.netmask},{lease_s}s",
             "dhcp-authoritative", "dhcp-match=set:ipxe,175", "enable-tftp", f"tftp-root={tftp_root}"]
    for i, (mac, address) in enumerate(ducks):
        if ipaddress.IPv4Address(address) not in net.network:
            raise RuntimeError(f"fleet.pxe.ducks[{i}].address = {address!r}: not on {interface}'s subnet {net.network}")
        lines += [f"dhcp-host={mac},{address},set:duck{i}", f"dhcp-boot=tag:ipxe,tag:duck{i},duck-{i}.ipxe"]
    if UNDIONLY.exists():
        lines.append("dhcp-boot=tag:!ipxe,undionly.kpxe")
    return "\n".join(lines) + "\n"


def find_dnsmasq(configured: str = "") -> str:
    path = configured or shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if Path("/usr/sbin/dnsmasq").exists() else "")
    if not path or not Path(path).exists():
        raise RuntimeError(f"dnsmasq not found{f' at {configured}' if configured else ''}: "
                           "apt-get install -y dnsmasq-base (or set fleet.pxe.dnsmasq)")
    return path


@dataclass(slots=True)
class BootStages:
    """How far one duck's network boot got, from the boot server's log."""
    offered: str = ""                 # the address offered
    acks: int = 0                     # leases acknowledged: iPXE's, then Linux's
    fetched: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    discovers: int = 0

    def describe(self) -> str:
        if not self.discovers and not self.offered:
            return "no DHCP request from its MAC (not powered on, not set to network boot, or on another subnet)"
        parts = [f"DHCP offered {self.offered}" if self.offered else "DHCP asked, nothing offered (MAC not configured?)"]
        got = list(dict.fromkeys(_FILE_NAMES.get("duck-" if f.startswith("duck-") else f, f) for f in self.fetched))
        if got:
            parts.append(", ".join(got) + " fetched by TFTP")
        if self.failed:
            parts.append("TFTP failed for " + ", ".join(dict.fromkeys(self.failed)))
        if "initrd" in got and self.acks >= 2:
            parts.append("Linux leased its address")
        elif "initrd" in got:
            parts.append("Linux never asked for its address (kernel did not start, or no NIC driver in the image)")
        return ", ".join(parts)


_FILE_NAMES = {"duck-": "boot script", "vmlinuz": "kernel", "initrd.img": "initrd", "undionly.kpxe": "iPXE loader"}


def stages(log_text: str, mac: str, address: str, script: str) -> BootStages:
    """The boot stages of the duck (mac, address, its iPXE script's name) in a slice of dnsmasq's log."""
    st = BootStages()
    for line in log_text.splitlines():
        m = _DHCP.search(line)
        if m and m.group(3) == mac:
            kind = m.group(1)
            st.discovers += kind == "DISCOVER"
            if kind == "OFFER":
                st.offered = m.group(2) or address
            elif kind == "ACK":
                st.acks += 1
                st.offered = st.offered or m.group(2) or address
            continue
        m = _TFTP_SENT.search(line)
        if m and m.group(3) == address:
            (st.fetched if m.group(1) == "sent" else st.failed).append(Path(m.group(2)).name)
            continue
        m = _TFTP_REFUSED.search(line)
        if m:
            name = Path(m.group(1) or m.group(3)).name
            if name == script or not name.startswith("duck-"):
                st.failed.append(f"{name} ({m.group(2) or 'not found'})")
    return st


class Dnsmasq:
    """One dnsmasq process, started by start(), ended by stop(); its files in folder."""

    def __init__(self, binary: str, folder: Path):
        self.binary, self.folder = binary, folder
        self.conf, self.log_file = folder / "dnsmasq.conf", folder / "dnsmasq.log"
        self.proc: subprocess.Popen | None = None

    def start(self, text: str) -> None:
        self.conf.write_text(text)
        self.log_file.write_text("")
        # --user=root: the TFTP root is in duckd's 0700 state folder, where only root reaches the image
        # (it holds the fleet key); dnsmasq as root serves world-readable files only (PxeDriver makes them so)
        cmd = [self.binary, "--keep-in-foreground", f"--conf-file={self.conf}", "--user=root", "--group=root",
               f"--pid-file={self.folder / 'dnsmasq.pid'}"]
        test = subprocess.run([*cmd, "--test"], capture_output=True, text=True)
        if test.returncode != 0:
            raise RuntimeError(f"dnsmasq refused its config {self.conf}: {test.stderr.strip()}")
        with open(self.folder / "dnsmasq.err", "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        try:
            self.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            log.info("dnsmasq (pid %d) serving; log %s", self.proc.pid, self.log_file)
            return
        err = (self.folder / "dnsmasq.err").read_text(errors="replace").strip()
        raise RuntimeError(f"dnsmasq exited at start with status {self.proc.returncode}: {err}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_size(self) -> int:
        return self.log_file.stat().st_size if self.log_file.exists() else 0

    def log_since(self, offset: int) -> str:
        with open(self.log_file, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
