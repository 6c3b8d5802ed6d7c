"""Real duckfw processes on loopback for the tests: start, kill -9, restart.
Every duck binds 127.0.0.1 on a port the kernel picks, blocks when idle and
runs one worker thread (the CI machine has 2 cores)."""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from native.transport import Fleet, duckfw_path, write_key_file

log = logging.getLogger("tests.ducks")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("duck_firmware_build", ROOT / "firmware" / "build.py")
firmware_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(firmware_build)


def sanitizer_binary() -> Path:
    """The ASan/UBSan build of duckfw (built on first use, rebuilt when a source changes)."""
    return firmware_build.build("asan")


class Duck:
    """One duckfw process; its cache dir and key survive restarts."""

    def __init__(self, index: int, workdir: Path, key_file: Path, binary: Path | None = None, args=()):
        self.index, self.workdir, self.key_file = index, workdir, key_file
        self.binary = binary or duckfw_path()
        self.args = list(args)
        self.cache_dir = workdir / f"cache{index}"
        self.log_path = workdir / f"duck{index}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 20.0) -> "Duck":
        port_file = self.workdir / f"port{self.index}"
        port_file.unlink(missing_ok=True)
        env = dict(os.environ, ASAN_OPTIONS="abort_on_error=0:detect_leaks=1:exitcode=23",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=24")
        log = open(self.log_path, "ab")
        # the same port again after a restart, so the fleet's address list stays valid
        cmd = [str(self.binary), "--bind", "127.0.0.1", "--port", str(self.port), "--port-file", str(port_file),
               "--id", str(self.index), "--key-file", str(self.key_file), "--threads", "1", "--idle", "block",
               *([] if "--memory-cache" in self.args else ["--cache-dir", str(self.cache_dir)]), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"duck {self.index} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"duck {self.index} did not bind within {timeout} s:\n{self.log()}")
            time.sleep(0.005)
        self.port = int(port_file.read_text())
        return self

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.proc.returncode if self.proc else 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


class Ducks:
    """N ducks and a Fleet over them; a context manager that always cleans up."""

    def __init__(self, n: int, workdir: Path, binary: Path | None = None, args=(), per_duck_args=None,
                 **fleet_opts):
        workdir.mkdir(parents=True, exist_ok=True)
        self.key_file = workdir / "key"
        self.key = write_key_file(self.key_file)
        per_duck_args = per_duck_args or {}
        self.ducks = [Duck(i, workdir, self.key_file, binary, list(args) + list(per_duck_args.get(i, ())))
                      for i in range(n)]
        self.fleet_opts = fleet_opts
        self.fleet: Fleet | None = None

    def __enter__(self) -> "Ducks":
        try:
            for d in self.ducks:
                d.start()
            self.fleet = Fleet([d.address for d in self.ducks], self.key, **self.fleet_opts)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:   # the ducks' side of a failure, in pytest's captured log
            for d in self.ducks:
                log.error("duck %d log tail:\n%s", d.index, d.log()[-2000:])
        try:
            if self.fleet:
                self.fleet.close()
        finally:
            for d in self.ducks:
                d.stop()

    def __getitem__(self, i: int) -> Duck:
        return self.ducks[i]


def sanitizer_report(text: str) -> list[str]:
    """Lines of an ASan/UBSan report in a duck's log."""
    return [line for line in text.splitlines()
            if "AddressSanitizer" in line or "runtime error:" in line or "LeakSanitizer" in line]
