"""The pxe driver end to end: two QEMU VMs on a bridge made here network-boot the duck boot image
from duckd (dnsmasq DHCP + TFTP, iPXE), reach SERVING and answer a chat; then one VM is reset
(QEMU monitor system_reset) mid-chat: the chat still answers, and the duck boots again and is
SERVING, its weights from the disk it keeps its cache on. TCG (what a CI machine has);
DUCK_TEST_ACCEL=kvm uses KVM.

Needs root, iproute2 and the packages of qemu_fleet.PACKAGES; when they are missing and
apt-get works, the test installs them (about two minutes), else it skips saying what is missing.
"""
import os
import re
import shutil
import subprocess
import threading
import time

import pytest

from duck_proto import duck_pb2 as pb
from tests.duckd.qemu_fleet import VirtualFleet, boot_host_tools  # noqa: F401 (a fixture)
from tests.duckd_fixture import RunningDaemon, write_config

pytestmark = [pytest.mark.qemu,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                 reason="network boot in VMs needs root and iproute2 (bridge, taps, dnsmasq)")]


def _pxe_config(tmp_path, vf: VirtualFleet, state):
    cfg = write_config(tmp_path / "duckd.toml", state, ducks=len(vf.macs), driver="pxe", link_timeout_s=240.0,
                       restart_delay_s=0.5, spin=False)   # TCG VMs share this host's cores: they block
    # a TCG VM answers its health pings slower than a local duck
    cfg.write_text(cfg.read_text().replace("fail_after_s = 1.0", "fail_after_s = 3.0"))
    with open(cfg, "a") as f:
        f.write(f'\n[fleet.pxe]\ninterface = "{vf.bridge}"\npower = "command"\n'
                f'power_on = ["{vf.power_on}", "{{index}}", "{{mac}}"]\nboot_timeout_s = 240.0\n')
        for mac, address in zip(vf.macs, vf.addresses):
            f.write(f'[[fleet.pxe.ducks]]\nmac = "{mac}"\naddress = "{address}"\n')
    return cfg


def _serving_after_reboot(daemon, vf: VirtualFleet, i: int, timeout: float):
    """The duck SERVING again once its VM booted a second time (the console shows two boots)."""
    deadline = time.monotonic() + timeout
    while vf.serial(i).count("image duck image") < 2 or \
            f"duckfw on {vf.addresses[i]}" not in vf.serial(i).rsplit("image duck image", 1)[1]:
        assert time.monotonic() < deadline, f"VM {i} did not boot again in {timeout} s"
        time.sleep(0.5)
    return daemon.wait_duck(i, pb.SERVING, timeout=max(1.0, deadline - time.monotonic()))


def test_a_duck_that_never_boots_fails_with_its_boot_stages(tmp_path, boot_host_tools):
    """No VM behind the MAC: the daemon's start fails naming the stage the duck never reached."""
    name = f"dq{os.getpid() % 1000}"
    state = tmp_path / "duck"
    with VirtualFleet(tmp_path, name, "10.233.8", 1) as vf:
        cfg = _pxe_config(tmp_path, vf, state)
        cfg.write_text(cfg.read_text().replace(str(vf.power_on), "true").replace("boot_timeout_s = 240.0",
                                                                                 "boot_timeout_s = 3.0"))
        daemon = RunningDaemon(cfg, state)
        with pytest.raises(RuntimeError, match="duckd exited"):
            daemon.start(timeout=120)
        assert ("boot failed: no DHCP request from its MAC (not powered on, not set to network boot, or on another "
                "subnet), no hello in 3 s at 10.233.8.10:7700") in daemon.log()
        assert "dnsmasq stopped" in daemon.log()


def test_two_vms_pxe_boot_serve_a_chat_and_survive_a_reset(tmp_path, boot_host_tools):
    accel = os.environ.get("DUCK_TEST_ACCEL", "tcg")
    name = f"dp{os.getpid() % 1000}"
    state = tmp_path / "duck"
    disk = tmp_path / "duck1-cache.img"      # VM 1 keeps its cache on a disk, VM 0 in RAM
    disk.write_bytes(b"")
    os.truncate(disk, 256 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-L", "duckcache", str(disk)], check=True)
    with VirtualFleet(tmp_path, name, "10.233.7", 2, accel, disks={1: disk}) as vf:
        daemon = RunningDaemon(_pxe_config(tmp_path, vf, state), state)
        t0 = time.monotonic()
        try:
            daemon.start(timeout=420)
            booted = time.monotonic() - t0
            ducks = daemon.ducks()
            assert [d.state for d in ducks] == [pb.SERVING] * 2, [(d.state, d.reason) for d in ducks]
            assert [d.address for d in ducks] == [f"{a}:7700" for a in vf.addresses]
            text, _ = daemon.chat("Which city is the capital of France?", max_tokens=12, timeout=300)
            assert "Paris" in text
            first_chat = time.monotonic() - t0
            for i in range(2):   # the image's init on the VM's console: DHCP, the cache, duckfw
                assert f"duckfw on {vf.addresses[i]}:7700" in vf.serial(i)
            assert "weight cache in RAM" in vf.serial(0) and "weight cache on /dev/vda" in vf.serial(1)

            # a VM reset mid-chat: a lost duck; the chat goes on, the duck boots again
            result = {}
            chat = threading.Thread(target=lambda: result.update(
                zip(("text", "stats"), daemon.chat("Which city is the capital of France?", max_tokens=24,
                                                   timeout=400))))
            chat.start()
            time.sleep(1.0)
            vf.monitor(1, "system_reset")
            t_reset = time.monotonic()
            chat.join(420)
            assert "Paris" in result.get("text", ""), result
            back = _serving_after_reboot(daemon, vf, 1, timeout=300)
            again = time.monotonic() - t_reset
            # the second boot found the weights of the first on its disk
            second_boot = vf.serial(1).rsplit("image duck image", 1)[1]
            loaded = re.search(r"cache: (\d+) entries", second_boot)
            assert loaded and int(loaded.group(1)) > 0, second_boot[-2000:]
            text, _ = daemon.chat("Which city is the capital of France?", max_tokens=12, timeout=300)
            assert "Paris" in text
            print(f"\npxe boot ({accel}): 2 VMs SERVING {booted:.0f} s after duckd started, first chat answered at "
                  f"{first_chat:.0f} s; duck 1 SERVING again {again:.0f} s after its reset (link {back.time_to_link_ms:.0f} ms);"
                  f" total {time.monotonic() - t0:.0f} s")
        except BaseException:
            for i in range(2):
                print(f"--- vm{i} console ---\n{vf.serial(i)[-3000:]}")
            print(f"--- dnsmasq ---\n{(state / 'pxe' / 'dnsmasq.log').read_text()[-3000:] if (state / 'pxe' / 'dnsmasq.log').exists() else ''}")
            print(f"--- duckd ---\n{daemon.log()}")
            raise
        finally:
            daemon.stop()
