"""duckctl bench transport, in the README's form (--json), at a small size: every
case names its datagram size, partials, host wait, retransmits and the ducks'
wake-up; a 64 KiB datagram carries a layer in one datagram each way."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from duckd.ctl import main as duckctl


@pytest.mark.alone   # counts datagrams per call: a retransmit beside a busy neighbour adds some
def test_bench_transport_json(capfd):
    rc = duckctl(["bench", "transport", "--json", "--ducks", "2", "--iters", "30", "--skip-deepseek"])
    assert rc == 0
    r = json.loads(capfd.readouterr().out)
    assert r["command"].startswith("duckctl bench transport --json")
    cost = r.pop("data_mac_cost")
    cases = {k: v for k, v in r.items() if isinstance(v, dict)}
    assert set(cases) == {"overhead_2_ducks", "overhead_2_ducks_host_polling", "overhead_2_ducks_hidden7168",
                          "overhead_2_ducks_hidden7168_host_polling", "overhead_2_ducks_hidden7168_no_data_mac",
                          "partials_2_ducks_hidden7168_fp32", "partials_2_ducks_hidden7168_bf16",
                          "partials_2_ducks_hidden7168_fp32_no_data_mac", "overhead_1_duck",
                          "overhead_1_duck_host_polling", "overhead_1_duck_hidden7168"}
    for name, c in cases.items():
        assert c["data_mac"] == (not name.endswith("_no_data_mac")), name
    # the data MAC with and without: in C alone (cheaper than BLAKE2b) and end to end
    assert 0 < cost["link_mac_us_activation_fp32"] < cost["blake2b_mac_us_activation_fp32"]
    assert cost["host_us_per_layer_2_ducks"] > 0 and cost["duck_us_per_layer"] > 0
    assert "partials_2_ducks_hidden7168_fp32_median_us_added" in cost
    for name, c in cases.items():
        assert c["median_us"] > 0 and c["p99_us"] >= c["median_us"] and c["retransmits"] >= 0, name
        assert c["datagram_bytes"] == 65535 and c["datagrams_per_call"] == 2 * c["ducks"], name
        assert c["duck_wake_us_slowest"]["median"] > 0 and c["duck_wake_us_mean"] > 0, name
        assert c["host"] == ("polling" if name.endswith("_host_polling") else "blocking"), name
        partial = name.removesuffix("_no_data_mac").rsplit("_", 1)[1]
        assert c["partials"] == (partial if name.startswith("partials") else "none"), name
    assert cases["partials_2_ducks_hidden7168_bf16"]["partial_bytes_per_duck"] == 7168 * 2
    assert cases["partials_2_ducks_hidden7168_fp32"]["kernel_us_slowest"]["median"] > 0


@pytest.mark.alone   # counts datagrams per call: a retransmit beside a busy neighbour adds some
def test_bench_transport_table_at_ethernet_size(capfd):
    rc = duckctl(["bench", "transport", "--ducks", "2", "--iters", "20", "--skip-deepseek", "--mtu", "1500"])
    assert rc == 0
    out = capfd.readouterr().out

    def row(case: str) -> tuple[int, float, int]:
        """(datagram bytes, datagrams per call, retransmits) of a case's line"""
        cols = next(line for line in out.splitlines() if line.startswith(case + " ")).split()
        return int(cols[3]), float(cols[4]), int(cols[7])

    def per_call(case: str, clean: float) -> None:
        size, dgrams, retx = row(case)
        assert size == 1500, case
        # a retransmit on a loaded machine adds at most the 21 fragments each way of one call
        assert clean <= dgrams <= clean + retx * 42 / 20 and (retx or dgrams == clean), (case, dgrams, retx)

    per_call("overhead_2_ducks_hidden7168", 44.0)            # 21 fragments out per duck, a zero partial back
    per_call("partials_2_ducks_hidden7168_fp32", 84.0)       # and 21 back


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="the emulated LAN needs root and iproute2 (CI has both)")
def test_bench_transport_on_an_emulated_lan_and_the_plan_of_it(capfd, tmp_path):
    """--netns: ducks in namespaces behind tc link limits, each size a case; everything removed after;
    the planner reads the file."""
    name = f"bx{os.getpid() % 1000}"
    rc = duckctl(["bench", "transport", "--json", "--netns", "4", "--netns-sizes", "2,4", "--subnets", "2",
                  "--iters", "20", "--duck-rate-mbit", "1000", "--duck-delay-us", "20", "--port-rate-mbit", "10000",
                  "--netns-name", name, "--netns-prefix", "10.216"])
    assert rc == 0
    r = json.loads(capfd.readouterr().out)
    assert r["fleet"] == "netns" and r["links"]["duck_rate_mbit"] == 1000 and r["links"]["subnets"] == 2
    cases = {k: v for k, v in r.items() if isinstance(v, dict) and "median_us" in v}
    assert set(cases) == {f"netns_{kind}_{n}_ducks_hidden7168{dt}" for n in (2, 4)
                          for kind, dt in (("overhead", ""), ("partials", "_fp32"), ("partials", "_bf16"))}
    for k, c in cases.items():
        # 20 us each way at least, and 28 KB of fp32 activation at 1 Gbit/s (about 230 us, a frame early at most)
        assert c["median_us"] > 200 + 40, k
        assert c["subnets_used"] == 2 and c["own_cpu_us_per_call"] > 0 and c["datagram_bytes"] == 1500, k
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert name not in namespaces and name not in links
    path = tmp_path / "netns.json"
    path.write_text(json.dumps(r))
    from duckd.plan.cli import validate
    rows = [row for row in validate(str(path))["rows"] if row["source"] == "emulated LAN"]
    assert [row["case"].split()[1] for row in rows] == ["2", "4", "2", "4"]
    assert rows[0]["error"] == 0.0 and rows[1]["predicted"] > rows[0]["predicted"]


def test_bench_transport_prefill_chunk(capfd):
    """--chunk: a prefill chunk's bytes both ways (bf16, 128 tokens x hidden 1024: 256 KiB per duck
    and way), the host on one thread and on its helper threads; the transport is the round trip
    less the slowest duck's kernel."""
    rc = duckctl(["bench", "transport", "--json", "--ducks", "2", "--iters", "20", "--skip-deepseek",
                  "--chunk", "128x1024"])
    assert rc == 0
    r = json.loads(capfd.readouterr().out)
    one, helped = r["chunk_2_ducks_128x1024_host_1_thread"], r["chunk_2_ducks_128x1024_host_threads"]
    for c in (one, helped):
        assert c["tokens"] == 128 and c["hidden"] == 1024 and c["bytes_per_duck_each_way"] == 128 * 1024 * 2
        assert c["partials"] == "bf16" and c["requests"] == 1 and c["datagram_bytes"] == 65535
        assert 0 < c["transport_us"] < c["median_us"] and c["host_cpu_us_per_call"] > 0
        assert c["datagrams_per_call"] >= 2 * 2 * 4     # 256 KiB each way: at least 4 datagrams per duck
    assert one["host_workers"] == 1 and helped["host_workers"] == min(len(os.sched_getaffinity(0)), 8)


def test_bench_transport_rejects_a_malformed_chunk(capfd):
    assert duckctl(["bench", "transport", "--chunk", "512by2048"]) != 0
    assert "expected TOKENSxHIDDEN" in capfd.readouterr().err
