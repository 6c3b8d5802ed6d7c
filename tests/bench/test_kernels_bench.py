"""duckctl bench kernels on tiny sizes: every figure present, each fp9 kernel set
beside an int8 peer of its own instruction set, both MoE shapes, the prefill
GEMM beside the FMA peak of its instruction set, the pool's wake-up; --kernels refuses a set this CPU lacks."""
from __future__ import annotations

import json

import pytest

from duckd.ctl import main as duckctl
from native.kernels import kernels, kernels_available, kernels_name

TINY = ["--rounds", "1", "--seconds", "0.01", "--read-mib", "8", "--cold-mib", "8", "--moe-experts", "8"]


def test_bench_kernels_reports_every_case_with_its_peer(capfd):
    assert duckctl(["bench", "kernels", "--threads", "1,2", "--json"] + TINY) == 0
    r = json.loads(capfd.readouterr().out)
    assert r["kernels"] == kernels_name(kernels()) == r["kernel_sets"][0]
    assert set(r["read_gbps"]) == {"1", "2"}
    fp9 = [c for c in r["cases"] if c["name"] == "fp9_gemv"]
    int8 = {(str(c["shape"]), c["threads"], c["isa"]) for c in r["cases"] if c["name"] == "int8_gemv"}
    assert {c["kernels"] for c in fp9} == set(r["kernel_sets"])
    for c in fp9:   # the peer of the same vector width was measured in the same run
        want = {"avx512": "avx512", "avx512-bf16": "avx512", "amx": "avx512", "avx2-xor": "avx2", "avx2-blend": "avx2",
                "ref": "scalar"}[c["kernels"]]
        assert c["int8_peer_isa"] == want and (str(c["shape"]), c["threads"], want) in int8
        assert c["ratio_to_int8"] > 0 and c["ratio_to_read"] > 0
    moe = {(c["model"], c["tokens"], c["threads"]) for c in r["cases"] if c["name"] == "moe_slice"}
    assert moe == {(m, t, n) for m, t in (("deepseek-v3", 1), ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 2))
                   for n in (1, 2)}
    qwen = next(c for c in r["cases"] if c["name"] == "moe_slice" and c["model"] == "qwen3-30b-a3b")
    assert qwen["shape"] == [128, 3, 192, 2048] and qwen["experts_per_call"] == 8
    peaks = {(c["isa"], c["threads"]): c for c in r["cases"] if c["name"] == "fma_peak"}
    gemm = [c for c in r["cases"] if c["name"] == "fp9_gemm"]
    assert {(c["kernels"], c["tokens"], c["threads"]) for c in gemm} == \
        {(k, t, n) for k in r["kernel_sets"] for t in (8, 32, 128) for n in (1, 2)}
    for c in gemm:   # measured against the FMA peak of its own instruction set and thread count
        peak = peaks[(c["fma_peak_isa"], c["threads"])]
        assert peak["gflops"] > 0   # per core printed to 0.1: a loaded host's small peak needs the abs
        assert peak["gflops_per_core"] == pytest.approx(peak["gflops"] / c["threads"], rel=1e-3, abs=0.05)
        assert c["ratio_to_fma_peak"] == pytest.approx(c["gflops"] / peak["gflops"], rel=1e-2)   # one round
        assert c["gflops_per_core"] == pytest.approx(c["gflops"] / c["threads"], rel=1e-3, abs=0.05)
    (wake,) = r["pool_wake"]
    assert wake["threads"] == 2 and wake["blocked"]["wake_us"] > 0 and wake["shared_blocked"]["run_us"] > 0


def test_bench_kernels_refuses_unknown_and_missing_sets(capfd):
    assert duckctl(["bench", "kernels", "--kernels", "avx1024"] + TINY) == 2   # argparse refuses it in bench's process
    assert "unknown avx1024 (known: ref, avx2, avx2-xor, avx2-blend, avx512, avx512-bf16, amx, amx-emu)" in capfd.readouterr().err
    missing = [k for k in ("avx2-xor", "avx512") if k not in kernels_available()]
    if missing:   # where the CPU has every set there is nothing more to refuse
        assert duckctl(["bench", "kernels", "--kernels", missing[0]] + TINY) == 2   # argparse refuses it in bench's process
        assert f"lacks {missing[0]}" in capfd.readouterr().err


def test_the_amx_tile_rate_is_measured_where_amx_runs():
    """duck_kernels_amx_probe: every thread runs its rounds of four tile products in each mode
    (the benchmark times them); where amx does not run it does nothing and the benchmark has no
    amx_peak case (the amx GEMM's ratio is then to the FMA peak alone)."""
    from bench.kernels_gemm import amx_peak_cases
    from native._native import lib
    from native.kernels import Pool

    pool = Pool(2)
    if "amx" not in kernels_available():
        assert lib.duck_kernels_amx_probe(pool.ptr, 0, 1000) == 0
        assert amx_peak_cases(pool, 2, ["amx", "avx512"]) == []
        return
    for mode in range(3):
        assert lib.duck_kernels_amx_probe(pool.ptr, mode, 1 << 14) == 2 * (1 << 14) * 4 * 16 * 16 * 32 * 2
    assert lib.duck_kernels_amx_probe(pool.ptr, 3, 1) == 0
    assert [c.info["mode"] for c in amx_peak_cases(pool, 2, ["amx"])] == ["tiles", "tile_loads", "stored_tile_loads"]


def test_the_amx_peak_modes_are_three_cases():
    """Each mode of the tile-rate probe is its own case (their keys differ), as each
    instruction set's FMA peak is."""
    from bench.kernel_cases import Case

    keys = {Case("amx_peak", None, 0, 0, mode=m).key for m in ("tiles", "tile_loads", "stored_tile_loads")}
    assert len(keys) == 3


