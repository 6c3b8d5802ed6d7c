"""The duck boot image (duckd/image) and the pxe driver's parts that need no VM: the cpio writer,
a reproducible build, clear errors, the pxe config, dnsmasq's config and its log read as boot stages."""
import gzip
import ipaddress
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from duckd.config import ConfigError, load
from duckd.drivers.dnsmasq import config_text, stages
from duckd.image import ImageError, ImageSettings, build_image, cpio, resolve_modules
from tests.duckd.qemu_fleet import boot_host_tools  # noqa: F401 (a fixture)


def _members(archive: bytes) -> list[tuple[str, int, int]]:
    """(name, mode, mtime) of each newc member, read back independently of cpio.py."""
    out, pos = [], 0
    while True:
        h = archive[pos:pos + 110]
        assert h[:6] == b"070701"
        f = [int(h[6 + 8 * i:14 + 8 * i], 16) for i in range(13)]
        name = archive[pos + 110:pos + 110 + f[11] - 1].decode()
        pos += 110 + f[11]
        pos += -pos % 4
        pos += f[6] + (-f[6] % 4)
        if name == cpio.TRAILER:
            return out
        out.append((name, f[1], f[5]))


def test_cpio_is_sorted_root_owned_and_timeless():
    entries = [cpio.file("etc/b", b"xyz"), cpio.directory("etc"), cpio.file("init", b"#!/bin/sh\n", 0o755),
               cpio.symlink("bin/sh", "busybox"), cpio.directory("bin"), cpio.char_device("dev/console", 5, 1),
               cpio.directory("dev")]
    a = cpio.archive(entries, mtime=0)
    assert a == cpio.archive(list(reversed(entries)), mtime=0)
    names = [m[0] for m in _members(a)]
    assert names == sorted(names) == ["bin", "bin/sh", "dev", "dev/console", "etc", "etc/b", "init"]
    assert all(m[2] == 0 for m in _members(a))
    gz = cpio.gzip_reproducible(a)
    assert gz[4:8] == b"\0\0\0\0" and gzip.decompress(gz) == a        # no mtime in the gzip header
    if shutil.which("cpio"):      # and cpio(1) reads it
        listing = subprocess.run(["cpio", "-t"], input=a, capture_output=True).stdout.decode().split()
        assert listing == names


@pytest.mark.parametrize("entries, message", [
    ([cpio.file("etc/x", b"")], "its folder 'etc' is not in the archive"),
    ([cpio.file("a", b"1"), cpio.file("a", b"2")], "given twice"),
])
def test_cpio_refuses_a_bad_tree(entries, message):
    with pytest.raises(ValueError, match=message):
        cpio.archive(entries)


def test_cpio_entry_paths_stay_inside():
    for bad in ("/etc/x", "../x", ""):
        with pytest.raises(ValueError, match="relative path"):
            cpio.file(bad, b"")


def test_image_settings_name_the_bad_value():
    with pytest.raises(ImageError, match="cache = 'disk'"):
        ImageSettings(cache="disk")
    with pytest.raises(ImageError, match="not a module name"):
        ImageSettings(modules=("e1000; rm",))


def test_modules_come_with_their_dependencies(tmp_path):
    (tmp_path / "modules.dep").write_text("kernel/a.ko: kernel/b.ko kernel/c.ko\nkernel/b.ko: kernel/c.ko\n"
                                          "kernel/c.ko:\nkernel/d-x.ko:\n")
    (tmp_path / "modules.builtin").write_text("kernel/e.ko\n")
    assert resolve_modules(tmp_path, ("a", "d_x", "e")) == ["kernel/c.ko", "kernel/b.ko", "kernel/a.ko", "kernel/d-x.ko"]
    with pytest.raises(ImageError, match="module 'nope': not in .*modules.dep nor built into the kernel"):
        resolve_modules(tmp_path, ("nope",))


