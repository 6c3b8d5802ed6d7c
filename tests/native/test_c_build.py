"""The C floor on its own: the standalone test binary under ASan + UBSan."""
import subprocess
from pathlib import Path

from native import sources

ROOT = Path(__file__).resolve().parents[2]


def test_native_c_tests_pass_under_sanitizers(tmp_path):
    exe = tmp_path / "test_native"
    cmd = ["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined", "-o", str(exe)] + [f"-I{ROOT / d}" for d in sources.INCLUDE_DIRS] + \
          [str(ROOT / s) for s in sources.FP9 + sources.KERNELS + sources.C_TESTS] + ["-lpthread", "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failed" in run.stdout and "ERROR" not in run.stderr, run.stdout + run.stderr
