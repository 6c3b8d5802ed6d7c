"""The pxe driver end to end: two QEMU VMs on a bridge made here network-boot the duck boot image
from duckd (dnsmasq DHCP + TFTP, iPXE), reach SERVING and answer a chat; then one VM is reset
(QEMU monitor system_reset) mid-chat: the chat still answers, and the duck boots again and is
SERVING. TCG (what a CI machine has); DUCK_TEST_ACCEL=kvm uses KVM.

Needs root, iproute2 and the packages of qemu_fleet.PACKAGES; when they are missing and
apt-get works, the test installs them (about two minutes), else it skips saying what is missing.
"""
import os
import shutil
import threading
import time

import pytest

from duck_proto import duck_pb2 as pb
from tests.duckd.qemu_fleet import VirtualFleet, install_tools, missing_tools
from tests.duckd_fixture import RunningDaemon, write_config

pytestmark = [pytest.mark.qemu,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                 reason="network boot in VMs needs root and iproute2 (bridge, taps, dnsmasq)")]


@pytest.fixture(scope="module")
def host_tools():
    missing = missing_tools()
    if missing:
        t0 = time.monotonic()
        why = install_tools()
        missing = missing_tools()
        if why or missing:
            pytest.skip(f"QEMU network boot needs {', '.join(missing)}: {why or 'still missing after apt-get'}")
        print(f"\ninstalled the QEMU test's packages in {time.monotonic() - t0:.0f} s")


def _pxe_config(tmp_path, vf: VirtualFleet, state):
    cfg = write_config(tmp_path / "duckd.toml", state, ducks=len(vf.macs), driver="pxe", link_timeout_s=240.0,
                       restart_delay_s=0.5)
    # a TCG VM answers its health pings slower than a local duck
    cfg.write_text(cfg.read_text().replace("fail_after_s = 1.0", "fail_after_s = 3.0"))
    with open(cfg, "a") as f:
        f.write(f'\n[fleet.pxe]\ninterface = "{vf.bridge}"\npower = "command"\n'
                f'power_on = ["{vf.power_on}", "{{index}}", "{{mac}}"]\nboot_timeout_s = 240.0\n')
        for mac, address in zip(vf.macs, vf.addresses):
            f.write(f'[[fleet.pxe.ducks]]\nmac = "{mac}"\naddress = "{address}"\n')
    return cfg


def test_two_vms_pxe_boot_serve_a_chat_and_survive_a_reset(tmp_path, host_tools):
    accel = os.environ.get("DUCK_TEST_ACCEL", "tcg")
    name = f"dp{os.getpid() % 1000}"
    state = tmp_path / "duck"
    with VirtualFleet(tmp_path, name, "10.233.7", 2, accel) as vf:
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
            for i in range(2):   # the image's init on the VM's console: DHCP, RAM cache, duckfw
                assert f"duckfw on {vf.addresses[i]}:7700" in vf.serial(i)
                assert "weight cache in RAM" in vf.serial(i)

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
            daemon.wait_duck(1, pb.FAILED, timeout=60)
            back = daemon.wait_duck(1, pb.SERVING, timeout=300)
            again = time.monotonic() - t_reset
            text, _ = daemon.chat("Which city is the capital of France?", max_tokens=12, timeout=300)
            assert "Paris" in text
            assert vf.serial(1).count("duck-init [") > 0
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
