"""The fleet planner: decode and prefill tok/s of a model on a fleet, before the
boxes are bought (`duckctl plan`).

Per layer of a decode step (ARCHITECTURE.md, Data flow) the time is

    host      the GPU/host stage (attention, router, norms; measured per host)
    kernel    the slowest duck streaming its slice of the routed experts:
              params / min(cores x kernel Gparam/s per core, read GB/s / 1.125)
    transport the duck call's fixed cost (wake, dispatch, reply, the host's sum:
              the seeds' "judge gap") + the wire: the activations out through
              each subnet's host port and each duck's link, the partials back
              (the fan-in: a subnet's partials share its host port) + the links'
              latency both ways + the host's per-duck work

and a step is layers x (host + kernel + transport) + the head (embedding,
lm_head, sampling). MTP1 verifies two tokens per step and emits 1 + acceptance;
dual lane (the seeds' final system) overlaps one lane's host stage with the
other's duck stage, so a step is layers x max(2 x duck stage, 2 x host). Prefill
reads each distinct expert once per chunk and is bound by the ducks' GEMM rate
(param x token products per second) or their read bandwidth.

Slices are zero-padded to multiple_of columns, so past tp = moe_intermediate /
multiple_of more ducks stop shrinking the kernel: the planner shows it.
Every input is a field of Fleet with the seeds' N100 fleet as the default;
duckd/plan/cli.py calibrates them from `bench kernels|transport|e2e` JSON files.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

FP9_BYTES = 1.125          # bytes per weight (docs/fp9.md)


class PlanError(ValueError):
    """An input the planner cannot use; the message names it."""


@dataclass(slots=True)
class ModelShape:
    """What the planner needs of a model: the FFNs the ducks run, per layer."""
    name: str
    layers: int
    hidden: int
    experts: int               # routed experts per MoE layer (0: a dense model)
    topk: int
    moe_intermediate: int
    dense_layers: int          # layers whose FFN is a dense MLP (DeepSeek's first_k_dense_replace)
    dense_intermediate: int
    mtp_layers: int = 0        # DeepSeek's MTP head: one more MoE layer per draft
    host_gb: float = 0.0       # what the GPU holds beside the FFNs: attention, router, shared experts, embeddings

    def __post_init__(self):
        for name in ("layers", "hidden"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{self.name}: {name} = {getattr(self, name)!r}: expected a positive number")
        if self.experts and not 0 < self.topk <= self.experts:
            raise PlanError(f"{self.name}: num_experts_per_tok = {self.topk!r}: expected 1..{self.experts}")
        if self.experts and self.moe_intermediate <= 0:
            raise PlanError(f"{self.name}: moe_intermediate_size = {self.moe_intermediate!r}: expected > 0")

    @classmethod
    def from_config(cls, d: dict, name: str) -> "ModelShape":
        t = d.get("text_config") if isinstance(d.get("text_config"), dict) and "hidden_size" not in d else d
        try:
            layers, hidden = int(t["num_hidden_layers"]), int(t["hidden_size"])
        except KeyError as e:
            raise PlanError(f"{name}: config has no {e.args[0]}") from None
        experts = int(t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts") or 0)
        dense = layers if not experts else min(int(t.get("first_k_dense_replace") or 0), layers)
        dense += len(t.get("mlp_only_layers") or []) if experts else 0
        return cls(name=name, layers=layers, hidden=hidden, experts=experts,
                   topk=int(t.get("num_experts_per_tok") or 0), moe_intermediate=int(t.get("moe_intermediate_size") or 0),
                   dense_layers=dense, dense_intermediate=int(t.get("intermediate_size") or 0),
                   mtp_layers=int(t.get("num_nextn_predict_layers") or 0), host_gb=_host_gb(t, layers, hidden, experts))

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


def _host_gb(t: dict, layers: int, hidden: int, experts: int) -> float:
    """The GPU's own weights (everything but the FFNs the ducks hold), estimated from the config: MLA or
    GQA attention, routers, shared experts, embeddings and head; fp8 for DeepSeek's checkpoints (the GPU
    path keeps them so: docs/gpu.md), bf16 otherwise. Linear-attention layers (Qwen3.5) count as full."""
    heads = int(t.get("num_attention_heads") or 0)
    if t.get("kv_lora_rank"):
        q, kv, rope = int(t.get("q_lora_rank") or 0), int(t["kv_lora_rank"]), int(t.get("qk_rope_head_dim") or 0)
        nope, v = int(t.get("qk_nope_head_dim") or 0), int(t.get("v_head_dim") or 0)
        attn = (hidden * q + q * heads * (nope + rope) if q else hidden * heads * (nope + rope)) + \
            hidden * (kv + rope) + kv * heads * (nope + v) + heads * v * hidden
    else:
        d = int(t.get("head_dim") or hidden // max(1, heads))
        attn = hidden * (heads + 2 * int(t.get("num_key_value_heads") or heads)) * d + heads * d * hidden
    shared = int(t.get("n_shared_experts") or 0) * 3 * hidden * int(t.get("moe_intermediate_size") or 0) + \
        3 * hidden * int(t.get("shared_expert_intermediate_size") or 0)
    params = layers * (attn + (shared + experts * hidden if experts else 0)) + 2 * int(t.get("vocab_size") or 0) * hidden
    return params * (1 if str(t.get("model_type", "")).startswith("deepseek") else 2) / 1e9


def load_model(what: str) -> ModelShape:
    """A synthetic name (duckd/plan/shapes.py), a checkpoint folder or its config.json."""
    from duckd.plan.shapes import SHAPES
    if what in SHAPES:
        return ModelShape.from_config(SHAPES[what], what)
    p = Path(what).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"model {what!r}: neither a known name ({', '.join(SHAPES)}) nor a checkpoint folder "
                        "with a config.json")
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{p}: cannot read: {e}") from None
    return ModelShape.from_config(d, str(what))


@dataclass(slots=True)
class Fleet:
    """The fleet and host; defaults: the seeds' 32 x N100 behind an RTX 5090 host (docs/plan.md)."""
    ducks: int = 32
    subnets: int = 4
    cores: int = 4                     # worker threads per duck
    kernel_gparams_per_core: float = 5.4   # fp9 GEMV, one core (bench kernels: fp9_gemv, 1 thread)
    read_gbps: float = 20.0            # per duck, all cores (bench kernels: read_gbps)
    kernel_read_ratio: float = 1.0     # the decode kernel on the model's slice / the read at the duck's threads
                                       # (bench kernels: moe_slice's ratio_to_read at the slice width; 1: read-bound)
    gemm_gparams_per_core: float = 5.4     # prefill: param x token products per second per core
    mem_gb: float = 32.0               # per duck
    duck_link_gbit: float = 2.5
    port_gbit: float = 25.0            # the host's port of each subnet
    latency_us: float = 10.0           # one way host <-> duck (switch, NICs), each direction
    call_us: float = 78.0              # fixed cost of a duck call per layer beyond wire and kernel (seeds' judge gap)
    kernel_call_us: float = 0.0        # the duck's pool per layer call: waking its blocked workers and their phases
                                       # (bench kernels: pool_wake's blocked run_us; spinning workers: its spinning)
    host_per_duck_us: float = 0.0      # the host's own work per duck per layer (send, receive, sum)
    host_ms: float = 0.093             # GPU/host stage per layer (seeds: 5.7 ms per 61 layers)
    head_ms: float = 0.5               # per step: embedding, lm_head, sampling
    multiple_of: int = 64
    act_bytes: int = 2                 # activation on the wire (bf16 host model)
    partial_bytes: int = 2             # partial back (docs/wire.md, Partials' type)
    broadcast: bool = False            # one activation per subnet (broadcast) instead of one per duck
    mtp_acceptance: float = 0.0        # MTP1 (0: off)
    dual_lane: bool = True             # MTP1's two lanes overlap host and ducks (else one batched forward)
    prefill_chunk: int = 1024
    prefill_host_ms: float = 0.0       # the host stage of one chunk per layer (0: host_ms, an underestimate)
    colocated_cores: int = 0           # the ducks share this many CPUs with the host (emulation): 0 = own boxes
    colocated_cpu_us_per_duck: float = 0.0   # CPU one duck's call costs such a machine (bench transport)
    emulated_link_mtu: int = 0         # links are tc-emulated with this MTU (their token bucket): 0 = real links
    gpu_tflops: float = 150.0          # the host GPU's bf16 matrix rate in use (RTX 5090: ~210 peak); 0: none
    pcie_gbps: float = 50.0            # pinned host-to-GPU copies (PCIe 5.0 x16)
    host_copy: str = "ram"             # where the host keeps the experts for streamed prefill: ram | nvme | none
    nvme_gbps: float = 7.0             # the pack cache's drive, when host_copy = nvme (PCIe 4.0 x4)
    gpu_prefill_chunk: int = 16384     # tokens per streamed pass
    gpu_gb: float = 0.0                # the GPU's memory: what the model's own weights and duckd's margin leave
                                       # is the FFN budget (engine.placement), unless gpu_ffn_gb says it
    gpu_ffn_gb: float = 0.0            # GPU memory for FFN weights computed beside the ducks (engine.placement)
    gpu_gbps: float = 1792.0           # the GPU's memory read rate (RTX 5090; H100 SXM ~3350)
    gpu_ffn_us: float = 15.0           # a GPU-computed FFN's fixed cost per layer (its kernels' launches in the graph)
    gpu_fp9_read_ratio: float = 0.2    # the fused fp9 GEMV's read rate over gpu_gbps (H200: 0.10-0.28 measured,
                                       # bench/results/2026-12-06-placement-h200)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        for name in ("ducks", "subnets", "cores", "multiple_of", "act_bytes", "partial_bytes", "prefill_chunk",
                     "gpu_prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise PlanError(f"{name} = {v!r}: expected a positive integer")
        for name in ("kernel_gparams_per_core", "read_gbps", "gemm_gparams_per_core", "mem_gb", "duck_link_gbit",
                     "port_gbit", "kernel_read_ratio"):
            if not getattr(self, name) > 0:
                raise PlanError(f"{name} = {getattr(self, name)!r}: expected a positive number")
        for name in ("latency_us", "call_us", "kernel_call_us", "host_per_duck_us", "host_ms", "head_ms", "colocated_cpu_us_per_duck",
                     "prefill_host_ms",
                     "colocated_cores", "emulated_link_mtu", "gpu_tflops", "pcie_gbps", "nvme_gbps", "gpu_ffn_gb", "gpu_gb",
                     "gpu_gbps", "gpu_ffn_us", "gpu_fp9_read_ratio"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name} = {getattr(self, name)!r}: expected >= 0")
        if self.kernel_read_ratio > 1.5:
            raise PlanError(f"kernel_read_ratio = {self.kernel_read_ratio!r}: expected the kernel's rate over the "
                            f"read probe's, 0 < ratio <= 1.5")
        if not 0 <= self.mtp_acceptance <= 1:
            raise PlanError(f"mtp_acceptance = {self.mtp_acceptance!r}: expected a fraction 0..1 (0: no MTP)")
        if self.multiple_of % 32:
            raise PlanError(f"multiple_of = {self.multiple_of!r}: expected a multiple of 32")

    @property
    def duck_gparams(self) -> float:
        """Params a duck streams per second: its cores' kernels, or its memory at the rate its decode
        kernel reads the model's slice (kernel_read_ratio), whichever is less."""
        return min(self.cores * self.kernel_gparams_per_core, self.read_gbps * self.kernel_read_ratio / FP9_BYTES)


