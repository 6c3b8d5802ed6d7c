"""engine.gpu.fp9_decode on the CPU: the Triton kernel (under Triton's interpreter, in a worker
process: tests/engine/conftest.py `interpreted`) and the torch reference give the C codec's
fp32 values (fp9_unpack_f32) as bf16, bit for bit, for several tensors in one buffer placed as
an expert's tp slices side by side: odd shapes (a short last panel, an odd row count, columns
that are no multiple of 64), signs, subnormals, block scales that are no powers of two, the
output NaN-poisoned so an element left unwritten fails. tests/gpu runs the compiled kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.gpu import fp9_decode
from engine.gpu.fp9_decode import Placement, decode_fp9, decode_fp9_ref, tensor_bytes
from native.fp9 import Fp9Tensor

# (rows, columns, tp slices, block scales): a program decodes one row pair of one tensor, so the
# interpreter's time grows with rows; few rows keep every case (a short last panel of 32 groups,
# columns past a multiple of 64, odd rows) but the scaled one, whose 130 rows cross a 128-row scale block
SHAPES = [(2, 64, 1, False), (3, 70, 2, False), (6, 2100, 2, False), (5, 4200, 3, False), (130, 300, 2, True),
          (10, 192, 4, False)]


def _tensors(rows: int, cols: int, n: int, scales: bool, seed: int) -> list[Fp9Tensor]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if scales:
            gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
            codes = (torch.randn(rows, cols, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 0.7 + 0.3
            out.append(Fp9Tensor.from_fp8(codes, scale))
        else:   # magnitudes over ~20 binades by row: normals and subnormals of e5m3
            w = rng.standard_normal((rows, cols)) * np.exp2(rng.uniform(-20, 3, (rows, 1)))
            out.append(Fp9Tensor.from_float(w.astype(np.float32)))
    return out


def check_decode(rows: int, cols: int, per: int, scales: bool, device: str, seed: int, ref: bool = False) -> None:
    """count = 2 experts x per slices of [rows, cols], each slice's columns side by side in its expert
    ([rows, per * cols]), as the down slices of a layer are placed; decoded vs the codec."""
    tensors = _tensors(rows, cols, 2 * per, scales, seed)
    stride = -(-max(t.nbytes for t in tensors) // 64) * 64
    assert max(t.nbytes for t in tensors) == tensor_bytes(rows, cols, scales)
    src = torch.zeros(len(tensors) * stride, dtype=torch.uint8)
    for i, t in enumerate(tensors):
        src[i * stride:i * stride + t.nbytes] = torch.from_numpy(t.buf[:t.nbytes].copy())
    out = torch.full((2, rows, per * cols), float("nan"), dtype=torch.bfloat16)
    place = Placement(per=per, outer=rows * per * cols, inner=cols, row_stride=per * cols)
    src, out = src.to(device), out.to(device)
    (decode_fp9_ref if ref else decode_fp9)(src, len(tensors), stride, rows, cols, out, place)
    want = torch.stack([torch.cat([torch.from_numpy(tensors[e * per + d].to_float()) for d in range(per)], 1)
                        for e in range(2)]).to(torch.bfloat16)
    got = out.cpu()
    assert not got.isnan().any(), "elements left unwritten"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"{rows}x{cols} (scales {scales}): {(got.float() != want.float()).sum().item()} values differ"


def _interpreted_cases() -> bool:
    assert fp9_decode.INTERPRETED
    for i, shape in enumerate(SHAPES):
        check_decode(*shape, "cpu", seed=i)
    return True


@pytest.mark.parametrize("rows,cols,per,scales", SHAPES)
def test_the_reference_is_the_codec(rows, cols, per, scales):
    check_decode(rows, cols, per, scales, "cpu", seed=rows * cols, ref=True)


def test_the_kernel_is_the_codec_under_the_interpreter(interpreted):
    assert interpreted(_interpreted_cases)


def test_bad_arguments_are_refused():
    src = torch.zeros(tensor_bytes(4, 64), dtype=torch.uint8)
    out = torch.zeros(4 * 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2 tensors of 4x64 need 2 x >= 352 bytes; src has 352"):
        decode_fp9(src, 2, tensor_bytes(4, 64), 4, 64, out, Placement(1, 256, 0, 64))
    with pytest.raises(ValueError, match="does not hold tensor 0"):
        decode_fp9(src, 1, tensor_bytes(4, 64), 4, 64, out[:100], Placement(1, 256, 0, 64))
    with pytest.raises(ValueError, match="must be bfloat16"):
        decode_fp9(src, 1, tensor_bytes(4, 64), 4, 64, out.float(), Placement(1, 256, 0, 64))
