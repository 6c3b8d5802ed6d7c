"""The table `duckctl bench e2e --synthetic` prints (bench/e2e_synthetic.py) from its
result, and scripts/e2e_table.py from a saved --json file."""
from __future__ import annotations

from bench.e2e_prefill import prefill_line


def format_table(r: dict) -> str:
    """The human-readable form of a `bench e2e --synthetic` result (its --json)."""
    lines = [f"{r['model']} ({r['note']})",
             (f"host {r['host_device']} {r['host_dtype']}, "
              f"{r['shape']['layers']} layers, {r['shape']['experts']} experts")]
    if "fleet_read_gbps" in r:
        lines.append(f"fleet read bandwidth (all ducks at once): {r['fleet_read_gbps']:.1f} GB/s"
                     + (f" before the runs, {r['fleet_read_gbps_end']:.1f} after" if "fleet_read_gbps_end" in r else ""))
    if "fleet_kernel" in r:
        k = r["fleet_kernel"]
        lines.append(f"fleet decode kernel (all ducks at once, {k['kernels']}): {k['gbps_per_duck']:.2f} GB/s per duck "
                     f"(slowest {k['gbps_slowest_duck']:.2f}) on slices of {'x'.join(map(str, k['shape']))}"
                     + (f" x {k['layers']} layers; in rounds of every duck at once {k['gbps_per_duck_in_step']:.2f} "
                        f"(a round {k['round_ms_median']:.3f} ms)" if "rounds" in k else ""))
    for kind in ("fleet", "gpu", "cpu-torch"):
        if kind not in r:
            continue
        k = r[kind]
        for p in k["prompts"]:
            lines.append(prefill_line(kind, p))
            if "prefill_chunk_by_chunk" in p:
                lines.append(prefill_line(kind, p["prefill_chunk_by_chunk"]))
            d = p["decode"]
            split = d["per_layer_ms"]
            extra = "".join(f", {n} {v:.2f}" for n, v in split.items() if v is not None)
            lines.append(f"{kind:9s} decode after {p['prompt_len']:5d}: {d['tok_s']:.2f} tok/s; per layer ms: "
                         f"{extra[2:]}")
            r = d.get("routing")
            if r:
                lines.append(f"{kind:9s} routing over {r['steps']} steps: {r['distinct_experts_per_layer_step']:.1f} "
                             f"distinct experts per layer and step, {100 * r['reused_from_previous_step']:.0f}% "
                             f"read by the step before too, {100 * r['experts_read_over_the_steps']:.0f}% of the "
                             f"{r['experts']} experts read")
        if "mtp_pair" in k:
            m = k["mtp_pair"]
            lines.append(f"{kind:9s} MTP pair: single {m['single_step_ms']:.1f} ms, serial {m['serial_ms']:.1f}, "
                         f"pair batch {m['pair_batch_ms']:.1f} ({m['pair_over_single_batch']:.2f}x single, "
                         f"overlap {m['overlap_ratio_batch']:.2f}), pair lanes {m['pair_lanes_ms']:.1f} "
                         f"({m['pair_over_single_lanes']:.2f}x, overlap {m['overlap_ratio_lanes']:.2f})")
        for b in k.get("batched", []):
            how = "graphs" if b.get("graphs") else "eager"
            lines.append(f"{kind:9s} batch of {b['sequences']:3d} ({how}) after {b['prompt_len']}: {b['tok_s']:.2f} tok/s "
                         f"({b['over_one_sequence']:.2f}x one), step {b['step_ms']:.1f} ms, FFN call "
                         f"{b['ffn_call_per_layer_ms']:.3f} ms per layer"
                         if b["over_one_sequence"] is not None else
                         f"{kind:9s} batch of {b['sequences']:3d} ({how}): {b['tok_s']:.2f} tok/s, step {b['step_ms']:.1f} ms")
        g = k.get("graph_stage")
        if g:
            lines.append(f"{kind:9s} GPU stage per layer: eager {g['per_layer_eager_ms']:.3f} ms, "
                         f"CUDA graphs {g['per_layer_graph_ms']:.3f} ms ({g['speedup']:.2f}x)")
        if kind == "fleet" and "roofline_tok_s" in k:
            lines.append(f"fleet roofline {k['roofline_tok_s']:.2f} tok/s "
                         f"({k['ffn_bytes_per_token'] / 1e6:.1f} MB FFN per token): ratio {k['ratio_to_roofline']:.2f}"
                         + (f" (median of the {len(k['prompts'])} decodes: {k['decode_tok_s_median']:.2f} tok/s, "
                            f"ratio {k['ratio_to_roofline_median']:.2f})" if "ratio_to_roofline_median" in k else "")
                         + (f"; {k['speedup_over_cpu_torch']:.2f}x the torch CPU offload"
                            if "speedup_over_cpu_torch" in k else ""))
    return "\n".join(lines)
