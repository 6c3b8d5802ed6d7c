"""Linears over the same input as one matmul (attention's q/k/v projections): one
GEMM launch instead of three, the same products.

The modules keep their parameters and Hugging Face names, so checkpoints load as
they are. The stacked weight [sum of N_i, K] is made at the first call, on the device
and in the dtype the parameters have then, and the parameters are re-pointed at
their rows of it (the same Parameter objects: ties, fp8 sources and in-place writes
keep working), so it costs no memory. When a parameter is given new storage later
(model.to, place_on_device) the next call notices and stacks again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _storage_key(linears) -> tuple:
    return tuple((p.data_ptr(), p.device, p.dtype, tuple(p.shape))
                 for m in linears for p in (m.weight, m.bias) if p is not None)


def _plain(m: nn.Module) -> bool:
    """A plain nn.Linear, or a module whose output is one (a router's logits: MERGEABLE)."""
    return type(m) is nn.Linear or getattr(type(m), "MERGEABLE", False)


class MergedLinear:
    """merged(x, q_proj, k_proj, v_proj) -> (q_proj(x), k_proj(x), v_proj(x)) by one matmul.
    Linears other than plain nn.Linear (Fp8Linear, ...) are called one by one; a MERGEABLE
    module (a router) gives its linear part, F.linear(x, m.weight)."""

    def __init__(self):
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._sizes: list[int] = []

    def __call__(self, x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
        if not all(_plain(m) for m in linears) or len({m.bias is None for m in linears}) > 1:
            self._key = self._weight = self._bias = None   # e.g. swapped for Fp8Linear: keep no dense copy alive
            return tuple(F.linear(x, m.weight, m.bias) if _plain(m) else m(x) for m in linears)
        if _storage_key(linears) != self._key:
            self._stack(linears)
        return F.linear(x, self._weight, self._bias).split(self._sizes, dim=-1)

    def _stack(self, linears) -> None:
        # the stacked weight of the parameters' own kind (an inference tensor or not, whatever mode the call
        # runs in): a parameter's data can only be set to a tensor of its kind
        with torch.inference_mode(linears[0].weight.is_inference()), torch.no_grad():
            self._weight = torch.cat([m.weight for m in linears])
            self._bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
            self._sizes = [m.out_features for m in linears]
            at = 0
            for m, n in zip(linears, self._sizes):
                m.weight.data = self._weight[at:at + n]
                if self._bias is not None:
                    m.bias.data = self._bias[at:at + n]
                at += n
        self._key = _storage_key(linears)
