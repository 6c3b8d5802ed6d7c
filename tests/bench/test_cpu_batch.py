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
