"""engine.ops on CPU: each Triton kernel (engine.gpu.ops_triton, engine.gpu.decode_attention)
under the Triton interpreter against its torch reference, on odd sizes, T = 1, 2, 5,
head_dim 64 and 128, GQA groups 1 and 4, positions that do not start at 0, fp32 and
bf16, with every output allocation NaN-poisoned; a tiny Qwen3-MoE and Llama run with
the kernels equal the reference path; the kernels compile for Hopper (sm_90) without
register spills. The interpreted checks run in the `interpreted` worker (conftest.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine import ops
from tests.engine.test_fp8_triton import assert_close_to_exact, stack_bytes

FP32_RTOL = 1e-5            # fp32: max |kernel - reference| / max |reference| (fp32 sums in another order)
BF16_ONE_ULP = 2.0 ** -7    # bf16 norms and rotary: within one bf16 ulp of the largest |reference| value...
BF16_MIN_EXACT = 0.99       # ...and bit-identical almost everywhere (same roundings in the same order)
DELTA_GPU_BF16_RTOL = 2e-2  # DeltaNet kernel vs reference on CUDA in bf16 (the conv's roundings, see the check)
ROUTER_ATOL = 1e-6          # router weights (fp32, in [0, 1]): exp and the sums in another order
PROBS_BF16_ATOL = 2.0 ** -8  # GPU attention in bf16: the probabilities rounded to bf16, times max |v|
MODEL_RTOL = 1e-5           # tiny models in fp32, logits: kernels vs references
# local memory of libdevice's sinf/cosf: the table of their range reduction for huge arguments,
# there in any kernel that calls them (a one-line tl.cos kernel has it too); no register spill
TRIG_STACK_BYTES = 32


# -- in the worker ----------------------------------------------------------------------
@contextmanager
def poisoned_outputs():
    """torch.empty / empty_like fill what they return with NaN (-7 for integers): an output
    element a kernel leaves unwritten, or a workspace entry read before it is written, shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype} {tuple(got.shape)}"
    assert not got.isnan().any(), f"{what}: NaN in the output: elements left unwritten"
    err = (got.float() - want.float()).abs().max().item()
    top = want.float().abs().max().item()
    if got.dtype == torch.float32:
        assert err <= FP32_RTOL * top, f"{what}: max err {err:.2e} > {FP32_RTOL:.0e} of {top:.2e}"
        return
    assert err <= BF16_ONE_ULP * top, f"{what}: max err {err:.2e} > one bf16 ulp of {top:.2e}"
    exact = (got == want).float().mean().item()
    assert exact >= BF16_MIN_EXACT, f"{what}: only {exact:.1%} of the elements bit-identical"


def check_rms_norm(t: int, n: int, dtype: torch.dtype, seed: int, device: str = "cpu",
                   zero_centered: bool = False) -> None:
    from engine.gpu import ops_triton

    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, n + 9, generator=gen).to(device, dtype)
    x = wide[:, 3:n + 3]                                     # a view: row stride > N
    residual = (torch.randn(t, n, generator=gen) * 4).to(device, dtype)
    weight = ((0 if zero_centered else 1) + 0.2 * torch.randn(n, generator=gen)).to(device, dtype)
    what = f"rms_norm T={t} N={n} {dtype}" + " zero-centered" * zero_centered
    with poisoned_outputs():
        plain, none = ops_triton.rms_norm(x, weight, 1e-6, zero_centered=zero_centered)
        normed, stream = ops_triton.rms_norm(x, weight, 1e-6, residual, zero_centered)
    assert none is None
    assert_matches(plain, ops.rms_norm_ref(x, weight, 1e-6, zero_centered), what)
    want_normed, want_stream = ops.add_rms_norm_ref(x, residual, weight, 1e-6, zero_centered)
    assert torch.equal(stream, want_stream), f"{what}: residual + x differs from torch's sum"
    assert_matches(normed, want_normed, what + " after the residual add")


