"""engine.gpu.moe on the GPU: the compiled grouped GEMV against float64, and a tiny
Qwen3-MoE decoded from ONE CUDA graph per step (the FFNs captured inline) against
the eager forward with the torch reference experts. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine.gpu.graphs import GraphLane
from engine.gpu.moe import GpuExpertsFfn
from engine.lanes import run_lane
from engine.loader import load_model
from tests.engine.conftest import TINY, hf_model, write_word_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_compiled_grouped_kernel_matches_float64():
    from engine.ffn import ExpertWeights, torch_experts_forward
    from engine.gpu import moe
    from engine.gpu.moe import stack_experts
    from tests.engine.test_gpu_moe import _experts

    gen = torch.Generator().manual_seed(3)
    for t, k, e, hidden, inter in [(1, 8, 16, 2048, 768), (2, 8, 16, 7168, 256), (3, 2, 3, 64, 150)]:
        experts = _experts(e, hidden, inter, gen)
        gate_up, down = (s.cuda() for s in stack_experts(experts))
        x = torch.randn(t, hidden, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen)
        y = moe.grouped_experts_forward(gate_up, down, x.cuda(), ids.cuda().to(torch.int32), w.cuda())
        ref = torch_experts_forward([ExpertWeights(*(p.double() for p in (x_.gate, x_.up, x_.down)))
                                     for x_ in experts], x.double(), ids, w.double())
        err = ((y.cpu().double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"grouped forward on CUDA T={t} k={k} E={e}: rel err {err:.1e}"


@pytest.mark.parametrize("tokens", [1, 2])
def test_one_graph_per_step_with_the_ffns_inside(tmp_path, tokens):
    folder = tmp_path / "qwen3_moe"
    hf_model("qwen3_moe").save_pretrained(folder)
    write_word_tokenizer(folder, TINY["qwen3_moe"]["vocab_size"])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lm = load_model(folder, backend="torch", device="cuda")
        model = lm.model
        gpu = GpuExpertsFfn()
        for m, layer in list(model.ffn_layers()):
            gpu.load_layer(layer)
            m.ffn = gpu
        prompt = torch.randint(2, TINY["qwen3_moe"]["vocab_size"], (9,), generator=torch.Generator().manual_seed(1))
        ref_cache, cache = model.make_cache(32), model.make_cache(32)
        with torch.inference_mode():
            model(prompt.cuda(), torch.arange(9, device="cuda"), ref_cache)
            model(prompt.cuda(), torch.arange(9, device="cuda"), cache)
            lane = GraphLane(model, cache, tokens)
            assert len(lane.segments) == 1, "the FFNs of a GPU backend must stay inside the step's graph"
            pos = 9
            for step in range(4):
                ids = torch.randint(2, 100, (tokens,), generator=torch.Generator().manual_seed(step))
                positions = torch.arange(pos, pos + tokens)
                got = run_lane(lane, gpu, ids, positions).clone()
                want = model(ids.cuda(), positions.cuda(), ref_cache)
                rel = ((got - want).abs().max() / want.abs().max()).item()
                assert rel < 1e-4, f"step {step}: one-graph decode vs eager rel err {rel:.1e}"
                pos += tokens
            lane.close()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
