"""The planner (duckd/plan/model.py): the seeds' figures, the H200 runs in bench/results,
its inputs checked by name, and `duckctl plan` as a user runs it."""
import json
from pathlib import Path

import pytest

from duckd.plan.model import Fleet, ModelShape, PlanError, load_model, plan, slice_width
from duckd.plan.cli import RESULTS, main, validate


@pytest.fixture(scope="module")
def rows():
    return validate()["rows"]


def test_the_seeds_three_figures_within_20_percent(rows):
    seeds = [r for r in rows if r["source"] == "seeds"]
    assert len(seeds) == 3
    for r in seeds:
        assert abs(r["error"]) <= 0.20, r


# The H200 runs the planner misses by more than 15 %, each with what is known of why (docs/plan.md,
# *Known misses*). A file missing that is not named here fails the test, and so does a named one
# that comes within 15 % (the list must say what the planner gets wrong, no more).
KNOWN_MISSES = {
    # DeepSeek-V3.2 at 8 ducks x 2 threads, twice: the ducks' kernel 6.2 ms per layer where the
    # planner gives 4.7 (75 % of a duck's share of the probe's bandwidth). Found on 2026-12-04: the
    # decode kernel on that slice (256 wide) at 2 threads reads at 0.77 of the read probe; these runs
    # had no kernels file of their own, so the planner takes them as read-bound (the -kernels run has one).
    "2026-12-02-e2e-synthetic-deepseek-v32-h200-8x2.json": (0.15, 0.40),
    "2026-12-02-e2e-synthetic-deepseek-v32-h200-8x2-run2.json": (0.15, 0.40),
    # the median of two decodes, 42.7 (after the 16-token prompt, the first after the warm-up) and
    # 54.5 tok/s (after 1024, +4.5 % of the prediction): the first decode of a DeepSeek run is the
    # slower one in every file of that day (39-45 tok/s), this one by the most
    "2026-12-02-e2e-synthetic-deepseek-v32-h200-interleaved-overlap.json": (0.15, 0.25),
    # the two runs of 2026-12-04 on the fastest machines yet (read probe 119-128 GB/s, 30-32 GB/s per
    # duck): the decode kernel stayed at the rate of machines reading 90 (Qwen3 0.48 ms per layer,
    # 21.6 Gparam/s per duck against 19.6 at 22 GB/s), so the planner, which takes it as read-bound
    # there, over-predicts; these runs had no kernels file of their own (the -kernels runs of the
    # same day, on a machine reading 105-114 GB/s, have one and are within 5 %)
    "2026-12-04-e2e-synthetic-qwen3-30b-a3b-h200-held1024.json": (0.15, 0.32),
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-held1024.json": (0.15, 0.25),
    # at 16 x 1 and 8 x 2 on a machine reading 120-139 GB/s, with `bench kernels` of one duck alone
    # (its ratio 0.82 / 0.77): when all ducks run at once they do not share the memory evenly (the next
    # lease's probe: 222 to 386 calls a second among 16 ducks) and each layer waits for the slowest,
    # which a one-duck ratio does not see; the -probe runs measure it (bench/kernel_probe.py)
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-16x1-kernels.json": (0.15, 0.20),
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-8x2-kernels-run2.json": (0.15, 0.22),
    # its two decodes 47.53 and 35.60 tok/s (duck kernel 4.40 and 5.96 ms per layer on the same
    # slices): the first is +20 % of the prediction, the median (the measured figure) +37 %; and its
    # read probe rose from 96.8 GB/s to 125.6 during the run, which the prediction follows
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-8x2-probe.json": (0.15, 0.40),
    # DeepSeek-V3.2 at 8 x 2 with the probe of rounds on one layer: the run's steps fall in two modes
    # (17-20 and 25-30 ms, within one decode) and the probe's rounds saw the fast one (the -probe2 and
    # -llc runs of that machine are within 15 %, +9.6 and +13.7 %; on the machine of the -steps24 runs
    # the probe predicts 8 x 2 within 10 %, spinning and blocking)
    "2026-12-04-e2e-synthetic-deepseek-v32-h200-8x2-synced.json": (0.15, 0.20),
    # Qwen3-30B-A3B at 4 x 4 with a probe of one layer's slices (680 MB in all) on a machine with a
    # 300 MB last-level cache: the probe read partly from the cache (round 0.35 ms against the run's
    # 0.49); with 15 layers a duck (32 x the LLC, the -llc run) the same shape is within 3 %
    "2026-12-04-e2e-synthetic-qwen3-30b-a3b-h200-probe.json": (0.15, 0.20),
    "2026-12-04-e2e-synthetic-qwen3-30b-a3b-h200-probe3.json": (0.15, 0.22),
    "2026-12-04-e2e-synthetic-qwen3-30b-a3b-h200-synced.json": (0.15, 0.40),
}


