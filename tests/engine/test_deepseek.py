"""DeepSeek-V3 / V3.2 (MLA, grouped sigmoid routing, YaRN) against transformers on
tiny random models saved by transformers; fp9 and fleet backends against fp32;
the V3.2 tokenizer and chat format; V3.2's indexer cache (its sparse attention: test_dsa.py)."""
from __future__ import annotations

import json
import shutil
import zipfile

import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.fleet_ffn import FleetFfn
from engine.generate import forward_logits, generate
from engine.loader import load_model
from engine.models import deepseek_v3 as ds
from engine.tokens import SamplingParams
from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_tokenizer import _data

FP32_LOGITS_RTOL = 1e-4        # max |ours - transformers| / max |transformers|, fp32, torch backend
GREEDY_TOKENS = 32
FP9_STEPS = 32
FP9_MIN_TOP1_AGREEMENT = 0.9   # fp9 FFNs vs fp32, teacher-forced on the fp32 greedy continuation
FLEET_VS_FP9_RTOL = 1e-5       # same fp9 values, partials summed in another order
DUCKS = 3

_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
             mscale=1.0, mscale_all_dim=0.7, beta_fast=32, beta_slow=1)
# eos_token_id=None: transformers' min_new_tokens would mask EOS, which random models do pick
TINY_DS = {
    # grouped routing (n_group 4, topk_group 2), q_lora, YaRN with mscale != mscale_all_dim, a dense first layer
    "deepseek_v3": dict(vocab_size=131, hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                        n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2,
                        first_k_dense_replace=1, q_lora_rank=48, routed_scaling_factor=2.5,
                        max_position_embeddings=256, rope_parameters=_YARN, eos_token_id=None, **_MLA),
    # no q_lora (q_proj), half-split rope, plain rope, one group, no normalization of the top-k weights
    "deepseek_v3_plain": dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, n_shared_experts=2,
                              n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=0, q_lora_rank=None, norm_topk_prob=False,
                              rope_interleave=False, routed_scaling_factor=1.5, max_position_embeddings=256,
                              rope_parameters=dict(rope_type="default", rope_theta=5000.0), eos_token_id=None,
                              **_MLA),
    "deepseek_v32": dict(vocab_size=113, hidden_size=64, intermediate_size=72, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=1, q_lora_rank=40, index_topk=96, index_head_dim=32, index_n_heads=4,
                         max_position_embeddings=256, rope_parameters=_YARN, eos_token_id=None, **_MLA),
}
KINDS = sorted(TINY_DS)


def hf_deepseek(kind: str, seed: int = 0, **overrides):
    import transformers

    cfg_cls, model_cls = ((transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM) if kind == "deepseek_v32"
                          else (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM))
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**TINY_DS[kind], **overrides})).eval()
    with torch.no_grad():  # the routing bias must matter: transformers initializes it to zero
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.1)
    return model


@pytest.fixture(scope="module")
def ds_checkpoint(tmp_path_factory):
    made = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            model = hf_deepseek(kind)
            model.save_pretrained(folder)
            write_word_tokenizer(folder, TINY_DS[kind]["vocab_size"])
            made[kind] = (folder, model)
        return made[kind]

    return make


def _prompt(kind: str, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TINY_DS[kind]["vocab_size"], (n,), generator=g).tolist()


# 11 tokens: the absorbed (decode) MLA path; 29: the expanded (prefill) path
@pytest.mark.parametrize("n", [11, ds.ABSORB_MAX_TOKENS + 13])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, n, ds_checkpoint, report):
    folder, hf = ds_checkpoint(kind)
    lm = load_model(folder)
    assert type(lm.model).__name__ == "DeepseekV3ForCausalLM" and lm.config.model_type == kind.split("_plain")[0]
    prompt = _prompt(kind, n, seed=1)
    ours = forward_logits(lm.model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    report(f"tiny {kind}: fp32 logits rel err vs transformers {rel:.1e} ({n} tokens, "
           f"{'absorbed' if n <= ds.ABSORB_MAX_TOKENS else 'expanded'} MLA)")
    assert rel <= FP32_LOGITS_RTOL, f"{kind}: logits relative error {rel:.2e} > {FP32_LOGITS_RTOL:.0e}"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(kind, ds_checkpoint):
    folder, hf = ds_checkpoint(kind)
    lm = load_model(folder)
    prompt = _prompt(kind, 9, seed=2)
    ours = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(prompt):]
    assert ours.token_ids == ref.tolist()


