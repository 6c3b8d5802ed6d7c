"""engine.merged_linear: q/k/v as one matmul equals the three linears, costs no memory,
and follows the parameters through in-place writes, dtype changes and inference mode."""
from __future__ import annotations

import torch
from torch import nn

from engine.merged_linear import MergedLinear


def _linears(bias: bool = False):
    torch.manual_seed(0)
    return nn.Linear(24, 16, bias=bias), nn.Linear(24, 8, bias=bias), nn.Linear(24, 8, bias=bias)


def _separate(x, linears):
    return [torch.nn.functional.linear(x, m.weight, m.bias) for m in linears]


def test_merged_equals_separate_and_shares_the_parameters():
    linears = _linears(bias=True)
    x = torch.randn(5, 24)
    want = [y.clone() for y in _separate(x, linears)]
    weight = linears[0].weight
    merged = MergedLinear()
    got = merged(x, *linears)
    assert all(torch.allclose(g, w, rtol=1e-6, atol=1e-6) for g, w in zip(got, want))
    assert linears[0].weight is weight, "the Parameter object stays (ties, fp8 sources)"
    base = linears[0].weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == base for m in linears), "views of one stacked weight"
    with torch.no_grad():
        linears[1].weight.mul_(2)          # an in-place write (a weight load) reaches the stacked weight
    assert torch.allclose(merged(x, *linears)[1], _separate(x, linears)[1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(merged(x, *linears)[1], want[1])


def test_a_dtype_change_stacks_again():
    linears = _linears()
    merged = MergedLinear()
    x = torch.randn(3, 24)
    merged(x, *linears)
    for m in linears:
        m.to(torch.float64)
    got = merged(x.double(), *linears)
    assert all(g.dtype == torch.float64 for g in got)
    assert all(torch.allclose(g, w) for g, w in zip(got, _separate(x.double(), linears)))


def test_inference_tensors_and_other_modules():
    with torch.inference_mode():
        linears = _linears()
        x = torch.randn(2, 24)
        got = MergedLinear()(x, *linears)     # parameters made in inference mode can take its views
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, _separate(x, linears)))
    odd = (linears[0], nn.Sequential(linears[1]), linears[2])   # not all nn.Linear: one call each
    assert [g.shape for g in MergedLinear()(x, *odd)] == [(2, 16), (2, 8), (2, 8)]
