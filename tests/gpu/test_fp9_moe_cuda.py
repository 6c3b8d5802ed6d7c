"""The grouped GEMMs from fp9 bytes (engine.gpu.fp9_moe) compiled on CUDA: the reference's result
for bf16 and fp32 activations, plain and block-scaled experts, steps of a few to a few hundred
tokens; the same result replayed from a CUDA graph (no host sync in it). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine.gpu.fp9_moe import fp9_moe_forward, fp9_moe_ref
from tests.engine.test_fp9_moe import _routing, _scaled_layer, decoded_copies, row_error
from tests.engine.test_fp9_gemv import _layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _on_cuda(lay):
    src = lay.host.cuda()
    lay.host = src
    return lay, src


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "block_scales"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [9, 40, 300])
def test_the_compiled_kernel_is_the_reference(scaled, dtype, tokens):
    lay, src = _on_cuda(_scaled_layer() if scaled else _layer()[1])
    x, slots, weights = (t.cuda() for t in _routing(tokens, lay.held))
    x = x.to(dtype)
    y = fp9_moe_forward(lay, src, x, slots, weights)
    want = fp9_moe_ref(lay, src, x, slots, weights)
    assert row_error(y, want) < (2e-3 if dtype == torch.bfloat16 else 1e-5), row_error(y, want)


def test_a_graph_replays_the_kernels_result():
    lay, src = _on_cuda(_layer()[1])
    x, slots, weights = (t.cuda() for t in _routing(40, lay.held))
    x = x.to(torch.bfloat16)
    want = fp9_moe_forward(lay, src, x, slots, weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp9_moe_forward(lay, src, x, slots, weights)
    new_x, new_slots, new_weights = (t.cuda() for t in _routing(40, lay.held, seed=9))
    x.copy_(new_x.to(torch.bfloat16))
    slots.copy_(new_slots)
    weights.copy_(new_weights)
    graph.replay()
    assert torch.equal(y, fp9_moe_forward(lay, src, x, slots, weights))
    assert not torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [9, 300])
def test_the_copies_kernel_is_the_torch_grouped_gemms(dtype, tokens):
    from engine.gpu.fp9_moe import copies_moe_forward
    from engine.placement import _grouped_share

    gu, dn = decoded_copies("cuda", dtype)
    x, slots, weights = (t.cuda() for t in _routing(tokens, 3))
    x = x.to(dtype)
    y = copies_moe_forward(gu, dn, x, slots, weights)
    want = _grouped_share(gu, dn, x, slots, weights)
    assert row_error(y, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5), row_error(y, want)


def test_the_start_up_check_turns_the_kernels_on_here():
    from engine.gpu.fp9_moe import check_fused, fused_ready
    assert check_fused("cuda") and fused_ready(torch.device("cuda"))
