"""The netns and wol boot drivers with a real daemon."""
import os
import shutil
import socket
import subprocess
import threading

import pytest

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


def test_wol_driver_sends_magic_packets_then_waits_for_hello(tmp_path):
    from engine.fleet import LocalDucks
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