def test_the_h200_runs_of_the_current_code_within_15_percent(rows):
    """Files of 2026-12-01 on (the C step, pinned or blocking ducks): decode tok/s from the run's host
    stage, transport and read bandwidth; the kernel is the planner's, with the duck's pool run per call
    (docs/plan.md: without it Qwen3's small slices came out +14 to +18 %). The noisy-host files are not
    gated. 36 of 39 within 15 % on 2026-12-02, at 4, 8 and 16 ducks, 63 of 75 on 2026-12-04 (a run's
    kernel_read_ratio from its own probe of every duck's kernel at once, over the read probe taken
    beside it: rounds that wait for the slowest duck where it has them, else the slowest duck; or else
    from `bench kernels` of one duck in the same lease); the known misses above missed by as much as
    their bounds say."""
    gated = [r for r in rows if r["source"] == "H200 e2e" and r["case"] >= "2026-12-01"]
    assert len(gated) >= 39
    assert {r["case"] for r in gated} >= set(KNOWN_MISSES)
    within = [r for r in gated if r["case"] not in KNOWN_MISSES]
    assert all(abs(r["error"]) <= 0.15 for r in within), [(r["case"], r["error"]) for r in within]
    for r in gated:
        if r["case"] in KNOWN_MISSES:
            low, high = KNOWN_MISSES[r["case"]]
            assert low < r["error"] <= high, (r["case"], r["error"])
    fleets = {(r["inputs"].split(" ducks")[0]) for r in within}
    assert {"4", "8", "16"} <= fleets   # the fleet sizes the issue asks for, each with runs within 15 %


def test_a_run_with_its_own_kernels_file_takes_the_kernels_rate_on_its_slice(rows):
    """DeepSeek-V3.2 at 8 x 2: `bench kernels --moe-width 256` in the same lease reads the slice at 0.77
    of the probe at 2 threads; taken as read-bound the run is +40 % (like the two 12-02 8 x 2 runs),
    with the measured ratio within 15 %."""
    from duckd.plan.cli import RESULTS as R, SAME_LEASE_KERNELS, from_e2e, slice_read_ratio
    name = "2026-12-04-e2e-synthetic-deepseek-v32-h200-8x2-kernels.json"
    fleet, m, measured = from_e2e(json.loads((R / name).read_text()), name[:10], name)
    kernels = json.loads((R / SAME_LEASE_KERNELS[name]).read_text())
    assert fleet["kernel_read_ratio"] == slice_read_ratio(kernels, m, 8, 2) == pytest.approx(0.768)
    assert slice_read_ratio(kernels, m, 4, 2) is None    # no case at the 4-duck width (512) in that file
    assert abs(plan(m, Fleet(**fleet))["decode"]["tok_s"] / measured - 1) <= 0.15
    assert plan(m, Fleet(**{**fleet, "kernel_read_ratio": 1.0}))["decode"]["tok_s"] / measured - 1 > 0.3
    row = next(r for r in rows if r["case"] == name)
    assert row["ok"] and row["predicted"] == pytest.approx(plan(m, Fleet(**fleet))["decode"]["tok_s"], abs=0.01)
    with pytest.raises(PlanError, match="kernel_read_ratio"):
        Fleet(kernel_read_ratio=2.0)


def test_a_run_with_a_kernel_probe_takes_its_slowest_duck(rows):
    """DeepSeek-V3.2 at 16 x 1: every duck's kernel at once on its own slice (bench/kernel_probe.py), the
    slowest at 5.48 GB/s of the read probe's 6.96 per duck beside it; a layer waits for it: within 15 %
    (+13.5 %; the machine's read rose by 29 % by the run's end, and the prediction with it)."""
    from duckd.plan.cli import RESULTS as R, from_e2e
    name = "2026-12-04-e2e-synthetic-deepseek-v32-h200-16x1-probe.json"
    d = json.loads((R / name).read_text())
    fleet, m, measured = from_e2e(d, name[:10], name)
    beside = d["fleet_read_gbps"] / 16   # the read probe taken just before the kernel probe
    assert fleet["kernel_read_ratio"] == pytest.approx(d["fleet_kernel"]["gbps_slowest_duck"] / beside)
    assert fleet["kernel_read_ratio"] < 0.80
    assert fleet["read_gbps"] == pytest.approx((d["fleet_read_gbps"] + d["fleet_read_gbps_end"]) / 2 / 16)
    assert abs(next(r for r in rows if r["case"] == name)["error"]) <= 0.15


