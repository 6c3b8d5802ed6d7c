"""The CUDA host path (engine.gpu) on a GPU: decode steps replayed from CUDA graphs
against the eager forward, generate() on CUDA against the CPU, the dual lane with
graph lanes against the 2-token forward, a host backend called with CUDA tensors,
the decoder's cache reuse and the per-layer stage timing. Skipped without CUDA.

The FFNs run on the host (TorchFfn on the CPU, and the fp9 kernels through the FFN
host contract: pinned copies made inside the graphs) unless a test says otherwise;
TF32 is off so that fp32 means fp32."""
from __future__ import annotations

import pytest
import torch

from engine.ffn import TorchFfn
from engine.generate import generate
from engine.gpu.decode import cuda_decoder, release_cuda_decoder
from engine.tokens import SamplingParams
from bench.gpu_stage import stage_times
from engine.gpu.graphs import GraphLane
from engine.lanes import FfnWorker, run_lane, run_two_lanes
from engine.layers import static_decode
from engine.loader import load_model
from engine.mtp import generate_mtp
from tests.engine.conftest import TINY
from tests.engine.test_deepseek_mtp import mtp_checkpoint  # noqa: F401 (fixture: tiny DeepSeek-V3 + nextn layer)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA host path needs a CUDA device")

KINDS = ["llama", "qwen3_moe", "deepseek_v3_mtp", "qwen3_5_moe"]
STEPS = 16
PROMPT = 9
FP32_VS_EAGER_RTOL = 1e-4     # graphs (static attention) vs today's eager decode, fp32 logits
BF16_VS_STATIC_RTOL = 1e-3    # graphs vs the same static-attention forward run eagerly, bf16 logits
GREEDY_TOKENS = 16


@pytest.fixture(autouse=True)
def _exact_fp32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(scope="module")
def checkpoint(tiny_family, mtp_checkpoint):  # noqa: F811 (the imported fixture)
    """kind -> folder of a tiny random checkpoint ("deepseek_v3_mtp": with a nextn layer)."""
    return lambda kind: mtp_checkpoint if kind == "deepseek_v3_mtp" else tiny_family(kind)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(folder, dtype="float32", backend=None):
    lm = load_model(folder, device="cuda", dtype=dtype, backend=backend or TorchFfn(device="cpu"))
    assert lm.model.lm_head.weight.is_cuda
    return lm


@torch.inference_mode()
def _prefilled(model, prompt: list[int], length: int, copies: int):
    caches = [model.make_cache(length) for _ in range(copies)]
    for cache in caches:
        model(torch.tensor(prompt, device="cuda"), torch.arange(len(prompt), device="cuda"), cache)
    return caches


@torch.inference_mode()
def _graphs_against_eager(lm, steps: int, static_reference: bool) -> float:
    """Worst relative logit error of `steps` 1-token steps replayed from graphs against the
    eager forward (with static attention when static_reference), teacher-forced on the reference."""
    model = lm.model
    prompt = _tokens(lm.config.vocab_size, PROMPT, seed=1)
    graph_cache, ref_cache = _prefilled(model, prompt, PROMPT + steps + 3, 2)
    lane = GraphLane(model, graph_cache, tokens=1)
    backend = model.ffn_backend()
    assert lane.host_io == backend.host_io and (lane.io is None or lane.io.x.is_pinned())
    token, worst = prompt[-1], 0.0
    try:
        for i in range(steps):
            pos = PROMPT + i
            got = model.compute_logits(run_lane(lane, backend, torch.tensor([token]), torch.tensor([pos])))
            ids, positions = torch.tensor([token], device="cuda"), torch.tensor([pos], device="cuda")
            if static_reference:
                with static_decode():
                    ref = model.compute_logits(model(ids, positions, ref_cache))
            else:
                ref = model.compute_logits(model(ids, positions, ref_cache))
            worst = max(worst, _rel(got, ref))
            token = int(ref[0].argmax())
    finally:
        lane.close()
    return worst


@pytest.mark.parametrize("kind", KINDS)
def test_graph_replay_equals_eager_fp32(kind, checkpoint):
    lm = _load(checkpoint(kind))
    worst = _graphs_against_eager(lm, STEPS, static_reference=False)
    assert worst <= FP32_VS_EAGER_RTOL, f"{kind}: graph replay differs from eager decode by {worst:.2e} (fp32)"


@pytest.mark.parametrize("kind", KINDS)
def test_graph_replay_equals_eager_bf16(kind, checkpoint):
    lm = _load(checkpoint(kind), dtype="bfloat16")
    worst = _graphs_against_eager(lm, STEPS, static_reference=True)
    assert worst <= BF16_VS_STATIC_RTOL, f"{kind}: graph replay differs from the eager static forward by {worst:.2e}"


