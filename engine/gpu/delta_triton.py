"""The gated DeltaNet mixer of Qwen3.5 for a few tokens (decode, MTP) in one Triton
kernel: engine.ops.gated_delta_decode_ref is its torch reference.

Per token t, for each key head (a program owns one key head and the `rep` value heads
it serves, so every conv channel it reads is its own and it updates their conv state
without racing another program):

    conv    x_c = silu(sum_j w[c, j] * in[c, t + j])       in = conv state ‖ this step's tokens
    q, k    l2-normed (q also times Dk^-1/2);  beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
    state   S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q      (fp32, [Dk, Dv])
    norm    y = w * rmsnorm(o) * silu(z)                    (the gated RMSNorm of the output)

The state S stays in registers over the tokens and is written back once; the conv
state then becomes the last K-1 inputs. Rounding to the model dtype where the
reference rounds: the conv output, silu, o before the norm, the normed row, its
product with the weight, the output. What is left is the order of fp32 sums.
"""
from __future__ import annotations

import torch

from engine.gpu.ops_triton import _next_pow2, _round, _rsqrt, tl_dtype, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _tap(qkv_ptr, stride_qkv, conv_ptr, ch, ok, i: tl.constexpr, KM1: tl.constexpr):
        """Input i of the conv window of channels ch: the conv state, then this step's tokens."""
        if i < KM1:
            v = tl.load(conv_ptr + ch * KM1 + i, mask=ok, other=0.0)
        else:
            v = tl.load(qkv_ptr + (i - KM1) * stride_qkv + ch, mask=ok, other=0.0)
        return v.to(tl.float32)

    @triton.jit
    def _conv_silu(qkv_ptr, stride_qkv, conv_ptr, w_ptr, ch, ok, t: tl.constexpr, K: tl.constexpr,
                   DTYPE: tl.constexpr):
        acc = tl.zeros(ch.shape, tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + ch * K + j, mask=ok, other=0.0).to(tl.float32)
            acc += w * _tap(qkv_ptr, stride_qkv, conv_ptr, ch, ok, t + j, K - 1)
        x = _round(acc, DTYPE)
        return _round(x / (1.0 + tl.exp(-x)), DTYPE)

    @triton.jit
    def _shift_conv_state(qkv_ptr, stride_qkv, conv_ptr, ch, ok, T: tl.constexpr, K: tl.constexpr):
        """The conv state becomes the last K-1 inputs: all read, then all written."""
        for j in tl.static_range(K - 1):
            if T + j < K - 1:
                v = tl.load(conv_ptr + ch * (K - 1) + T + j, mask=ok, other=0.0)
            else:
                v = tl.load(qkv_ptr + (T + j - (K - 1)) * stride_qkv + ch, mask=ok, other=0.0)
            if j == 0:
                v0 = v
            elif j == 1:
                v1 = v
            else:
                v2 = v
        tl.debug_barrier()
        for j in tl.static_range(K - 1):
            if j == 0:
                tl.store(conv_ptr + ch * (K - 1) + j, v0, mask=ok)
            elif j == 1:
                tl.store(conv_ptr + ch * (K - 1) + j, v1, mask=ok)
            else:
                tl.store(conv_ptr + ch * (K - 1) + j, v2, mask=ok)

    @triton.jit
    def _l2norm(x):
        return x * _rsqrt(tl.sum(x * x, axis=0) + 1e-6)

    @triton.jit
    def _gated_delta_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, stride_qkv, stride_z, stride_b, stride_a,
                            conv_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, state_ptr, out_ptr,
                            q_scale, eps,
                            T: tl.constexpr, K: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                            DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            DTYPE: tl.constexpr):
        hk = tl.program_id(0)
        REP: tl.constexpr = HV // HK
        kc = tl.arange(0, BK)
        vc = tl.arange(0, BV)
        k_ok = kc < DK
        v_ok = vc < DV
        q_ch = hk * DK + kc
        k_ch = HK * DK + hk * DK + kc
        for r in tl.static_range(REP):
            h = hk * REP + r
            v_ch = 2 * HK * DK + h * DV + vc
            s_off = h * DK * DV + kc[:, None] * DV + vc[None, :]
            s_ok = k_ok[:, None] & v_ok[None, :]
            state = tl.load(state_ptr + s_off, mask=s_ok, other=0.0)                    # [BK, BV] fp32
            decay_rate = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
            dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
            norm_w = tl.load(norm_w_ptr + vc, mask=v_ok, other=0.0).to(tl.float32)
            for t in tl.static_range(T):
                q = _l2norm(_conv_silu(qkv_ptr, stride_qkv, conv_ptr, conv_w_ptr, q_ch, k_ok, t, K, DTYPE)) * q_scale
                k = _l2norm(_conv_silu(qkv_ptr, stride_qkv, conv_ptr, conv_w_ptr, k_ch, k_ok, t, K, DTYPE))
                v = _conv_silu(qkv_ptr, stride_qkv, conv_ptr, conv_w_ptr, v_ch, v_ok, t, K, DTYPE)
                beta = tl.load(b_ptr + t * stride_b + h).to(tl.float32)
                beta = 1.0 / (1.0 + tl.exp(-beta))
                a = tl.load(a_ptr + t * stride_a + h).to(tl.float32) + dt_bias
                g = decay_rate * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))       # softplus, torch's threshold
                state = state * tl.exp(g)
                u = beta * (v - tl.sum(k[:, None] * state, axis=0))                    # [BV]
                state = state + k[:, None] * u[None, :]
                o = _round(tl.sum(q[:, None] * state, axis=0), DTYPE)                   # [BV]
                rstd = _rsqrt(tl.sum(o * o, axis=0) / DV + eps)
                y = _round(norm_w * _round(o * rstd, DTYPE), DTYPE)
                z = tl.load(z_ptr + t * stride_z + h * DV + vc, mask=v_ok, other=0.0).to(tl.float32)
                y = _round(y * (z / (1.0 + tl.exp(-z))), DTYPE)
                tl.store(out_ptr + t * HV * DV + h * DV + vc, y.to(DTYPE), mask=v_ok)
            tl.store(state_ptr + s_off, state, mask=s_ok)
        # every program has read its channels' conv inputs for all tokens: now shift them
        for r in tl.static_range(REP):
            v_ch = 2 * HK * DK + (hk * REP + r) * DV + vc
            _shift_conv_state(qkv_ptr, stride_qkv, conv_ptr, v_ch, v_ok, T, K)
        _shift_conv_state(qkv_ptr, stride_qkv, conv_ptr, q_ch, k_ok, T, K)
        _shift_conv_state(qkv_ptr, stride_qkv, conv_ptr, k_ch, k_ok, T, K)