def test_image_build_is_reproducible_and_small(tmp_path, boot_host_tools):
    from native.transport import write_key_file

    key = tmp_path / "fleet.key"
    write_key_file(key)
    a = build_image(tmp_path / "a", key)
    b = build_image(tmp_path / "b", key)
    assert a.digest == b.digest and (tmp_path / "a" / "initrd.img").read_bytes() == (tmp_path / "b" / "initrd.img").read_bytes()
    assert a.size < 40e6
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["digest"] == a.digest and any(m.endswith("virtio_net.ko") for m in manifest["modules"])
    assert (tmp_path / "a" / "initrd.img").stat().st_mode & 0o077 == 0          # it holds the fleet key
    names = [m[0] for m in _members(gzip.decompress((tmp_path / "a" / "initrd.img").read_bytes()))]
    assert {"init", "bin/busybox", "bin/duckfw", "etc/duck/fleet.key", "etc/duck/duck.conf"} <= set(names)
    # another key, another image
    write_key_file(key)
    assert build_image(tmp_path / "c", key).digest != a.digest


def test_image_build_says_what_is_missing(tmp_path):
    key = tmp_path / "fleet.key"
    key.write_text("x" * 64 + "\n")
    with pytest.raises(ImageError, match="kernel /nonexistent/vmlinuz-1: no such file"):
        build_image(tmp_path / "a", key, ImageSettings(kernel="/nonexistent/vmlinuz-1"))


def _pxe_toml(tmp_path, body: str) -> Path:
    p = tmp_path / "duckd.toml"
    p.write_text('[fleet]\ndriver = "pxe"\n' + body)
    return p


