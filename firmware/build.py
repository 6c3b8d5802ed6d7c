"""Builds duckfw (release, ASan/UBSan) and the parser fuzzer from the same
sources: firmware/*.c plus the kernels and the wire code of native/.

Used by setup.py (release binary into native/bin/duckfw) and by the tests
(sanitizer and fuzz variants into a build folder). Stdlib only: it runs
before the project is installed.

    python firmware/build.py [release|static|asan|fuzz] [-o OUTPUT]
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("duck.firmware.build")

ROOT = Path(__file__).resolve().parent.parent

def _native_sources():
    """native/sources.py, the one list of native/'s C sources (loaded by path: nothing is installed yet)."""
    spec = importlib.util.spec_from_file_location("native_sources", ROOT / "native" / "sources.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NATIVE_SOURCES = _native_sources()
NATIVE = NATIVE_SOURCES.DUCK
CORE = ["firmware/log.c", "firmware/cache.c", "firmware/cache_upload.c", "firmware/cache_synth.c",
        "firmware/session.c", "firmware/reasm.c", "firmware/replay.c", "firmware/fault.c", "firmware/reply.c", "firmware/core.c", "firmware/handlers.c",
        "firmware/hold.c", "firmware/forward.c"]
PLATFORM = ["firmware/net_linux.c", "firmware/main.c"]
FUZZ = ["firmware/fuzz_parser.c"]

COMMON = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-sign-compare",
          "-fno-strict-aliasing", *(f"-I{d}" for d in NATIVE_SOURCES.INCLUDE_DIRS), "-Ifirmware"]
VARIANTS = {
    "release": (["-O3", "-DNDEBUG"], ["-lpthread", "-lm"]),
    # the duck boot image (duckd/image): no shared libraries in an initramfs; generic x86-64
    # code plus the runtime-dispatched AVX2 kernels, as the release build; no build path or
    # build id in the binary, so the same sources give the same bytes
    "static": (["-O3", "-DNDEBUG", "-ffile-prefix-map=" + str(ROOT) + "=."],
               ["-static", "-Wl,--build-id=none", "-s", "-lpthread", "-lm"]),
    "asan": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
              "-fno-sanitize-recover=undefined"], ["-fsanitize=address,undefined", "-lpthread", "-lm"]),
    # clang ignores kernels_avx2.c's `#pragma GCC target`: the fuzz build is AVX2 throughout
    "fuzz": (["-O1", "-g", "-mavx2", "-mfma", "-fno-omit-frame-pointer", "-fsanitize=fuzzer,address,undefined",
              "-fno-sanitize-recover=undefined"], ["-fsanitize=fuzzer,address,undefined", "-lpthread", "-lm"]),
    # no clang: the same harness with a bounded random-mutation driver (fuzz_main.c), gcc + ASan/UBSan
    "fuzz-gcc": (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined"], ["-fsanitize=address,undefined", "-lpthread", "-lm"]),
}


class BuildError(RuntimeError):
    """The compiler failed or is missing; the message carries its output."""


def sources(variant: str) -> list[str]:
    if variant == "fuzz":
        return NATIVE + CORE + FUZZ
    if variant == "fuzz-gcc":
        return NATIVE + CORE + FUZZ + ["firmware/fuzz_main.c"]
    return NATIVE + CORE + PLATFORM


def compiler(variant: str) -> str:
    if variant == "fuzz":
        cc = shutil.which("clang")
        if not cc:
            raise BuildError("the libFuzzer build needs clang: apt-get install -y clang (or use variant fuzz-gcc)")
        return cc
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if not cc:
        raise BuildError("no C compiler found: apt-get install -y gcc")
    return cc


def build(variant: str = "release", output: Path | str | None = None) -> Path:
    """Compiles one variant and returns the path of the binary. Rebuilds only
    when a source or header is newer than the output."""
    if variant not in VARIANTS:
        raise BuildError(f"unknown variant {variant!r}: expected one of {sorted(VARIANTS)}")
    out = Path(output) if output else ROOT / "build" / "firmware" / f"duckfw-{variant}"
    srcs = sources(variant)
    deps = [ROOT / s for s in srcs] + NATIVE_SOURCES.headers(ROOT) + list((ROOT / "firmware").glob("*.h"))
    if out.exists() and all(d.stat().st_mtime <= out.stat().st_mtime for d in deps):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = VARIANTS[variant]
    tmp = out.with_name(out.name + ".part")
    cmd = [compiler(variant), *COMMON, *cflags, *srcs, "-o", str(tmp), *ldflags]
    log.info("building %s: %s", variant, " ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"building duckfw ({variant}) failed:\n{' '.join(cmd)}\n{proc.stderr[-8000:]}")
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", nargs="?", default="release", choices=sorted(VARIANTS))
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(args.variant, args.output)
    except BuildError as e:
        log.error("%s", e)
        return 1
    log.info("built %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