def slice_width(intermediate: int, tp: int, multiple_of: int) -> int:
    return math.ceil(intermediate / tp / multiple_of) * multiple_of


def distinct_experts(experts: int, topk: int, tokens: int) -> float:
    """Expected distinct experts routed for `tokens` tokens (uniform routing)."""
    return experts * (1 - (1 - topk / experts) ** tokens)


def layer_params(m: ModelShape, f: Fleet, tokens: int) -> tuple[float, float]:
    """Params one duck reads per (MoE, dense) layer for a forward of `tokens` tokens."""
    moe = 0.0
    if m.experts:
        moe = distinct_experts(m.experts, m.topk, tokens) * 3 * m.hidden * slice_width(m.moe_intermediate, f.ducks,
                                                                                        f.multiple_of)
    dense = 3 * m.hidden * slice_width(m.dense_intermediate, f.ducks, f.multiple_of) if m.dense_layers else 0.0
    return moe, dense


def _bucket_kbit(f: Fleet, gbit: float) -> float:
    """What an emulated link passes at once when idle (duckd/drivers/links.py: tbf's bucket), in kbit."""
    if not f.emulated_link_mtu:
        return 0.0
    from duckd.drivers.links import BUCKET_US, FRAME_OVERHEAD
    return max(f.emulated_link_mtu + FRAME_OVERHEAD, gbit * 1e3 / 8 * BUCKET_US) * 8e-3


