"""The seeds' three published figures as planner cases: N100 ducks (fp9 5.4
Gparam/s per core, 4 cores, ~20 GB/s, 32 GB DDR4-3200 single channel, 2.5GbE)
behind an RTX 5090 host with 4 x 25GbE, 8 ducks per subnet.

Each case takes the system as it was on the day of its figure, from the seeds'
own per-layer figures, never fitted to the figure (docs/plan.md, Inputs):
  host stage  0.093 ms per layer: DeepSeek-V3.2's GPU stage s0 = 5.7 ms per
              61 layers (001, 11.6), the only per-layer GPU figure; used for all
  call cost   the per-call launch gap ("judge_gap", 001, 11.3/11.4): 78 us with
              the persistent session (2026-03-23 on), 418 us before it for
              4-core SMP launches (V3.2), 133 us before it at tp=24 on Qwen3
              (the one pre-persistent figure of a single-core launch)
  cores       4-core SMP forwards from 2026-03-16 (001, 11.4); 1 core before
  multiple_of 64 (the sub-128 unlock); 32 for Qwen3.5-35B-A3B (002, 6.3)
  head        0.5 ms per step (embedding, lm_head, sampling: the H200 runs'
              head_ms, 0.37 to 0.74; the seeds give none)
"""
from __future__ import annotations

N100 = {"subnets": 4, "kernel_gparams_per_core": 5.4, "read_gbps": 20.0, "mem_gb": 32.0, "duck_link_gbit": 2.5,
        "port_gbit": 25.0, "latency_us": 10.0, "host_ms": 0.093, "head_ms": 0.5, "act_bytes": 2, "partial_bytes": 2}

SEED_CASES = [
    {"name": "seeds: DeepSeek-V3.2 tp32 MTP1 87% (2026-03-30)", "model": "deepseek-v32", "measured_tok_s": 15.3,
     "fleet": {**N100, "ducks": 32, "cores": 4, "call_us": 78.0, "multiple_of": 64, "mtp_acceptance": 0.87,
               "dual_lane": True},
     "why": "final system: persistent session (78 us), 4-core SMP, MTP1 dual lane at 87.1 %"},
    {"name": "seeds: Qwen3-30B-A3B tp24 (2026-03-14)", "model": "qwen3-30b-a3b", "measured_tok_s": 24.0,
     "fleet": {**N100, "ducks": 24, "cores": 1, "call_us": 133.0, "multiple_of": 64},
     "why": "flattened runtime + CUDA graph; before 4-core SMP (03-16): 1 core; before the persistent session: "
            "133 us (tp=24); 768/24 = 32 padded to 64"},
    {"name": "seeds: Qwen3.5-35B-A3B tp16 (flattened, 2026-03-17..22)", "model": "qwen3.5-35b-a3b",
     "measured_tok_s": 37.9,
     "fleet": {**N100, "ducks": 16, "cores": 4, "call_us": 418.0, "multiple_of": 32},
     "why": "after 4-core SMP, before the persistent session: 418 us SMP launch; multiple_of 32 (512/16)"},
]
