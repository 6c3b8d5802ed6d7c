"""A bounded fuzz run of everything a duck does with a datagram
(firmware/fuzz_parser.c): libFuzzer with clang, else the gcc driver
(fuzz_main.c, random mutations, no coverage guidance). Both run under
ASan/UBSan; any crash or sanitizer report fails the test."""
import os
import shutil
import subprocess

from tests.transport.ducks import firmware_build

FUZZ_SECONDS = int(os.environ.get("DUCK_FUZZ_SECONDS", "20"))


def test_parser_survives_fuzzing(tmp_path):
    variant = "fuzz" if shutil.which("clang") else "fuzz-gcc"
    binary = firmware_build.build(variant)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    args = [str(binary), f"-max_total_time={FUZZ_SECONDS}", "-seed=1"]
    if variant == "fuzz":
        # One allocation over 1 GiB is a failure. The resident size is bounded loosely: in one CI
        # run ASan's allocator held 2.6 GB of freed reassembly buffers (live heap: 24 MB), which
        # is retention, not a leak; the release interval below hands such memory back.
        args += ["-rss_limit_mb=6144", "-malloc_limit_mb=1024", "-timeout=10", str(corpus)]
    env = dict(os.environ, DUCK_FUZZ_DIR=str(tmp_path / "cache"),
               ASAN_OPTIONS="allocator_release_to_os_interval_ms=500")
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=FUZZ_SECONDS + 120)
    tail = r.stderr[-4000:]
    assert r.returncode == 0, f"{variant} found a failure:\n{tail}"
    assert "ERROR: AddressSanitizer" not in r.stderr and "runtime error:" not in r.stderr, tail
