"""The fused decoder ops (engine.ops) compiled for the GPU (the CPU suite runs them under
the interpreter): each kernel against its torch reference on CUDA, at the CPU suite's
cases and at Qwen3-30B-A3B's shapes; tiny Qwen3-MoE and Llama models with the kernels
against the references on CUDA in bf16 and fp32; a tiny Qwen3-MoE captured as CUDA
graphs (GraphLane) with the kernels; the kernels one layer launches. Skipped without CUDA."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import ops
from engine.gpu.graphs import GraphLane
from engine.lanes import run_lane
from engine.layers import static_decode
from engine.loader import load_model
from tests.engine.test_ops_triton import (
    ATTENTION_CASES,
    DELTA_CASES,
    SLOT_ATTENTION_CASES,
    check_all_qk_norm_rope,
    check_decode_attention,
    check_slot_decode_attention,
    check_gated_delta,
    check_model_matches_reference,
    check_rms_norm,
    check_router,
)
from tests.gpu.test_cuda_path import _exact_fp32  # noqa: F401 (autouse fixture: TF32 off, fp32 means fp32)

log = logging.getLogger(__name__)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA device")

BF16_MODEL_RTOL = 2e-2      # bf16 logits, kernels vs references (6e-3 on the H200): ulp-level roundings, compounded
FP32_MODEL_RTOL = 1e-4      # fp32 logits (TF32 off)
GRAPH_RTOL = 1e-3           # graph replay vs the same ops run eagerly (bf16)
MAX_KERNELS_PER_LAYER = 10  # the GPU part of a Qwen3-MoE layer (86 launches with the references)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n", [(1, 64), (2, 200), (5, 17), (1, 2048), (64, 2048)])
def test_rms_norm_on_cuda(t, n, dtype):
    check_rms_norm(t, n, dtype, 10 * t + n, device="cuda")


def test_qk_norm_rope_on_cuda():
    check_all_qk_norm_rope(device="cuda")


@pytest.mark.parametrize("case", ATTENTION_CASES + [
    (1, 32, 4, 128, 2048, [1024], torch.bfloat16, None),             # Qwen3-30B-A3B decode
    (2, 32, 4, 128, 2048, [2046, 2047], torch.bfloat16, None),       # the MTP pair at the cache's end
    (64, 32, 4, 128, 4096, list(range(3000, 3064)), torch.bfloat16, None),
])
def test_decode_attention_on_cuda(case):
    check_decode_attention(*case, seed=7, device="cuda")


@pytest.mark.parametrize("case", SLOT_ATTENTION_CASES + [
    (32, 4, 128, 2048, list(range(50, 2048, 64))[:31] + [2047], list(range(32)), 33, torch.bfloat16),  # Qwen3 x 32
])
def test_slot_decode_attention_on_cuda(case):
    check_slot_decode_attention(*case, seed=7, device="cuda")


@pytest.mark.parametrize("case", DELTA_CASES + [
    (1, 16, 128, 32, 128, 4, torch.bfloat16),    # Qwen3.5-35B-A3B's DeltaNet, decode
    (2, 16, 128, 32, 128, 4, torch.bfloat16),    # the MTP pair
    (1, 16, 128, 32, 128, 4, torch.float32),
])
def test_gated_delta_on_cuda(case):
    check_gated_delta(*case, seed=5, device="cuda")


def test_zero_centered_rms_norm_on_cuda():
    check_rms_norm(2, 2048, torch.bfloat16, 3, device="cuda", zero_centered=True)


@pytest.mark.parametrize("t,e,k,normalize,dtype", [
    (1, 7, 3, True, torch.float32), (2, 128, 8, True, torch.bfloat16), (64, 128, 8, True, torch.bfloat16),
    (5, 60, 1, False, torch.bfloat16)])
def test_router_on_cuda(t, e, k, normalize, dtype):
    check_router(t, e, k, normalize, dtype, t * e + k, device="cuda")


@pytest.mark.parametrize("dtype,rtol", [("bfloat16", BF16_MODEL_RTOL), ("float32", FP32_MODEL_RTOL)])
@pytest.mark.parametrize("kind", ["qwen3_moe", "llama", "qwen3_5_moe"])
def test_model_with_kernels_matches_references_on_cuda(kind, dtype, rtol, tiny_family):
    log.info(check_model_matches_reference(str(tiny_family(kind)), device="cuda", dtype=dtype, rtol=rtol))


@torch.inference_mode()
def test_graph_capture_with_the_kernels(tiny_family, monkeypatch):
    """A tiny Qwen3-MoE in bf16 captured as CUDA graphs with the kernels inside: replays equal
    the same static forward run eagerly, and stay close to the references' forward."""
    lm = load_model(tiny_family("qwen3_moe"), device="cuda", dtype="bfloat16", backend="torch")
    model = lm.model
    assert ops.triton_runs_on(model.lm_head.weight)
    prompt = torch.randint(2, lm.config.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).cuda()
    caches = [model.make_cache(32) for _ in range(3)]
    for cache in caches:
        model(prompt, torch.arange(9, device="cuda"), cache)
    lane = GraphLane(model, caches[0], tokens=1)
    backend = model.ffn_backend()
    token, worst, worst_ref = prompt[-1:].cpu(), 0.0, 0.0
    try:
        for pos in range(9, 20):
            got = model.compute_logits(run_lane(lane, backend, token, torch.tensor([pos]))).float()
            ids, positions = token.cuda(), torch.tensor([pos], device="cuda")
            with static_decode():
                same_ops = model.compute_logits(model(ids, positions, caches[1])).float()
                monkeypatch.setenv(ops.TRITON_OPS_ENV, "0")
                ref = model.compute_logits(model(ids, positions, caches[2])).float()
                monkeypatch.delenv(ops.TRITON_OPS_ENV)
            worst = max(worst, ((got - same_ops).abs().max() / same_ops.abs().max()).item())
            worst_ref = max(worst_ref, ((got - ref).abs().max() / ref.abs().max()).item())
            token = same_ops[0].argmax().view(1).cpu()
    finally:
        lane.close()
    log.info("tiny qwen3_moe bf16, CUDA graphs with the Triton ops: vs eager %.1e, vs references %.1e",
             worst, worst_ref)
    assert worst <= GRAPH_RTOL, f"graph replay vs the eager forward: {worst:.2e}"
    assert worst_ref <= BF16_MODEL_RTOL, f"graph replay vs the references' forward: {worst_ref:.2e}"


def test_bench_counts_at_most_ten_kernels_per_layer(tmp_path):
    """bench/gpu_ops.py at Qwen3-30B-A3B's shapes (3 layers, few steps): the GPU part of a
    layer is at most MAX_KERNELS_PER_LAYER launches with the kernels."""
    out = tmp_path / "ops.json"
    run = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "bench" / "gpu_ops.py"), "--layers", "3",
                          "--tokens", "1", "--steps", "3", "--json", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"bench exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
    cases = {c["ops"]: c for c in json.loads(out.read_text())["cases"]}
    fused, ref = cases["triton"], cases["reference"]
    log.info("qwen3-30b-a3b layer, T=1: %d kernels with the Triton ops, %d with the references; graph %.4f ms vs "
             "%.4f ms per layer", fused["kernels_per_layer"], ref["kernels_per_layer"], fused["per_layer_graph_ms"],
             ref["per_layer_graph_ms"])
    assert fused["kernels_per_layer"] <= MAX_KERNELS_PER_LAYER, fused["kernels"]
