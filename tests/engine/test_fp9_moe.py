"""The grouped GEMM from fp9 bytes (engine.gpu.fp9_moe): the Triton kernel, in Triton's
interpreter (tests/engine/conftest.py `interpreted`), gives the reference's result on the
ducks' own slices (tp slices side by side, held experts in any order, pairs of no held expert
as -1, blocks of several rows and experts of more rows than a block); the reference is the
float math of the same weights. On CUDA: tests/gpu/test_placement_cuda.py."""
from __future__ import annotations

import pytest
import torch

from engine.gpu.fp9_moe import copies_moe_forward, fp9_moe_forward, fp9_moe_ref, pair_blocks
from tests.engine.test_fp9_gemv import EXPERTS, HIDDEN, _layer

K = 3


def _routing(tokens: int, held: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    slots = torch.randint(-1, held, (tokens, K), generator=g, dtype=torch.int32)
    slots[: tokens // 2, 0] = 0          # one expert with more rows than a block of 16
    weights = torch.rand(tokens, K, generator=g)
    return x, slots, weights


def row_error(y: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative difference of a row."""
    return float(((y - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-6)).max())


def decoded_copies(device, dtype):
    """_layer()'s held experts (3, 0, 4) decoded: gate_up [3, 2I, H], down [3, H, I] in dtype."""
    from engine.gpu.expert_stream import decode_experts
    from native.transport import split_experts
    from tests.engine.test_fp9_gemv import TP

    experts, _ = _layer()
    gu, dn = decode_experts(split_experts(experts, TP, 64, name="test"), [3, 0, 4], device)
    return gu.to(dtype), dn.to(dtype)


def test_the_pairs_are_cut_into_blocks_of_one_expert():
    slots = torch.tensor([2, -1, 0, 2, 2, 0, -1, 2, 2], dtype=torch.int32)
    order, block_e, block_at, block_n = pair_blocks(slots, 3, 2)
    assert [int(slots[i]) for i in order] == [0, 0, 2, 2, 2, 2, 2, -1, -1]
    live = [(int(e), int(a), int(n)) for e, a, n in zip(block_e, block_at, block_n) if e >= 0]
    assert live == [(0, 0, 2), (2, 2, 2), (2, 4, 2), (2, 6, 1)]
    assert len(block_e) == -(-9 // 2) + 3 and all(int(n) == 0 for e, n in zip(block_e, block_n) if e < 0)


def _scaled_layer():
    """A layer of fp8 experts with block scales that are no powers of two (DeepSeek's): fp9 tensors
    carrying their block scales, 2 slices of gate_up [192, 128] and down [128, 96] (a partial group)."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.gpu.fp9_layout import Layer
    from native.fp9 import Fp9Tensor
    from native.kernels import ExpertSlice

    g = torch.Generator().manual_seed(11)

    def fp8(rows, cols):
        codes = (torch.randn(rows, cols, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        return Fp9Tensor.from_fp8(codes, torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 0.7 + 0.3)

    per_duck = [[ExpertSlice(fp8(192, HIDDEN), fp8(HIDDEN, 96)) for _ in range(4)] for _ in range(2)]
    assert per_duck[0][0].gate_up.has_block_scales
    with ThreadPoolExecutor(1) as workers:
        return Layer(-1, per_duck, None, False, workers, which=[2, 0, 3])


def _kernel_is_the_reference() -> bool:
    from engine.gpu import fp9_gemv
    assert fp9_gemv.INTERPRETED
    for lay, tokens, bm in ((_layer()[1], 7, None), (_layer()[1], 24, 16), (_scaled_layer(), 9, None)):
        x, slots, weights = _routing(tokens, lay.held)
        y = fp9_moe_forward(lay, lay.host, x, slots, weights, bm=bm)
        want = fp9_moe_ref(lay, lay.host, x, slots, weights)
        assert row_error(y, want) < 1e-5, (tokens, row_error(y, want))
        none = (slots < 0).all(1)
        assert not none.any() or y[none].abs().max() == 0
    return True


def test_the_kernel_is_the_reference_under_the_interpreter(interpreted):
    assert interpreted(_kernel_is_the_reference)


def _copies_kernel_is_the_grouped_gemms() -> bool:
    """The kernel on decoded copies against engine.placement's torch grouped GEMMs on the same copies."""
    from engine.gpu import fp9_gemv
    from engine.placement import _grouped_share
    assert fp9_gemv.INTERPRETED
    gu, dn = decoded_copies("cpu", torch.float32)
    for tokens, bm in ((7, None), (24, 16)):
        x, slots, weights = _routing(tokens, 3)
        y = copies_moe_forward(gu, dn, x, slots, weights, bm=bm)
        want = _grouped_share(gu, dn, x, slots, weights)
        assert row_error(y, want) < 1e-5, (tokens, row_error(y, want))
    return True


def test_the_copies_kernel_is_the_grouped_gemms_under_the_interpreter(interpreted):
    assert interpreted(_copies_kernel_is_the_grouped_gemms)


def test_the_reference_is_the_float_math_of_the_held_experts():
    experts, lay = _layer()
    which = [3, 0, 4]
    x, slots, weights = _routing(6, lay.held)
    y = fp9_moe_ref(lay, lay.host, x, slots, weights)
    for t in range(6):
        want = torch.zeros(HIDDEN)
        for s, w in zip(slots[t].tolist(), weights[t].tolist()):
            if s >= 0:
                gate, up, down = experts[which[s]]
                want += w * (down @ (torch.nn.functional.silu(gate @ x[t]) * (up @ x[t])))
        assert (y[t] - want).norm() <= 0.1 * want.norm() + 1e-6, t   # fp9's rounding: 3 mantissa bits a weight
    assert EXPERTS == 5


def _the_check_agrees_under_the_interpreter() -> bool:
    from engine.gpu.fp9_moe import _fused_errors
    errors = _fused_errors(torch.device("cpu"))
    assert len(errors) == 2 and max(errors) < 2e-2, errors
    return True


def test_the_start_up_check_finds_the_kernels_agree_under_the_interpreter(interpreted):
    assert interpreted(_the_check_agrees_under_the_interpreter)


@pytest.mark.parametrize("failure", ["raises", "disagrees"])
def test_a_device_whose_kernels_fail_the_check_keeps_the_older_paths(monkeypatch, caplog, failure):
    """On a CUDA device where the kernels do not compile or disagree with the reference, check_fused
    says so once (a warning) and the steps keep the GEMV and decoded paths (no CUDA needed: the
    check's outcome is what is tested; tests/gpu runs it for real)."""
    from engine.gpu import fp9_moe

    def broken(device):
        if failure == "raises":
            raise RuntimeError("no kernel image for this device")
        return [0.5, 1e-4]

    monkeypatch.setattr(fp9_moe, "_fused_errors", broken)
    monkeypatch.setattr(fp9_moe, "kernel_runs", lambda device: True)
    monkeypatch.setattr(fp9_moe, "_FUSED", {})
    device = torch.device("cuda", 7)
    assert not fp9_moe.fused_ready(device)          # never asked: off
    with caplog.at_level("WARNING", logger="engine.gpu.fp9_moe"):
        assert fp9_moe.check_fused(device) is False
        assert fp9_moe.check_fused(device) is False  # once: the answer is kept
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "off" in warnings[0], warnings
    assert ("no kernel image" in warnings[0]) == (failure == "raises")
    assert not fp9_moe.fused_ready(device)
