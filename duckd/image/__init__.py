"""The duck boot image: a Linux kernel and an initramfs that make a bare x86-64 box a duck.

The initramfs holds a static duckfw (firmware/build.py, variant static), a static busybox, the
kernel modules the ducks' NICs and disks need (with their dependencies), /init (init.sh here),
the fleet key and the settings. Everything comes from files installed on this host by
distribution packages (linux-image-amd64, busybox-static); nothing is fetched when a duck
boots. Same inputs, same bytes: see cpio.py.

    image = build_image(out_dir, key_file, ImageSettings())
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from duckd.image import cpio

log = logging.getLogger("duckd.image")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FORMAT = 1
# virtual machines (virtio, e1000), the NICs of common mini PCs (Intel i219/i210/i225/i226,
# Realtek 8111/8125) and the disks a duck may keep its cache on (SATA, NVMe, virtio)
# (ext4 asks for crc32c at mount time, a soft dependency modules.dep does not list)
DEFAULT_MODULES = ("virtio_pci", "virtio_net", "e1000", "e1000e", "igb", "igc", "r8169",
                   "virtio_blk", "ahci", "nvme", "sd_mod", "crc32c_generic", "crc32c_intel", "ext4")
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")


class ImageError(RuntimeError):
    """An input of the image is missing or unusable; the message says which and what to do."""


@dataclass(frozen=True, slots=True)
class ImageSettings:
    """What the image's ducks run with (duck.conf); a kernel command line overrides per duck."""
    port: int = 7700                  # the duck's UDP port
    threads: int = 0                  # worker threads; 0: every CPU of the duck
    cache: str = "auto"               # auto (a partition labelled duckcache, else RAM) | ram | /dev/NAME
    cache_capacity_mb: int = 0        # weights held; 0: the duck's memory less reserve_mb
    reserve_mb: int = 512             # memory left to the kernel and the image when capacity is 0
    idle: str = "block"               # block | spin (dedicated ducks: spin-then-block)
    spin_us: int = 1000               # with idle = spin: how long a duck polls before it blocks
    log_level: str = "info"
    data_mac: bool = True
    modules: tuple[str, ...] = DEFAULT_MODULES
    kernel: str = ""                  # a vmlinuz; "" = the newest /boot/vmlinuz-*
    busybox: str = ""                 # a static busybox; "" = /bin/busybox (busybox-static)

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise ImageError(f"port = {self.port!r}: expected 1..65535")
        if not 0 <= self.threads <= 1024:
            raise ImageError(f"threads = {self.threads!r}: expected 0 (every CPU) .. 1024")
        if self.cache not in ("auto", "ram") and not re.fullmatch(r"/dev/[A-Za-z0-9/_.-]+", self.cache):
            raise ImageError(f"cache = {self.cache!r}: expected auto, ram or a device like /dev/sda")
        if self.cache_capacity_mb < 0 or self.reserve_mb < 0:
            raise ImageError("cache_capacity_mb and reserve_mb: expected >= 0")
        if self.idle not in ("block", "spin"):
            raise ImageError(f"idle = {self.idle!r}: expected block or spin")
        if not 1 <= self.spin_us <= 1000000:
            raise ImageError(f"spin_us = {self.spin_us!r}: expected 1..1000000")
        if self.log_level not in ("error", "warn", "info", "debug"):
            raise ImageError(f"log_level = {self.log_level!r}: expected error, warn, info or debug")
        for m in self.modules:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", m):
                raise ImageError(f"modules: {m!r} is not a module name")


@dataclass(slots=True)
class Image:
    folder: Path
    kernel: Path
    initrd: Path
    digest: str                       # sha256 of the components' digests (manifest.json)
    size: int                         # bytes of kernel + initrd
    manifest: dict = field(default_factory=dict)