def test_bench_kernels_gemm_only_on_a_named_slice(capfd):
    """--gemm-only: the read, the peaks and the prefill GEMM alone, on the layer slices and token counts
    asked for (DeepSeek's slice, 16 tokens per expert: its prefill at 512 tokens); --amx-parts adds the
    amx GEMM with each part left out where the amx program runs (the tiles, or amx-emu). Beside the GEMM,
    the duck's whole forward of a chunk with that many tokens per expert (moe_prefill: 32 experts x 16 / 8
    = 64 tokens) and, with --amx-parts, where its time goes (moe_profile: thread-ms per phase)."""
    sets = [k for k in ("amx-emu", "avx2-blend", "avx2-xor") if k in kernels_available()][:1]
    args = ["bench", "kernels", "--threads", "1", "--json", "--gemm-only", "--gemm-models", "deepseek-v3",
            "--gemm-tokens", "16", "--amx-parts", "--kernels", sets[0]] + TINY
    assert duckctl(args) == 0
    r = json.loads(capfd.readouterr().out)
    names = {c["name"] for c in r["cases"]}
    assert not names & {"fp9_gemv", "int8_gemv", "moe_slice"} and r["read_gbps"]["1"] > 0
    (gemm,) = [c for c in r["cases"] if c["name"] == "fp9_gemm"]
    assert gemm["model"] == "deepseek-v3" and gemm["tokens"] == 16 and gemm["shape"] == [32, 3, 512, 7168]
    assert gemm["gflops"] > 0 and gemm["ratio_to_fma_peak"] > 0
    (moe,) = [c for c in r["cases"] if c["name"] == "moe_prefill"]
    assert (moe["chunk"], moe["tokens"], moe["kernels"]) == (64, 16, sets[0])
    assert moe["gflops"] > 0 and moe["seconds"] > 0 and moe["ratio_to_gemm"] > 0
    (prof,) = [c for c in r["cases"] if c["name"] == "moe_profile"]
    assert set(prof["thread_ms"]) == {"setup", "gate_up", "silu", "down_wait", "down", "reduce"}
    assert prof["thread_ms"]["gate_up"] > 0 and prof["thread_ms"]["down"] > 0 and prof["run_wall_ms"] > 0
    assert prof["run_wall_ms"] >= prof["thread_ms"]["gate_up"] + prof["thread_ms"]["down"] - 1e-3   # one thread
    parts = {c["part"]: c for c in r["cases"] if c["name"] == "amx_part"}
    if sets[0] == "amx-emu":
        assert set(parts) == {"serial", "no_decode", "no_tiles", "no_out", "no_prefetch", "decode_only"}
        assert all(c["time_ratio"] > 0 and c["seconds"] > 0 for c in parts.values())
    else:
        assert not parts   # no amx program on this CPU: nothing to take apart


@pytest.mark.parametrize("flag,value,says", [("--gemm-models", "llama", "known are qwen3-30b-a3b, deepseek-v3"),
                                             ("--gemm-tokens", "0,16", "token counts from 1 to 1024"),
                                             ("--gemm-tokens", "x", "token counts from 1 to 1024"),
                                             ("--gemm-activations", "fp16", "bf16, fp32 or both")])
def test_bench_kernels_refuses_bad_gemm_cases(flag, value, says, capfd):
    assert duckctl(["bench", "kernels", flag, value] + TINY) == 2   # argparse refuses it in bench's process
    assert says in capfd.readouterr().err


def test_bench_kernels_gemm_on_fp32_activations(capfd):
    """--gemm-activations bf16,fp32: the prefill GEMM on a GPU host's activations and on a CPU
    host's (amx runs the latter on its tiles in three bf16 parts), each its own case."""
    sets = [k for k in ("amx-emu", "avx2-blend", "avx2-xor") if k in kernels_available()][:1]
    args = ["bench", "kernels", "--threads", "1", "--json", "--gemm-only", "--gemm-models", "qwen3-30b-a3b",
            "--gemm-tokens", "8", "--gemm-activations", "bf16,fp32", "--kernels", sets[0]] + TINY
    assert duckctl(args) == 0
    r = json.loads(capfd.readouterr().out)
    gemms = {c["activations"]: c for c in r["cases"] if c["name"] == "fp9_gemm"}
    assert set(gemms) == {"bf16", "fp32"}
    assert all(c["gflops"] > 0 and c["tokens"] == 8 and c["kernels"] == sets[0] for c in gemms.values())
    (moe,) = [c for c in r["cases"] if c["name"] == "moe_prefill"]   # beside the bf16 GEMM, as before
    assert moe["ratio_to_gemm"] > 0


def test_bench_kernels_takes_avx2_by_its_plain_name(capfd):
    """`--kernels avx2` (the variant for this CPU's vendor) is measured against the AVX2 int8 peer
    (it raised KeyError: the peer table knew only avx2-xor and avx2-blend)."""
    if "avx2" not in kernels_available():
        pytest.skip("this CPU lacks AVX2+FMA")
    assert duckctl(["bench", "kernels", "--kernels", "avx2", "--threads", "1", "--json"] + TINY) == 0
    r = json.loads(capfd.readouterr().out)
    fp9 = [c for c in r["cases"] if c["name"] == "fp9_gemv"]
    assert fp9 and {c["kernels"] for c in fp9} == {"avx2"} and {c["int8_peer_isa"] for c in fp9} == {"avx2"}
    assert all(c["ratio_to_int8"] > 0 for c in fp9)
