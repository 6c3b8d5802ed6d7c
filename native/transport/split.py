"""The tensor-parallel split: the transport's contract with the engine. Every
expert (or dense MLP) is cut into tp slices of S intermediate units, one per duck;
synth_experts gives the same slices for benchmark models the ducks generate."""
from __future__ import annotations

import hashlib

import numpy as np

from native.fp9 import Fp9Error, Fp9Tensor, SynthTensor, _to_numpy, pack_gate_up
from native.kernels import ExpertSlice


def slice_width(intermediate: int, tp: int, multiple_of: int = 64) -> int:
    """S, the intermediate units per duck: ceil(I / (tp * multiple_of)) * multiple_of."""
    if intermediate <= 0 or tp <= 0 or multiple_of <= 0 or multiple_of % 2:
        raise ValueError(f"intermediate {intermediate}, tp {tp} and an even multiple_of {multiple_of} must be > 0")
    return -(-intermediate // (tp * multiple_of)) * multiple_of


def split_expert(gate, up, down, tp: int, multiple_of: int = 64, name: str = "expert") -> list[ExpertSlice]:
    """Splits one expert (or a dense MLP) into tp tensor-parallel fp9 slices.

    gate, up: [I, H]; down: [H, I] (torch or numpy; fp32, fp16 or bf16; for fp8
    checkpoints dequantize to fp32 first, which is exact for power-of-two
    block scales). With S = slice_width(I, tp, multiple_of), duck d gets the
    intermediate units [d*S, (d+1)*S), zero-padded past I:
      gate_up [2S, H], rows interleaved gate_0, up_0, gate_1, up_1, ...
      down    [H, S]
    so that sum over d of MoeSlice(duck d).forward(x) = down(silu(gate x) * up x)
    up to fp9 rounding of the weights and fp32 summation order.
    """
    g, u, dn = (_to_numpy(t) for t in (gate, up, down))
    if g.ndim != 2 or g.shape != u.shape or dn.shape != (g.shape[1], g.shape[0]):
        raise Fp9Error(f"{name}: gate {g.shape}, up {u.shape}, down {dn.shape} are not [I, H], [I, H], [H, I]")
    inter, hidden = g.shape
    s = slice_width(inter, tp, multiple_of)
    pad = tp * s - inter
    if pad:
        g = np.concatenate([g, np.zeros((pad, hidden), g.dtype)])
        u = np.concatenate([u, np.zeros((pad, hidden), u.dtype)])
        dn = np.concatenate([dn, np.zeros((hidden, pad), dn.dtype)], axis=1)
    out = []
    for d in range(tp):
        rows = slice(d * s, (d + 1) * s)
        gu = pack_gate_up(g[rows], u[rows], f"{name}.gate_up")
        out.append(ExpertSlice(Fp9Tensor.from_float(gu, f"{name}.gate_up[{d}/{tp}]"),
                               Fp9Tensor.from_float(np.ascontiguousarray(dn[:, rows]), f"{name}.down[{d}/{tp}]")))
    return out


def split_experts(experts, tp: int, multiple_of: int = 64, name: str = "layer") -> list[list[ExpertSlice]]:
    """A layer's experts [(gate, up, down), ...] -> per duck, its slice of every expert:
    result[d][e] for duck d and expert e (expert ids on the wire index this list)."""
    per_expert = [split_expert(g, u, dn, tp, multiple_of, f"{name}.expert{e}") for e, (g, u, dn) in enumerate(experts)]
    return [[per_expert[e][d] for e in range(len(per_expert))] for d in range(tp)]


def synth_seed(*parts: int) -> int:
    """A 64-bit seed made from integers (BLAKE2b of them): related tensors get unrelated weights."""
    data = b"".join((int(p) % 2**64).to_bytes(8, "little") for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def synth_experts(n_experts: int, hidden: int, intermediate: int, tp: int, multiple_of: int = 64, seed: int = 0,
                  name: str = "layer") -> list[list[ExpertSlice]]:
    """Benchmarks only: split_experts' result for a layer of random experts that
    nobody has to hold: result[d][e] is duck d's slice of expert e, gate_up
    [2S, H] and down [H, S] with S = slice_width(intermediate, tp, multiple_of),
    zero past the intermediate size exactly like split_experts' padding, made of
    SynthTensors that Fleet.upload asks the ducks to generate (wire SYNTH).
    materialize() gives the same bytes here for a local reference."""
    if n_experts < 0 or hidden <= 0:
        raise ValueError(f"{name}: {n_experts} experts of hidden size {hidden}; need >= 0 experts and hidden > 0")
    s = slice_width(intermediate, tp, multiple_of)
    out: list[list[ExpertSlice]] = [[] for _ in range(tp)]
    for e in range(n_experts):
        for d in range(tp):
            live = min(max(intermediate - d * s, 0), s)     # units of this slice that are not padding
            gate_up = SynthTensor(2 * s, hidden, synth_seed(seed, e, d, 0), f"{name}.expert{e}.gate_up[{d}/{tp}]",
                                  live_rows=2 * live)
            down = SynthTensor(hidden, s, synth_seed(seed, e, d, 1), f"{name}.expert{e}.down[{d}/{tp}]",
                               live_cols=live)
            out[d].append(ExpertSlice(gate_up, down))
    return out
