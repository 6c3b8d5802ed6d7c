"""Benchmark-only models at real shapes with random weights.

The shapes are those of the published configs (DeepSeek-V3.2, Qwen3-30B-A3B,
Qwen3.5-35B-A3B), at full widths; depth and expert count may be reduced to fit
the machine. Host weights (attention, norms, router, shared experts, embeddings)
are random tensors on the host device. Expert FFNs are never made on the host
for the fleet: each duck generates its fp9 slices itself from a seed
(FleetFfn.load_synthetic_layer). The baselines get random bf16 experts where
they run (GPU memory, or host RAM for the naive torch offload).

Nothing here is a real model: the outputs are noise, the timings are real.
"""
from __future__ import annotations

import copy
import logging
import math
import time

import torch

from engine.config import ModelConfig
from engine.ffn import ExpertWeights, FfnBackend, FfnLayer, TorchFfn
from engine.models import model_class

from duckd.plan.shapes import SHAPES

log = logging.getLogger(__name__)

NOTE = "synthetic: random weights at real shapes; expert FFNs generated in fp9 on the ducks (benchmark only)"


def synthetic_config(name: str, layers: int | None = None, experts: int | None = None,
                     dense_layers: int | None = None) -> ModelConfig:
    """The config of `name` with depth `layers`, `experts` routed experts and (DeepSeek)
    `dense_layers` leading dense layers; None keeps the published value."""
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}: expected one of {', '.join(SHAPES)}")
    d = copy.deepcopy(SHAPES[name])
    text = d.get("text_config", d)
    n = layers or text["num_hidden_layers"]
    if n <= 0:
        raise ValueError(f"layers must be positive, got {n}")
    text["num_hidden_layers"] = n
    if "full_attention_interval" in text:
        k = text.pop("full_attention_interval")
        text["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    key = "n_routed_experts" if "n_routed_experts" in text else "num_experts"
    if experts is not None:
        if experts < text["num_experts_per_tok"]:
            raise ValueError(f"experts={experts} is fewer than the {text['num_experts_per_tok']} each token uses")
        text[key] = experts
        if "n_group" in text and experts % text["n_group"]:
            raise ValueError(f"experts={experts} must be a multiple of n_group={text['n_group']}")
    if dense_layers is not None and "first_k_dense_replace" in text:
        text["first_k_dense_replace"] = min(dense_layers, n)
    return ModelConfig.from_dict(d, source=f"synthetic {name}")


def _fill_(t: torch.Tensor, name: str, gen: torch.Generator, zero_centered: bool) -> None:
    """Random values that keep activations finite through many layers: linear
    weights like nn.Linear's init, norms at their identity, biases small."""
    leaf = name.rsplit(".", 1)[-1]
    if t.ndim >= 2:
        if "embed" in name:
            t.uniform_(-1.0, 1.0, generator=gen)
        else:
            bound = 1.0 / math.sqrt(t.shape[-1] * (t.shape[1] if t.ndim == 3 else 1))
            t.uniform_(-bound, bound, generator=gen)
    elif "norm" in name and leaf == "weight":
        t.fill_(0.0 if zero_centered else 1.0)
    elif leaf == "A_log":
        t.uniform_(0.0, 2.7, generator=gen)        # decay rates exp(A) in [1, 15]
    else:
        t.uniform_(-0.01, 0.01, generator=gen)     # biases, dt_bias, e_score_correction_bias


def fp9_bytes(rows: int, cols: int) -> int:
    """Bytes of the blocks of an fp9 [rows, cols] tensor (144-byte blocks of 2 rows x 64 columns)."""
    return -(-rows // 2) * -(-cols // 64) * 144


def build_host_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """The model with every host tensor random and every expert FFN tensor left empty
    (an FFN backend supplies them). Returns the model, eval mode, no grad."""
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    for m in model.ffn_modules():
        for p in m.expert_parameters():
            p.data = torch.empty(0, dtype=p.dtype, device="meta")
    t0 = time.perf_counter()
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    total = 0
    with torch.no_grad():
        for mname, m in model.named_modules():
            zero_centered = type(m).__name__.startswith("ZeroCentered")
            for pname, p in m.named_parameters(recurse=False):
                if p.numel():
                    _fill_(p.data, f"{mname}.{pname}", gen, zero_centered)
                    total += p.numel()
    model.eval().requires_grad_(False)
    log.info("synthetic %s: %d layers, %.2f G host parameters made on %s in %.1f s", config.model_type,
             config.num_hidden_layers, total / 1e9, device, time.perf_counter() - t0)
    return model


def ffn_shapes(model) -> list[tuple[int, int, int, int]]:
    """(layer, experts, hidden, intermediate) of every FFN the backends run (the MTP layer's too)."""
    from engine.placement import model_ffn_shapes
    return [(s.layer, s.experts, s.hidden, s.intermediate) for s in model_ffn_shapes(model, main_only=False)]


def ffn_bytes_per_token(model, top_k: int) -> int:
    """fp9 bytes the ducks stream for one token of the main model: the dense FFNs whole,
    top_k experts per MoE layer."""
    total = 0
    main_layers = model.config.num_hidden_layers   # an MTP layer's FFN runs only when drafting
    for layer, n, h, i in ffn_shapes(model):
        if layer >= main_layers:
            continue
        one = fp9_bytes(2 * i, h) + fp9_bytes(h, i)
        total += one * (1 if n == 1 else top_k)
    return total


def install_synthetic_fleet(model, fleet_ffn, seed: int = 1) -> None:
    """Registers every FFN layer as duck-generated fp9 (a seed per layer) and routes the model to the fleet."""
    for layer, n, h, i in ffn_shapes(model):
        fleet_ffn.load_synthetic_layer(layer, n, h, i, seed * 100003 + layer)
    t0 = time.perf_counter()
    fleet_ffn.finish_loading()
    log.info("synthetic expert weights resident on the ducks in %.1f s", time.perf_counter() - t0)
    model.set_ffn(fleet_ffn)


class _RandomPool:
    """Random bf16 values to copy from: filling many GB by copy runs at memory speed,
    where a random generator on the CPU would take minutes."""

    def __init__(self, device, numel: int = 1 << 26, seed: int = 2):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.data = torch.empty(numel, dtype=torch.bfloat16, device=device).uniform_(-1, 1, generator=gen)
        self.at = 0

    def tensor(self, rows: int, cols: int, scale: float) -> torch.Tensor:
        out = torch.empty(rows * cols, dtype=torch.bfloat16, device=self.data.device)
        done = 0
        while done < out.numel():
            n = min(out.numel() - done, self.data.numel() - self.at)
            out[done:done + n].copy_(self.data[self.at:self.at + n])
            done += n
            self.at = (self.at + n) % (self.data.numel() - 4093)   # shift the phase between tensors
        return out.view(rows, cols).mul_(scale)


def install_random_torch_experts(model, device: torch.device | str, on_progress=None) -> FfnBackend:
    """Random bf16 expert weights on `device`: on a GPU stacked for the grouped GEMV
    (engine.gpu.moe, inside the CUDA graphs: the upper bound); in host RAM run by plain
    torch (TorchFfn: the naive CPU offload)."""
    device = torch.device(device)
    pool = _RandomPool(device)
    shapes = ffn_shapes(model)
    if device.type == "cuda":
        from engine.gpu.moe import GpuExpertsFfn
        backend = GpuExpertsFfn()
        for done, (layer, n, h, i) in enumerate(shapes, 1):
            backend.add_stacked(layer, pool.tensor(n * 2 * i, h, h ** -0.5).view(n, 2 * i, h),
                                pool.tensor(n * h, i, i ** -0.5).view(n, h, i))
            if on_progress:
                on_progress(done, len(shapes))
    else:
        backend = TorchFfn(device=device)
        for done, (layer, n, h, i) in enumerate(shapes, 1):
            experts = [ExpertWeights(pool.tensor(i, h, h ** -0.5), pool.tensor(i, h, h ** -0.5),
                                     pool.tensor(h, i, i ** -0.5)) for _ in range(n)]
            backend.load_layer(FfnLayer(layer, experts, h))
            if on_progress:
                on_progress(done, len(shapes))
    return model.set_ffn(backend)
