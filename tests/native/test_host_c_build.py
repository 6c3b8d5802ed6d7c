"""native/host/ on its own: the standalone test binary under ASan + UBSan, with
the best kernel set this CPU runs and with AVX2 forced (DUCK_HOST_KERNELS)."""
import os
import subprocess
from pathlib import Path

import pytest

from native import sources

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def test_binary(tmp_path_factory):
    exe = tmp_path_factory.mktemp("host_c") / "test_host"
    cmd = ["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined", "-o", str(exe)] + [f"-I{ROOT / d}" for d in sources.INCLUDE_DIRS] + \
          [str(ROOT / s) for s in sources.HOST + sources.HOST_C_TESTS + ["native/kernels/pool.c"]] + \
          ["-lpthread", "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


@pytest.mark.parametrize("kernels", ["best", "avx2"])
def test_host_c_tests_pass_under_sanitizers(test_binary, kernels):
    env = {k: v for k, v in os.environ.items() if k != "DUCK_HOST_KERNELS"}
    if kernels != "best":
        env["DUCK_HOST_KERNELS"] = kernels
    run = subprocess.run([str(test_binary)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failed" in run.stdout and "ERROR" not in run.stderr, run.stdout + run.stderr