def transport_us(f: Fleet, hidden: int, tokens: int = 1) -> dict:
    """One duck call's transport per layer, in microseconds, by part."""
    per_subnet = math.ceil(f.ducks / f.subnets)
    act, part = tokens * hidden * f.act_bytes * 8e-3, tokens * hidden * f.partial_bytes * 8e-3   # kbit
    port, link = f.port_gbit, f.duck_link_gbit                                                   # kbit/us
    bp, bl = _bucket_kbit(f, port), _bucket_kbit(f, link)
    sent = 1 if f.broadcast else per_subnet
    # out: the port sends each duck's activation in turn, each duck link drains its own
    out = max(max(0.0, sent * act - bp) / port, (sent - 1) * act / port + max(0.0, act - bl) / link)
    # back: every duck sends at its link's rate, the subnet's partials share the host port (fan-in)
    fan_in = max(0.0, per_subnet * part - bp) / port
    back = max(max(0.0, part - bl) / link, fan_in)
    wire = out + back + 2 * f.latency_us
    host = f.ducks * f.host_per_duck_us
    r = {"call_us": f.call_us, "wire_us": wire, "fan_in_us": fan_in, "host_per_duck_us": host,
         "total_us": f.call_us + wire + host}
    if f.colocated_cores:   # ducks on the host's own CPUs: their CPU work adds to the call
        r["colocated_cpu_us"] = f.ducks * f.colocated_cpu_us_per_duck / f.colocated_cores
        r["total_us"] += r["colocated_cpu_us"]
    return r


