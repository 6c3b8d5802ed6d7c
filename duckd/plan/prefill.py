"""The planner's streamed prefill (engine.gpu.hybrid_prefill): a long prompt's experts cross
PCIe to the GPU once per pass while the ducks compute a share of each layer beside it. Where
the host keeps its copy of the experts decides the pass: host RAM at the pinned copy rate,
an NVMe pack cache at the lesser of the drive's and PCIe's, or none (the fleet alone).

    streamed_prefill(model, fleet, tokens) -> {"tok_s", "gpu_share", "bound", ...}

The fleet's share costs its GEMM or read time in proportion to the experts it keeps, plus its
wire and host stage in full (duckd.plan.model.prefill's parts); the GPU's, its pass over PCIe or its
matrix time, whichever is longer. The share is where the two end together (all to one side
where that is faster), and never worse than the fleet alone."""
from __future__ import annotations

import dataclasses
import math

from duckd.plan.model import FP9_BYTES, Fleet, ModelShape, PlanError, prefill

HOST_COPIES = ("ram", "nvme", "none")


def expert_params(m: ModelShape) -> tuple[float, float]:
    """(every FFN weight of the model, the weights one token's FFNs read)."""
    moe = 3 * m.hidden * m.moe_intermediate * m.moe_layers if m.experts else 0
    dense = 3 * m.hidden * m.dense_intermediate * m.dense_layers
    return moe * m.experts + dense, moe * m.topk + dense


def copy_gbps(f: Fleet) -> float:
    if f.host_copy not in HOST_COPIES:
        raise PlanError(f"host_copy = {f.host_copy!r}: expected one of {', '.join(HOST_COPIES)}")
    return {"ram": f.pcie_gbps, "nvme": min(f.nvme_gbps, f.pcie_gbps), "none": 0.0}[f.host_copy]


def streamed_prefill(m: ModelShape, f: Fleet, tokens: int) -> dict:
    chunk = min(tokens, f.prefill_chunk)
    alone = prefill(m, dataclasses.replace(f, prefill_chunk=chunk))
    chunks = math.ceil(tokens / chunk)
    fleet_s = tokens / alone["tok_s"]
    rate = copy_gbps(f)
    out = {"tokens": tokens, "host_copy": f.host_copy, "fleet_alone_tok_s": alone["tok_s"]}
    if not rate or not f.gpu_tflops:
        return {**out, "tok_s": alone["tok_s"], "gpu_share": 0.0, "bound": "the fleet alone (no host copy or GPU)"}
    total, active = expert_params(m)
    passes = math.ceil(tokens / f.gpu_prefill_chunk)
    copy_s = passes * total * FP9_BYTES / (rate * 1e9)
    gpu_s = max(copy_s, tokens * 2 * active / (f.gpu_tflops * 1e12))       # every expert on the GPU
    work_s = chunks * alone["ducks_ms"] / 1e3                               # the ducks' kernels, all experts
    fixed_s = chunks * (alone["wire_ms"] + alone["host_ms"]) / 1e3          # their wire and host stage, any share
    share = min(1.0, max(0.0, (work_s + fixed_s) / (gpu_s + work_s)))
    hybrid_s = max(share * gpu_s, (1 - share) * work_s + fixed_s) if share < 1 else gpu_s
    best = min((hybrid_s, "the GPU and the ducks together"), (gpu_s, "the GPU alone"), (fleet_s, "the fleet alone"))
    bound = best[1] + (" (PCIe copies)" if best[1] != "the fleet alone" and copy_s >= gpu_s else "")
    return {**out, "tok_s": tokens / best[0], "gpu_share": 0.0 if best[0] == fleet_s else share,
            "gpu_alone_tok_s": tokens / gpu_s, "pass_gb": total * FP9_BYTES / 1e9, "copy_gbps": rate,
            "bound": bound}
