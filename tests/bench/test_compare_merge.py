"""bench.compare_merge: duck's and llama.cpp's figures of one device call in one file, the
ratios, and llama.cpp's estimated PCIe limit (a figure above it marks a collapsed router)."""
from __future__ import annotations

import json

from bench.compare_merge import llama_rows, merge


def _duck() -> dict:
    detail = lambda tok_s, g: {"prefill_tok_s": tok_s, "gpu_experts_per_moe_layer": g,  # noqa: E731
                               "distinct_experts_per_layer_pass": 128.0, "pcie_bytes_per_pass": 10e9}
    side = lambda f: {"prefill_tok_s": {"512": f, "2048": 2 * f}, "detail": {"512": detail(f, 100), "2048": detail(2 * f, 128)}}  # noqa: E731
    duck = {"commit": "abc", "date": "2026-12-06", "machine": {"gpu": "H100"}, "read_gbps": 200.0,
            "pcie_gbps": 50.0, "duck_gb_per_token": 0.5, "shape": {"experts": 128},
            "duck": side(1000.0), "duck_gpu_only": side(900.0), "duck_fleet_only": side(300.0),
            "ttft_1024_runs": [0.5, 0.6]}
    duck["duck"].update(ttft_s_1024=0.5, pcie_limit_tok_s={"512": 2560.0, "2048": 10240.0}, decode_tok_s=40.0,
                        decode={"tok_s": 40.0})
    return duck


def _llama() -> list[dict]:
    rows = [{"n_prompt": 512, "n_gen": 0, "n_ubatch": 512, "avg_ts": 800.0},
            {"n_prompt": 2048, "n_gen": 0, "n_ubatch": 512, "avg_ts": 810.0},
            {"n_prompt": 2048, "n_gen": 0, "n_ubatch": 2048, "avg_ts": 11000.0},
            {"n_prompt": 0, "n_gen": 64, "n_ubatch": 512, "avg_ts": 32.0},
            {"n_prompt": 0, "n_gen": 64, "n_ubatch": 2048, "avg_ts": 31.0}]
    return llama_rows(["not json\n"] + [json.dumps(r) + "\n" for r in rows])


def test_merge_takes_llamas_best_microbatch_and_flags_a_figure_above_its_pcie_limit():
    out = merge(_duck(), _llama(), "qwen3", "h100")
    assert out["llama_cpp"]["prefill_tok_s"] == {"512": 800.0, "2048": 11000.0}
    assert out["llama_cpp"]["best_ubatch"] == {"512": 512, "2048": 2048}
    assert out["llama_cpp_ub512"]["prefill_tok_s"] == {"512": 800.0, "2048": 810.0}
    assert out["llama_cpp"]["decode_tok_s"] == 32.0
    assert out["ratios"]["512"]["duck_over_llama_cpp_best"] == 1.25
    assert out["ratios"]["2048"]["hybrid_over_best_alone"] == round(2000 / 1800, 3)
    assert out["ratios"]["decode_duck_over_llama_cpp"] == 1.25
    # every expert (10 GB in fp9, 9.44 in Q8_0) over 50 GB/s once: 2048 tokens in 0.189 s
    assert out["llama_cpp_pcie_limit_tok_s"]["2048"] == round(2048 / (10e9 * 1.0625 / 1.125 / 50e9), 1)
    assert out["llama_cpp_above_its_pcie_limit"] == ["2048"]


def test_merge_carries_the_placement_budgets_and_their_ratios():
    duck = _duck()
    budget = lambda tok_s, gb: {"decode_tok_s": tok_s, "duck_gb_per_token": gb, "plan": {"gpu_gb": 1.0}}  # noqa: E731
    duck.update(duck_budget_0=budget(40.0, 1.6), duck_budget_quarter=budget(52.0, 1.2), llama_cpp_gb_per_token=1.12)
    gpu_rows = [{"n_prompt": 0, "n_gen": 64, "n_ubatch": 512, "avg_ts": 40.0}]
    out = merge(duck, _llama(), "qwen3", "h100", gpu_rows)
    assert out["duck_budget_quarter"]["decode_tok_s"] == 52.0 and out["llama_cpp_gb_per_token"] == 1.12
    assert out["llama_cpp_gpu_quarter"]["decode_tok_s"] == 40.0
    r = out["placement_ratios"]["duck_budget_quarter"]
    assert r == {"over_llama_cpp": round(52 / 32, 3), "over_duck_budget_0": 1.3, "over_llama_cpp_gpu_quarter": 1.3}
    assert "placement_ratios" not in merge(_duck(), _llama(), "qwen3", "h100")