def duck_stage_ms(m: ModelShape, f: Fleet, tokens: int) -> dict:
    """Kernel and transport of one layer (the mean over the model's MoE and dense layers)."""
    moe, dense = layer_params(m, f, tokens)
    params = (moe * m.moe_layers + dense * m.dense_layers) / m.layers
    kernel = params / f.duck_gparams / 1e6 + f.kernel_call_us / 1e3
    t = transport_us(f, m.hidden, tokens)
    return {"kernel_ms": kernel, "transport_ms": t["total_us"] / 1e3, "transport": t,
            "params_per_duck": params}


GPU_MARGIN_GB, GPU_MARGIN_FRACTION, KV_GB = 4.0, 0.10, 2.0   # duckd's default margin (engine.placement), a KV cache


def ffn_budget_gb(m: ModelShape, f: Fleet) -> float:
    """gpu_ffn_gb, or from gpu_gb what duckd's auto budget leaves: less the model's own weights, a KV
    cache and the margin (engine.placement.default_budget)."""
    if f.gpu_ffn_gb or not f.gpu_gb:
        return f.gpu_ffn_gb
    return max(0.0, f.gpu_gb - m.host_gb - KV_GB - GPU_MARGIN_GB - GPU_MARGIN_FRACTION * f.gpu_gb)


def placement(m: ModelShape, f: Fleet):
    """engine.placement's plan for gpu_ffn_gb of GPU memory (None without): dense layers first, then whole
    MoE layers or a share of each, the cheaper by the fleet's call cost and read rate."""
    budget = ffn_budget_gb(m, f)
    if budget <= 0:
        return None
    from engine.placement_plan import FfnShape, plan_placement
    shapes = [FfnShape(i, 1, m.hidden, m.dense_intermediate) for i in range(m.dense_layers)]
    shapes += [FfnShape(i, m.experts, m.hidden, m.moe_intermediate) for i in range(m.dense_layers, m.layers)]
    call_s = (transport_us(f, m.hidden)["total_us"] + f.kernel_call_us) * 1e-6
    return plan_placement(shapes, max(1, m.topk), int(budget * 1e9), call_s=call_s,
                          duck_gbps=f.ducks * f.duck_gparams * FP9_BYTES, gpu_gbps=f.gpu_gbps * f.gpu_fp9_read_ratio)