def test_router_groups_limit_the_choice(ds_checkpoint):
    """With topk_group < n_group the chosen experts lie in the best groups only; the
    bias steers the choice but not the weights; weights sum to routed_scaling_factor."""
    folder, hf = ds_checkpoint("deepseek_v3")
    lm = load_model(folder)
    gate = lm.model.model.layers[1].mlp.gate
    x = torch.randn(64, lm.config.hidden_size, generator=torch.Generator().manual_seed(5))
    ids, weights = gate(x)
    per_group = lm.config.num_experts // gate.n_group
    assert all(len(set((row // per_group).tolist())) <= gate.topk_group for row in ids)
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        _, ref_w, ref_ids = hf.model.layers[1].mlp.gate(x)
    assert (ids.sort(-1).values == ref_ids.sort(-1).values).all()
    torch.testing.assert_close(weights.sort(-1).values, ref_w.sort(-1).values)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v32"])
def test_fp9_and_fleet_agree_with_fp32(kind, ds_checkpoint, report):
    folder, _ = ds_checkpoint(kind)
    ref = load_model(folder, backend="torch")
    fp9 = load_model(folder, backend="fp9")
    fleet = load_model(folder, backend=FleetFfn(local_ducks=DUCKS))
    try:
        prompt = _prompt(kind, 9, seed=3)
        gold = generate(ref.model, ref.tokenizer, prompt, SamplingParams(max_tokens=FP9_STEPS, ignore_eos=True)).token_ids
        seq = prompt + gold
        l9, lf = forward_logits(fp9.model, seq), forward_logits(fleet.model, seq)
        agree = (l9[len(prompt) - 1:-1].argmax(-1) == torch.tensor(gold)).float().mean().item()
        rel = ((lf - l9).abs().max() / l9.abs().max()).item()
        report(f"tiny {kind}: fp9 top-1 agreement with fp32 {agree:.1%} over {FP9_STEPS} steps; "
               f"fleet ({DUCKS} ducks) vs local fp9 logits rel err {rel:.1e}")
        assert fp9.ffn.bytes_streamed > 0 and fleet.ffn.bytes_streamed > 0
        assert agree >= FP9_MIN_TOP1_AGREEMENT
        assert rel <= FLEET_VS_FP9_RTOL
    finally:
        fleet.ffn.close()


def test_v32_caches_its_indexer_keys_past_index_topk(ds_checkpoint):
    folder, _ = ds_checkpoint("deepseek_v32")
    lm = load_model(folder)
    topk = TINY_DS["deepseek_v32"]["index_topk"]
    cache = lm.model.make_cache(topk + 50)
    assert cache.index_k.shape == (3, topk + 50, 32) and cache.index_k.dtype == torch.float8_e4m3fn
    assert cache.index_scale.shape == (3, topk + 50)
    from duckd.context_size import cache_bytes_per_token
    # measured on a cache of the model's own (duckd sizes the context so) = the closed form
    assert cache_bytes_per_token(lm.model) == lm.model.cache_bytes_per_token() == 3 * ((32 + 16) * 4 + 32 + 4)
    out = generate(lm.model, lm.tokenizer, _prompt("deepseek_v32", topk + 20, seed=4),
                   SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(out.token_ids) == 20
    assert lm.model.model.layers[0].self_attn.indexer.wq_b.weight.shape == (4 * 32, 40)


def test_config_errors_name_the_field():
    base = dict(model_type="deepseek_v3", vocab_size=10, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, **_MLA)
    ds.DeepseekArgs.from_config(ModelConfig.from_dict(base))
    for bad, match in (({"n_group": 3}, "n_group=3"), ({"n_group": 4, "topk_group": 5}, "topk_group=5"),
                       ({"scoring_func": "softmax"}, "scoring_func='softmax'"), ({"kv_lora_rank": 0}, "kv_lora_rank"),
                       ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok=3")):
        with pytest.raises(ConfigError, match=match):
            ds.DeepseekArgs.from_config(ModelConfig.from_dict({**base, **bad}))
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn' is not supported for llama"):
        ModelConfig.from_dict({**base, "model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 2.0}})


def test_v32_tokenizer_renders_the_seed_prompt_and_drives_a_model(tmp_path):
    """The official DeepSeek-V3.2 tokenizer (no Jinja template: the V3.1 family template
    is passed) on a tiny V3.2 model with the real vocabulary size."""
    with zipfile.ZipFile(_data("deepseek-v3.2") / "tokenizer.json.zip") as z:
        z.extract("tokenizer.json", tmp_path)
    shutil.copy(_data("deepseek-v3.2") / "tokenizer_config.json", tmp_path)
    template = json.loads((_data("deepseek-v3.1") / "tokenizer_config.json").read_text())["chat_template"]
    small = dict(vocab_size=129280, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                 n_group=1, topk_group=1, q_lora_rank=16, index_head_dim=16, index_n_heads=2, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=64, max_position_embeddings=64)
    hf_deepseek("deepseek_v32", **small).save_pretrained(tmp_path)
    lm = load_model(tmp_path, chat_template=template)
    messages = [{"role": "user", "content": "1000以内最大的质数是多少？"}]
    text = lm.tokenizer.apply_chat_template(messages)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>1000以内最大的质数是多少？<｜Assistant｜></think>"
    ids = lm.tokenizer.encode_chat(messages)
    assert lm.tokenizer.decode(ids) == text
    assert ids[0] == lm.tokenizer.token_to_id("<｜begin▁of▁sentence｜>")
    out = generate(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and max(out.token_ids) < 129280