def test_graph_replay_with_the_fp9_backend(checkpoint):
    lm = _load(checkpoint("qwen3_moe"), backend="fp9")
    worst = _graphs_against_eager(lm, STEPS, static_reference=False)
    assert lm.ffn.bytes_streamed > 0
    assert worst <= FP32_VS_EAGER_RTOL, f"fp9 backend: graph replay differs from eager decode by {worst:.2e}"


@pytest.mark.parametrize("ffn", ["torch-gpu", "torch-cpu"])
@pytest.mark.parametrize("kind", ["deepseek_v3_mtp", "qwen3_5_moe"])
@torch.inference_mode()
def test_pair_graph_equals_two_token_forward(kind, ffn, checkpoint):
    """The MTP pair's step (T=2) replayed from graphs; the FFN requests as the static device
    tensors (TorchFfn on the GPU) or as pinned host copies (TorchFfn on the CPU)."""
    lm = _load(checkpoint(kind), backend="torch" if ffn == "torch-gpu" else None)
    model = lm.model
    prompt = _tokens(lm.config.vocab_size, PROMPT, seed=2)
    graph_cache, ref_cache = _prefilled(model, prompt, PROMPT + 2 * 6, 2)
    lane = GraphLane(model, graph_cache, tokens=2)
    assert lane.host_io == (ffn == "torch-cpu")
    backend = model.ffn_backend()
    pairs = torch.tensor(_tokens(lm.config.vocab_size, 12, seed=3)).view(6, 2)
    try:
        for i, pair in enumerate(pairs):
            positions = torch.arange(PROMPT + 2 * i, PROMPT + 2 * i + 2)
            got = run_lane(lane, backend, pair, positions)
            ref = model(pair.cuda(), positions.cuda(), ref_cache)
            assert _rel(got, ref) <= FP32_VS_EAGER_RTOL, f"{kind}: pair step {i}"
    finally:
        lane.close()


@pytest.mark.parametrize("kind", KINDS)
@torch.inference_mode()
def test_dual_lane_with_graph_lanes_equals_two_token_forward(kind, checkpoint):
    lm = _load(checkpoint(kind))
    model = lm.model
    prompt = _tokens(lm.config.vocab_size, PROMPT, seed=4)
    cache, ref_cache = _prefilled(model, prompt, PROMPT + 2 * 4, 2)
    lane_a, lane_b = GraphLane(model, cache, 1, name="a"), GraphLane(model, cache, 1, name="b")
    assert lane_a.stream != lane_b.stream and lane_a.pool != lane_b.pool
    worker = FfnWorker(model.ffn_backend())
    pairs = torch.tensor(_tokens(lm.config.vocab_size, 8, seed=5)).view(4, 2)
    try:
        for i, pair in enumerate(pairs):
            positions = torch.arange(PROMPT + 2 * i, PROMPT + 2 * i + 2)
            got = run_two_lanes(lane_a, lane_b, worker, pair, positions)
            ref = model(pair.cuda(), positions.cuda(), ref_cache)
            rel = _rel(got, ref)
            assert rel <= FP32_VS_EAGER_RTOL, f"{kind}: dual lane step {i} differs by {rel:.2e}"
    finally:
        for part in (lane_a, lane_b, worker):
            part.close()