def test_a_probe_of_rounds_on_more_than_the_cache_predicts_every_fleet_shape(rows):
    """The probe as bench e2e runs it now (rounds of every duck at once, each round waiting for its
    slowest duck, on slices of 32 x the host's last-level cache): DeepSeek-V3.2 at 16 x 1 and 4 x 4,
    Qwen3-30B-A3B at 4 x 4 and 8 x 2 within 10 %; DeepSeek at 8 x 2 within 15 % (+13.7 %: its steps fell
    in two modes, and the probe's rounds saw the fast one)."""
    from duckd.plan.cli import RESULTS as R, from_e2e
    llc = sorted(p.name for p in R.glob("2026-12-04-e2e-synthetic-*-llc.json"))
    assert len(llc) == 5
    for name in llc:
        d = json.loads((R / name).read_text())
        k = d["fleet_kernel"]
        experts, _, width, hidden = k["shape"]   # fp9: 9 bits a weight; that machine's LLC: 300 MiB
        assert k["ducks"] * k["layers"] * experts * 3 * width * hidden * 9 / 8 >= 0.95 * 32 * (300 << 20)
        fleet, _, _ = from_e2e(d, name[:10], name)
        beside = d["fleet_read_gbps"] / k["ducks"]   # the read probe taken just before the kernel probe
        assert fleet["kernel_read_ratio"] == pytest.approx(k["gbps_per_duck_in_step"] / beside)
        error = next(r for r in rows if r["case"] == name)["error"]
        assert abs(error) <= (0.15 if "8x2" in name and "deepseek" in name else 0.10), (name, error)


def test_the_probe_predicts_every_fleet_shape_of_another_machine_within_ten_percent(rows):
    """The -steps24 runs (24 decode steps each, the probe of the -llc runs): on one machine, in one lease,
    DeepSeek-V3.2 at 4 x 4, 16 x 1 and 8 x 2 (spinning and blocking ducks) and Qwen3-30B-A3B at 4 x 4
    within 10 %, DeepSeek 8 x 2 included; on a second machine Qwen3 at 8 x 2 within 15 % (its blocking
    run -11.2 %: the read probe rose by 19 % during it, which the prediction follows; with the ratio
    over the mean of the two reads, as before, it was -16.6 %)."""
    from duckd.plan.cli import RESULTS as R
    runs = {p.name for p in R.glob("2026-12-04-e2e-synthetic-*-steps24*.json")}
    gated = {r["case"]: r for r in rows if r["case"] in runs and r["source"] == "H200 e2e"}
    assert len(runs) == 8 and len(gated) == 7   # the Qwen3 8 x 2 run of the first machine is filed as noisy
    for name, r in gated.items():
        d = json.loads((R / name).read_text())
        assert len(d["fleet"]["prompts"][0]["decode"]["step_ms_all"]) == 24
        assert name not in KNOWN_MISSES
        assert abs(r["error"]) <= (0.15 if "m2-block" in name else 0.10), (name, r["error"])
    assert {gated[n]["inputs"].split(" ducks")[0] for n in gated} == {"4", "8", "16"}


def test_duckctl_plan_takes_the_slice_ratio_from_a_kernels_file(capsys):
    from duckd.ctl import main as ctl_main
    kernels = str(RESULTS / "2026-12-04-kernels-h200-w256.json")   # 2 and 4 threads, the 8-duck slice
    assert ctl_main(["plan", "deepseek-v32", "--ducks", "8", "--cores", "2", "--json", "--kernels", kernels]) == 0
    fleet = json.loads(capsys.readouterr().out)["fleet"]
    assert fleet["kernel_read_ratio"] == pytest.approx(0.768)
    gemv = [c["gparams"] for c in json.loads(Path(kernels).read_text())["cases"]
            if c["name"] == "fp9_gemv" and c["threads"] == 2]
    assert fleet["kernel_gparams_per_core"] == pytest.approx(max(gemv) / 2)   # its fewest threads, per core


