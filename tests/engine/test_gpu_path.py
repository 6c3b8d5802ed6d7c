"""The CUDA host path's parts that run without a GPU (tests/gpu/test_cuda_path.py runs
the rest on one): static decode (attention over the whole static cache under a mask)
gives the logits of today's decode for every family, at steps of 1 and 2 tokens and
up to the cache's last slot, without a host sync; the device choice and its
switches; placing a model on another device; which backends take host io."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.ffn import TorchFfn
from engine.gpu.device import (
    GpuUnavailable,
    gpu_switch,
    host_device,
    place_on_device,
    resolve_device,
)
from bench.gpu_stage import stage_times
from engine.gpu.graphs import (
    GraphLane,
    make_lane,
    reset_sequence_state,
    set_linear_progress,
)
from engine.gpu.moe import GpuExpertsFfn
from engine.host_ffn import Fp9Ffn
from engine.lanes import EagerLane, calls_to
from engine.layers import static_decode
from engine.loader import load_model

STATIC_VS_EAGER_RTOL = 1e-5   # max |static - eager| / max |eager|, fp32 logits: same math, sums over more (zero) terms
FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_plain", "deepseek_v32", "qwen3_5",
            "qwen3_5_moe"]
PROMPT, CACHE = 7, 16
STEP_SIZES = (1, 2, 1, 2, 2, 1)       # positions 7 .. 15: ends on the last slot of the cache
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def family(tiny_family):
    """kind -> folder of a tiny random checkpoint of that family."""
    return tiny_family


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _tokens(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


class _ZeroFfn:
    """FFN calls answered with zeros: keeps the backend (host code by design) out of what is checked."""

    def _ffn_call(self, req):
        return torch.zeros_like(req.x)


class _HostSyncs(TorchDispatchMode):
    """Records the ops that need the host to wait for the device, or give data-dependent shapes."""
    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
               "repeat_interleave.Tensor", "item"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        base = name.split(".")[0]
        if base in self.SYNCING or name in self.SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", FAMILIES)
@torch.inference_mode()
def test_static_decode_gives_the_eager_logits(kind, family, report):
    lm = load_model(family(kind), device="cpu")
    model, vocab = lm.model, lm.config.vocab_size
    prompt = _tokens(vocab, PROMPT, seed=1)
    eager_cache, static_cache = model.make_cache(CACHE), model.make_cache(CACHE)
    for cache in (eager_cache, static_cache):
        model(prompt, torch.arange(PROMPT), cache)
    tokens = _tokens(vocab, sum(STEP_SIZES), seed=2)
    pos, worst = PROMPT, 0.0
    for t in STEP_SIZES:
        ids, positions = tokens[pos - PROMPT:pos - PROMPT + t], torch.arange(pos, pos + t)
        ref = model.compute_logits(model(ids, positions, eager_cache))
        set_linear_progress(static_cache, pos, pos + t, "test")   # the host bookkeeping static decode leaves out
        with static_decode():
            got = model.compute_logits(model(ids, positions, static_cache))
        worst = max(worst, _rel(got, ref))
        pos += t
    assert pos == CACHE
    report(f"tiny {kind}: static decode vs eager logits rel err {worst:.1e} (steps {STEP_SIZES}, cache {CACHE})")
    assert worst <= STATIC_VS_EAGER_RTOL, f"{kind}: static decode differs by {worst:.2e}"


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v3", "deepseek_v32", "qwen3_5_moe"])
@pytest.mark.parametrize("t", [1, 2])
@torch.inference_mode()
def test_static_decode_never_waits_for_the_device(kind, t, family):
    """What CUDA-graph capture forbids: reading a device value on the host (int(), .item(),
    .tolist()) or an op whose output shape depends on data. The FFN calls are cut out,
    as the capture cuts them."""
    model = load_model(family(kind), device="cpu").model
    cache = model.make_cache(CACHE)
    ids, positions = _tokens(model.config.vocab_size, t, seed=3), torch.arange(5, 5 + t)
    syncs = _HostSyncs()
    with calls_to(_ZeroFfn()), static_decode(), syncs:
        model(ids, positions, cache)
    assert syncs.seen == [], f"{kind}: static decode synchronizes with the device: {syncs.seen}"
    eager = _HostSyncs()
    with calls_to(_ZeroFfn()), eager:
        model(ids, torch.arange(0, t), model.make_cache(CACHE))
    assert eager.seen, "the detector saw no sync in the eager path, which has them"


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v32", "qwen3_5_moe"])
@torch.inference_mode()
def test_static_decode_runs_on_the_device_alone(kind, family):
    """The model and its cache moved to the meta device (shapes, no data): a static step
    runs through, so it makes no host tensor and reads no device value (the meta device
    has none to read); the eager step, which does, cannot."""
    model = load_model(family(kind), device="cpu").model
    place_on_device(model, "meta")
    cache = model.make_cache(CACHE)
    for t in (1, 2):
        ids = torch.zeros(t, dtype=torch.int64, device="meta")
        with calls_to(_ZeroFfn()), static_decode():
            hidden = model(ids, torch.arange(t, device="meta"), cache)
        assert hidden.device.type == "meta" and hidden.shape == (t, model.config.hidden_size)
    with calls_to(_ZeroFfn()), pytest.raises((RuntimeError, NotImplementedError)):
        model(ids, torch.arange(t, device="meta"), cache)


@torch.inference_mode()
def test_a_reused_hybrid_cache_starts_over(family):
    model = load_model(family("qwen3_5_moe"), device="cpu").model
    prompt = _tokens(model.config.vocab_size, PROMPT, seed=4)
    fresh = model.compute_logits(model(prompt, torch.arange(PROMPT), model.make_cache(CACHE)))
    cache = model.make_cache(CACHE)
    model(_tokens(model.config.vocab_size, 5, seed=5), torch.arange(5), cache)
    with pytest.raises(ValueError, match="cannot rewind"):
        set_linear_progress(cache, 0, PROMPT, "test")
    reset_sequence_state(cache)
    again = model.compute_logits(model(prompt, torch.arange(PROMPT), cache))
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)


# -- the device choice ----------------------------------------------------------------------
def test_device_switches(monkeypatch):
    monkeypatch.delenv("DUCK_GPU", raising=False)
    assert host_device("off") == torch.device("cpu") and host_device(False) == torch.device("cpu")
    assert gpu_switch("auto") == "auto" and gpu_switch(None) == "auto" and gpu_switch(True) == "on"
    monkeypatch.setenv("DUCK_GPU", "0")
    assert gpu_switch("auto") == "off" and host_device() == torch.device("cpu")
    assert gpu_switch("on") == "on", "an explicit gpu='on' wins over the environment"
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv("DUCK_GPU", "maybe")
    with pytest.raises(ValueError, match="DUCK_GPU='maybe'"):
        host_device()
    with pytest.raises(ValueError, match="gpu='sometimes'"):
        host_device("sometimes")


@pytest.mark.skipif(not NO_CUDA, reason="checks the errors of a host without CUDA")
def test_asking_for_the_gpu_without_cuda_is_an_error(monkeypatch, tiny_checkpoint):
    monkeypatch.delenv("DUCK_GPU", raising=False)
    assert host_device() == torch.device("cpu")   # auto: the CPU, quietly
    with pytest.raises(GpuUnavailable, match=r"gpu='on'.*CUDA|gpu='on'.*GPU"):
        host_device("on")
    monkeypatch.setenv("DUCK_GPU", "1")
    with pytest.raises(GpuUnavailable, match="DUCK_GPU='1'"):
        host_device()
    with pytest.raises(GpuUnavailable, match="device='cuda'"):
        resolve_device("cuda")
    monkeypatch.delenv("DUCK_GPU")
    with pytest.raises(GpuUnavailable, match="gpu='on'"):
        load_model(tiny_checkpoint("llama")[0], gpu="on")
    lm = load_model(tiny_checkpoint("llama")[0], gpu="off")
    assert lm.model.lm_head.weight.device.type == "cpu"


@pytest.mark.skipif(NO_CUDA, reason="checks the choice of a host with CUDA")
def test_auto_picks_cuda_and_can_be_switched_off(monkeypatch):
    monkeypatch.delenv("DUCK_GPU", raising=False)
    assert host_device().type == "cuda" and host_device("off").type == "cpu"
    monkeypatch.setenv("DUCK_GPU", "0")
    assert host_device().type == "cpu" and host_device("on").type == "cuda"


def test_place_on_device_moves_all_but_the_experts(family):
    """To the meta device (a real move that needs no GPU): parameters, rotary tables
    and ties follow; with keep_experts the expert tensors stay with the backend."""
    for kind in ("qwen3_moe", "deepseek_v3"):
        model = load_model(family(kind), device="cpu", backend=TorchFfn(device="cpu")).model
        experts = {id(p) for m in model.ffn_modules() for p in m.expert_parameters()}
        place_on_device(model, "meta", keep_experts=True)
        for name, p in model.named_parameters():
            assert p.device.type == ("cpu" if id(p) in experts else "meta"), name
        tables = [m.rotary_emb.inv_freq for m in model.modules() if hasattr(m, "rotary_emb")]
        tables += [m.rotary.inv_freq for m in model.modules() if hasattr(m, "rotary")]
        assert tables and all(t.device.type == "meta" for t in tables)
        assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings


# -- which backends take host io, and the lanes, CPU side --------------------------------------
def test_which_backends_run_on_the_host():
    """host_io: a GPU model hands these pinned host copies (engine.host_ffn); the grouped
    GPU backend stays inside the CUDA graph instead."""
    assert TorchFfn(device="cpu").host_io and not TorchFfn().host_io
    assert Fp9Ffn(threads=1).host_io and not Fp9Ffn(threads=1).captures_in_graph
    assert GpuExpertsFfn().captures_in_graph and not GpuExpertsFfn().host_io


def test_graph_parts_refuse_a_cpu_model(tiny_checkpoint):
    lm = load_model(tiny_checkpoint("llama")[0], device="cpu")
    cache = lm.model.make_cache(8)
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        GraphLane(lm.model, cache)
    with pytest.raises(ValueError, match="measures CUDA work"):
        stage_times(lm.model)
    lane = make_lane(lm.model, cache)
    try:
        assert isinstance(lane, EagerLane)
    finally:
        lane.close()
