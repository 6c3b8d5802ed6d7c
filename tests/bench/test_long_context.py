"""`python -m bench long_context` on the CPU at tiny widths (--tiny) with a small index_topk, so the
longer context's decode runs DeepSeek-V3.2's sparse attention: the JSON's keys, the figures, and
the lightning indexer's selection seen at work in the decode steps past index_topk."""
from __future__ import annotations

import json

import pytest
import torch

import engine.models.deepseek_v3 as deepseek_v3
from bench.__main__ import main as bench_main
from bench.long_context import fill_cache, long_config

TOPK = 128
ARGS = ["--tiny", "--layers", "2", "--contexts", "64,300", "--index-topk", str(TOPK), "--steps", "3",
        "--warmup", "1", "--prefill-chunk", "128"]


@pytest.fixture
def selects(monkeypatch):
    """(rows, keys) of every call of the indexer's top-k selection (deepseek_dsa.select)."""
    calls = []
    real = deepseek_v3.select

    def counted(scores, *args, **kwargs):
        calls.append(tuple(scores.shape))
        return real(scores, *args, **kwargs)

    monkeypatch.setattr(deepseek_v3, "select", counted)
    return calls


def test_long_context_on_torch_experts(tmp_path, selects, capsys):
    out = tmp_path / "long.json"
    rc = bench_main(["long_context", *ARGS, "--prefill", "300", "--backend", "gpu", "--out", str(out), "--json"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r
    for key in ("commit", "machine", "shape", "layers", "decode_tok_s", "decode_ratio_to_first", "prefill_tok_s_300",
                "ttft_s_300", "detail", "index_topk", "bytes_cache_per_token"):
        assert key in r, key
    assert r["machine"] == "cpu" and r["layers"] == 2 and r["index_topk"] == TOPK and r["shape"]["tiny"]
    assert r["shape"]["name"] == "deepseek-v32" and r["shape"]["hidden"] == 256
    # per position and main layer: latent 64 + rotary key 16 in fp32, the indexer's fp8 key 32 and its fp32 scale
    assert r["bytes_cache_per_token"] == 2 * ((64 + 16) * 4 + 32 + 4)
    assert set(r["decode_tok_s"]) == {"64", "300"} and min(r["decode_tok_s"].values()) > 0
    assert r["decode_ratio_to_first"]["64"] == 1.0
    assert r["decode_ratio_to_first"]["300"] == pytest.approx(r["decode_tok_s"]["300"] / r["decode_tok_s"]["64"])
    assert r["prefill_tok_s_300"] > 0 and r["ttft_s_300"] > 0
    assert r["prefill_tok_s_300"] == pytest.approx(300 / r["ttft_s_300"])
    short, long = r["detail"]["decode"]["64"], r["detail"]["decode"]["300"]
    for d in (short["random"], long["random"]):
        assert d["filled"] == "random" and d["steps"] == 3 and d["warmup_steps"] == 1 and len(d["step_ms_all"]) == 4
        assert 0 < d["step_ms_median"] <= d["step_ms_p90"] and d["tok_s"] == pytest.approx(1e3 / d["step_ms_median"])
    assert short["random"]["attention"] == "dense" and long["random"]["attention"] == "sparse"
    assert short["prefill"]["filled"] == "prefill" and long["prefill"]["attention"] == "sparse"
    p = r["detail"]["prefill"]
    assert p["method"] == "chunks" and p["chunks"] == 3 and len(p["ttft_s_all"]) == 2
    assert p["decode_after"]["attention"] == "sparse" and p["decode_after"]["tok_s"] > 0
    # the decode steps past index_topk selected from every key before them: one row, per main layer and step,
    # at contexts 300 (random, then prefilled) and after the prefill of 300; none at 64
    one_row = [keys for rows, keys in selects if rows == 1]
    assert len(one_row) == 3 * 2 * 4
    assert sorted(set(one_row)) == [301, 302, 303, 304]
    assert all(keys > TOPK for _, keys in selects)


def test_long_context_on_local_ducks(tmp_path):
    out = tmp_path / "long.json"
    rc = bench_main(["long_context", *ARGS, "--prefill", "0", "--real-prefill-max", "0", "--ducks", "2",
                     "--duck-threads", "1", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["backend"] == "fleet" and r["fleet"]["ducks"] == 2 and "prefill_tok_s_300" not in r
    long = r["detail"]["decode"]["300"]
    assert long["random"]["attention"] == "sparse" and "prefill" not in long
    assert long["random"]["per_layer_ms"]["duck_kernel"] > 0 and long["random"]["ffn_bytes_streamed_per_step"] > 0


def test_the_random_cache_looks_like_what_the_indexer_writes():
    from argparse import Namespace

    from bench.synthetic import build_host_model
    from engine.models.deepseek_dsa import FP8
    config = long_config(Namespace(synthetic="deepseek-v32", layers=2, experts=None, dense_layers=1, tiny=True,
                                   index_topk=TOPK))
    model = build_host_model(config, "cpu", torch.float32)
    cache = model.make_cache(40)
    fill_cache(cache, 30, ue8m0=True, seed=3, block=7)
    assert cache.index_k.dtype == FP8
    for t in cache.per_position():
        assert t[:, :30].float().abs().amax(-1 if t.dim() == 3 else None).min() > 0    # every filled position
        assert not t[:, 30:].float().any()                                              # the rest untouched
    assert cache.latent[:, :30].std().item() == pytest.approx(1.0, abs=0.1)
    scales = cache.index_scale[:, :30]
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)                 # ue8m0: powers of two
    keys = cache.index_k[:, :30].float() * scales[..., None]
    assert keys.std().item() == pytest.approx(1.0, abs=0.15)