def newest_kernel() -> Path:
    found = sorted(Path("/boot").glob("vmlinuz-*"),
                   key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
    if not found:
        raise ImageError("no kernel in /boot: apt-get install -y linux-image-amd64 (or pass --kernel PATH)")
    return found[-1]


def _is_static_elf(path: Path) -> bool:
    """An ELF with no PT_INTERP program header (no dynamic loader)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    phoff, phentsize, phnum = (int.from_bytes(data[0x20:0x28], "little"), int.from_bytes(data[0x36:0x38], "little"),
                               int.from_bytes(data[0x38:0x3a], "little"))
    return all(int.from_bytes(data[phoff + i * phentsize:phoff + i * phentsize + 4], "little") != 3
               for i in range(phnum))


def _busybox(path: str) -> Path:
    p = Path(path) if path else next((Path(c) for c in BUSYBOX_CANDIDATES if Path(c).exists()), None)
    if p is None or not p.exists():
        raise ImageError(f"no busybox at {path or ' or '.join(BUSYBOX_CANDIDATES)}: "
                         "apt-get install -y busybox-static")
    if not _is_static_elf(p):
        raise ImageError(f"{p} is linked dynamically; the image needs a static one: apt-get install -y busybox-static")
    return p


def resolve_modules(moddir: Path, names: tuple[str, ...]) -> list[str]:
    """Paths (relative to moddir) of the named modules and their dependencies, in load order;
    a module built into the kernel needs none. An unknown name is an error naming it."""
    dep_file = moddir / "modules.dep"
    if not dep_file.exists():
        raise ImageError(f"{dep_file} is missing: the kernel's modules are not installed (linux-image package)")
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in dep_file.read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[re.sub(r"\.ko(\.[a-z]+)?$", "", Path(path).name).replace("-", "_")] = path
    builtin_file = moddir / "modules.builtin"
    builtin = {re.sub(r"\.ko$", "", Path(p).name).replace("-", "_")
               for p in (builtin_file.read_text().split() if builtin_file.exists() else [])}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for d in deps.get(path, []):
            visit(d)
        order.append(path)

    for name in names:
        key = name.replace("-", "_")
        if key in by_name:
            visit(by_name[key])
        elif key not in builtin:
            raise ImageError(f"module {name!r}: not in {dep_file} nor built into the kernel")
    for path in order:
        if not path.endswith(".ko"):
            raise ImageError(f"module {path}: compressed modules are not supported (busybox insmod loads plain .ko)")
    return order


def static_duckfw() -> Path:
    """firmware/build.py's static variant, built (or found up to date) in build/firmware."""
    script = ROOT / "firmware" / "build.py"
    if not script.exists():
        raise ImageError(f"{script} is missing: the image is built from a source checkout of duck")
    spec = importlib.util.spec_from_file_location("duck_firmware_build", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return mod.build("static")
    except mod.BuildError as e:
        raise ImageError(f"{e}\n(the static build needs libc6-dev's libc.a: apt-get install -y libc6-dev)") from None


def duck_conf(s: ImageSettings) -> str:
    capacity = f"{s.cache_capacity_mb}M" if s.cache_capacity_mb else "auto"
    return "".join(f"{k}={v}\n" for k, v in (
        ("DUCK_PORT", s.port), ("DUCK_THREADS", s.threads), ("DUCK_CACHE", s.cache),
        ("DUCK_CACHE_CAPACITY", capacity), ("DUCK_RESERVE_MB", s.reserve_mb), ("DUCK_IDLE", s.idle), ("DUCK_SPIN_US", s.spin_us),
        ("DUCK_LOG_LEVEL", s.log_level), ("DUCK_EXTRA", "" if s.data_mac else "--no-data-mac")))


def initramfs_entries(kernel_version: str, moddir: Path, modules: list[str], busybox: Path, duckfw: Path,
                      key: bytes, settings: ImageSettings) -> list[cpio.Entry]:
    dirs = {"bin", "dev", "etc", "etc/duck", "proc", "sys", "run", "tmp", "cache", "var", "lib", "lib/modules"}
    entries = [cpio.file("init", (HERE / "init.sh").read_bytes(), 0o755),
               cpio.file("bin/busybox", busybox.read_bytes(), 0o755),
               cpio.symlink("bin/sh", "busybox"),
               cpio.file("bin/duckfw", duckfw.read_bytes(), 0o755),
               cpio.char_device("dev/console", 5, 1), cpio.char_device("dev/null", 1, 3, 0o666),
               cpio.file("etc/duck/udhcpc.sh", (HERE / "udhcpc.sh").read_bytes(), 0o755),
               cpio.file("etc/duck/duck.conf", duck_conf(settings).encode()),
               cpio.file("etc/duck/fleet.key", key, 0o600),
               cpio.file("etc/duck/modules", "".join(f"{kernel_version}/{m}\n" for m in modules).encode()),
               cpio.file("etc/duck/version", f"duck image format {FORMAT}, kernel {kernel_version}\n".encode())]
    for m in modules:
        rel = f"lib/modules/{kernel_version}/{m}"
        entries.append(cpio.file(rel, (moddir / m).read_bytes()))
        parts = rel.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return entries + [cpio.directory(d) for d in dirs]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_image(out_dir: Path, key_file: Path, settings: ImageSettings = ImageSettings()) -> Image:
    """Builds (or rebuilds) the image into out_dir: vmlinuz, initrd.img (mode 0600: it holds the
    fleet key) and manifest.json. Reproducible: same inputs, same digest."""
    kernel = Path(settings.kernel) if settings.kernel else newest_kernel()
    if not kernel.exists():
        raise ImageError(f"kernel {kernel}: no such file")
    if not os.access(kernel, os.R_OK):
        raise ImageError(f"kernel {kernel}: not readable (Debian keeps /boot/vmlinuz-* 0600: build as root)")
    version = kernel.name.removeprefix("vmlinuz-")
    moddir = Path("/lib/modules") / version
    log.info("kernel %s (modules %s)", kernel, moddir)
    modules = resolve_modules(moddir, settings.modules)
    log.info("%d modules for %s", len(modules), ", ".join(settings.modules))
    busybox = _busybox(settings.busybox)
    log.info("busybox %s; building the static duckfw", busybox)
    duckfw = static_duckfw()
    from native.transport import read_key_file
    try:
        key = Path(key_file).read_bytes()
        read_key_file(key_file)
    except (OSError, ValueError) as e:
        raise ImageError(f"fleet key {key_file}: {e}") from None
    entries = initramfs_entries(version, moddir, modules, busybox, duckfw, key, settings)
    log.info("packing %d files into the initramfs (cpio, gzip -9)", len(entries))
    initrd = cpio.gzip_reproducible(cpio.archive(entries))
    kernel_bytes = kernel.read_bytes()
    parts = {"vmlinuz": _sha256(kernel_bytes), "initrd.img": _sha256(initrd)}
    digest = _sha256(json.dumps(parts, sort_keys=True).encode())
    manifest = {"format": FORMAT, "digest": digest, "size": len(kernel_bytes) + len(initrd), "files": parts,
                "kernel": str(kernel), "kernel_version": version, "modules": modules, "busybox": str(busybox),
                "duckfw_sha256": _sha256(duckfw.read_bytes()), "key_sha256": _sha256(key),
                "settings": asdict(settings)}
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / "vmlinuz", kernel_bytes, 0o644)
    _write(out_dir / "initrd.img", initrd, 0o600)
    _write(out_dir / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode(), 0o644)
    log.info("image %s: %.1f MB (kernel %.1f MB, initramfs %.1f MB), digest %s", out_dir, manifest["size"] / 1e6,
             len(kernel_bytes) / 1e6, len(initrd) / 1e6, digest)
    return Image(out_dir, out_dir / "vmlinuz", out_dir / "initrd.img", digest, manifest["size"], manifest)


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def load_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


__all__ = ["Image", "ImageError", "ImageSettings", "build_image", "load_manifest", "resolve_modules"]
