"""A tiny DeepSeek-V3 saved as an fp8 e4m3 checkpoint with 128x128 ue8m0
block scales by our own quantizer (as DeepSeek publishes its weights):
our loader matches transformers run on the same dequantized weights, and
the fp9 FFN backend reproduces the fp32 result, its conversion being exact."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from engine.generate import forward_logits
from engine.loader import load_model
from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_deepseek import _MLA, _YARN, hf_deepseek

FP32_LOGITS_RTOL = 1e-4   # ours vs transformers on the same (dequantized) weights
FP9_LOGITS_RTOL = 1e-5    # the fp9 FFNs hold exactly the fp8 values: only summation order differs
BLOCK = 128
FP8_MAX = 448.0

# dimensions at multiples of 128 (kv_a_proj_with_mqa's 128 + 64 rows end in a short block)
TINY_FP8 = dict(vocab_size=131, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                q_lora_rank=128, routed_scaling_factor=2.5, max_position_embeddings=256,
                rope_parameters=_YARN, eos_token_id=None, **{**_MLA, "kv_lora_rank": 128})


def quantize_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] -> (e4m3 codes, weight_scale_inv [ceil(R/128), ceil(C/128)]): each block's
    scale is the power of two that brings its largest magnitude to at most 448."""
    rows, cols = w.shape
    sr, sc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = torch.empty(sr, sc)
    for i in range(sr):
        for j in range(sc):
            amax = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max().clamp_min(1e-30)
            scale[i, j] = 2.0 ** torch.ceil(torch.log2(amax / FP8_MAX))
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def _quantized(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek stores in fp8: the linear projections; not embeddings, norms, router, head."""
    return (t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "norm" not in name
            and not name.endswith("mlp.gate.weight") and name != "lm_head.weight")


def test_fp8_checkpoint_matches_transformers_and_fp9_is_exact(tmp_path, report):
    import transformers

    hf = hf_deepseek("deepseek_v3", seed=3, **TINY_FP8)
    plain, quant = tmp_path / "fp32", tmp_path / "fp8"
    hf.save_pretrained(plain)
    files = sorted(plain.glob("*.safetensors"))
    assert len(files) == 1
    tensors, fp8 = load_file(files[0]), {}
    for name, t in tensors.items():
        if _quantized(name, t):
            codes, scale = quantize_ue8m0(t.float())
            fp8[name], fp8[name + "_scale_inv"] = codes, scale
            full = scale.repeat_interleave(BLOCK, 0)[:t.shape[0]].repeat_interleave(BLOCK, 1)[:, :t.shape[1]]
            tensors[name] = (codes.float() * full).to(t.dtype)   # exact: codes times powers of two
        else:
            fp8[name] = t
    assert sum(1 for n in fp8 if n.endswith("_scale_inv")) >= 10
    # the reference: transformers with exactly the weights the fp8 checkpoint encodes
    save_file(tensors, files[0], metadata={"format": "pt"})
    ref_model = transformers.DeepseekV3ForCausalLM.from_pretrained(plain).eval()
    quant.mkdir()
    save_file(fp8, quant / files[0].name, metadata={"format": "pt"})
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"}
    (quant / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(quant, TINY_FP8["vocab_size"])

    prompt = torch.randint(2, TINY_FP8["vocab_size"], (13,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
    ours = forward_logits(load_model(quant, backend="torch").model, prompt)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    fp9 = forward_logits(load_model(quant, backend="fp9").model, prompt)
    rel9 = ((fp9 - ours).abs().max() / ours.abs().max()).item()
    report(f"tiny deepseek_v3 fp8 (ue8m0) checkpoint: logits vs transformers {rel:.1e}; fp9 FFNs vs fp32 {rel9:.1e}")
    assert rel <= FP32_LOGITS_RTOL, f"fp8 checkpoint: logits rel err {rel:.2e} > {FP32_LOGITS_RTOL:.0e}"
    assert rel9 <= FP9_LOGITS_RTOL, f"fp9 from fp8: logits rel err {rel9:.2e} > {FP9_LOGITS_RTOL:.0e} (not exact?)"