def layer_costs(m: ModelShape, f: Fleet, tokens: int, plan=None) -> list[tuple[float, float, float]]:
    """(host, kernel, transport) ms of each layer's step of `tokens` tokens: the host stage (with the GPU's
    share of the FFN under a placement plan: its bytes at gpu_gbps and a fixed cost), the ducks' kernel on
    what is left of the layer, and their call (none for a layer the GPU holds whole)."""
    moe, dense = layer_params(m, f, tokens)
    t = duck_stage_ms(m, f, tokens)["transport_ms"]
    out = []
    for i in range(m.layers):
        kernel = (dense if i < m.dense_layers or not m.experts else moe) / f.duck_gparams / 1e6 + f.kernel_call_us / 1e3
        host = f.host_ms
        if plan is not None and i in plan.gpu:
            share, s = plan.share.get(i, 0.0), plan.shapes[i]
            k = 1 if s.dense else min(distinct_experts(s.experts, m.topk, tokens), s.experts)
            host += share * k * s.expert_weights * FP9_BYTES / (f.gpu_gbps * f.gpu_fp9_read_ratio * 1e6) + \
                f.gpu_ffn_us / 1e3
            out.append((host, 0.0, 0.0) if plan.whole(i) else (host, kernel * (1 - share), t))
        else:
            out.append((host, kernel, t))
    return out


def decode(m: ModelShape, f: Fleet) -> dict:
    plan_ = placement(m, f)
    layers = layer_costs(m, f, 1, plan_)
    step = sum(map(sum, layers)) + f.head_ms
    mean = [sum(c[j] for c in layers) / m.layers for j in range(3)]
    out = {"tok_s": 1e3 / step, "step_ms": step, "mode": "one token per step",
           "per_layer_ms": dict(zip(("host", "kernel", "transport"), mean))}
    if plan_ is not None:
        s = plan_.summary()
        out["placement"] = {**{k: s[k] for k in ("gpu_gb", "duck_gb_per_token", "duck_calls_per_token", "filling")},
                            "gpu_layers_whole": len(s["gpu_layers_whole"])}
    if f.mtp_acceptance:
        one = duck_stage_ms(m, f, 1)
        mtp_layer = f.host_ms + one["kernel_ms"] + one["transport_ms"] if m.mtp_layers else 0.0   # the draft's MTP layer
        if f.dual_lane:
            mtp_step = sum(max(2 * (k + t), 2 * h) for h, k, t in layers) + f.host_ms + mtp_layer + f.head_ms
            mode = "MTP1 dual lane"
        else:
            mtp_step = sum(map(sum, layer_costs(m, f, 2, plan_))) + mtp_layer + f.head_ms
            mode = "MTP1 batched"
        out.update(tok_s=(1 + f.mtp_acceptance) * 1e3 / mtp_step, step_ms=mtp_step, mode=mode,
                   tokens_per_step=1 + f.mtp_acceptance, tok_s_without_mtp=1e3 / step)
    return out


