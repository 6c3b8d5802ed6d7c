"""bench.loop_compare on the CPU: a synthetic layer at Qwen3-30B-A3B widths on two local ducks, the
request loop against the one-request path, users, and a chat's two turns with the prefix cache."""
from __future__ import annotations

import json

import pytest

from bench.loop_compare import main

TINY = ["--synthetic", "qwen3-30b-a3b", "--layers", "1", "--experts", "16", "--ducks", "2", "--duck-threads", "1",
        "--repeats", "2", "--users", "2", "--prompt", "8", "--tokens", "4", "--turn-tokens", "64", "--more", "8",
        "--turn-out", "4"]


def test_every_part_in_one_run(tmp_path):
    out = tmp_path / "loop.json"
    assert main([*TINY, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["one_request"]["decode_tok_s"] > 0 and r["batch_of_one"]["decode_tok_s"] > 0
    assert r["batch_of_one_over_one_request"] > 0 and r["users"]["2"]["over_batch_of_one"] > 0
    p = r["prefix"]
    assert p["first"]["prompt_tokens"] == 64 and p["first"]["cached_tokens"] == 0
    # the second turn: the first's prompt and answer (less the last token, not yet read) found cached
    assert p["second_cached"]["prompt_tokens"] == 64 + 4 + 8 and p["second_cached"]["cached_tokens"] == 64 + 4 - 1
    assert p["second_uncached"]["cached_tokens"] == 0 and p["identical"]
    assert r["streamed_layers"] == 0 and r["fp9_grouped_gemms"] is False      # no GPU here


def test_parts_measure_only_what_is_asked(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert main([*TINY, "--parts", "prefix", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert "prefix" in r and not {"one_request", "batch_of_one", "users"} & set(r)
    with pytest.raises(SystemExit):
        main([*TINY, "--parts", "decode,speed"])
    assert "--parts 'decode,speed': expected some of decode,users,prefix" in capsys.readouterr().err
