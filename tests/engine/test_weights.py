"""Config validation, the fp8 block dequantizer, and the loader's errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, ModelConfig
from engine.generate import forward_logits
from engine.loader import load_model
from engine.weights import WeightError, dequantize_fp8_blocks
from tests.engine.conftest import write_word_tokenizer

FP8_LOGITS_RTOL = 1e-4  # our fp8 load vs transformers on weights dequantized by the numpy reference


def test_config_validates_itself():
    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4)
    c = ModelConfig.from_dict(base)
    assert (c.num_key_value_heads, c.head_dim) == (4, 16)
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        ModelConfig.from_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        ModelConfig.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="num_experts_per_tok=9"):
        ModelConfig.from_dict({**base, "num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 8})
    with pytest.raises(ConfigError, match="missing vocab_size"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})
    moe = ModelConfig.from_dict({**base, "num_local_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                 "mlp_only_layers": [0], "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert moe.num_experts == 6 and moe.rope_theta == 5e5
    assert [moe.is_moe_layer(i) for i in range(2)] == [False, True]
    from engine.models import model_class
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported; supported: .*llama, qwen3"):
        model_class(ModelConfig.from_dict({**base, "model_type": "gpt2"}))


def _dequant_reference(codes: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """Block by block, the slow obvious way."""
    out = np.empty(codes.shape, dtype=np.float64)
    for i in range(0, codes.shape[0], block):
        for j in range(0, codes.shape[1], block):
            out[i:i + block, j:j + block] = codes[i:i + block, j:j + block] * scale[i // block, j // block]
    return out


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (1, 129), (257, 17)])
def test_fp8_dequantize_short_last_block(shape):
    g = torch.Generator().manual_seed(sum(shape))
    codes = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand((-(-shape[0] // 128), -(-shape[1] // 128)), generator=g) + 0.01
    ours = dequantize_fp8_blocks(codes, scale, (128, 128))
    ref = _dequant_reference(codes.float().numpy(), scale.numpy())
    assert np.array_equal(ours.numpy(), ref.astype(np.float32))
    with pytest.raises(WeightError, match="weight_scale_inv has shape"):
        dequantize_fp8_blocks(codes, scale[:, :1] if scale.shape[1] > 1 else torch.ones(5, 5), (128, 128), "w")


def _quantize_fp8(w: torch.Tensor, pow2: bool):
    rows, cols = w.shape
    sr, sc = -(-rows // 128), -(-cols // 128)
    scale = torch.empty(sr, sc)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            s = 2.0 ** torch.ceil(torch.log2(s)) if pow2 else s
            scale[i, j] = s
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s).to(torch.float8_e4m3fn)
    return codes, scale


def test_fp8_checkpoint_loads_and_packs_exactly(tmp_path):
    import transformers

    from engine.host_ffn import _to_fp9

    cfg = transformers.LlamaConfig(vocab_size=150, hidden_size=160, intermediate_size=300, num_hidden_layers=2,
                                   num_attention_heads=5, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    quant, deq = {}, {}
    for i, (name, w) in enumerate(sorted(state.items())):
        if w.dim() == 2 and "proj" in name:
            codes, scale = _quantize_fp8(w, pow2=i % 2 == 0)
            quant[name], quant[name + "_scale_inv"] = codes, scale
            deq[name] = torch.from_numpy(_dequant_reference(codes.float().numpy(), scale.numpy()).astype(np.float32))
        else:
            quant[name] = deq[name] = w
    (tmp_path / "model.safetensors").unlink()
    save_file(quant, tmp_path / "model.safetensors")
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                   "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    write_word_tokenizer(tmp_path, 150)

    lm = load_model(tmp_path)
    params = dict(lm.model.named_parameters())
    for name, w in deq.items():
        assert torch.equal(params[name], w), name
    hf.load_state_dict(deq)
    prompt = list(range(3, 20))
    ref = hf(torch.tensor([prompt])).logits[0].detach()
    rel = ((forward_logits(lm.model, prompt) - ref).abs().max() / ref.abs().max()).item()
    assert rel <= FP8_LOGITS_RTOL
    # the fp9 packer reads the fp8 codes again: bit-exact where the scales are powers of two
    exact = [n for i, n in enumerate(sorted(state)) if n in deq and n + "_scale_inv" in quant and i % 2 == 0]
    assert exact
    for name in exact:
        assert np.array_equal(_to_fp9(params[name], name).to_float(), deq[name].numpy()), name


def _tiny_folder(tiny_checkpoint, tmp_path, kind="llama"):
    import shutil
    src, _ = tiny_checkpoint(kind)
    dst = tmp_path / kind
    shutil.copytree(src, dst)
    return dst


def test_missing_unexpected_misshaped_tensors_are_named(tiny_checkpoint, tmp_path):
    folder = _tiny_folder(tiny_checkpoint, tmp_path)
    path = folder / "model.safetensors"
    state = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"

    save_file({k: v for k, v in state.items() if k != name}, path)
    with pytest.raises(WeightError, match=rf"no tensor '{name}'"):
        load_model(folder)

    save_file({**state, "model.layers.1.mlp.extra.weight": torch.zeros(3)}, path)
    with pytest.raises(WeightError, match=r"'model.layers.1.mlp.extra.weight' in model.safetensors is not used"):
        load_model(folder)

    save_file({**state, name: state[name][:, :-1].contiguous()}, path)
    with pytest.raises(WeightError, match=rf"'{name}' in model.safetensors has shape \(200, 95\), "
                                          rf"the model expects \(200, 96\)"):
        load_model(folder)


def test_sharded_checkpoint_with_index(tiny_checkpoint, tmp_path):
    src, hf = tiny_checkpoint("qwen3_moe")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    write_word_tokenizer(tmp_path, hf.config.vocab_size)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompt = [5, 6, 7, 8]
    assert torch.equal(forward_logits(load_model(tmp_path).model, prompt), forward_logits(load_model(src).model, prompt))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    moved = next(iter(index["weight_map"]))
    index["weight_map"][moved] = "model-99999.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match="model-99999.safetensors"):
        load_model(tmp_path)
