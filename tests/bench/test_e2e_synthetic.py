"""The synthetic decode benchmark (duckctl bench e2e --synthetic) end to end at real
widths and depth 2: real ducks generating their fp9 experts, the torch CPU offload
beside them, every figure present and consistent with what the ducks report."""
from __future__ import annotations

import json

import pytest

from duckd.ctl import main as duckctl
from bench.synthetic import SHAPES, synthetic_config
from native.kernels import MAX_TOKENS   # what a duck announces: its kernels' tokens per call


def test_synthetic_configs_keep_the_published_widths():
    ds = synthetic_config("deepseek-v32", layers=4, experts=64, dense_layers=1)
    assert (ds.hidden_size, ds.moe_intermediate_size, ds.num_experts, ds.num_hidden_layers) == (7168, 2048, 64, 4)
    q35 = synthetic_config("qwen3.5-35b-a3b", layers=8)
    assert q35.extra["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    with pytest.raises(ValueError, match="multiple of n_group"):
        synthetic_config("deepseek-v32", experts=12)
    with pytest.raises(ValueError, match="unknown synthetic model"):
        synthetic_config("gpt-5")
    assert set(SHAPES) == {"deepseek-v3", "deepseek-v32", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3.5-35b-a3b"}
    assert synthetic_config("deepseek-v3").model_type == "deepseek_v3" and "index_topk" not in SHAPES["deepseek-v3"]


def test_bench_e2e_synthetic_runs_fleet_and_cpu_offload(capfd):
    rc = duckctl(["bench", "e2e", "--synthetic", "qwen3-30b-a3b", "--layers", "2", "--experts", "16",
                  "--ducks", "2", "--duck-threads", "1", "--prompts", "5,12", "--steps", "3", "--prefill-chunk", "8",
                  "--backends", "fleet,cpu-torch", "--batch", "1,3", "--prefill-overlap", "both", "--json"])
    assert rc == 0
    r = json.loads(capfd.readouterr().out)
    assert "synthetic" in r["note"] and r["shape"]["hidden"] == 2048 and r["shape"]["layers"] == 2
    fleet, cpu = r["fleet"], r["cpu-torch"]
    assert fleet["duck_spin_us"] == 0          # unpinned ducks share the cores: they block
    assert r["fleet_read_gbps"] > 0 and fleet["roofline_tok_s"] > 0
    # every duck's decode kernel at once on its own slice of the 16 experts (width 768 / 2 ducks = 384)
    k = r["fleet_kernel"]
    assert k["shape"] == [16, 3, 384, 2048] and k["ducks"] == 2 and len(k["calls"]) == 2 and min(k["calls"]) > 0
    assert 0 < k["gbps_slowest_duck"] <= k["gbps_per_duck"]
    # as many layers as make 32 x the last-level cache in all, and rounds of every duck at once
    assert k["layers"] >= 1 and k["rounds"] >= 8 and k["gbps_per_duck_in_step"] > 0 and k["round_ms_median"] > 0
    assert [p["prompt_len"] for p in fleet["prompts"]] == [5, 12]
    for p in fleet["prompts"] + cpu["prompts"]:
        assert p["ttft_s"] > 0 and p["prefill_tok_s"] > 0 and p["decode"]["tok_s"] > 0
        assert p["decode"]["ffn_calls_per_step"] == 2
        assert p["chunks"] == (1 if p["prompt_len"] == 5 else 2)
        # the fleet's 2-chunk prompt runs two chunks in flight (the host's share then overlaps the calls')
        assert p["overlap"] == (p in fleet["prompts"] and p["chunks"] == 2)
        assert (p["per_layer_chunk_ms"]["host"] is None) if p["overlap"] else p["per_layer_chunk_ms"]["host"] > 0
        # top-8 of 16 experts over 5..8 tokens of a chunk: at least 8 distinct per layer
        assert 8 <= p["distinct_experts_per_layer_chunk"] <= 16
    # --prefill-overlap both: the chunk-by-chunk prefill of the 2-chunk prompt beside the overlapped one
    (cbc,) = [p["prefill_chunk_by_chunk"] for p in fleet["prompts"] if "prefill_chunk_by_chunk" in p]
    assert cbc["prompt_len"] == 12 and not cbc["overlap"] and cbc["per_layer_chunk_ms"]["host"] > 0
    assert "prefill_chunk_by_chunk" not in fleet["prompts"][0] and cbc["ttft_s"] > 0
    for p in fleet["prompts"]:
        assert p["per_layer_chunk_ms"]["duck_kernel"] > 0
        assert p["requests_per_call"]["requests"] == 1 and p["requests_per_call"]["duck_max_tokens"] == MAX_TOKENS
    d = fleet["prompts"][0]["decode"]
    assert d["per_layer_ms"]["duck_kernel"] > 0 and d["per_layer_ms"]["transport"] >= 0
    # what the ducks streamed for one token: the 8 chosen experts' slices in both layers (padding aside)
    assert 1.0 <= d["ffn_bytes_streamed_per_step"] / fleet["ffn_bytes_per_token"] <= 1.1
    pair = fleet["mtp_pair"]
    assert pair["lanes"]["ffn_calls_per_step"] == 4 and pair["batch"]["ffn_calls_per_step"] == 2
    assert pair["serial_ms"] == pytest.approx(2 * pair["single_step_ms"])
    assert fleet["speedup_over_cpu_torch"] == pytest.approx(fleet["decode_tok_s"] / cpu["decode_tok_s"])
    # the torch batching path: 3 sequences in one step; the ducks stream the union of their experts once
    one, three = fleet["batched"]
    assert (one["sequences"], three["sequences"]) == (1, 3) and one["over_one_sequence"] == 1
    assert three["tok_s"] > 0 and three["over_one_sequence"] == pytest.approx(three["tok_s"] / one["tok_s"])
    assert 1.0 <= three["ffn_bytes_streamed_per_step"] / one["ffn_bytes_streamed_per_step"] <= 16 / 8 + 0.1
    # routing honesty: the ids the FFN calls carried, counted per routed layer and step
    routing = d["routing"]
    assert routing["layers"] == 2 and routing["steps"] == 3 and routing["experts"] == 16
    assert routing["distinct_experts_per_layer_step"] == 8       # top-8 of 16, one token: 8 distinct
    assert 0 <= routing["reused_from_previous_step"] <= 1 and 8 / 16 <= routing["experts_read_over_the_steps"] <= 1


def test_routing_spread_counts_what_repeats():
    from bench.timed_ffn import routing_spread

    steps = [[(0, (1, 2)), (1, (5, 6))], [(0, (1, 3)), (1, (5, 6))], [(0, (4, 7)), (1, (5, 6))]]
    r = routing_spread(steps, n_experts=8)
    assert r["layers"] == 2 and r["steps"] == 3 and r["distinct_experts_per_layer_step"] == 2
    # layer 0 reuses 1/2 then 0/2, layer 1 all of it twice (a collapsed router): (0.5 + 0 + 1 + 1) / 4
    assert r["reused_from_previous_step"] == pytest.approx(0.625)
    assert r["experts_read_over_the_steps"] == pytest.approx((5 / 8 + 2 / 8) / 2)
    assert routing_spread([[], []], 8) is None


def test_pinned_ducks_spin_unless_told():
    """--pin-ducks gives each duck CPUs of its own, as boxes: they spin-then-block by default,
    as duckd's network-booted ducks do; --duck-spin-us says otherwise, 0 included."""
    from argparse import Namespace

    from bench.synthetic_ducks import PINNED_DUCK_SPIN_US, duck_spin_us

    assert duck_spin_us(Namespace(duck_spin_us=None, pin_ducks=True)) == PINNED_DUCK_SPIN_US > 0
    assert duck_spin_us(Namespace(duck_spin_us=None, pin_ducks=False)) == 0
    assert duck_spin_us(Namespace(duck_spin_us=0, pin_ducks=True)) == 0
    assert duck_spin_us(Namespace(duck_spin_us=300, pin_ducks=False)) == 300


def test_the_kernel_probe_names_what_it_cannot_measure():
    from bench.kernel_probe import measure_fleet_kernel
    with pytest.raises(ValueError, match="experts >= 8"):
        measure_fleet_kernel(ducks=2, threads=1, experts=4, hidden=256, width=64)
    with pytest.raises(ValueError, match="ducks, threads >= 1"):
        measure_fleet_kernel(ducks=0, threads=1, experts=8, hidden=256, width=64)


def test_the_kernel_probe_reads_more_than_the_cache_holds():
    """Each duck takes as many layers as make its share of the working set (32 x the last-level cache
    by default), one per call in turn, and its rounds wait for the slowest duck."""
    from bench.kernel_probe import _slice, measure_fleet_kernel, probe_bytes_per_duck
    from native.kernels import Pool
    layer = sum(e.weight_bytes for e in _slice(8, 256, 64, 1, Pool(1, pin=False)).experts)
    k = measure_fleet_kernel(ducks=2, threads=1, experts=8, hidden=256, width=64, seconds=0.05,
                             min_bytes_per_duck=3 * layer - 1)
    assert k["layers"] == 3 and k["rounds"] >= 8 and min(k["calls"]) > 0
    assert measure_fleet_kernel(ducks=2, threads=1, experts=8, hidden=256, width=64, seconds=0.05,
                                min_bytes_per_duck=1)["layers"] == 1
    assert probe_bytes_per_duck(4) >= 1 << 20