@pytest.mark.parametrize("ffn", ["torch-gpu", "torch-cpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_generate_on_cuda_matches_the_cpu(kind, ffn, checkpoint, monkeypatch):
    folder = checkpoint(kind)
    cpu = load_model(folder, device="cpu")
    gpu = _load(folder, backend="torch" if ffn == "torch-gpu" else None)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    try:
        for seed in (6, 7):   # the second request reuses the first one's cache and graphs
            prompt = _tokens(cpu.config.vocab_size, PROMPT, seed=seed)
            want = generate(cpu.model, cpu.tokenizer, prompt, params).token_ids
            assert generate(gpu.model, gpu.tokenizer, prompt, params).token_ids == want, f"seed {seed}"
        decoder = gpu.model._cuda_decoder
        assert list(decoder.lanes) == [(1, "main")]
        monkeypatch.setenv("DUCK_CUDA_GRAPHS", "0")   # eager on CUDA: the backend gets CUDA tensors
        assert generate(gpu.model, gpu.tokenizer, prompt, params).token_ids == want
    finally:
        release_cuda_decoder(gpu.model)


def test_mtp_on_cuda_matches_the_cpu(checkpoint):
    folder = checkpoint("deepseek_v3_mtp")
    cpu, gpu = load_model(folder, device="cpu"), _load(folder)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    prompt = _tokens(cpu.config.vocab_size, 7, seed=8)
    want = generate(cpu.model, cpu.tokenizer, prompt, params).token_ids
    assert generate_mtp(gpu.model, gpu.tokenizer, prompt, params).token_ids == want
    release_cuda_decoder(gpu.model)


def test_decoder_reuses_its_cache_and_drops_its_graphs_when_it_grows(checkpoint):
    lm = _load(checkpoint("llama"))
    decoder = cuda_decoder(lm.model, 40)
    try:
        first = decoder.cache
        assert first.max_model_len == 256 and decoder.lane(1) is decoder.lane(1)
        assert decoder.begin(100) is first                              # fits: reused, graphs kept
        assert decoder.lanes and cuda_decoder(lm.model, 40) is None    # one request at a time
        grown = decoder.begin(300)
        assert grown is not first and grown.max_model_len == 300 and not decoder.lanes
    finally:
        decoder.release()
        release_cuda_decoder(lm.model)


@torch.inference_mode()
def test_host_backend_called_with_cuda_tensors_matches_host_tensors(checkpoint):
    """engine.host_ffn stages a call with CUDA tensors through the thread's pinned buffers."""
    lm = _load(checkpoint("qwen3_moe"), backend="fp9")
    layer = lm.model.ffn_modules()[0].layer_idx
    hidden, k = lm.config.hidden_size, lm.config.num_experts_per_tok
    for t in (1, 2, 5, 1):   # the staging grows and is reused
        x = torch.randn(t, hidden, device="cuda")
        ids = torch.randint(0, lm.config.num_experts, (t, k), device="cuda")
        w = torch.rand(t, k, device="cuda")
        if layer in TINY["qwen3_moe"]["mlp_only_layers"]:
            ids, w = ids[:, :1] * 0, w[:, :1]
        y = lm.ffn.forward(layer, x, ids, w)
        assert y.is_cuda and y.dtype == x.dtype
        torch.testing.assert_close(y.cpu(), lm.ffn.forward(layer, x.cpu(), ids.cpu(), w.cpu()))


def test_stage_times_eager_and_graphs(checkpoint):
    lm = _load(checkpoint("qwen3_moe"))
    out = stage_times(lm.model, steps=5, max_model_len=64)
    calls = len(lm.model.ffn_modules())
    assert len(out["segments"]) == calls + 1 and out["segments"][-1]["ends_at_layer"] is None
    assert [s["ends_at_layer"] for s in out["segments"][:-1]] == sorted(m.layer_idx for m in lm.model.ffn_modules())
    assert out["graph_step_ms"] > 0 and out["eager_step_ms"] > 0 and out["speedup"] > 0
    print(f"tiny qwen3_moe stage times: eager {out['per_layer_eager_ms']:.3f} ms/layer, "
          f"graphs {out['per_layer_graph_ms']:.3f} ms/layer (x{out['speedup']:.1f})")


def test_the_automatic_choice_is_cuda(checkpoint, monkeypatch):
    monkeypatch.delenv("DUCK_GPU", raising=False)
    lm = load_model(checkpoint("llama"))
    assert lm.model.lm_head.weight.is_cuda
    monkeypatch.setenv("DUCK_GPU", "0")
    assert not load_model(checkpoint("llama")).model.lm_head.weight.is_cuda


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3_mtp"])
def test_step_driven_from_c_equals_the_python_driver(kind, checkpoint):
    """The fleet's decode step as one C call (graph, forward, graph, ...: native/transport/step.c)
    gives the same bits as run_lane driving the same graphs from Python, step after step."""
    from engine.fleet_ffn import FleetFfn

    lm = _load(checkpoint(kind), dtype="bfloat16", backend=FleetFfn(local_ducks=2))
    model, backend = lm.model, lm.model.ffn_backend()
    prompt = _tokens(lm.config.vocab_size, PROMPT, seed=3)
    cache_c, cache_py = _prefilled(model, prompt, PROMPT + STEPS + 3, 2)
    lane_c = GraphLane(model, cache_c, tokens=1, name="c")
    lane_py = GraphLane(model, cache_py, tokens=1, name="py", drive_from_c=False)
    token = prompt[-1]
    try:
        for i in range(STEPS):
            ids, positions = torch.tensor([token]), torch.tensor([PROMPT + i])
            got = run_lane(lane_c, backend, ids, positions).clone()
            want = run_lane(lane_py, backend, ids, positions)
            assert lane_c.driven_from_c and not lane_py.driven_from_c
            assert torch.equal(got, want), f"step {i}"
            token = int(model.compute_logits(want)[0].argmax())
    finally:
        lane_c.close()
        lane_py.close()
        backend.close()