def prefill(m: ModelShape, f: Fleet) -> dict:
    """One chunk of prefill_chunk tokens: each distinct expert read once, then GEMM over its tokens."""
    t = f.prefill_chunk
    moe, dense = layer_params(m, f, t)
    w_moe = slice_width(m.moe_intermediate, f.ducks, f.multiple_of) if m.experts else 0
    w_dense = slice_width(m.dense_intermediate, f.ducks, f.multiple_of) if m.dense_layers else 0
    products = (m.moe_layers * t * m.topk * 3 * m.hidden * w_moe + m.dense_layers * t * 3 * m.hidden * w_dense)
    read_ms = (moe * m.moe_layers + dense * m.dense_layers) * FP9_BYTES / f.read_gbps / 1e6
    compute_ms = products / (f.cores * f.gemm_gparams_per_core) / 1e6
    wire_ms = m.layers * transport_us(f, m.hidden, t)["total_us"] / 1e3
    host_ms = m.layers * (f.prefill_host_ms or f.host_ms)
    chunk = max(read_ms, compute_ms) + wire_ms + host_ms
    return {"tok_s": t * 1e3 / chunk, "chunk_tokens": t, "chunk_ms": chunk,
            "bound": "duck compute" if compute_ms >= read_ms else "duck read bandwidth",
            "ducks_ms": max(read_ms, compute_ms), "wire_ms": wire_ms, "host_ms": host_ms}


def memory(m: ModelShape, f: Fleet) -> dict:
    """Each duck's slice of every expert of every layer (and of the MTP layer), in GB."""
    moe = m.experts * 3 * m.hidden * slice_width(m.moe_intermediate, f.ducks, f.multiple_of) if m.experts else 0
    dense = 3 * m.hidden * slice_width(m.dense_intermediate, f.ducks, f.multiple_of) if m.dense_layers else 0
    weights = (moe * (m.moe_layers + m.mtp_layers) + dense * m.dense_layers) * FP9_BYTES / 1e9
    return {"weights_gb_per_duck": weights, "headroom_gb_per_duck": f.mem_gb - weights, "fits": weights < f.mem_gb,
            "fleet_weights_gb": weights * f.ducks}


def bottleneck(m: ModelShape, f: Fleet, dec: dict, mem: dict) -> str:
    if not mem["fits"]:
        return f"duck memory: {mem['weights_gb_per_duck']:.1f} GB of weights per duck > {f.mem_gb:g} GB"
    pl = dec["per_layer_ms"]
    t = duck_stage_ms(m, f, 1)["transport"]
    part, ms = max(pl.items(), key=lambda kv: kv[1])
    if part == "kernel":
        w = slice_width(m.moe_intermediate or m.dense_intermediate, f.ducks, f.multiple_of)
        exact = (m.moe_intermediate or m.dense_intermediate) / f.ducks
        pad = "" if w <= exact * 1.01 else f" (slices padded {exact:g} -> {w} columns" + (
            ": more ducks no longer help)" if w == f.multiple_of else ")")
        what = "memory bandwidth" if f.read_gbps * f.kernel_read_ratio / FP9_BYTES < f.cores * f.kernel_gparams_per_core \
            else "kernel compute"
        return f"duck {what}: {ms:.3f} ms of {sum(pl.values()):.3f} per layer{pad}"
    if part == "transport":
        parts = {"fixed call cost": t["call_us"], "wire": t["wire_us"], "host per-duck work": t["host_per_duck_us"],
                 "shared CPUs": t.get("colocated_cpu_us", 0)}
        worst = max(parts, key=parts.get)
        link_us = m.hidden * f.partial_bytes * 8e-3 / f.duck_link_gbit
        extra = f", of which host-port fan-in {t['fan_in_us']:.0f} us" if worst == "wire" and \
            t["fan_in_us"] > link_us else ""
        return f"transport ({worst}, {parts[worst]:.0f} us{extra}): {ms:.3f} ms of {sum(pl.values()):.3f} per layer"
    return f"host stage: {ms:.3f} ms of {sum(pl.values()):.3f} per layer"


def plan(m: ModelShape, f: Fleet) -> dict:
    dec, mem = decode(m, f), memory(m, f)
    moe, dense = layer_params(m, f, 1)
    fleet_params_per_token = (moe * m.moe_layers + dense * m.dense_layers) * f.ducks
    return {"model": asdict(m), "fleet": {k: v for k, v in asdict(f).items() if k != "notes"}, "notes": f.notes,
            "decode": dec, "prefill": prefill(m, f), "memory": mem, "bottleneck": bottleneck(m, f, dec, mem),
            # every duck streaming all the time, nothing else: the bound no host or wire can beat
            "roofline_tok_s": f.ducks * f.duck_gparams * 1e9 / fleet_params_per_token}
