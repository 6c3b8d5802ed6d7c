"""The FFN host contract (engine.host_ffn): a call on host buffers in the wire's types
(x fp32/bf16, ids int32, weights fp32, out fp32/bf16) is one C call that writes out and
converts nothing; any other call (other dtypes, int64 ids, no out) is staged through the
calling thread's buffers and gives the same numbers; the local fp9 backend and the
fleet agree through it."""
from __future__ import annotations

import pytest
import torch

from engine.ffn import ExpertWeights, FfnLayer
from engine.fleet_ffn import FleetFfn
from engine.host_ffn import FfnIO, Fp9Ffn, is_wire_call

HIDDEN, INTER, EXPERTS, TOPK = 128, 96, 6, 2


def _layer(seed: int) -> FfnLayer:
    g = torch.Generator().manual_seed(seed)
    experts = [ExpertWeights(torch.randn(INTER, HIDDEN, generator=g) * 0.1, torch.randn(INTER, HIDDEN, generator=g) * 0.1,
                             torch.randn(HIDDEN, INTER, generator=g) * 0.1) for _ in range(EXPERTS)]
    return FfnLayer(3, experts, HIDDEN)


def _routing(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, TOPK, generator=g)
    return x, ids, w


def test_io_views_are_contiguous_and_bounded():
    io = FfnIO.allocate(4, HIDDEN, TOPK, torch.bfloat16, pinned=False)
    x, ids, w, y = io.views(3, 1)   # a dense layer: one expert per token
    assert x.shape == (3, HIDDEN) and ids.shape == (3, 1) and w.shape == (3, 1) and y.shape == (3, HIDDEN)
    assert all(t.is_contiguous() for t in (x, ids, w, y))
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and x.dtype == y.dtype == torch.bfloat16
    assert is_wire_call(x, ids, w, y) and not is_wire_call(x, ids.long(), w, y) and not is_wire_call(x, ids, w, None)
    with pytest.raises(ValueError, match="does not fit buffers for 4 x 2"):
        io.views(5, 2)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        FfnIO.allocate(1, HIDDEN, 1, torch.float16, pinned=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wire_call_writes_out_and_staged_call_agrees(dtype):
    ffn = Fp9Ffn(threads=2)
    ffn.load_layer(_layer(1))
    x, ids, w = _routing(5, seed=2)
    x = x.to(dtype)
    io = FfnIO.allocate(8, HIDDEN, TOPK, dtype, pinned=False)
    xh, ih, wh, yh = io.views(5, TOPK)
    xh.copy_(x), ih.copy_(ids), wh.copy_(w)
    yh.fill_(float("nan"))
    before = ffn.bytes_streamed
    got = ffn.forward(3, xh, ih, wh, out=yh)
    assert got is yh and not torch.isnan(yh.float()).any() and ffn.bytes_streamed > before
    staged = ffn.forward(3, x, ids.long(), w.double())     # other types: staged, one conversion each way
    assert staged.dtype == dtype and torch.equal(staged, yh)


def test_fleet_and_local_fp9_agree_through_the_contract():
    """tp = 2 ducks against the same experts whole on this host: the sum of the two slices'
    partials equals the whole expert up to fp32 summation order."""
    layer = _layer(4)
    local = Fp9Ffn(threads=1)
    local.load_layer(layer)
    fleet = FleetFfn(local_ducks=2)
    try:
        fleet.load_layer(layer)
        fleet.finish_loading()
        x, ids, w = _routing(3, seed=5)
        io = FfnIO.allocate(3, HIDDEN, TOPK, torch.float32, pinned=False)
        xh, ih, wh, yh = io.views(3, TOPK)
        xh.copy_(x), ih.copy_(ids), wh.copy_(w)
        fleet.forward(3, xh, ih, wh, out=yh)
        want = local.forward(3, x, ids, w)
        torch.testing.assert_close(yh, want, rtol=1e-5, atol=1e-5)
    finally:
        fleet.close()
