"""duckctl bench transport, in the README's form (--json), at a small size: every
case names its datagram size, partials, host wait, retransmits and the ducks'
wake-up; a 64 KiB datagram carries a layer in one datagram each way."""
from __future__ import annotations

import json

from duckd.ctl import main as duckctl


def test_bench_transport_json(capsys):
    rc = duckctl(["bench", "transport", "--json", "--ducks", "2", "--iters", "30", "--skip-deepseek"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
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


def test_bench_transport_table_at_ethernet_size(capsys):
    rc = duckctl(["bench", "transport", "--ducks", "2", "--iters", "20", "--skip-deepseek", "--mtu", "1500"])
    assert rc == 0
    out = capsys.readouterr().out
    out_only = next(line for line in out.splitlines() if line.startswith("overhead_2_ducks_hidden7168 "))
    assert " 1500 " in out_only and " 44.0 " in out_only     # 21 fragments out per duck, a zero partial back
    both = next(line for line in out.splitlines() if line.startswith("partials_2_ducks_hidden7168_fp32 "))
    assert " 84.0 " in both                                  # and 21 back
