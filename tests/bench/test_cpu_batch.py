"""bench/cpu_batch.py on the default model with real local ducks: a batch step and a
one-sequence step timed in one run, their parts adding up, and the ratio between them."""
import json

import pytest

from bench import cpu_batch


def test_cpu_batch_times_one_sequence_and_a_batch_in_one_run(tmp_path, capsys):
    out = tmp_path / "batch.json"
    assert cpu_batch.main(["--sequences", "3", "--steps", "3", "--rounds", "2", "--ducks", "2",
                           "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["sequences"] == 3 and len(r["aggregate_over_one_by_round"]) == 2
    for k in ("one", "batch"):
        m = r["median_ms"][k]
        assert m["step"] > 0 and m["ffn"] > 0 and m["logits"] > 0 and 0 < m["kernel"] <= m["ffn"]
        # medians of parts need not add up exactly, but no part exceeds the step
        assert all(m[p] <= m["step"] for p in cpu_batch.PARTS)
    assert r["tok_s"]["batch"] == pytest.approx(3e3 / r["median_ms"]["batch"]["step"])
    assert r["aggregate_over_one"] > 0
    assert "aggregate / one sequence" in capsys.readouterr().out


def test_cpu_batch_names_bad_arguments():
    with pytest.raises(SystemExit):
        cpu_batch.parse_args(["--sequences", "1"])


def test_cpu_batch_compares_fleet_sizes_round_by_round(tmp_path, capsys):
    out = tmp_path / "fleets.json"
    assert cpu_batch.main(["--sequences", "2", "--steps", "2", "--rounds", "2", "--ducks", "2,1",
                           "--json", str(out)]) == 0
    fleets = json.loads(out.read_text())["fleets"]
    assert [f["ducks"] for f in fleets] == [2, 1]
    for f in fleets:
        assert len(f["aggregate_over_one_by_round"]) == 2 and f["tok_s"]["batch"] > 0 and f["tok_s"]["one"] > 0
    table = capsys.readouterr().out
    assert "2 local ducks" in table and "1 local ducks" in table


@pytest.mark.parametrize("ducks", ["0", "2,2", "two"])
def test_cpu_batch_names_bad_fleet_sizes(ducks):
    with pytest.raises(SystemExit):
        cpu_batch.parse_args(["--ducks", ducks])