def test_the_pool_run_is_read_from_a_kernels_file():
    from duckd.plan.cli import from_kernels
    d = json.loads((RESULTS / "2026-12-01-kernels-h200-gemm.json").read_text())   # 43.19 us at 4 threads
    assert from_kernels(d, 4)["kernel_call_us"] == d["pool_wake"][0]["blocked"]["run_us"]
    m = load_model("qwen3-30b-a3b")
    slow = plan(m, Fleet(ducks=4, kernel_call_us=43.0))["decode"]["per_layer_ms"]["kernel"]
    assert slow == pytest.approx(plan(m, Fleet(ducks=4))["decode"]["per_layer_ms"]["kernel"] + 0.043)


def test_past_moe_intermediate_over_multiple_of_more_ducks_do_not_shrink_the_slices():
    m = load_model("deepseek-v32")
    assert slice_width(2048, 32, 64) == 64 and slice_width(2048, 64, 64) == 64 and slice_width(2048, 64, 32) == 32
    p32, p64 = plan(m, Fleet(ducks=32)), plan(m, Fleet(ducks=64))
    assert p64["memory"]["weights_gb_per_duck"] == pytest.approx(p32["memory"]["weights_gb_per_duck"], rel=0.01)
    assert "padded 32 -> 64" in p64["bottleneck"]
    assert plan(m, Fleet(ducks=64, multiple_of=32))["decode"]["per_layer_ms"]["kernel"] < \
        0.6 * p64["decode"]["per_layer_ms"]["kernel"]
    # the seeds' log: 22351.6 MiB of fp9 slices per rank at tp 32
    assert p32["memory"]["weights_gb_per_duck"] == pytest.approx(22351.6 * 2**20 / 1e9, rel=0.01)


def test_the_fan_in_grows_with_the_ducks_behind_a_host_port():
    m = load_model("deepseek-v32")
    t = [plan(m, Fleet(ducks=n))["decode"]["per_layer_ms"]["transport"] for n in (32, 64, 128)]
    assert t[0] < t[1] < t[2]


@pytest.mark.parametrize("fleet,text", [({"ducks": 0}, "ducks = 0: expected a positive integer"),
                                        ({"read_gbps": 0.0}, "read_gbps = 0.0: expected a positive number"),
                                        ({"mtp_acceptance": 1.5}, "mtp_acceptance = 1.5: expected a fraction"),
                                        ({"multiple_of": 48}, "multiple_of = 48: expected a multiple of 32"),
                                        ({"call_us": -1.0}, "call_us = -1.0: expected >= 0")])
def test_bad_fleet_values_are_named(fleet, text):
    with pytest.raises(PlanError, match=text):
        Fleet(**fleet)


def test_a_checkpoint_folder_is_planned_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144}))
    m = load_model(str(tmp_path))
    assert (m.layers, m.experts, m.dense_layers) == (48, 128, 0)
    assert m == ModelShape.from_config(json.loads((tmp_path / "config.json").read_text()), str(tmp_path))
    with pytest.raises(PlanError, match="neither a known name"):
        load_model(str(tmp_path / "missing"))


