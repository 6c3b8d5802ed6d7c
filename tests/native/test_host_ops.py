"""The native decoder's host ops (native/host/host_ops.c) against the torch
modules they stand in for (engine.layers, engine.models.base) and float64, with
every kernel set: RMSNorm, the fused residual add + RMSNorm, rotary with and
without Qwen3's per-head norm (default and llama3 rope scaling), cached GQA
attention over a strided cache, and the softmax top-k router."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers import RMSNorm, rope_inv_freq
from engine.ops import qk_norm_rope_ref
from engine.models.base import TopKRouter
from native.host import ops
from tests.native.test_host_kernels import SETS, kernel_set

NORM_TOL = 3e-6        # max |ours - torch| / max |torch|: one fp32 sum of squares, ordered differently
ROPE_TOL = 3e-6        # cos/sin (libm vs torch's vectorized ones, ~1 ulp each) times |x|, relative to max |x|
ATTEND_TOL = 2e-6      # max |ours - float64| / max |v|: fp32 scores, softmax and weighted sum
ROUTER_TOL = 1e-6      # weights, absolute (they lie in [0, 1])

HIDDEN = [1, 3, 17, 33, 576]


def _data(*shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", HIDDEN)
def test_rmsnorm_matches_torch(name, n):
    x, w = _data(3, n, seed=n) * 5, _data(n, seed=n + 1)
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.from_numpy(w)
    y, x_after = ops.rmsnorm(x, w, 1e-5, kernel_set(name))
    assert np.array_equal(x_after, x), "without add, x is left as it was"
    assert _rel(y, norm(torch.from_numpy(x)).detach().numpy()) <= NORM_TOL


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n", HIDDEN)
def test_add_rmsnorm_adds_the_residual_then_norms(name, n):
    x, add, w = _data(2, n, seed=n), _data(2, n, seed=n + 2), _data(n, seed=n + 3)
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = torch.from_numpy(w)
    y, x_after = ops.rmsnorm(x, w, 1e-6, kernel_set(name), add=add)
    assert np.array_equal(x_after, x + add), "the residual add is one fp32 add, as x + y in torch"
    assert _rel(y, norm(torch.from_numpy(x + add)).detach().numpy()) <= NORM_TOL


def _rope_config(head_dim: int, scaling: dict | None) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=8, hidden_size=4 * head_dim, intermediate_size=8,
                       num_hidden_layers=1, num_attention_heads=4, head_dim=head_dim, rope_theta=500000.0,
                       rope_scaling=scaling, max_position_embeddings=131072)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("head_dim", [2, 6, 64, 128])
@pytest.mark.parametrize("position", [0, 1, 37, 5000, 100000])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rope_matches_the_models_rotary(name, head_dim, position, scaling):
    config = _rope_config(head_dim, scaling)
    q, k = _data(3, head_dim, seed=head_dim), _data(1, head_dim, seed=position)
    rq, rk = qk_norm_rope_ref(torch.from_numpy(q)[None], torch.from_numpy(k)[None], torch.tensor([position]),
                              rope_inv_freq(config))                           # the models' rotary (engine.ops)
    inv_freq = rope_inv_freq(config).numpy()
    assert _rel(ops.rope(q, position, inv_freq, kernel_set(name)), rq[0].numpy()) <= ROPE_TOL
    assert _rel(ops.rope(k, position, inv_freq, kernel_set(name)), rk[0].numpy()) <= ROPE_TOL


@pytest.mark.parametrize("name", SETS)
def test_rope_norms_each_head_first_like_qwen3(name):
    config = _rope_config(64, None)
    x, w = _data(5, 64, seed=1) * 3, _data(64, seed=2)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.from_numpy(w)
    normed = norm(torch.from_numpy(x))                                               # [heads, D]
    want, _ = qk_norm_rope_ref(normed[None], normed[None], torch.tensor([42]), rope_inv_freq(config))
    got = ops.rope(x, 42, rope_inv_freq(config).numpy(), kernel_set(name), norm_w=w, eps=1e-6)
    assert _rel(got, want[0].detach().numpy()) <= ROPE_TOL + NORM_TOL


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n_ctx", [1, 2, 17, 300])
@pytest.mark.parametrize("head_dim", [2, 16, 64, 80])
def test_attend_matches_float64_on_a_strided_cache(name, n_ctx, head_dim):
    """Head 1 of a [S, 3 kv heads, D] cache, as the decoder reads it."""
    keys, values = _data(n_ctx, 3, head_dim, seed=n_ctx), _data(n_ctx, 3, head_dim, seed=head_dim)
    q = _data(head_dim, seed=n_ctx + head_dim) * 2
    scale = head_dim ** -0.5
    out = ops.attend(q, keys, values, scale, kernel_set(name), head=1)
    k64, v64 = keys[:, 1].astype(np.float64), values[:, 1].astype(np.float64)
    s = k64 @ q.astype(np.float64) * scale
    p = np.exp(s - s.max())
    want = (p / p.sum()) @ v64
    assert np.max(np.abs(out - want)) / np.max(np.abs(v64)) <= ATTEND_TOL


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("n_ctx", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
def test_attend_on_a_half_cache_matches_float64(name, n_ctx, head_dim):
    """Three query heads of one kv head over float16 keys and values (a half cache's
    head, its positions one run; keys widened 64 positions at a time): the float64
    attention over the same halves, and each head the bits it gets alone."""
    keys = _data(n_ctx, head_dim, seed=n_ctx).astype(np.float16)
    values = _data(n_ctx, head_dim, seed=head_dim).astype(np.float16)
    q = _data(3, head_dim, seed=n_ctx + head_dim) * 2
    scale = head_dim ** -0.5
    out = ops.attend_half(q, keys, values, scale, kernel_set(name))
    k64, v64 = keys.astype(np.float64), values.astype(np.float64)
    for h in range(3):
        s = k64 @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        assert np.max(np.abs(out[h] - (p / p.sum()) @ v64)) / np.max(np.abs(v64)) <= ATTEND_TOL, h
        assert np.array_equal(ops.attend_half(q[h], keys, values, scale, kernel_set(name))[0], out[h]), h


@pytest.mark.parametrize("name", SETS)
def test_a_half_cache_gives_the_bits_of_its_values_widened(name):
    """Attention on a half cache is the fp32 attention on the same values widened, bit for bit."""
    keys = _data(200, 64, seed=1).astype(np.float16)
    values = _data(200, 64, seed=2).astype(np.float16)
    q = _data(64, seed=3)
    half = ops.attend_half(q, keys, values, 0.125, kernel_set(name))[0]
    assert np.array_equal(half, ops.attend(q, keys.astype(np.float32), values.astype(np.float32), 0.125,
                                           kernel_set(name)))


def test_attend_matches_torch_sdpa():
    keys, values, q = _data(50, 64, seed=1), _data(50, 64, seed=2), _data(64, seed=3)
    want = F.scaled_dot_product_attention(torch.from_numpy(q)[None, None], torch.from_numpy(keys)[None],
                                          torch.from_numpy(values)[None], scale=0.125)[0, 0].numpy()
    assert np.max(np.abs(ops.attend(q, keys, values, 0.125) - want)) / np.max(np.abs(values)) <= ATTEND_TOL


@pytest.mark.parametrize("experts,topk", [(1, 1), (7, 3), (128, 8), (33, 32)])
@pytest.mark.parametrize("normalize", [False, True])
def test_topk_softmax_matches_the_router(experts, topk, normalize):
    router = TopKRouter(48, experts, topk, normalize)
    router.weight.data = torch.from_numpy(_data(experts, 48, seed=experts))
    x = torch.from_numpy(_data(4, 48, seed=topk))
    with torch.no_grad():
        want_ids, want_w = router(x)
        logits = F.linear(x, router.weight).numpy()
    for t in range(4):
        ids, weights = ops.topk_softmax(logits[t], topk, normalize)
        assert ids.tolist() == want_ids[t].tolist()
        assert np.max(np.abs(weights - want_w[t].numpy())) <= ROUTER_TOL