def check_qk_norm_rope(t: int, h: int, kvh: int, d: int, dtype: torch.dtype, first: int, norm: bool,
                       cache: bool, seed: int, device: str = "cpu", rows: bool = False) -> None:
    """rows: the cache is two slots of a slot cache seen flat, the tokens written in the second
    (at rows = slots + positions, as a batch's step writes: engine.layers.SlotBatch.flat)."""
    from engine.gpu import ops_triton

    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(device, dtype) * 3   # one matmul's output
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)           # strided views, as the model has
    positions = torch.arange(first, first + t, device=device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
    q_w, k_w = ((1 + 0.2 * torch.randn(d, generator=gen)).to(device, dtype) for _ in range(2)) if norm else (None, None)
    slots = (first + t + 3) * (2 if rows else 1)
    k_cache, v_cache = (torch.randn(slots, kvh, d, generator=gen).to(device, dtype) for _ in range(2))
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    written = positions + slots // 2 if rows else positions
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, rows=written if rows else None) if cache else {}
    with poisoned_outputs():
        got = ops_triton.qk_norm_rope(q, k, positions, inv_freq, q_w, k_w, 1e-6, **caches)
    want = ops.qk_norm_rope_ref(q, k, positions, inv_freq, q_w, k_w, 1e-6, v=v, k_cache=want_k_cache,
                                v_cache=want_v_cache, rows=written if rows else None)
    what = f"qk_norm_rope T={t} H={h} KVH={kvh} D={d} {dtype} from {first} norm={norm} cache={cache} rows={rows}"
    assert_matches(got[0], want[0], what + ": q")
    assert_matches(got[1], want[1], what + ": k")
    if cache:
        assert torch.equal(k_cache[written], got[1]), f"{what}: the cache holds another k than returned"
        assert torch.equal(v_cache, want_v_cache), f"{what}: v cache"
        others = torch.ones(slots, dtype=torch.bool, device=device)
        others[written] = False
        assert torch.equal(k_cache[others], want_k_cache[others]), f"{what}: slots off the positions written"


QK_CASES = [  # T, H, KVH, D, dtype, first position, norm, cache
    (1, 4, 4, 64, torch.float32, 0, True, True),
    (2, 8, 2, 128, torch.bfloat16, 37, True, True),
    (5, 8, 2, 64, torch.bfloat16, 40000, True, False),     # far positions: cos/sin range reduction
    (5, 4, 1, 128, torch.float32, 11, False, True),        # Llama: no q/k norm
    (2, 6, 2, 64, torch.bfloat16, 5, False, False),
]


def check_all_qk_norm_rope(device: str = "cpu") -> None:
    for i, case in enumerate(QK_CASES):
        check_qk_norm_rope(*case, seed=i, device=device)
    check_qk_norm_rope(3, 8, 2, 64, torch.bfloat16, 9, True, True, seed=7, device=device, rows=True)
    check_qk_norm_rope(1, 4, 4, 64, torch.float32, 5, False, True, seed=8, device=device, rows=True)


