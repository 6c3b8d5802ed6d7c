"""engine.gguf_file's own GGUF reader: the same fields, tensor infos and bytes as the
`gguf` package's GGUFReader (the slow reference) on the default SmolLM2 file and
on a small file written by GGUFWriter with every value type; damaged files raise
WeightError naming the problem."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from engine.gguf_file import GgufCheckpoint, GgufFile
from engine.loader import default_model_path
from engine.weights import WeightError

# key -> (value, GGUFWriter add_key_value's type, array item type): every value type
VALUES = {
    "t.u8": (200, GGUFValueType.UINT8, None), "t.i8": (-100, GGUFValueType.INT8, None),
    "t.u16": (60000, GGUFValueType.UINT16, None), "t.i16": (-30000, GGUFValueType.INT16, None),
    "t.u32": (4_000_000_000, GGUFValueType.UINT32, None), "t.i32": (-2_000_000_000, GGUFValueType.INT32, None),
    "t.f32": (0.1, GGUFValueType.FLOAT32, None), "t.bool": (True, GGUFValueType.BOOL, None),
    "t.false": (False, GGUFValueType.BOOL, None), "t.str": ("héllo wörld 😀", GGUFValueType.STRING, None),
    "t.u64": (2**63 + 5, GGUFValueType.UINT64, None), "t.i64": (-(2**62), GGUFValueType.INT64, None),
    "t.f64": (1 / 3, GGUFValueType.FLOAT64, None),
    "t.arr_u8": ([1, 2, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    "t.arr_i16": ([-1, 2, -3], GGUFValueType.ARRAY, GGUFValueType.INT16),
    "t.arr_i32": ([-5, 6], GGUFValueType.ARRAY, GGUFValueType.INT32),
    "t.arr_u64": ([2**64 - 1, 0], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    "t.arr_f32": ([0.5, -1.25, 3.1], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "t.arr_f64": ([0.1, 1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
    "t.arr_bool": ([True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    "t.arr_str": (["a", "", "ü b", "<|im_end|>"], GGUFValueType.ARRAY, GGUFValueType.STRING),
}
NESTED = [[1, 2], [3]]  # an array of arrays: GGUFReader flattens it, we keep the lists


def _small_gguf(path, alignment: int = 64):
    """A small llama-named GGUF: every value type, F32, F16 and Q8_0 tensors, a custom alignment."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    for key, (value, vtype, sub) in VALUES.items():
        w.add_key_value(key, value, vtype, sub)
    w.add_array("t.nested", NESTED)
    w.add_tensor("output_norm.weight", rng.standard_normal(40).astype(np.float32))
    w.add_tensor("blk.0.attn_v.weight", rng.standard_normal((3, 8)).astype(np.float16))
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("token_embd.weight", quants.quantize(q8, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same_as_reference(path, skip=()):
    ours, ref = GgufFile(path), GGUFReader(str(path))
    assert list(ours.fields) == list(ref.fields)
    for key, f in ref.fields.items():
        if key in skip:
            continue
        assert ours.fields[key] == f.contents(), key
        assert type(ours.fields[key]) is type(f.contents()), key
        assert ours.types[key] == [int(t) for t in f.types], key
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    assert len(ours.tensors) == len(ref.tensors)
    for t, r in zip(ours.tensors, ref.tensors):
        assert (t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.data_offset) == (
            r.name, r.tensor_type, tuple(int(d) for d in r.shape), r.n_elements, r.n_bytes, r.data_offset), r.name
        assert type(t.data) is np.ndarray and t.data.dtype == np.uint8 and t.data.nbytes == t.n_bytes
        assert np.array_equal(t.data.reshape(-1), np.asarray(r.data).view(np.uint8).reshape(-1)), r.name
    return ours, ref


def test_default_model_matches_gguf_reader():
    ours, ref = _assert_same_as_reference(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152 and len(ours.tensors) == 272
    ckpt = GgufCheckpoint(default_model_path())
    for name in ("model.norm.weight", "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"):
        t = ckpt._tensors[name]
        r = next(r for r in ref.tensors if r.name == t.name)
        assert ckpt.nbytes(name) == r.n_bytes
        want = quants.dequantize(r.data, r.tensor_type).reshape(ckpt.shape(name))
        assert np.array_equal(ckpt.get(name).numpy(), want), name


def test_small_file_every_value_type(tmp_path):
    path = _small_gguf(tmp_path / "small.gguf")
    ours, ref = _assert_same_as_reference(path, skip={"t.nested"})
    for key, (value, _, _) in VALUES.items():
        if isinstance(value, float) or key in ("t.arr_f32",):
            assert ours.fields[key] == pytest.approx(value, rel=1e-7), key
        else:
            assert ours.fields[key] == value, key
    assert ours.fields["t.nested"] == NESTED and ours.types["t.nested"] == [9, 9, 5]
    assert ref.fields["t.nested"].contents() == [1, 2, 3]  # flattened by the reference
    assert ours.alignment == 64 and ours.data_offset % 64 == 0
    ckpt = GgufCheckpoint(path)
    assert ckpt.shape("model.layers.0.self_attn.v_proj.weight") == (3, 8)
    ref = {r.name: r for r in GGUFReader(str(path)).tensors}
    for name, gguf_name in (("model.norm.weight", "output_norm.weight"),
                            ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight"),
                            ("model.embed_tokens.weight", "token_embd.weight")):
        got = ckpt.get(name)
        want = quants.dequantize(ref[gguf_name].data, ref[gguf_name].tensor_type).reshape(ckpt.shape(name))
        assert got.dtype.is_floating_point and np.array_equal(got.numpy(), want), name
        got.add_(1)  # a copy of its own, not a view of the file
    assert np.array_equal(ckpt.get("model.norm.weight").numpy(), ref["output_norm.weight"].data)
    ckpt.close()


# -- damaged files -------------------------------------------------------------
def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def _file(tmp_path, body: bytes = b"", n_kv: int = 0, n_tensors: int = 0, version: int = 3) -> str:
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body)
    return p


def _tensor_info(name="w", dims=(4,), ggml_type=0, offset=0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "e.gguf", "not a GGUF file"),  # empty
    (lambda p: p / "e.gguf", "not a GGUF file (magic b'GGML'"),
    (lambda p: _file(p, version=1), "GGUF version 1 is not supported"),
    (lambda p: p / "e.gguf", "big-endian GGUF files are not supported"),
    (lambda p: p / "e.gguf", "truncated: the header"),
    (lambda p: _file(p, n_kv=1), "truncated: key 0 length at byte 24"),
    (lambda p: _file(p, struct.pack("<Q", 10**12) + b"abc", n_kv=1),
     "key 0 length 1000000000000 at byte 24 runs past the end of the file (35 bytes)"),
    (lambda p: _file(p, _s("k") + struct.pack("<I", 8) + struct.pack("<Q", 99) + b"xy", n_kv=1),
     "'k' length 99 at byte 37 runs past the end"),
    (lambda p: _file(p, _s("k") + struct.pack("<I", 13), n_kv=1), "'k' has unknown value type 13 at byte 33"),
    (lambda p: _file(p, _s("k") + struct.pack("<IIQ", 9, 42, 1), n_kv=1), "'k' has arrays of unknown value type 42"),
    (lambda p: _file(p, _s("k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 40, n_kv=1),
     "'k'[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0] has arrays nested deeper than 16"),
    (lambda p: _file(p, _s("k") + struct.pack("<IIQ", 9, 5, 1000) + b"\0" * 12, n_kv=1),
     "'k': 1000 i32 items at byte 49 run past the end"),
    (lambda p: _file(p, _s("k") + struct.pack("<IIQ", 9, 8, 2) + _s("ab") + struct.pack("<Q", 50) + b"c", n_kv=1),
     "'k' item 1 length 50 at byte 59 runs past the end"),
    (lambda p: _file(p, _s("k") + struct.pack("<IIQ", 9, 8, 3) + _s("ab"), n_kv=1), "truncated: 'k' item 1 length"),
    (lambda p: _file(p, _s("k") + struct.pack("<I", 4) + b"\1", n_kv=1), "truncated: 'k' at byte 37 needs 4 bytes"),
    (lambda p: _file(p, _s(b"\xff\xfe") + struct.pack("<I", 0) + b"\1", n_kv=1), "key 0 at byte 32 is not UTF-8"),
    (lambda p: _file(p, (_s("k") + struct.pack("<IB", 0, 1)) * 2, n_kv=2), "key 'k' appears twice"),
    (lambda p: _file(p, _s("general.alignment") + struct.pack("<II", 4, 48), n_kv=1),
     "general.alignment 48 is not a u32 power of two"),
    (lambda p: _file(p, _s("general.alignment") + struct.pack("<IQ", 10, 64), n_kv=1),
     "general.alignment 64 is not a u32 power of two"),
    (lambda p: _file(p, _tensor_info()[:-6], n_tensors=1), "truncated: the info of tensor 'w'"),
    (lambda p: _file(p, _tensor_info(dims=(1,) * 9), n_tensors=1), "tensor 'w' has 9 dimensions"),
    (lambda p: _file(p, _tensor_info(ggml_type=99), n_tensors=1), "tensor 'w' has unknown ggml type 99"),
    (lambda p: _file(p, _tensor_info(ggml_type=8, dims=(20,)), n_tensors=1),
     "tensor 'w': rows of 20 are not whole Q8_0 blocks of 32"),
    (lambda p: _file(p, _tensor_info() * 2, n_tensors=2), "tensor 'w' appears twice"),
    (lambda p: _file(p, _tensor_info(dims=(4, 3)) + b"\0" * 40, n_tensors=1),
     "tensor 'w' (48 bytes at byte 96) runs past the end of the file (105 bytes)"),
    (lambda p: _file(p, _tensor_info(offset=2**40) + b"\0" * 100, n_tensors=1), "runs past the end of the file"),
], ids=["empty", "magic", "version1", "big_endian", "short_header", "no_key", "key_length", "string_length",
        "value_type", "array_type", "nesting", "numeric_array", "string_array_length", "string_array_truncated",
        "scalar_truncated", "not_utf8", "duplicate_key", "alignment", "alignment_u64", "tensor_info",
        "n_dims", "ggml_type", "block", "duplicate_tensor", "tensor_past_end", "tensor_offset"])
def test_damaged_files_raise_weight_error(tmp_path, make, message, request):
    path = make(tmp_path)
    contents = {"empty": b"", "magic": b"GGML" + b"\0" * 30, "big_endian": b"GGUF\0\0\0\3" + b"\0" * 16,
                "short_header": b"GGUF\3\0\0\0\1\0"}
    case = request.node.callspec.id
    if case in contents:
        path.write_bytes(contents[case])
    with pytest.raises(WeightError) as e:
        GgufFile(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)


def test_every_truncation_of_a_real_file_raises_weight_error(tmp_path):
    data = _small_gguf(tmp_path / "small.gguf").read_bytes()
    f = GgufFile(tmp_path / "small.gguf")
    start, end = f.data_offset, max(t.data_offset + t.n_bytes for t in f.tensors)  # the rest is padding
    cut = tmp_path / "cut.gguf"
    for n in [*range(start + 1), *range(start + 1, end, 7), end - 1]:
        cut.write_bytes(data[:n])
        with pytest.raises(WeightError) as e:
            GgufFile(cut)
        msg = str(e.value)
        if n == 0:
            assert "not a GGUF file" in msg
        elif n < start:
            assert "truncated" in msg or "runs past the end" in msg or "run past the end" in msg, (n, msg)
        else:
            assert msg.startswith(f"{cut}: tensor '") and "runs past the end of the file" in msg, (n, msg)


def test_garbage_after_the_header_raises_weight_error(tmp_path):
    rng = np.random.default_rng(1)
    for i in range(50):
        p = tmp_path / f"g{i}.gguf"
        p.write_bytes(b"GGUF\3\0\0\0" + rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes())
        with pytest.raises(WeightError, match=f"^{re.escape(str(p))}: "):
            GgufFile(p)


def test_checkpoint_names_the_file(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"GGUF\3\0\0\0" + b"\xff" * 20)
    with pytest.raises(WeightError, match=f"^{re.escape(str(p))}: truncated"):
        GgufCheckpoint(p)
    with pytest.raises(WeightError, match="cannot read"):
        GgufCheckpoint(tmp_path / "missing.gguf")
