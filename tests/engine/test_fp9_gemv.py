"""The grouped GEMV from fp9 bytes (engine.gpu.fp9_gemv): the Triton kernel (in Triton's
interpreter, a worker process: tests/engine/conftest.py `interpreted`) gives the torch
reference's result on the ducks' own slices (tp slices side by side, held experts in any order,
the ducks' pairs as -1), and the reference is the float math of the same weights. On CUDA:
tests/gpu/test_placement_cuda.py."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from engine.gpu.fp9_layout import Layer
from engine.gpu.fp9_gemv import fp9_down, fp9_gate_up, fp9_gemv_ref

HIDDEN, INTER, TP, EXPERTS, K = 128, 160, 2, 5, 2   # a slice of 128 = 64 + 16 live + padding


def _layer(which=(3, 0, 4)):
    """A layer of random experts split into the ducks' fp9 slices; the held ones (which) laid out."""
    from native.transport import split_experts

    g = torch.Generator().manual_seed(7)
    experts = [(torch.randn(INTER, HIDDEN, generator=g) / 8, torch.randn(INTER, HIDDEN, generator=g) / 8,
                torch.randn(HIDDEN, INTER, generator=g) / 8) for _ in range(EXPERTS)]
    per_duck = split_experts(experts, TP, 64, name="test")
    with ThreadPoolExecutor(1) as workers:
        lay = Layer(-1, per_duck, None, False, workers, which=list(which))
    return experts, lay


def _inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, HIDDEN, generator=g)
    slots = torch.tensor([0, -1, 2, 1, -1, 0, 1, 2], dtype=torch.int32)      # 4 tokens x K=2
    return x, slots


def _kernel_vs_reference() -> bool:
    from engine.gpu import fp9_gemv
    assert fp9_gemv.INTERPRETED
    _, lay = _layer()
    x, slots = _inputs()
    h = fp9_gate_up(lay, lay.host, slots, x, K)
    want = fp9_gemv_ref(lay, lay.host, slots, x, K, down=False)
    assert torch.allclose(h, want, rtol=1e-4, atol=1e-4), (h - want).abs().max()
    a = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
    y = fp9_down(lay, lay.host, slots, a)
    want = fp9_gemv_ref(lay, lay.host, slots, a, 1, down=True)
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-4), (y - want).abs().max()
    assert y[1].abs().max() == 0 and h[4].abs().max() == 0                      # the ducks' pairs
    return True


def test_the_kernel_is_the_reference_under_the_interpreter(interpreted):
    assert interpreted(_kernel_vs_reference)


def test_the_reference_is_the_float_math_of_the_held_experts():
    experts, lay = _layer()
    x, slots = _inputs()
    which = [3, 0, 4]
    h = fp9_gemv_ref(lay, lay.host, slots, x, K, down=False)
    a = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
    y = fp9_gemv_ref(lay, lay.host, slots, a, 1, down=True)
    for j, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        gate, up, down = experts[which[s]]
        want = down @ (torch.nn.functional.silu(gate @ x[j // K]) * (up @ x[j // K]))
        assert (y[j] - want).norm() / want.norm() < 0.1, j          # fp9's rounding: 3 mantissa bits a weight


def _resident_fp9_is_the_decoded_copies() -> bool:
    """engine.placement on fp9 bytes (the fused GEMV, as on CUDA) against decoded fp32 copies of the same
    slices: one call of a layer held in part (the ducks' share through a backend) and of a layer held whole."""
    from engine.ffn import ExpertWeights, FfnLayer, TorchFfn
    from engine.gpu.expert_stream import decode_experts
    from engine.placement import PlacementPlan, ResidentExperts
    from engine.placement_plan import FfnShape

    from native.transport import split_experts

    experts, _ = _layer()
    per_duck = split_experts(experts, TP, 64, name="test")
    x, _ = _inputs()
    ids = torch.tensor([[3, 1], [0, 4], [2, 3], [4, 0]], dtype=torch.int32)
    w = torch.rand(4, K, generator=torch.Generator().manual_seed(1))
    ducks = TorchFfn()
    ducks.load_layer(FfnLayer(0, [ExpertWeights(*e) for e in experts], HIDDEN))
    for which in ((3, 0, 4),):   # held in part; a layer held whole is the same share without the ducks
        plan = PlacementPlan({0: FfnShape(0, EXPERTS, HIDDEN, INTER)}, K, 1 << 30, {0: which})
        fp9 = ResidentExperts.from_slices(plan, {0: per_duck}, "cpu", torch.float32, fp9=True)
        decoded = ResidentExperts(plan, "cpu", torch.float32)
        gu, dn = decode_experts(per_duck, list(which), "cpu")
        decoded.add(0, which, EXPERTS, gu.float(), dn.float())
        a, b = fp9.call(ducks, 0, x, ids, w), decoded.call(ducks, 0, x, ids, w)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (which, (a - b).abs().max())
    return True


def test_placement_on_fp9_bytes_is_placement_on_decoded_copies(interpreted):
    assert interpreted(_resident_fp9_is_the_decoded_copies)
