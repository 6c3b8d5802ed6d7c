"""The gated delta rule of Qwen3.5's linear-attention (DeltaNet) layers, in torch.

Per value head, state S [Dk, Dv]: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q.

    gated_delta_recurrent   token by token (decode)
    gated_delta_chunked     C tokens per step by the UT transform (prefill)
    gated_delta_mixer       the whole mixer between its input projections and out_proj:
                            causal depthwise conv (its state: the last K-1 inputs), silu,
                            l2-normed q and k, the gates, the rule, the gated RMSNorm
    gated_delta_mixer_slots the mixer for one token of each of B sequences at once (a batch's
                            decode step, engine.batch_torch), their states gathered from their
                            slots and scattered back; gated_delta_mixer per sequence is its reference

gated_delta_mixer is the reference of engine.gpu.delta_triton's fused decode kernel
(engine.ops.gated_delta_decode chooses).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_delta_recurrent(q, k, v, g, beta, state):
    """One token at a time. q, k [H, T, Dk], v [H, T, Dv], g, beta [H, T], state [H, Dk, Dv] (fp32)
    -> out [H, T, Dv], new state."""
    out = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]                              # [H, Dk, Dv]
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hk,hkv->hv", k[:, t], state))  # [H, Dv]
        state = state + k[:, t, :, None] * u[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[:, t], state))                    # [H, Dv]
    return torch.stack(out, dim=1), state


def _unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], row by row (forward substitution):
    on CPU ~9x faster than batched torch.linalg.solve_triangular for these small systems."""
    c = lower.shape[-1]
    inv = -lower  # row i: X[i, :i] = -L[i, :i] - sum_j L[i, j] X[j, :i], with X[j, j] = 1
    for i in range(1, c):
        inv[..., i, :i] += (inv[..., i, :i, None] * inv[..., :i, :i]).sum(-2)
    return inv + torch.eye(c, dtype=lower.dtype, device=lower.device)


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence, C tokens per step: within a chunk the delta updates are
    solved as one unit-lower-triangular system (the UT transform), so the sequential
    part is T/C small matmuls. Shapes as gated_delta_recurrent."""
    h, t, dk = k.shape
    pad = -t % chunk  # padded tokens have beta = 0, k = 0, g = 0: they leave the state alone
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, -1) for x in (q, k, v))                   # [H, N, C, D]
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    cum = g.cumsum(-1)                                                           # [H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    kb = k * beta[..., None]
    inverse = _unit_lower_inverse(((kb @ k.transpose(-1, -2)) * decay).tril(-1))  # [H, N, C, C]
    u0 = inverse @ (v * beta[..., None])                                         # [H, N, C, Dv]
    w = inverse @ (kb * cum.exp()[..., None])                                    # [H, N, C, Dk]
    attn = (q @ k.transpose(-1, -2)) * decay                                     # [H, N, C, C]
    q_decayed = q * cum.exp()[..., None]                                         # [H, N, C, Dk]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]                        # [H, N, C, Dk]
    out = torch.empty_like(u0)
    for c in range(n):
        u = u0[:, c] - w[:, c] @ state                                           # [H, C, Dv]
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ u
        state = state * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.reshape(h, n * chunk, -1)[:, :t], state


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # eps inside the root, as the reference kernels


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet's output norm: weight * rmsnorm(x) * silu(z), rounded where HF rounds."""
    y = x.float()
    y = weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(z.float())).to(x.dtype)


def gated_delta_mixer(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                      conv_state: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                      heads: tuple[int, int, int, int], chunked: bool = False) -> torch.Tensor:
    """The projections' outputs qkv [T, 2 Hk Dk + Hv Dv], z [T, Hv Dv], b, a [T, Hv] -> the
    normed mixer output [T, Hv Dv] (qkv's dtype), before out_proj. conv_state [C, K-1]
    (the model dtype) and state [Hv, Dk, Dv] (fp32) are updated in place. heads = (Hk, Dk,
    Hv, Dv); each q/k head serves Hv / Hk consecutive value heads."""
    hk, dk, hv, dv = heads
    t, kernel = qkv.shape[0], conv_weight.shape[-1]
    mixed = torch.cat((conv_state, qkv.T), dim=-1)                               # [C, K-1+T]
    conv_state.copy_(mixed[:, mixed.shape[1] - (kernel - 1):])
    mixed = F.silu(F.conv1d(mixed[None], conv_weight, groups=mixed.shape[0]))[0].T  # [T, C]
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    rep = hv // hk
    q = q.reshape(t, hk, dk).repeat_interleave(rep, dim=1).transpose(0, 1).float()
    k = k.reshape(t, hk, dk).repeat_interleave(rep, dim=1).transpose(0, 1).float()
    v = v.reshape(t, hv, dv).transpose(0, 1).float()                            # [Hv, T, Dv]
    q = l2norm(q) * dk ** -0.5                                                   # [Hv, T, Dk]
    k = l2norm(k)
    beta = b.float().sigmoid().T                                                 # [Hv, T]
    g = (-a_log.float().exp() * F.softplus(a.float() + dt_bias.float())).T       # [Hv, T]
    rule = gated_delta_chunked if chunked else gated_delta_recurrent
    out, new_state = rule(q, k, v, g, beta, state)
    state.copy_(new_state)
    out = gated_rms_norm(out.transpose(0, 1).to(qkv.dtype), z.reshape(t, hv, dv), norm_weight, eps)  # [T, Hv, Dv]
    return out.reshape(t, hv * dv)


def gated_delta_mixer_slots(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                            conv_state: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                            dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                            heads: tuple[int, int, int, int], slots: torch.Tensor) -> torch.Tensor:
    """gated_delta_mixer of one token for each of B sequences, batched over B: row i of qkv
    [B, 2 Hk Dk + Hv Dv], z [B, Hv Dv], b, a [B, Hv] is the next token of the sequence in slot
    slots[i] (distinct) of conv_state [S, C, K-1] and state [S, Hv, Dk, Dv] (fp32), whose rows
    are updated in place; the other slots are left alone. -> [B, Hv Dv] (qkv's dtype)."""
    hk, dk, hv, dv = heads
    n = qkv.shape[0]
    mixed = torch.cat((conv_state.index_select(0, slots), qkv[:, :, None]), dim=-1)   # [B, C, K]
    conv_state.index_copy_(0, slots, mixed[:, :, 1:])
    mixed = F.silu(F.conv1d(mixed, conv_weight, groups=mixed.shape[1]))[:, :, 0]     # [B, C]
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    rep = hv // hk
    q = l2norm(q.reshape(n, hk, dk).repeat_interleave(rep, dim=1).float()) * dk ** -0.5   # [B, Hv, Dk]
    k = l2norm(k.reshape(n, hk, dk).repeat_interleave(rep, dim=1).float())
    v = v.reshape(n, hv, dv).float()                                                  # [B, Hv, Dv]
    beta = b.float().sigmoid()                                                        # [B, Hv]
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())                # [B, Hv]
    s = state.index_select(0, slots) * g.exp()[..., None, None]                       # [B, Hv, Dk, Dv]
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, s))                   # [B, Hv, Dv]
    s = s + k[..., None] * u[..., None, :]
    state.index_copy_(0, slots, s)
    out = torch.einsum("bhk,bhkv->bhv", q, s)                                         # [B, Hv, Dv]
    out = gated_rms_norm(out.to(qkv.dtype), z.reshape(n, hv, dv), norm_weight, eps)
    return out.reshape(n, hv * dv)
