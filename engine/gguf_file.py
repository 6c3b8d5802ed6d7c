"""GGUF checkpoints (llama.cpp's single file): config, tensors under Hugging Face
names (dequantized to fp32 by the `gguf` package's quants), tokenizer.

GgufFile reads the file layout itself over an mmap (the `gguf` package's
GGUFReader builds a numpy memmap view per metadata item and takes seconds on a
100k-token vocabulary; tests/engine/test_gguf_file.py keeps it as the reference).

llama.cpp's converter permutes the rows of Q and K for llama so that its rope
can rotate adjacent pairs; we undo that, as transformers' GGUF loader does,
because our rope rotates halves.
"""
from __future__ import annotations

import logging
import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.tokenizer import Tokenizer
from engine.weights import Checkpoint, WeightError

log = logging.getLogger(__name__)

# -- the file layout ----------------------------------------------------------
# little endian throughout: "GGUF", u32 version, u64 tensor count, u64 kv count,
# kv pairs (string key, u32 value type, value), tensor infos (string name,
# u32 n_dims, u64 dims fastest first, u32 ggml type, u64 offset from the data
# start), padding to general.alignment, tensor data. A string is a u64 length
# and UTF-8 bytes; an array is a u32 item type, a u64 count and the items.
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # version 1 had u32 counts and lengths
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# scalar value type -> (name, struct code); numpy reads arrays of them as "<" + code
_SCALARS = {0: ("u8", "B"), 1: ("i8", "b"), 2: ("u16", "H"), 3: ("i16", "h"), 4: ("u32", "I"), 5: ("i32", "i"),
            6: ("f32", "f"), 7: ("bool", "?"), 10: ("u64", "Q"), 11: ("i64", "q"), 12: ("f64", "d")}