def check_decode_attention(t: int, h: int, kvh: int, d: int, s: int, positions: list[int], dtype: torch.dtype,
                           split_tiles: int | None, seed: int, device: str = "cpu") -> None:
    from engine.gpu import decode_attention

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    k_cache = (torch.randn(s, kvh, d, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(s, kvh, d, generator=gen).to(dtype)
    pos = torch.tensor(positions)
    scale = d ** -0.5
    on = [x.to(device) for x in (q, k_cache, v_cache, pos)]
    with poisoned_outputs():
        got = decode_attention.decode_attention(*on, scale, split_tiles=split_tiles).cpu()
    want = ops.decode_attention_ref(*on, scale).cpu()
    # float64 from the same (rounded) inputs
    keys = k_cache.double().repeat_interleave(h // kvh, dim=1)                            # [S, H, D]
    scores = torch.einsum("thd,shd->ths", q.double(), keys) * scale                      # [T, H, S]
    scores = scores.masked_fill(torch.arange(s)[None, None, :] > pos[:, None, None], float("-inf"))
    exact = torch.einsum("ths,shd->thd", scores.softmax(-1), v_cache.double().repeat_interleave(h // kvh, dim=1))
    plan = decode_attention.plan(t, h, kvh, d, s, split_tiles)
    what = f"decode_attention T={t} H={h} KVH={kvh} D={d} S={s} at {positions} {dtype} splits={plan['splits']}"
    assert got.shape == (t, h * d) and got.dtype == dtype, what
    if device != "cpu" and dtype != torch.float32:
        # the probabilities enter the second dot in bf16 (flash attention's way, SDPA's too)
        for name, y in (("reference", want), ("triton", got)):
            err = ((y.double() - exact.reshape(t, -1)).abs() - BF16_ONE_ULP / 2 * exact.reshape(t, -1).abs()).max()
            bound = PROBS_BF16_ATOL * v_cache.abs().max().item()
            assert err <= bound, f"{name} {what}: max err {err:.2e} beyond half an ulp + {bound:.2e}"
        return
    assert_close_to_exact(want, exact.reshape(t, -1), "reference " + what)
    assert_close_to_exact(got, exact.reshape(t, -1), "triton " + what)


def check_slot_decode_attention(h: int, kvh: int, d: int, s: int, positions: list[int], slots: list[int],
                                n_slots: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> None:
    """A batch's decode step: row t over slot slots[t] of a slot cache [N, S, KVH, D] whose
    positions past each row's are NaN (a slot's cache is never cleared), against each row
    alone over its own slot's cache (ops.decode_attention_ref)."""
    from engine.gpu import decode_attention

    gen = torch.Generator().manual_seed(seed)
    t = len(positions)
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    k_cache = (torch.randn(n_slots, s, kvh, d, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(n_slots, s, kvh, d, generator=gen).to(dtype)
    for p, slot in zip(positions, slots):
        k_cache[slot, p + 1:] = float("nan")
        v_cache[slot, p + 1:] = float("nan")
    pos, sl = torch.tensor(positions), torch.tensor(slots)
    on = [x.to(device) for x in (q, k_cache, v_cache, pos, sl)]
    scale = d ** -0.5
    with poisoned_outputs():
        got = decode_attention.decode_attention(*on[:4], scale, slots=on[4]).cpu()
    slots_ref = ops.decode_attention_slots_ref(*on[:4], on[4], scale).cpu()
    alone = torch.cat([ops.decode_attention_ref(q[i:i + 1], k_cache[sl[i], :p + 1], v_cache[sl[i], :p + 1],
                                                pos[i:i + 1], scale) for i, p in enumerate(positions)])
    what = f"slot decode_attention H={h} KVH={kvh} D={d} S={s} at {positions} in slots {slots} {dtype}"
    assert got.shape == (t, h * d) and torch.isfinite(got).all(), what
    tol = FP32_RTOL if dtype == torch.float32 and device == "cpu" else 2e-2
    for name, y in (("triton", got), ("slots reference", slots_ref)):
        err = ((y.float() - alone.float()).abs().max() / alone.float().abs().max()).item()
        assert err <= tol, f"{name} {what}: {err:.2e} from each row alone"


SLOT_ATTENTION_CASES = [  # H, KVH, D, S, positions, slots, slots in the cache, dtype
    (4, 4, 64, 100, [0, 5, 99], [2, 0, 1], 3, torch.float32),
    (8, 2, 128, 130, [70, 3, 129, 64, 0], [4, 1, 0, 3, 2], 6, torch.bfloat16),
    (8, 1, 64, 40, [10, 10], [1, 0], 2, torch.float32),
]

ATTENTION_CASES = [  # T, H, KVH, D, S, positions, dtype, split_tiles (None: the default plan)
    (1, 4, 4, 64, 100, [0], torch.float32, None),                    # the first token: one slot
    (1, 8, 2, 128, 100, [70], torch.bfloat16, 1),                     # groups 4, several splits
    (2, 8, 2, 64, 100, [98, 99], torch.float32, None),
    (5, 8, 1, 64, 100, [3, 50, 51, 90, 99], torch.bfloat16, 1),       # groups 8, rows ending in other splits
    (5, 4, 4, 128, 77, [40, 41, 42, 43, 44], torch.bfloat16, 100),   # one split over the whole cache
    (2, 16, 2, 64, 260, [130, 259], torch.float32, 2),
]


def check_gated_delta(t: int, hk: int, dk: int, hv: int, dv: int, kernel: int, dtype: torch.dtype, seed: int,
                      device: str = "cpu") -> None:
    """Qwen3.5's DeltaNet mixer for a few tokens: the fused kernel against engine.delta_rule's
    token-by-token reference, from the same conv and recurrent states, both updated in place."""
    from engine.delta_rule import gated_delta_mixer
    from engine.gpu import delta_triton

    gen = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt)

    merged = rand(t, channels + hv * dv + 2 * hv + 3, scale=2)          # one matmul's output, as the model has
    qkv, z, b, a, _ = merged.split([channels, hv * dv, hv, hv, 3], dim=-1)
    conv, weight = rand(channels, kernel - 1, scale=2), rand(channels, 1, kernel, scale=0.5)
    a_log, dt_bias, norm_w = rand(hv), rand(hv), 1 + rand(dv, scale=0.2)
    state = rand(hv, dk, dv, scale=0.3, dt=torch.float32)
    heads = (hk, dk, hv, dv)
    want_conv, want_state = conv.clone(), state.clone()
    with poisoned_outputs():
        got = delta_triton.gated_delta_decode(qkv, z, b, a, conv, weight, a_log, dt_bias, norm_w, 1e-6, state, heads)
    want = gated_delta_mixer(qkv, z, b, a, want_conv, weight, a_log, dt_bias, norm_w, 1e-6, want_state, heads)
    what = f"gated_delta T={t} Hk={hk} Dk={dk} Hv={hv} Dv={dv} K={kernel} {dtype}"
    assert torch.equal(conv, want_conv), f"{what}: the conv state differs"
    err = ((state - want_state).abs().max() / want_state.abs().max()).item()
    if device != "cpu" and dtype == torch.bfloat16:
        # on the GPU the reference's conv is cuDNN's: its fp32 sums in another order can round a conv
        # output to the neighbouring bf16 value, which the state and the output then carry
        assert err <= DELTA_GPU_BF16_RTOL, f"{what}: recurrent state rel err {err:.1e}"
        out_err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert out_err <= DELTA_GPU_BF16_RTOL, f"{what}: output rel err {out_err:.1e}"
        return
    assert err <= FP32_RTOL, f"{what}: recurrent state rel err {err:.1e}"
    assert_matches(got, want, what)


DELTA_CASES = [  # T, Hk, Dk, Hv, Dv, conv kernel, dtype
    (1, 2, 16, 4, 16, 4, torch.float32),
    (2, 2, 12, 4, 20, 4, torch.bfloat16),     # sizes no power of two: masked lanes
    (3, 1, 16, 3, 8, 3, torch.float32),       # one key head for three value heads, more tokens than K-1
    (1, 2, 32, 2, 32, 2, torch.bfloat16),
]


def check_router(t: int, e: int, k: int, normalize: bool, dtype: torch.dtype, seed: int, device: str = "cpu") -> None:
    from engine.gpu import ops_triton

    gen = torch.Generator().manual_seed(seed)
    # distinct logits (a tie lets torch.topk choose either): multiples of 1/16 are exact in bf16
    logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).float() / 16 - e / 32
    if dtype == torch.float32:
        logits = logits + 0.01 * torch.rand(t, e, generator=gen)
    logits = logits.to(device, dtype)
    with poisoned_outputs():
        ids, weights = ops_triton.router_topk(logits, k, normalize)
    want_ids, want_weights = ops.router_topk_ref(logits, k, normalize)
    what = f"router_topk T={t} E={e} k={k} normalize={normalize} {dtype}"
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32, what
    assert torch.equal(ids, want_ids), f"{what}: ids {ids.tolist()} != {want_ids.tolist()}"
    err = (weights - want_weights).abs().max().item()
    assert err <= ROUTER_ATOL, f"{what}: weights off by {err:.1e}"


def check_router_ties() -> None:
    """Exactly equal logits: the kernel takes the lowest expert id, with the weight torch gives that value."""
    from engine.gpu import ops_triton

    logits = torch.tensor([[0.5, 1.0, 1.0, 0.25, 1.0, -2.0, 0.5],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    ids, weights = ops_triton.router_topk(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    _, want = ops.router_topk_ref(logits, 3, True)
    assert torch.allclose(weights, want, rtol=0, atol=ROUTER_ATOL)


def check_out_of_cache_position_writes_nothing() -> None:
    """A position past the cache (which a CUDA graph cannot check on the host) writes nothing."""
    from engine.gpu import ops_triton

    q, k, v = torch.randn(1, 2, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    k_cache, v_cache = torch.zeros(8, 1, 64), torch.zeros(8, 1, 64)
    ops_triton.qk_norm_rope(q, k, torch.tensor([8]), torch.ones(32), None, None, 0.0, v, k_cache, v_cache)
    assert not k_cache.any() and not v_cache.any()


def check_dispatch() -> None:
    """Under the interpreter CPU tensors take the kernels; DUCK_TRITON_OPS=0 keeps the references."""
    x = torch.randn(2, 8)
    assert ops.triton_runs_on(x)
    os.environ[ops.TRITON_OPS_ENV] = "0"
    try:
        assert not ops.triton_runs_on(x)
    finally:
        del os.environ[ops.TRITON_OPS_ENV]


def check_model_matches_reference(folder: str, device: str = "cpu", dtype: str = "float32",
                                  rtol: float = MODEL_RTOL) -> str:
    """A tiny model: a prefill (norms, rotary, router on the kernels) and static decode steps
    (the attention kernel too), kernels against DUCK_TRITON_OPS=0, the same cache history."""
    from engine.layers import static_decode
    from engine.loader import load_model

    model = load_model(folder, device=device, dtype=dtype).model
    vocab = model.config.vocab_size
    prefill, steps = 5, 2     # few: the interpreter runs a program at a time
    tokens = torch.randint(2, vocab, (prefill + steps,), generator=torch.Generator().manual_seed(8)).to(device)

    def run():
        cache = model.make_cache(prefill + steps + 3)
        logits = [model.compute_logits(model(tokens[:prefill], torch.arange(prefill, device=device), cache))]
        with static_decode():
            for p in range(prefill, prefill + steps):
                logits.append(model.compute_logits(model(tokens[p:p + 1], torch.tensor([p], device=device), cache)))
        return torch.cat(logits).float()

    with torch.inference_mode():
        got = run()
        os.environ[ops.TRITON_OPS_ENV] = "0"
        try:
            want = run()
        finally:
            del os.environ[ops.TRITON_OPS_ENV]
    worst = ((got - want).abs().max() / want.abs().max()).item()
    what = f"tiny {model.config.model_type} {dtype} on {device}"
    assert worst <= rtol, f"{what}: kernels vs references, logits rel err {worst:.1e} > {rtol:.0e}"
    return f"{what}: Triton ops vs references, logits rel err {worst:.1e}"


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n", [(1, 64), (2, 200), (5, 17)])
def test_rms_norm_kernel(interpreted, t, n, dtype):
    interpreted(check_rms_norm, t, n, dtype, 10 * t + n)


def test_zero_centered_rms_norm_kernel(interpreted):
    interpreted(check_rms_norm, 2, 200, torch.bfloat16, 7, "cpu", True)


@pytest.mark.parametrize("case", DELTA_CASES, ids=lambda c: "T{}-{}x{}-{}x{}-K{}-{}".format(*c[:6], str(c[6])[6:]))
def test_gated_delta_kernel(interpreted, case):
    interpreted(check_gated_delta, *case, DELTA_CASES.index(case))


def test_qk_norm_rope_kernel(interpreted):
    """Norms and rotary of q and k from strided views of one qkv output, and the cache write."""
    interpreted(check_all_qk_norm_rope)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[f"T{c[0]}-G{c[1] // c[2]}-D{c[3]}-{str(c[6])[6:]}"
                                                       for c in ATTENTION_CASES])
def test_decode_attention_kernel(interpreted, case):
    interpreted(check_decode_attention, *case, ATTENTION_CASES.index(case))


@pytest.mark.parametrize("case", SLOT_ATTENTION_CASES, ids=[f"T{len(c[4])}-G{c[0] // c[1]}-D{c[2]}-{str(c[7])[6:]}"
                                                            for c in SLOT_ATTENTION_CASES])
def test_slot_decode_attention_kernel(interpreted, case):
    interpreted(check_slot_decode_attention, *case, SLOT_ATTENTION_CASES.index(case))


@pytest.mark.parametrize("t,e,k,normalize,dtype", [(1, 7, 3, True, torch.float32), (2, 128, 8, True, torch.bfloat16),
                                                   (5, 60, 1, False, torch.bfloat16), (2, 33, 8, False, torch.float32)])
def test_router_kernel(interpreted, t, e, k, normalize, dtype):
    interpreted(check_router, t, e, k, normalize, dtype, t * e + k)


def test_router_ties_pick_the_lowest_expert(interpreted):
    interpreted(check_router_ties)


def test_positions_past_the_cache_write_nothing(interpreted):
    interpreted(check_out_of_cache_position_writes_nothing)


def test_dispatch_and_the_switch(interpreted):
    interpreted(check_dispatch)


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
def test_tiny_model_with_kernels_matches_references(interpreted, tiny_checkpoint, report, kind):
    folder, _ = tiny_checkpoint(kind)
    report(interpreted(check_model_matches_reference, str(folder)))


def test_cpu_tensors_run_the_references_without_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set for the whole run: CPU tensors take the kernels here too")
    x = torch.randn(3, 16)
    assert not ops.triton_runs_on(x)
    assert torch.equal(ops.rms_norm(x, torch.ones(16), 1e-6), ops.rms_norm_ref(x, torch.ones(16), 1e-6))


def test_bench_smoke_runs(tmp_path):
    """bench/gpu_ops.py on the CPU under the interpreter: the script the GPU host runs stays runnable."""
    out = tmp_path / "ops.json"
    run = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "bench" / "gpu_ops.py"), "--smoke",
                          "--tokens", "2", "--steps", "1", "--json", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"bench --smoke exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
    cases = json.loads(out.read_text())["cases"]
    assert [(c["ops"], c["tokens"]) for c in cases] == [("reference", 2), ("triton", 2)]
    assert all(c["per_layer_eager_ms"] > 0 for c in cases)


# -- compiled for Hopper, without a GPU ----------------------------------------------------
def _compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: "constexpr" if a in constexprs else signature.get(a, "i32") for a in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names) if sig[a].startswith("*")}
    return triton.compile(ASTSource(kernel, sig, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def test_kernels_compile_for_hopper_without_spills():
    """What the interpreter cannot show: the kernels lower for sm_90 at Qwen3-30B-A3B's
    shapes (hidden 2048, head_dim 128, 32/4 heads, 128 experts) and none spills registers
    (the rotary kernel's stack is sin/cos's table); the attention's bf16 dots are tensor-core MMAs."""
    from engine.gpu import decode_attention, delta_triton, ops_triton

    if ops_triton.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set for the whole run: nothing here is compiled")
    import triton.language as tl

    bf16 = "*bf16"
    p = decode_attention.plan(1, 32, 4, 128, 2048)
    launches = [
        (ops_triton._rms_norm_kernel, {n: bf16 for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
         | {"eps": "fp32"}, dict(DTYPE=tl.bfloat16, HAS_RESIDUAL=True, BLOCK=2048), 4),
        (ops_triton._qk_norm_rope_kernel, {n: bf16 for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "q_out_ptr",
                                                              "k_out_ptr", "k_cache_ptr", "v_cache_ptr")}
         | {"pos_ptr": "*i64", "row_ptr": "*i64", "inv_freq_ptr": "*fp32", "eps": "fp32"},
         dict(DTYPE=tl.bfloat16, HALF=64, BLOCK_HALF=64, NORM=True, CACHE=True, ROWS=True), 1),
        (ops_triton._router_topk_kernel, {"logits_ptr": bf16, "ids_ptr": "*i32", "weights_ptr": "*fp32"},
         dict(TOP_K=8, NORMALIZE=True, BLOCK_E=128, BLOCK_K=8), 1),
        *((decode_attention._split_kernel, {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "pos_ptr": "*i64",
                                            "slot_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                                            "qk_scale": "fp32", "stride_slot": "i64"},
           dict(GROUPS=q["groups"], BLOCK_T=q["block_t"], BLOCK_M=q["block_m"], BLOCK_S=q["block_s"],
                SPLIT_TILES=q["split_len"] // q["block_s"], D=128, BLOCK_D=q["block_d"], DOT_FP32=False, SLOTS=slots),
           4) for q, slots in ((p, False), (decode_attention.plan(32, 32, 4, 128, 2048, one_token=True), True))),
        (decode_attention._combine_kernel, {"o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "pos_ptr": "*i64",
                                            "out_ptr": bf16},
         dict(SPLITS=32, D=128, BLOCK_D=128, BLOCK_SPLITS=32, CHUNK=8, DTYPE=tl.bfloat16), 1),
        # Qwen3.5-35B-A3B's DeltaNet: 16 key heads, 32 value heads, 128 x 128 states, conv 4; T = 1 and 2 (MTP)
        *((delta_triton._gated_delta_kernel, {n: bf16 for n in ("qkv_ptr", "z_ptr", "b_ptr", "a_ptr", "conv_ptr",
                                                                 "conv_w_ptr", "a_log_ptr", "dt_bias_ptr",
                                                                 "norm_w_ptr", "out_ptr")}
           | {"state_ptr": "*fp32", "q_scale": "fp32", "eps": "fp32"},
           dict(T=t, K=4, HK=16, HV=32, DK=128, DV=128, BK=128, BV=128, DTYPE=tl.bfloat16), delta_triton.NUM_WARPS)
          for t in (1, 2)),
    ]
    for kernel, signature, constexprs, warps in launches:
        compiled = _compile_sm90(kernel, signature, constexprs, warps)
        name = kernel.fn.__name__
        if kernel is decode_attention._split_kernel:
            assert "mma" in compiled.asm["ptx"], f"{name}: the bf16 dots did not lower to tensor-core MMAs"
        allowed = TRIG_STACK_BYTES if kernel is ops_triton._qk_norm_rope_kernel else 0
        spilled = stack_bytes(compiled.asm["cubin"])
        assert spilled <= allowed, f"{name}: {spilled} bytes of local memory per thread on sm_90 (> {allowed})"