def test_duckctl_plan_json_and_table(capsys):
    from duckd.ctl import main as ctl_main
    assert ctl_main(["plan", "qwen3-30b-a3b", "--ducks", "24", "--json",
                     "--kernels", str(RESULTS / "2026-11-30-kernels-dev-2core.json")]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fleet"]["ducks"] == 24 and p["decode"]["tok_s"] > 0 and p["prefill"]["tok_s"] > 0
    assert set(p["decode"]["per_layer_ms"]) == {"host", "kernel", "transport"} and p["bottleneck"]
    assert p["notes"] and "kernels-dev-2core" in p["notes"][0]
    assert main(["qwen3-30b-a3b", "--ducks", "8", "--json", "--kernels",
                 str(RESULTS / "2026-12-01-kernels-dev-2core-gemm.json")]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fleet"]["gemm_gparams_per_core"] == pytest.approx(171.5 / 2)     # its fp9 GEMM at 128 tokens
    assert "padded 96 -> 128 columns)" in p["bottleneck"] or p["decode"]["per_layer_ms"]["kernel"] < \
        p["decode"]["per_layer_ms"]["transport"]
    assert main(["deepseek-v32", "--mtp-acceptance", "0.87", "--sizes", "32,64"]) == 0
    out = capsys.readouterr().out
    assert out.count("decode") == 2 and "MTP1 dual lane" in out
    assert main(["deepseek-v32", "--ducks", "0"]) == 2
    assert "ducks = 0" in capsys.readouterr().err


def test_the_emulated_fleet_repeated_runs_merge_by_median_and_fall_within_15_percent(tmp_path):
    """Five quiet runs of `bench transport --netns 32 --link-mtu 9000`: each case the median of the
    runs; calibrated at 8 ducks, the 16- and 32-duck predictions (docs/plan.md, Emulated fleet)."""
    runs = [str(RESULTS / f"2026-12-02-transport-netns32-dev-2core-mtu9000-quiet-run{i}.json") for i in range(1, 6)]
    rows = [r for r in validate(",".join(runs))["rows"] if r["source"] == "emulated LAN"]
    assert len(rows) == 6 and all("median of 5 runs" in r["case"] for r in rows)
    key = "netns_partials_16_ducks_hidden7168_fp32"
    medians = sorted(json.loads(open(p).read())[key]["median_us"] for p in runs)
    assert [r["measured"] for r in rows if r["case"].startswith("netns 16 ducks hidden 7168 fp32")] == [medians[2]]
    predicted = [r for r in rows if "calibration point" not in r["inputs"]]
    assert len(predicted) == 4 and all(abs(r["error"]) <= 0.15 for r in predicted), \
        [(r["case"], r["error"]) for r in predicted]
    other = json.loads(open(runs[0]).read())
    other["links"] = {**other["links"], "duck_rate_mbit": 1000.0}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(PlanError, match="other links"):
        validate(f"{runs[0]},{tmp_path / 'other.json'}")


def test_streamed_prefill_is_never_below_the_fleet_alone_and_ram_beats_nvme():
    import dataclasses

    from duckd.plan.model import Fleet, load_model
    from duckd.plan.prefill import streamed_prefill
    m, f = load_model("deepseek-v32"), Fleet()
    for tokens in (512, 1024, 8192, 32768):
        runs = {c: streamed_prefill(m, dataclasses.replace(f, host_copy=c), tokens) for c in ("ram", "nvme", "none")}
        alone = runs["none"]["tok_s"]
        assert runs["none"]["gpu_share"] == 0 and alone == runs["ram"]["fleet_alone_tok_s"]
        assert runs["ram"]["tok_s"] >= runs["nvme"]["tok_s"] >= alone
        assert all(0 <= r["gpu_share"] <= 1 for r in runs.values())
    ram = streamed_prefill(m, f, 8192)   # one pass of every expert over PCIe: at most tokens / (bytes / rate)
    assert ram["tok_s"] <= 8192 / (ram["pass_gb"] / f.pcie_gbps) * 1.0001
    assert 730 < ram["pass_gb"] < 745       # DeepSeek-V3.2's FFN weights in fp9 (the ~750 GB a host must hold)
    assert streamed_prefill(m, dataclasses.replace(f, gpu_tflops=0), 8192)["gpu_share"] == 0


def test_a_gpu_budget_places_ffns_and_the_plan_shows_fewer_duck_bytes_and_calls(capsys):
    """duckctl plan --gpu-gb: the budget is what the model's own weights and duckd's margin leave
    (engine.placement's plan on it); more budget never slows decode; a budget the model's own weights
    take whole places nothing."""
    from duckd.plan.model import Fleet, decode, ffn_budget_gb, load_model
    m = load_model("qwen3-235b-a22b")
    assert 14 < m.host_gb < 18                       # attention, routers, embeddings and head in bf16
    assert ffn_budget_gb(m, Fleet(gpu_gb=80)) == pytest.approx(80 - m.host_gb - 2 - 4 - 8)
    assert ffn_budget_gb(m, Fleet(gpu_gb=80, gpu_ffn_gb=5)) == 5 and ffn_budget_gb(m, Fleet(gpu_gb=20)) == 0
    none, some, more = (decode(m, Fleet(gpu_ffn_gb=gb, gpu_fp9_read_ratio=1.0)) for gb in (0, 20, 200))
    assert "placement" not in none and none["tok_s"] < some["tok_s"] < more["tok_s"]
    assert more["placement"]["duck_calls_per_token"] < some["placement"]["duck_calls_per_token"] < 94
    assert main(["deepseek-v32", "--gpu-gb", "32", "--gpu-fp9-read-ratio", "1"]) == 0
    out = capsys.readouterr().out
    assert "placement" in out and "3 layers whole" in out      # the dense layers first
    # the fused fp9 GEMV as measured (0.2 of the GPU's rate) reads slower than 32 N100: nothing pays
    assert decode(load_model("deepseek-v32"), Fleet(gpu_gb=80))["placement"]["gpu_gb"] == 0
    assert main(["deepseek-v32", "--gpu-gb", "32", "--gpu-fp9-read-ratio", "1", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["decode"]["placement"]["duck_gb_per_token"] < 23.2 and p["decode"]["placement"]["gpu_gb"] <= 32
