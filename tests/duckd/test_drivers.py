"""The netns and wol boot drivers with a real daemon."""
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

from duck_proto import duck_pb2 as pb
from duckd.drivers.wol import magic_packet
from tests.duckd_fixture import RunningDaemon, write_config

needs_root_ip = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                   reason="the netns driver needs root and iproute2 (CI has both)")


@needs_root_ip
def test_netns_driver_two_subnets_of_two_ducks_serves_a_chat(tmp_path):
    state = tmp_path / "duck"
    name = f"dt{os.getpid() % 1000}"
    cfg = write_config(tmp_path / "duckd.toml", state, ducks=4, driver="netns",
                       netns={"subnets": 2, "prefix": "10.213", "name": name})
    daemon = RunningDaemon(cfg, state).start()
    try:
        ducks = daemon.ducks()
        assert sorted({d.subnet for d in ducks}) == ["10.213.1.0/24", "10.213.2.0/24"]
        assert all(d.address.startswith("10.213.") for d in ducks)
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(f"{name}{i}" in namespaces for i in range(4))
        text, stats = daemon.chat("Which city is the capital of France?", max_tokens=12)
        assert "Paris" in text
    finally:
        assert daemon.stop() == 0
    # the driver removed what it made
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert name not in namespaces and f"{name}br0" not in links


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) these processes have used."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _leftovers(name: str, state) -> tuple[list[str], list[str], list[str]]:
    """Namespaces and links named with this test's prefix, and duckfw processes of its state folder."""
    namespaces = [ln.split()[0] for ln in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                          text=True).stdout.splitlines() if ln.startswith(name)]
    links = [ln.split(":")[1].strip().split("@")[0] for ln in subprocess.run(
        ["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
        if ln.split(":")[1].strip().startswith(name)]
    procs = [ln for ln in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
             if "duckfw" in ln and str(state) in ln]
    return namespaces, links, procs


@needs_root_ip
def test_netns_driver_32_ducks_in_4_subnets_with_link_limits_serve_a_chat(tmp_path):
    """The seeds' fleet on one machine: 32 one-thread ducks that block when idle, 4 subnets,
    2.5 Gbit/s and 50 us per duck link, 25 Gbit/s per host port; SIGTERM removes it all."""
    state = tmp_path / f"n32-{os.getpid()}"
    name = f"dq{os.getpid() % 1000}"
    cfg = write_config(tmp_path / "duckd.toml", state, ducks=32, driver="netns", threads_per_duck=1, spin=False,
                       link_timeout_s=60.0, fail_after_s=5.0, health_interval_s=1.0,
                       netns={"subnets": 4, "prefix": "10.214", "name": name, "duck_rate_mbit": 2500,
                              "duck_delay_us": 50, "port_rate_mbit": 25000})
    daemon = RunningDaemon(cfg, state).start(timeout=300)
    try:
        ducks = daemon.ducks()
        assert len(ducks) == 32 and all(d.state == pb.DuckState.SERVING for d in ducks), \
            [(d.id, pb.DuckState.Name(d.state)) for d in ducks]
        assert sorted({d.subnet for d in ducks}) == [f"10.214.{s}.0/24" for s in (1, 2, 3, 4)]
        qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
        assert f"dev {name}h31 " in qdiscs and "rate 2500Mbit" in qdiscs and "rate 25Gbit" in qdiscs
        text, _ = daemon.chat("Which city is the capital of France?", max_tokens=12)
        assert "Paris" in text
        ducks = daemon.ducks()
        assert all(d.state == pb.DuckState.SERVING for d in ducks)
        # 50 us each way on the duck link (netem, or duckfw's delay where the kernel lacks netem)
        assert min(d.rtt_us for d in ducks) >= 100, [round(d.rtt_us) for d in ducks]
        # idle, 32 ducks on this machine's cores block: together they take a small part of one CPU
        pids = [daemon.duck_pid(i) for i in range(32)]
        before, t0 = _cpu_s(pids), time.monotonic()
        time.sleep(2.0)
        idle = (_cpu_s(pids) - before) / (time.monotonic() - t0)
        assert idle < 0.1, f"32 idle ducks used {idle:.2f} CPU (spinning?)"
    finally:
        assert daemon.stop() == 0
    namespaces, links, procs = _leftovers(name, state)
    assert (namespaces, links, procs) == ([], [], [])


def test_wol_driver_sends_magic_packets_then_waits_for_hello(tmp_path):
    from engine.fleet_ffn import LocalDucks
    # the "hardware": two ducks already listening (as after a wake-up)
    (tmp_path / "hw").mkdir()
    hw = LocalDucks(2, workdir=str(tmp_path / "hw"))
    capture = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    capture.bind(("127.0.0.1", 0))
    capture.settimeout(30)
    packets = []
    t = threading.Thread(target=lambda: [packets.append(capture.recvfrom(2048)[0]) for _ in range(2)])
    t.start()
    macs = ["02:00:00:00:00:0a", "02:00:00:00:00:0b"]
    state = tmp_path / "duck"
    (state).mkdir(parents=True)
    (state / "fleet.key").write_bytes(hw.key)
    cfg = tmp_path / "duckd.toml"
    write_config(cfg, state, ducks=2, driver="wol")
    cfg.write_text(cfg.read_text().replace("ducks = 2\n", "") + "\n[fleet.wol]\n"
                   f'broadcast = "127.0.0.1:{capture.getsockname()[1]}"\n' + "".join(
                       f'[[fleet.wol.ducks]]\nmac = "{m}"\naddress = "{h}:{p}"\n'
                       for m, (h, p) in zip(macs, hw.addresses)))
    daemon = RunningDaemon(cfg, state)
    try:
        daemon.start()
        t.join(30)
        assert sorted(packets) == sorted(magic_packet(m) for m in macs)
        assert all(p[:6] == b"\xff" * 6 and len(p) == 102 for p in packets)
        text, _ = daemon.chat("Which city is the capital of France?", max_tokens=12)
        assert "Paris" in text
    finally:
        daemon.stop()
        hw.stop()
        capture.close()


def test_local_ducks_stop_with_a_script_that_never_stops_them(tmp_path):
    """engine.fleet_ffn.LocalDucks (what a script's local_ducks starts) ends its duckfw processes at
    the interpreter's exit even when the script forgets stop(): none is left behind."""
    import sys

    script = ("from engine.fleet_ffn import LocalDucks\n"
              "ducks = LocalDucks(2)\n"
              "print(' '.join(str(p.pid) for p in ducks.procs), ducks.workdir, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    *pids, workdir = out.stdout.split()
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    deadline = time.monotonic() + 15
    while any(alive(int(p)) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(int(p))]
    for p in left:
        os.kill(int(p), 9)
    assert not left, f"ducks {left} outlived the script that started them"
    assert not os.path.exists(workdir), "the ducks' temporary folder outlived the script"