@pytest.mark.parametrize("body, message", [
    ('[[fleet.pxe.ducks]]\nmac = "52:54:00:00:00:01"\naddress = "10.0.0.2"\n', "fleet.pxe.interface = \"\""),
    ('[fleet.pxe]\ninterface = "br0"\n', "fleet.pxe.ducks = \\[\\]"),
    ('[fleet.pxe]\ninterface = "br0"\n[[fleet.pxe.ducks]]\nmac = "52:54:00:00:01"\naddress = "10.0.0.2"\n',
     "mac = '52:54:00:00:01'"),
    ('[fleet.pxe]\ninterface = "br0"\n[[fleet.pxe.ducks]]\nmac = "52:54:00:00:00:01"\naddress = "10.0.0.2:7700"\n',
     "expected an IPv4 address"),
    ('[fleet.pxe]\ninterface = "br0"\npower = "command"\n[[fleet.pxe.ducks]]\nmac = "52:54:00:00:00:01"\n'
     'address = "10.0.0.2"\n', "power = \"command\" needs"),
])
def test_pxe_config_errors_name_the_field(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        load(_pxe_toml(tmp_path, body))


def test_pxe_config_takes_its_ducks(tmp_path):
    cfg = load(_pxe_toml(tmp_path, '[fleet.pxe]\ninterface = "br0"\n' + "".join(
        f'[[fleet.pxe.ducks]]\nmac = "52-54-00-00-00-0{i}"\naddress = "10.0.0.{10 + i}"\n' for i in range(3))))
    assert cfg.fleet.ducks == 3 and cfg.fleet.pxe.ducks[2].mac == "52:54:00:00:00:02"


def test_dnsmasq_config_leases_each_duck_its_address(tmp_path):
    net = ipaddress.IPv4Interface("10.9.0.1/24")
    text = config_text("br0", net, [("52:54:00:00:00:01", "10.9.0.10")], tmp_path, tmp_path / "log",
                       tmp_path / "leases", 600)
    assert "dhcp-host=52:54:00:00:00:01,10.9.0.10,set:duck0" in text
    assert "dhcp-boot=tag:ipxe,tag:duck0,duck-0.ipxe" in text and "port=0" in text
    with pytest.raises(RuntimeError, match="not on br0's subnet 10.9.0.0/24"):
        config_text("br0", net, [("52:54:00:00:00:01", "10.8.0.10")], tmp_path, tmp_path / "l", tmp_path / "x", 600)


LOG = """\
Dec  2 02:43:49 dnsmasq-dhcp[1]: DHCPDISCOVER(br0) 52:54:00:d0:0c:01 
Dec  2 02:43:49 dnsmasq-dhcp[1]: DHCPOFFER(br0) 10.233.7.10 52:54:00:d0:0c:01 
Dec  2 02:43:52 dnsmasq-dhcp[1]: DHCPREQUEST(br0) 10.233.7.10 52:54:00:d0:0c:01 
Dec  2 02:43:52 dnsmasq-dhcp[1]: DHCPACK(br0) 10.233.7.10 52:54:00:d0:0c:01 
Dec  2 02:43:52 dnsmasq-dhcp[1]: DHCPACK(br0) 10.233.7.11 52:54:00:d0:0c:02 
Dec  2 02:43:53 dnsmasq-tftp[1]: sent /srv/tftp/duck-0.ipxe to 10.233.7.10
Dec  2 02:43:55 dnsmasq-tftp[1]: sent /srv/tftp/vmlinuz to 10.233.7.10
Dec  2 02:43:56 dnsmasq-tftp[1]: sent /srv/tftp/initrd.img to 10.233.7.10
"""


def test_boot_stages_from_dnsmasq_log():
    st = stages(LOG, "52:54:00:d0:0c:01", "10.233.7.10", "duck-0.ipxe")
    assert st.describe() == ("DHCP offered 10.233.7.10, boot script, kernel, initrd fetched by TFTP, Linux never "
                             "asked for its address (kernel did not start, or no NIC driver in the image)")
    linux = LOG + "Dec  2 02:44:05 dnsmasq-dhcp[1]: DHCPACK(br0) 10.233.7.10 52:54:00:d0:0c:01 \n"
    assert stages(linux, "52:54:00:d0:0c:01", "10.233.7.10", "duck-0.ipxe").describe().endswith(
        "initrd fetched by TFTP, Linux leased its address")
    refused = LOG.split("Dec  2 02:43:55")[0] + "Dec  2 02:43:55 dnsmasq-tftp[1]: cannot access /srv/tftp/vmlinuz: Permission denied\n"
    assert "TFTP failed for vmlinuz (Permission denied)" in stages(refused, "52:54:00:d0:0c:01", "10.233.7.10",
                                                                  "duck-0.ipxe").describe()
    assert stages("", "52:54:00:d0:0c:01", "10.233.7.10", "duck-0.ipxe").describe().startswith("no DHCP request")


def test_duckctl_image_build_prints_path_size_and_digest(tmp_path, capsys, boot_host_tools):
    from duckd.ctl import main

    cfg = tmp_path / "duckd.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    assert main(["--config", str(cfg), "image", "build", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == str(tmp_path / "state" / "image") and (tmp_path / "state" / "fleet.key").exists()
    assert out["size"] == sum(Path(p).stat().st_size for p in out["files"].values()) and len(out["digest"]) == 64
    assert main(["--config", str(cfg), "image", "build", "--kernel", str(tmp_path / "vmlinuz-x")]) == 2
    assert f"kernel {tmp_path / 'vmlinuz-x'}: no such file" in capsys.readouterr().err


def test_network_booted_ducks_spin_by_default_and_take_spin_us():
    """Ducks of the pxe driver are dedicated boxes: they spin-then-block unless fleet.spin says
    not to, for fleet.spin_us (through the image's duck.conf); local and netns ducks share this
    host's cores and block."""
    from duckd.config import ConfigError, FleetConfig, PxeConfig, PxeDuck
    from duckd.drivers.pxe import image_settings
    from duckd.image import duck_conf

    pxe = PxeConfig(interface="eth1", ducks=[PxeDuck(mac="52:54:00:00:00:01", address="10.77.0.11")])
    fleet = FleetConfig(driver="pxe", pxe=pxe, spin_us=300)
    assert fleet.spin is True
    conf = duck_conf(image_settings(fleet))
    assert "DUCK_IDLE=spin\n" in conf and "DUCK_SPIN_US=300\n" in conf
    assert "DUCK_IDLE=block\n" in duck_conf(image_settings(FleetConfig(driver="pxe", pxe=pxe, spin=False)))
    assert FleetConfig().spin is False and FleetConfig(driver="netns").spin is False
    with pytest.raises(ConfigError, match="fleet.spin = 'yes'"):
        FleetConfig(spin="yes")
    with pytest.raises(ImageError, match="spin_us = 0"):
        ImageSettings(spin_us=0)