MAX_TOKENS = 8          # tokens per call: the loop over them is unrolled
MAX_CONV = 4            # conv kernel sizes 2..4 (Qwen3.5: 4)
NUM_WARPS = 4           # sm_90 at Dk = Dv = 128: no spill with 4 warps; 8 and 16 spill (a 128x128 fp32 state)


def takes(tokens: int, conv_kernel: int) -> bool:
    return 1 <= tokens <= MAX_TOKENS and 2 <= conv_kernel <= MAX_CONV


def gated_delta_decode(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       conv_state: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                       heads: tuple[int, int, int, int]) -> torch.Tensor:
    """See engine.ops.gated_delta_decode. conv_state and state are updated in place."""
    hk, dk, hv, dv = heads
    t, channels = qkv.shape
    k = conv_weight.shape[-1]
    if not takes(t, k):
        raise ValueError(f"gated_delta_decode: {t} tokens, conv kernel {k}; the kernel takes 1..{MAX_TOKENS} "
                         f"tokens (a prompt: the chunked rule) and kernels of 2..{MAX_CONV}")
    if channels != 2 * hk * dk + hv * dv or hv % hk:
        raise ValueError(f"gated_delta_decode: qkv has {channels} channels, heads (Hk, Dk, Hv, Dv) = {heads}")
    if conv_state.shape != (channels, k - 1) or not conv_state.is_contiguous() or conv_state.dtype != qkv.dtype:
        raise ValueError(f"gated_delta_decode: conv state {tuple(conv_state.shape)} {conv_state.dtype}, expected "
                         f"a contiguous ({channels}, {k - 1}) {qkv.dtype}")
    if state.shape != (hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"gated_delta_decode: state {tuple(state.shape)} {state.dtype}, expected a contiguous "
                         f"fp32 ({hv}, {dk}, {dv})")
    for name, x, n in (("z", z, hv * dv), ("b", b, hv), ("a", a, hv)):
        if x.shape != (t, n) or x.stride(-1) != 1:
            raise ValueError(f"gated_delta_decode: {name} {tuple(x.shape)} stride {x.stride()}, expected ({t}, {n})")
    if qkv.stride(-1) != 1 or not conv_weight.is_contiguous() or conv_weight.numel() != channels * k:
        raise ValueError("gated_delta_decode: qkv needs unit column stride and conv_weight [C, 1, K] contiguous")
    out = torch.empty((t, hv * dv), dtype=qkv.dtype, device=qkv.device)
    bk, bv = _next_pow2(dk), _next_pow2(dv)
    _gated_delta_kernel[(hk,)](
        qkv, z, b, a, qkv.stride(0), z.stride(0), b.stride(0), a.stride(0),
        conv_state, conv_weight, a_log, dt_bias, norm_weight, state, out, dk ** -0.5, eps,
        T=t, K=k, HK=hk, HV=hv, DK=dk, DV=dv, BK=bk, BV=bv, DTYPE=tl_dtype(qkv, "gated_delta_decode"),
        num_warps=NUM_WARPS)
    return out
