"""MTP1 on a tiny DeepSeek-V3 checkpoint with a nextn layer made here: greedy output
is token-identical with and without MTP (torch and fleet backends), drafts are
verified two tokens per main forward, and acceptance is counted and reported."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from engine.fleet_ffn import FleetFfn
from engine.generate import generate
from engine.loader import load_model
from engine.mtp import generate_mtp
from engine.tokens import SamplingParams
from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_deepseek import TINY_DS, hf_deepseek

KIND = "deepseek_v3"
TOKENS = 48
# The nextn layer imitates the main model's last step (eh_proj passes the token's
# embedding through, shared_head is lm_head, the decoder layer is random): its drafts
# are often, not always, right, so both accepted and rejected drafts occur.
SEEDS = (1, 3)
MIN_ACCEPT, MAX_ACCEPT = 0.2, 0.95


def write_mtp_checkpoint(folder, kind: str = KIND, **overrides):
    """A tiny `kind` checkpoint with a nextn layer: the main model, then a donor's extra last layer
    as the MTP layer (its attention, V3.2's indexer included, random), eh_proj passing the
    token's embedding through, shared_head the main model's norm and lm_head."""
    cfg = {**TINY_DS[kind], **overrides}
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    main = hf_deepseek(kind, **overrides)
    main.save_pretrained(folder)
    write_word_tokenizer(folder, cfg["vocab_size"])
    donor = hf_deepseek(kind, seed=7, **{**overrides, "num_hidden_layers": n + 1}).state_dict()
    mtp = {k: v.contiguous() for k, v in donor.items() if k.startswith(f"model.layers.{n}.")}
    # transformers keeps experts fused; the checkpoint layout has one tensor per expert
    gate_up, down = mtp.pop(f"model.layers.{n}.mlp.experts.gate_up_proj"), mtp.pop(f"model.layers.{n}.mlp.experts.down_proj")
    for e in range(gate_up.shape[0]):
        g, u = gate_up[e].chunk(2, dim=0)
        for name, t in (("gate_proj", g), ("up_proj", u), ("down_proj", down[e])):
            mtp[f"model.layers.{n}.mlp.experts.{e}.{name}.weight"] = t.contiguous()
    p = f"model.layers.{n}."
    mtp[p + "enorm.weight"] = torch.ones(h)
    mtp[p + "hnorm.weight"] = torch.ones(h)
    mtp[p + "eh_proj.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    mtp[p + "shared_head.norm.weight"] = main.model.norm.weight.detach().clone()
    mtp[p + "shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    mtp[p + "embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(folder / "mtp.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return write_mtp_checkpoint(tmp_path_factory.mktemp("deepseek_v3_mtp"))


def _prompt(seed: int) -> list[int]:
    return torch.randint(2, TINY_DS[KIND]["vocab_size"], (7,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mtp_layer_is_loaded_and_optional(mtp_checkpoint, tmp_path):
    lm = load_model(mtp_checkpoint)
    (layer,) = lm.model.mtp_layers
    assert layer.self_attn.layer_idx == TINY_DS[KIND]["num_hidden_layers"]
    assert torch.equal(layer.shared_head.head.weight, lm.model.lm_head.weight)
    for f in mtp_checkpoint.iterdir():  # the same checkpoint without mtp.safetensors: MTP off, model loads
        if f.name != "mtp.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    assert load_model(tmp_path).model.mtp_layers == []


@pytest.mark.parametrize("backend", ["torch", "fleet"])
def test_mtp_greedy_is_token_identical(mtp_checkpoint, backend, report, caplog):
    lm = load_model(mtp_checkpoint, backend=FleetFfn(local_ducks=2) if backend == "fleet" else "torch")
    try:
        calls = []
        forward = lm.ffn.forward
        lm.ffn.forward = lambda layer, x, ids, w, out=None: calls.append((layer, x.shape[0])) or forward(layer, x, ids, w, out=out)
        accepted = verified = 0
        for seed in SEEDS:
            prompt = _prompt(seed)
            params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
            plain = generate(lm.model, lm.tokenizer, prompt, params)
            calls.clear()
            with caplog.at_level("INFO", logger="engine.mtp"):
                spec = generate_mtp(lm.model, lm.tokenizer, prompt, params)
            assert spec.token_ids == plain.token_ids, f"seed {seed}: MTP changed the greedy output"
            assert spec.text == plain.text and spec.finish_reason == "length"
            a, v = spec.stats.mtp
            accepted, verified = accepted + a, verified + v
            assert f"accept=1 {a}/{v}" in str(spec.stats) and f"accept=1 {a}/{v}" in caplog.text
            main_layers = TINY_DS[KIND]["num_hidden_layers"]
            pairs = [t for layer, t in calls if layer == main_layers - 1]
            assert pairs.count(2) == v and len(pairs) == v + 1   # prefill + one forward per verification
            assert len(spec.token_ids) in (v + a, v + a + 1)    # 1 token per step, 2 when accepted (cut at max_tokens)
        report(f"tiny {KIND} + MTP1 ({backend}): greedy identical over {len(SEEDS)}x{TOKENS} tokens; accept=1 {accepted}/{verified}")
        assert 0 < accepted < verified and MIN_ACCEPT <= accepted / verified <= MAX_ACCEPT
    finally:
        lm.ffn.close()


def test_mtp_prefills_in_chunks(mtp_checkpoint):
    """The prompt in chunks of 3 (the MTP layer drafts from every chunk's hidden states):
    greedy tokens those of one whole-prompt forward, with and without MTP."""
    lm = load_model(mtp_checkpoint, backend="fp9")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for seed in SEEDS:
        prompt = _prompt(seed)
        whole = generate(lm.model, lm.tokenizer, prompt, params, prefill_chunk=len(prompt))
        assert generate(lm.model, lm.tokenizer, prompt, params, prefill_chunk=3).token_ids == whole.token_ids
        assert generate_mtp(lm.model, lm.tokenizer, prompt, params, prefill_chunk=3).token_ids == whole.token_ids


SAMPLES = 400
MAX_TOTAL_VARIATION = 0.2   # sampling noise at 400 draws is about 0.09 here


def test_sampled_mtp_keeps_the_output_distribution(mtp_checkpoint, report):
    """u * q(d) <= p(d) with the residual draw on rejection: the token decided by
    verification is distributed as without MTP (compared on many seeded draws)."""
    lm = load_model(mtp_checkpoint)
    opts = dict(max_tokens=2, temperature=0.9, top_k=4, ignore_eos=True)
    prompt = _prompt(1)
    plain, spec = Counter(), Counter()
    accepted = verified = 0
    for s in range(SAMPLES):
        plain[generate(lm.model, lm.tokenizer, prompt, SamplingParams(seed=s, **opts)).token_ids[1]] += 1
        r = generate_mtp(lm.model, lm.tokenizer, prompt, SamplingParams(seed=100000 + s, **opts))
        spec[r.token_ids[1]] += 1
        accepted, verified = accepted + r.stats.mtp[0], verified + r.stats.mtp[1]
    tv = 0.5 * sum(abs(plain[t] - spec[t]) for t in set(plain) | set(spec)) / SAMPLES
    report(f"tiny {KIND} + sampled MTP1: total variation {tv:.3f} between {SAMPLES} draws with and without MTP; "
           f"accept=1 {accepted}/{verified}")
    assert 0 < accepted < verified                       # both branches of the test ran
    assert tv <= MAX_TOTAL_VARIATION, (tv, plain, spec)


def test_dual_lane_mtp_is_token_identical_and_overlaps(mtp_checkpoint, report):
    """overlap="lanes": the pair runs as two lanes through the fleet, each token's FFN
    a call of its own (1 token), the output identical to plain greedy."""
    from engine.lanes import StepTrace

    lm = load_model(mtp_checkpoint, backend=FleetFfn(local_ducks=2))
    try:
        calls = []
        forward = lm.ffn.forward
        lm.ffn.forward = lambda layer, x, ids, w, out=None: calls.append((layer, x.shape[0])) or forward(layer, x, ids, w, out=out)
        prompt = _prompt(SEEDS[0])
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        plain = generate(lm.model, lm.tokenizer, prompt, params)
        calls.clear()
        trace = StepTrace()
        spec = generate_mtp(lm.model, lm.tokenizer, prompt, params, overlap="lanes", trace=trace)
        assert spec.token_ids == plain.token_ids
        a, v = spec.stats.mtp
        main_layers = TINY_DS[KIND]["num_hidden_layers"]
        last = [t for layer, t in calls if layer == main_layers - 1]
        assert last.count(1) == 2 * v and last.count(7) == 1     # per-token calls; prefill of 7 tokens once
        assert trace.calls == 2 * v * main_layers and trace.wall > 0
        report(f"tiny {KIND} + MTP1 dual lane (fleet): greedy identical, accept=1 {a}/{v}, "
               f"host {trace.host * 1e3:.1f} ms / FFN {trace.ffn * 1e3:.1f} ms / waited {trace.ffn_wait * 1e3:.1f} ms "
               f"of {trace.wall * 1e3:.1f} ms")
        with pytest.raises(ValueError, match="overlap must be"):
            generate_mtp(lm.model, lm.tokenizer, prompt, params, overlap="both")
    finally:
        lm.ffn.close()
