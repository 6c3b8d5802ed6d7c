"""duckfw's command line: clear refusals, fault injection only on request."""
import subprocess

import pytest

from native.transport import duckfw_path, write_key_file


def run(*args, timeout=10):
    return subprocess.run([str(duckfw_path()), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def key_file(tmp_path):
    p = tmp_path / "key"
    write_key_file(p)
    return p


def test_version_and_help():
    assert "duckfw" in run("--version").stdout
    assert "--enable-fault-injection" in run("--help").stdout


def test_key_is_required(tmp_path):
    r = run("--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 2 and "--key-file is required" in r.stderr


def test_cache_dir_or_memory_cache(tmp_path, key_file):
    r = run("--key-file", str(key_file))
    assert r.returncode == 2 and "--cache-dir DIR or --memory-cache is required" in r.stderr
    r = run("--key-file", str(key_file), "--memory-cache", "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 2 and "exclude each other" in r.stderr


@pytest.mark.parametrize("option", [["--drop-rate", "0.05"], ["--delay-us", "1000"]])
def test_fault_injection_is_refused_unless_enabled(tmp_path, key_file, option):
    r = run("--cache-dir", str(tmp_path / "c"), "--key-file", str(key_file), *option)
    assert r.returncode == 2 and "--enable-fault-injection" in r.stderr


def test_short_key_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"tooshort")
    r = run("--cache-dir", str(tmp_path / "c"), "--key-file", str(short))
    assert r.returncode == 2 and "holds 8 bytes" in r.stderr


@pytest.mark.parametrize("option,value,text", [("--mtu", "100", "--mtu 100"), ("--threads", "0", "--threads 0"),
                                               ("--idle", "busy", "expected block or spin"),
                                               ("--cache-capacity", "lots", "not a size"),
                                               ("--query-period-ms", "5", "--query-period-ms 5 is not 10..")])
def test_bad_values_are_named(tmp_path, key_file, option, value, text):
    r = run("--cache-dir", str(tmp_path / "c"), "--key-file", str(key_file), option, value)
    assert r.returncode == 2 and text in r.stderr
