"""GGUF checkpoints (llama.cpp's single file) read through the `gguf` package:
config, tensors under Hugging Face names (dequantized to fp32), tokenizer.

llama.cpp's converter permutes the rows of Q and K for llama so that its rope
can rotate adjacent pairs; we undo that, as transformers' GGUF loader does,
because our rope rotates halves.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from engine.tokenizer import Tokenizer
from engine.weights import Checkpoint, WeightError

log = logging.getLogger(__name__)

# GGUF name -> Hugging Face name ({n}: layer index)
_TENSOR_NAMES = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
)
_ARCH_MODEL_TYPE = {"llama": "llama", "qwen3": "qwen3"}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf permute for q_proj/k_proj rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GgufCheckpoint(Checkpoint):
    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except (OSError, ValueError) as e:
            raise WeightError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.arch = self.field("general.architecture")
        if self.arch not in _ARCH_MODEL_TYPE:
            raise WeightError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                              f"(supported: {', '.join(_ARCH_MODEL_TYPE)})")
        self._tensors = {}
        for t in self.reader.tensors:
            self._tensors[self._hf_name(t.name)] = t

    def _hf_name(self, name: str) -> str:
        for pattern, template in _TENSOR_NAMES:
            m = re.fullmatch(pattern, name)
            if m:
                return m.expand(template)
        raise WeightError(f"tensor {name!r} in {self.path} has no Hugging Face name in engine.gguf_file")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def config_dict(self) -> dict:
        a = self.arch
        heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        d = {
            "model_type": _ARCH_MODEL_TYPE[a],
            "vocab_size": self.field(f"{a}.vocab_size") or self._tensors["model.embed_tokens.weight"].shape[1],
            "hidden_size": hidden,
            "intermediate_size": self.field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.field(f"{a}.attention.head_count_kv", heads),
            "head_dim": self.field(f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": self.field(f"{a}.context_length", 4096),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        return d

    def names(self) -> list[str]:
        return list(self._tensors)

    def file_of(self, name: str) -> str:
        return self.path.name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in reversed(self._tensors[name].shape))  # GGUF lists dims fastest first

    def nbytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def get(self, name: str) -> torch.Tensor:
        from gguf import quants

        t = self._tensors[name]
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(self.shape(name))
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = self.field("llama.attention.head_count")
            if ".k_proj." in name:
                heads = self.field("llama.attention.head_count_kv", heads)
            w = unpermute_qk(w, heads)
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a writable copy

    # -- tokenizer -------------------------------------------------------------
    def tokenizer(self) -> Tokenizer:
        """A byte-level BPE tokenizer rebuilt from the GGUF vocabulary (model 'gpt2')."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HfTokenizer

        kind = self.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise WeightError(f"{self.path}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
        tokens = self.field("tokenizer.ggml.tokens")
        types = self.field("tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HfTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        pre = self.field("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":  # SmolLM's tokenizer.json: single digits, then GPT-2 byte level
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("default", "gpt2"):
            tok.pre_tokenizer = byte_level
        elif pre == "qwen2":
            split = pre_tokenizers.Split(Regex(
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            raise WeightError(f"{self.path}: GGUF pre-tokenizer {pre!r} is not supported")
        tok.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
        tok.add_special_tokens(control)
        eos = self.field("tokenizer.ggml.eos_token_id")
        bos = self.field("tokenizer.ggml.bos_token_id")
        special = {"eos_token": tokens[eos] if eos is not None else None,
                   "bos_token": tokens[bos] if bos is not None else None}
        return Tokenizer(tok, chat_template=self.field("tokenizer.chat_template"),
                         eos_token_ids=(eos,) if eos is not None else (), special_tokens=special, source=str(self.path))
