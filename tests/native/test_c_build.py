"""The C floor on its own: the standalone test binary under ASan + UBSan."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["fp9_codec.c", "fp9_synth.c", "kernels_ref.c", "kernels_avx2.c", "kernels.c", "pool.c", "ffn.c", "test_native.c"]


def test_native_c_tests_pass_under_sanitizers(tmp_path):
    exe = tmp_path / "test_native"
    cmd = ["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined", "-o", str(exe)] + [str(ROOT / "native" / s) for s in SOURCES] + \
          ["-lpthread", "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failed" in run.stdout and "ERROR" not in run.stderr, run.stdout + run.stderr