_STRUCTS = {t: struct.Struct("<" + c) for t, (_, c) in _SCALARS.items()}
_DTYPES = {t: np.dtype("<" + c) for t, (_, c) in _SCALARS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_MAX_DIMS = 8  # ggml has 4; more is a damaged file
_MAX_NESTING = 16  # arrays of arrays


class GgufTensor(NamedTuple):
    """One tensor's info: shape in GGUF order (fastest dimension first), data as a
    read-only uint8 array over the mmap shaped as gguf.quants.dequantize expects
    (rows in numpy order, the last axis the row's bytes)."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GgufFile:
    """A GGUF file (versions 2 and 3) parsed over a read-only mmap: fields (key ->
    Python value: int, float, bool, str or list, as GGUFReader's contents()
    gives, plus GGUF.version, GGUF.tensor_count and GGUF.kv_count), types (key ->
    value type ids, [9, item type...] for arrays), tensors in file order,
    alignment and data_offset. Damaged files raise WeightError naming the problem."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise WeightError(f"{self.path}: not a GGUF file ({e})") from e
        except OSError as e:
            raise WeightError(f"{self.path}: cannot read ({e})") from e
        self.size = len(self._mm)
        self.fields: dict[str, Any] = {}
        self.types: dict[str, list[int]] = {}
        self.tensors: list[GgufTensor] = []
        try:
            self._parse()
        except WeightError:
            self.close()
            raise

    def _error(self, msg: str) -> WeightError:
        return WeightError(f"{self.path}: {msg}")

    def _need(self, off: int, n: int, what: str) -> None:
        if off + n > self.size:
            raise self._error(f"truncated: {what} at byte {off} needs {n} bytes, the file has {self.size}")

    def _unpack(self, st: struct.Struct, off: int, what: str):
        self._need(off, st.size, what)
        return st.unpack_from(self._mm, off)[0]

    def _str(self, off: int, what: str) -> tuple[str, int]:
        """The string at off and the offset after it."""
        n = self._unpack(_U64, off, f"{what} length")
        off += 8
        if off + n > self.size:
            raise self._error(f"{what} length {n} at byte {off - 8} runs past the end of the file ({self.size} bytes)")
        try:
            return str(self._mm[off:off + n], "utf-8"), off + n
        except UnicodeDecodeError as e:
            raise self._error(f"{what} at byte {off} is not UTF-8 ({e})") from e

    def _value(self, vtype: int, off: int, what: str, depth: int = 0) -> tuple[Any, int, list[int]]:
        """The value of a type at off, the offset after it and its type ids."""
        if vtype in _STRUCTS:
            st = _STRUCTS[vtype]
            return self._unpack(st, off, what), off + st.size, [vtype]
        if vtype == _STRING:
            s, off = self._str(off, what)
            return s, off, [vtype]
        if vtype != _ARRAY:
            raise self._error(f"{what} has unknown value type {vtype} at byte {off - 4}")
        itype = self._unpack(_U32, off, f"{what} item type")
        n = self._unpack(_U64, off + 4, f"{what} item count")
        off += 12
        if itype in _DTYPES:  # numeric: one frombuffer
            dt = _DTYPES[itype]
            if off + n * dt.itemsize > self.size:
                raise self._error(f"{what}: {n} {_SCALARS[itype][0]} items at byte {off} run past "
                                  f"the end of the file ({self.size} bytes)")
            return np.frombuffer(self._mm, dt, n, off).tolist(), off + n * dt.itemsize, [_ARRAY, itype]
        if itype == _STRING:  # a tight loop, each length checked before its bytes are read
            mm, size, out, unpack = self._mm, self.size, [], _U64.unpack_from
            try:
                for i in range(n):
                    if off + 8 > size:
                        raise self._error(f"truncated: {what} item {i} length at byte {off}")
                    k = unpack(mm, off)[0]
                    off += 8
                    if off + k > size:
                        raise self._error(f"{what} item {i} length {k} at byte {off - 8} runs past the end "
                                          f"of the file ({size} bytes)")
                    out.append(str(mm[off:off + k], "utf-8"))
                    off += k
            except UnicodeDecodeError as e:
                raise self._error(f"{what} item {len(out)} at byte {off} is not UTF-8 ({e})") from e
            return out, off, [_ARRAY, _STRING]
        if itype != _ARRAY:
            raise self._error(f"{what} has arrays of unknown value type {itype} at byte {off - 12}")
        if depth >= _MAX_NESTING:
            raise self._error(f"{what} has arrays nested deeper than {_MAX_NESTING} at byte {off - 12}")
        out, types = [], [_ARRAY, _ARRAY]
        for i in range(n):  # arrays of arrays: nested lists, typed by the first
            v, off, inner = self._value(_ARRAY, off, f"{what}[{i}]", depth + 1)
            out.append(v)
            types = types if i else [_ARRAY, *inner]
        return out, off, types

    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self._need(0, _HEADER.size, "the header")
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(self._mm, 0)
        if magic != GGUF_MAGIC:
            raise self._error(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        if version not in GGUF_VERSIONS:
            what = "big-endian GGUF files are" if version and version & 0xFFFF == 0 else f"GGUF version {version} is"
            raise self._error(f"{what} not supported (versions {GGUF_VERSIONS})")
        for key, value in (("GGUF.version", version), ("GGUF.tensor_count", n_tensors), ("GGUF.kv_count", n_kv)):
            self.fields[key], self.types[key] = value, [4 if key == "GGUF.version" else 10]
        off = _HEADER.size
        for i in range(n_kv):
            key, off = self._str(off, f"key {i}")
            vtype = self._unpack(_U32, off, f"value type of {key!r}")
            value, off, types = self._value(vtype, off + 4, repr(key))
            if key in self.fields:
                raise self._error(f"key {key!r} appears twice")
            self.fields[key], self.types[key] = value, types
        self.alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        a = self.alignment
        if self.types.get("general.alignment", [4]) != [4] or a <= 0 or a & (a - 1):
            raise self._error(f"general.alignment {self.alignment!r} is not a u32 power of two")
        infos, seen = [], set()
        for i in range(n_tensors):
            name, off = self._str(off, f"name of tensor {i}")
            if name in seen:
                raise self._error(f"tensor {name!r} appears twice")
            seen.add(name)
            n_dims = self._unpack(_U32, off, f"n_dims of tensor {name!r}")
            if n_dims > _MAX_DIMS:
                raise self._error(f"tensor {name!r} has {n_dims} dimensions")
            self._need(off + 4, 8 * n_dims + 12, f"the info of tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}QIQ", self._mm, off + 4)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims[:n_dims], dims[-2], dims[-1]))
        self.data_offset = -(-off // self.alignment) * self.alignment
        for name, dims, ggml_type, rel in infos:
            try:
                qtype = GGMLQuantizationType(ggml_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise self._error(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
            n = math.prod(dims)
            row = dims[0] if dims else 1
            if row % block:
                raise self._error(f"tensor {name!r}: rows of {row} are not whole {qtype.name} blocks of {block}")
            n_bytes = n // block * type_size
            start = self.data_offset + rel
            if start + n_bytes > self.size:
                raise self._error(f"tensor {name!r} ({n_bytes} bytes at byte {start}) runs past the end "
                                  f"of the file ({self.size} bytes)")
            byte_shape = (*reversed(dims[1:]), row // block * type_size)
            data = np.frombuffer(self._mm, np.uint8, n_bytes, start).reshape(byte_shape)
            self.tensors.append(GgufTensor(name, qtype, tuple(dims), n, n_bytes, start, data))
        log.debug("%s: GGUF v%d, %d fields, %d tensors, data at byte %d", self.path.name, version,
                  len(self.fields), len(self.tensors), self.data_offset)

    def close(self) -> None:
        """Drops the tensors and closes the mmap (left to the garbage collector
        while arrays over it are still held elsewhere)."""
        self.tensors = []
        try:
            self._mm.close()
        except BufferError:
            pass


# -- the checkpoint -------------------------------------------------------------
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
    """A GGUF file as a checkpoint: tensors under Hugging Face names, config.json's
    fields from the metadata, the tokenizer rebuilt from the vocabulary."""

    # ggml types numpy reads as they are; the rest go through gguf.quants.dequantize
    _PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
              "I32": np.int32, "I64": np.int64}

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GgufFile(self.path)
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
        """A metadata value (int, float, bool, str or list), or default when absent."""
        return self.reader.fields.get(key, default)

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
        return self._tensors[name].n_bytes

    def close(self) -> None:
        self._tensors = {}
        self.reader.close()

    def get(self, name: str) -> torch.Tensor:
        """The tensor dequantized to fp32 in an array of its own (writable, C order)."""
        from gguf import quants

        t = self._tensors[name]
        plain = self._PLAIN.get(t.tensor_type.name)
        w = t.data.view(plain) if plain is not None else quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(self.shape(name))
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = self.field("llama.attention.head_count")
            if ".k_proj." in name:
                heads = self.field("llama.attention.head_count_kv", heads)
            w = unpermute_qk(w, heads)
        if not (w.flags.writeable and w.flags.c_contiguous):  # a view of the mmap (F32)
            w = np.array(w, order="C")
        return torch.from_numpy(w)

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
