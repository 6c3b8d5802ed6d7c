"""Every FFN on the GPU: the benchmarks' upper bound ("the same model with every
FFN on the GPU"). Each layer's experts are stacked, gate and up interleaved in
one [E, 2I, H] tensor and down in [E, H, I], in bf16. A decode step runs a
grouped GEMV in Triton: one program per (token, expert slot) and output tile
reads the chosen expert's rows where they lie, its id read on the device. No
gather copy and no host sync, so the whole FFN is captured inside the step's
CUDA graph (GraphLane runs a backend with captures_in_graph inline).

    h[j] = W_gate_up[ids[j]] @ x[j // k]        j over T*k (token, slot) pairs
    a[j] = silu(h[j][:I]) * h[j][I:]
    y[t] = sum_s w[t, s] * (W_down[ids[t*k + s]] @ a[t*k + s])

Larger steps (prefill) run the torch reference (engine.ffn.torch_experts_forward).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.ffn import ExpertWeights, FfnBackend, FfnLayer, torch_experts_forward

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the reference runs
    triton = None

log = logging.getLogger(__name__)

MAX_PAIRS = 64            # (token, slot) pairs up to which the grouped GEMV runs
BLOCK_N, BLOCK_K = 32, 128


if triton is not None:
    @triton.jit
    def _grouped_gemv_kernel(x_ptr, ids_ptr, w_ptr, out_ptr, N, K, x_div, stride_e, stride_n,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[j, n] = sum_k W[ids[j], n, k] * x[j // x_div, k] (fp32 accumulate, fp32 out);
        a pair whose id is negative reads nothing and gives zeros."""
        j = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(ids_ptr + j).to(tl.int64)
        held = e >= 0
        e = tl.maximum(e, 0)
        row = j // x_div
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        w_rows = w_ptr + e * stride_e + offs_n.to(tl.int64)[:, None] * stride_n
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + row * K + offs_k, mask=(offs_k < K) & held, other=0.0).to(tl.float32)
            w = tl.load(w_rows + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K) & held,
                        other=0.0)
            acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        tl.store(out_ptr + j * N + offs_n, acc, mask=offs_n < N)


def grouped_gemv(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, x_div: int) -> torch.Tensor:
    """x [R, K], ids [J] (expert of each pair j; negative: none, zeros), w [E, N, K] -> [J, N] fp32,
    row j from x[j // x_div]."""
    if triton is None:
        raise RuntimeError("grouped_gemv needs triton (torch's CUDA wheels bring it)")
    j, (n, k) = ids.numel(), w.shape[1:]
    if x.shape[1] != k or w.stride(2) != 1 or x.shape[0] * x_div < j:
        raise ValueError(f"grouped_gemv: x {tuple(x.shape)}, ids {j}, w {tuple(w.shape)} (x_div {x_div}) do not agree")
    out = torch.empty((j, n), dtype=torch.float32, device=x.device)
    grid = (j, triton.cdiv(n, BLOCK_N))
    _grouped_gemv_kernel[grid](x.contiguous(), ids.reshape(-1).contiguous(), w, out, n, k, x_div,
                               w.stride(0), w.stride(1), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def grouped_experts_forward(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                            weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], ids / weights [T, k] with experts stacked as gate_up [E, 2I, H] (gate row i
    at 2i, up at 2i + 1) and down [E, H, I] -> [T, H] in x's dtype."""
    t, k = ids.shape
    h = grouped_gemv(x, ids, gate_up, k)                                  # [T*k, 2I] fp32
    a = (F.silu(h[:, 0::2]) * h[:, 1::2]).to(x.dtype)                     # [T*k, I]
    y = grouped_gemv(a, ids, down, 1)                                     # [T*k, H] fp32
    return (y.view(t, k, -1) * weights.float()[:, :, None]).sum(1).to(x.dtype)


def stack_experts(experts: list[ExpertWeights]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked layout of grouped_experts_forward: gate_up [E, 2I, H] interleaved, down [E, H, I]."""
    gate = torch.stack([e.gate for e in experts])                         # [E, I, H]
    up = torch.stack([e.up for e in experts])                             # [E, I, H]
    gate_up = torch.stack((gate, up), 2).flatten(1, 2)                    # [E, 2I, H]
    return gate_up.contiguous(), torch.stack([e.down for e in experts]).contiguous()


class GpuExpertsFfn(FfnBackend):
    """Every FFN layer's experts stacked on the model's GPU; small steps through the
    grouped GEMV (captured inside CUDA graphs), larger ones through the torch reference."""
    name = "gpu-experts"
    captures_in_graph = True

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.experts: dict[int, list[ExpertWeights]] = {}

    def load_layer(self, layer: FfnLayer) -> None:
        self.add_stacked(layer.index, *stack_experts(layer.experts))

    def add_stacked(self, index: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """A layer already stacked (gate_up [E, 2I, H] interleaved, down [E, H, I])."""
        e, i2, h = gate_up.shape
        if down.shape != (e, h, i2 // 2) or i2 % 2:
            raise ValueError(f"FFN layer {index}: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} "
                             f"do not stack as [E, 2I, H] and [E, H, I]")
        self.layers[index] = (gate_up, down)
        self.experts[index] = [ExpertWeights(gate_up[x, 0::2], gate_up[x, 1::2], down[x]) for x in range(e)]

    def forward(self, layer, x, ids, weights, out=None):
        gate_up, down = self.layers[layer]
        if x.device.type == "cuda" and ids.numel() <= MAX_PAIRS and triton is not None:
            y = grouped_experts_forward(gate_up, down, x, ids.to(torch.int32), weights)
        else:
            y = torch_experts_forward(self.experts[layer], x, ids, weights)
        return y if out is None else out.copy_(y)
