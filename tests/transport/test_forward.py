"""Fleet forward against the local fp9 reference, with real ducks on loopback:
N = 1, 3, 8 in the DeepSeek slice shape (hidden 7168, 64 units per duck) and
a padded shape (intermediate not a multiple of tp * 64)."""
import numpy as np
import pytest
import torch

from native.kernels import MoeSlice
from native.transport import slice_width, split_expert, split_experts
from tests.transport.ducks import Ducks

# The fleet sums the same fp32 partials as the reference, in duck order: only
# the summation order may differ, bounded relative to the output's magnitude.
SUMMATION_ORDER_RTOL = 1e-6
# Weights on the fp9 grid make the split exact: fleet vs float64 dense math
# differs by fp32 accumulation only.
DENSE_RTOL = 1e-4

DEEPSEEK_HIDDEN = 7168


def grid_weights(rng, shape):
    """Values k/64, |k| <= 8: exactly representable in fp9 (and bf16)."""
    return (rng.integers(-8, 9, shape) / 64).astype(np.float32)


def make_layer(rng, n_experts, inter, hidden):
    return [(grid_weights(rng, (inter, hidden)), grid_weights(rng, (inter, hidden)),
             grid_weights(rng, (hidden, inter))) for _ in range(n_experts)]


def local_reference(per_duck, hidden, x, ids, w):
    return sum(MoeSlice(slices, hidden).forward(x, ids, w) for slices in per_duck)


def dense_reference(experts, x, ids, w):
    x64 = x.astype(np.float64)
    y = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], w[t]):
            if e < 0:
                continue
            g, u, dn = (a.astype(np.float64) for a in experts[e])
            a = g @ x64[t]
            y[t] += wt * (dn @ (a / (1 + np.exp(-a)) * (u @ x64[t])))
    return y


def routing(rng, ntok, topk, n_experts):
    ids = np.stack([rng.choice(n_experts, topk, replace=False) for _ in range(ntok)]).astype(np.int32)
    if ntok > 1:
        ids[-1, -1] = -1                  # a skipped slot
    return ids, rng.random((ntok, topk)).astype(np.float32)


def flat(per_duck):
    return [[t for e in slices for t in (e.gate_up, e.down)] for slices in per_duck]


def assert_close(y, ref, rtol, what):
    scale = float(np.abs(ref).max())
    err = float(np.abs(y - ref).max())
    assert scale > 0 and err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} x {scale:.3g}"


@pytest.mark.parametrize("n_ducks", [1, 3, 8])
def test_deepseek_slice_shape(tmp_path, n_ducks):
    rng = np.random.default_rng(n_ducks)
    hidden, n_experts = DEEPSEEK_HIDDEN, 3
    experts = make_layer(rng, n_experts, 64 * n_ducks, hidden)
    per_duck = split_experts(experts, tp=n_ducks)
    assert per_duck[0][0].gate_up.shape == (128, hidden) and per_duck[0][0].down.shape == (hidden, 64)
    with Ducks(n_ducks, tmp_path, retransmit_ms=50, deadline_ms=5000) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({7: per_duck}, hidden)
        for ntok in (1, 9):
            x = (rng.standard_normal((ntok, hidden)) * 0.1).astype(np.float32)
            ids, w = routing(rng, ntok, 2, n_experts)
            y = session.forward(7, x, ids, w)
            assert_close(y, local_reference(per_duck, hidden, x, ids, w), SUMMATION_ORDER_RTOL, f"N={n_ducks}")
            if ntok == 1:
                assert_close(y, dense_reference(experts, x, ids, w), DENSE_RTOL, "dense")
        assert session.bytes_streamed > 0
        stats = ducks.fleet.stats()
        assert all(s["forwards"] == 2 and s["malformed"] == 0 for s in stats)
        session.close()


def test_padded_shape_prefill_and_bf16(tmp_path):
    """inter 200 over tp 3: S = 128, the third duck's slice is all padding."""
    rng = np.random.default_rng(11)
    hidden, inter, tp, n_experts = 320, 200, 3, 5
    assert slice_width(inter, tp) == 128
    experts = make_layer(rng, n_experts, inter, hidden)
    per_duck = split_experts(experts, tp=tp)
    assert not per_duck[2][0].gate_up.to_float().any()
    with Ducks(tp, tmp_path, retransmit_ms=50, deadline_ms=5000) as ducks:
        # layer 1 puts the slices on the ducks in reverse order
        ducks.fleet.upload([a + b for a, b in zip(flat(per_duck), flat(per_duck[::-1]))])
        session = ducks.fleet.open_session({0: per_duck, 1: per_duck[::-1]}, hidden)
        x = (rng.standard_normal((64, hidden)) * 0.1).astype(np.float32)     # a prefill batch
        ids, w = routing(rng, 64, 4, n_experts)
        y = session.forward(0, x, ids, w)
        assert_close(y, local_reference(per_duck, hidden, x, ids, w), SUMMATION_ORDER_RTOL, "prefill")
        assert_close(y, dense_reference(experts, x, ids, w), DENSE_RTOL, "prefill dense")
        xb = torch.from_numpy(x[:3]).to(torch.bfloat16)
        yb = session.forward(0, xb, ids[:3], w[:3])
        assert_close(yb, local_reference(per_duck, hidden, xb, ids[:3], w[:3]), SUMMATION_ORDER_RTOL, "bf16")
        # more than 64 tokens are chunked; an empty routing gives zeros
        x2 = np.concatenate([x, x[:6]])
        ids2, w2 = np.concatenate([ids, ids[:6]]), np.concatenate([w, w[:6]])
        assert_close(session.forward(1, x2, ids2, w2), local_reference(per_duck[::-1], hidden, x2, ids2, w2),
                     SUMMATION_ORDER_RTOL, "chunked")
        assert not session.forward(0, x[:2], np.full((2, 2), -1), np.zeros((2, 2))).any()


def test_dense_mlp_is_one_expert(tmp_path):
    rng = np.random.default_rng(5)
    hidden, inter = 192, 256
    g, u, dn = make_layer(rng, 1, inter, hidden)[0]
    slices = split_expert(torch.from_numpy(g).to(torch.bfloat16), torch.from_numpy(u).to(torch.bfloat16),
                          torch.from_numpy(dn).to(torch.bfloat16), tp=2)
    with Ducks(2, tmp_path) as ducks:
        ducks.fleet.upload(flat([[s] for s in slices]))
        session = ducks.fleet.open_session({0: [[s] for s in slices]}, hidden)
        x = rng.standard_normal((4, hidden)).astype(np.float32)
        y = session.forward(0, x, np.zeros((4, 1), np.int32), np.ones((4, 1), np.float32))
        assert_close(y, dense_reference([(g, u, dn)], x, [[0]] * 4, [[1.0]] * 4), DENSE_RTOL, "dense MLP")


def bf16_rounded(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (round to nearest even) -> fp32, by torch."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).float().numpy()


def test_bf16_partials_and_the_output_types(tmp_path):
    """y in bf16: each duck's fp32 partial rounded once to bf16, summed in fp32 in
    duck order, the sum rounded once; out as numpy uint16 bits or torch bfloat16;
    fp32 outs (numpy, torch) are the fp32 sum. x passes through in either type."""
    rng = np.random.default_rng(31)
    hidden, n, n_experts = 320, 3, 4
    experts = make_layer(rng, n_experts, 64 * n, hidden)
    per_duck = split_experts(experts, tp=n)
    x = (rng.standard_normal((5, hidden)) * 0.5).astype(np.float32)
    ids, w = routing(rng, 5, 2, n_experts)
    acc = np.zeros_like(x)
    for slices in per_duck:                       # duck order
        acc = acc + bf16_rounded(MoeSlice(slices, hidden).forward(x, ids, w))
    want_bf16 = torch.from_numpy(acc).to(torch.bfloat16)
    with Ducks(n, tmp_path) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        bits = np.empty((5, hidden), np.uint16)
        assert session.forward(0, x, ids, w, out=bits) is bits
        assert np.array_equal(bits, want_bf16.view(torch.int16).numpy().view(np.uint16))
        tb = torch.empty((5, hidden), dtype=torch.bfloat16)
        assert session.forward(0, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), out=tb) is tb
        assert torch.equal(tb, want_bf16)
        ref = local_reference(per_duck, hidden, x, ids, w)
        tf = torch.empty((5, hidden), dtype=torch.float32)
        session.forward(0, x, ids, w, out=tf)
        assert np.array_equal(tf.numpy(), ref) and np.array_equal(session.forward(0, x, ids, w), ref)
        # bf16 activations: numpy bits and torch bfloat16 are the same request
        xb = torch.from_numpy(x).to(torch.bfloat16)
        y_torch = session.forward(0, xb, ids, w)
        y_bits = session.forward(0, xb.view(torch.int16).numpy().view(np.uint16), ids, w)
        assert np.array_equal(y_torch, y_bits)
        assert np.array_equal(y_torch, local_reference(per_duck, hidden, xb, ids, w))
        # converted, not refused: a strided x, float64 x, lists of ids and weights
        assert np.array_equal(session.forward(0, np.asfortranarray(x), ids.tolist(), w.tolist()), ref)
        assert np.array_equal(session.forward(0, x.astype(np.float64), ids, w), ref)
        for bad in (np.empty((5, hidden), np.float64), np.empty((4, hidden), np.float32),
                    np.empty((hidden, 5), np.float32).T, torch.empty((5, hidden), dtype=torch.float16)):
            with pytest.raises(ValueError, match="out must be a contiguous fp32 or bf16"):
                session.forward(0, x, ids, w, out=bad)
        frozen = np.empty((5, hidden), np.float32)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="out must be"):
            session.forward(0, x, ids, w, out=frozen)


@pytest.mark.parametrize("delays_ms", [(40, 20, 0), (0, 40, 20)])
def test_the_sum_has_the_same_bits_whatever_the_arrival_order(tmp_path, delays_ms):
    """Partials are added as they arrive but in duck order: replies that come in
    the order 2, 1, 0 (or 0, 2, 1) give the bits of duck order, in fp32 and bf16."""
    rng = np.random.default_rng(41)
    hidden, n, n_experts = 256, 3, 3
    per_duck = split_experts(make_layer(rng, n_experts, 64 * n, hidden), tp=n)
    x = (rng.standard_normal((2, hidden)) * 0.5).astype(np.float32)
    ids, w = routing(rng, 2, 3, n_experts)
    slow = {i: ["--enable-fault-injection", "--delay-us", str(ms * 1000)] for i, ms in enumerate(delays_ms) if ms}
    want = local_reference(per_duck, hidden, x, ids, w)
    with Ducks(n, tmp_path, per_duck_args=slow, retransmit_ms=200, deadline_ms=5000) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        y = session.forward(0, x, ids, w)
        bits = np.empty((2, hidden), np.uint16)
        session.forward(0, x, ids, w, out=bits)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
    with Ducks(n, tmp_path / "in-order") as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        in_order = np.empty((2, hidden), np.uint16)
        session.forward(0, x, ids, w, out=in_order)
    assert np.array_equal(bits, in_order)


def _cut_case():
    """A layer of 6 experts over 3 ducks (hidden 128) and 200 tokens routed top-2 to it."""
    rng = np.random.default_rng(5)
    hidden, n, n_experts = 128, 3, 6
    per_duck = split_experts(make_layer(rng, n_experts, 64 * n, hidden), tp=n)
    x = (rng.standard_normal((200, hidden)) * 0.5).astype(np.float32)
    ids, w = routing(rng, 200, 2, n_experts)
    return hidden, n, per_duck, x, ids, w


@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_many_requests_in_flight_give_the_bits_of_one_at_a_time(tmp_path, out_dtype):
    """A forward of 200 tokens cut into requests of 16 (13 of them, the last 8): with 1, 2
    and 4 in flight per duck the sum has the same bits (each token's partials are added in
    duck order), equal to the local reference; each request streams each expert once."""
    hidden, n, per_duck, x, ids, w = _cut_case()
    with Ducks(n, tmp_path) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden, request_tokens=16)
        session.group_tokens = 0                                     # each request its own kernel pass
        outs = {}
        for pipeline in (1, 2, 4):
            session.pipeline = pipeline
            outs[pipeline] = session.forward(0, x, ids, w, out=np.empty((200, hidden), out_dtype))
            assert (session.last_requests, session.last_request_tokens, session.last_pipeline) == (13, 16, pipeline)
        assert np.array_equal(outs[1], outs[2]) and np.array_equal(outs[1], outs[4])
        session.request_tokens = 0                                   # as many as the ducks take (their hello)
        limit = min(info.max_tokens for info in ducks.fleet.infos)
        whole = session.forward(0, x, ids, w, out=np.empty((200, hidden), out_dtype))
        cut = -(-200 // limit)                                       # requests, cut evenly
        assert (session.last_requests, session.last_request_tokens) == (cut, -(-200 // cut))
        stats = ducks.fleet.stats()
        # one kernel run per request, unless a loaded host retransmitted (then the duck may compute one again)
        retransmitted = ducks.fleet.transport_stats()["retransmits"] > 0
        assert all(s["forwards"] == 3 * 13 + cut or (retransmitted and s["forwards"] > 39 + cut) for s in stats), stats
    if out_dtype == np.float32:   # another cut groups other tokens in a kernel call: not the same bits
        assert_close(whole, outs[1], SUMMATION_ORDER_RTOL, "the ducks' own cut vs requests of 16")
        assert_close(outs[1], local_reference(per_duck, hidden, x, ids, w), SUMMATION_ORDER_RTOL, "pipelined")


@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_a_cut_forward_runs_each_group_of_requests_in_one_kernel_pass(tmp_path, out_dtype):
    """The same 200 tokens in requests of 16 with 4 in flight, now held on the ducks in
    groups of 4 (WIRE_FWD_HOLD): 13 requests, 4 kernel passes (4 + 4 + 4 + 1). Each pass
    streams the experts its tokens use once, so the bytes streamed are those of the passes'
    expert sets, not the requests'; the sum is the local reference's, the same bits on
    every run, and each duck answered every request."""
    hidden, n, per_duck, x, ids, w = _cut_case()
    with Ducks(n, tmp_path) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden, request_tokens=16, pipeline=4)
        runs, streamed = [], []
        for group_tokens in (0, None, None):                          # one pass per request, then held groups
            session.group_tokens = group_tokens
            before = session.bytes_streamed
            runs.append(session.forward(0, x, ids, w, out=np.empty((200, hidden), out_dtype)))
            streamed.append(session.bytes_streamed - before)
            assert (session.last_requests, session.last_request_tokens, session.last_pipeline) == (13, 16, 4)
        assert session.last_group == 4
        stats = ducks.fleet.stats()
        retransmitted = ducks.fleet.transport_stats()["retransmits"] > 0
        assert all(s["forwards"] == 3 * 13 or (retransmitted and s["forwards"] > 39) for s in stats), stats
    distinct = lambda rows: len({int(e) for e in ids[rows].ravel() if e >= 0})   # noqa: E731
    per_request = sum(distinct(slice(t, t + 16)) for t in range(0, 200, 16))
    per_pass = sum(distinct(slice(t, t + 64)) for t in range(0, 200, 64))
    assert per_pass < per_request
    assert streamed[1] * per_request == streamed[0] * per_pass and streamed[2] == streamed[1]
    assert np.array_equal(runs[1], runs[2])
    if out_dtype == np.float32:   # a pass over other tokens orders its sums otherwise: not the same bits
        assert_close(runs[1], runs[0], SUMMATION_ORDER_RTOL, "held groups vs a pass per request")
        assert_close(runs[1], local_reference(per_duck, hidden, x, ids, w), SUMMATION_ORDER_RTOL, "held groups")


def test_a_forward_longer_than_the_deadline_is_neither_resent_nor_failed(tmp_path):
    """A duck that computes a request for longer than the host's failure deadline: the
    host expects it (the duck's measured time per token times the request's tokens), so
    it neither retransmits nor gives up; a RESEND that arrives while the duck computes
    would be answered by the reply the duck sends anyway."""
    from native.transport import Fleet
    from native.transport.session import Session

    rng = np.random.default_rng(9)
    # 128 tokens through 2048 x 8192 x 3: about 45 ms on AMX tiles, several times that on FMAs
    hidden, inter, deadline_ms, ntok = 2048, 8192, 20, 128
    per_duck = split_experts([(grid_weights(rng, (inter, hidden)), grid_weights(rng, (inter, hidden)),
                               grid_weights(rng, (hidden, inter)))], tp=1)
    x = (rng.standard_normal((ntok, hidden)) * 0.1).astype(np.float32)
    ones = (np.zeros((ntok, 1), np.int32), np.ones((ntok, 1), np.float32))
    with Ducks(1, tmp_path, deadline_ms=5000) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        want = session.forward(0, x, *ones)
        with Fleet([ducks[0].address], ducks.key, retransmit_ms=2, deadline_ms=deadline_ms) as fast:
            fast.hello()
            quick = Session(fast, session.id, hidden, {0})
            # the duck's time per token, measured (this first call's timer knows nothing yet: on a
            # busy machine its 1-token kernel may outlast it and be resent once; not what is tested)
            quick.forward(0, x[:1], ones[0][:1], ones[1][:1])
            before, resent_before = fast.transport_stats()["retransmits"], quick.retransmits
            y = quick.forward(0, x, *ones)
            assert quick.kernel_us_max / 1000 > deadline_ms, "the request was not longer than the deadline"
            assert fast.transport_stats()["retransmits"] == before and quick.retransmits == resent_before
        assert np.array_equal(y, want)


def test_a_prefill_sized_forward_is_cut_to_what_the_messages_carry(tmp_path):
    """1024 tokens at hidden 4096 in fp32 are 16 MiB each way: more than a message may be at
    the fallback datagram size (a NACK names every fragment), so the forward goes as requests
    that fit, not as an error; the sum is that of the experts (here: none, zeros)."""
    hidden, n = 4096, 1024
    with Ducks(2, tmp_path) as ducks:
        session = ducks.fleet.open_session({0: [[], []]}, hidden)
        x = np.ones((n, hidden), np.float32)
        y = session.forward(0, x, np.full((n, 1), -1, np.int32), np.zeros((n, 1), np.float32))
        assert np.array_equal(y, np.zeros_like(x))
        assert session.last_requests >= 2 and session.last_request_tokens * session.last_requests >= n


@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_a_prefill_chunk_on_helper_threads_has_the_bits_of_one_thread(tmp_path, out_dtype):
    """A chunk of 256 tokens at hidden 1024 in bf16 is 512 KiB to each duck and 0.5-1 MiB
    back: the host seals, checks and sums it on its helper threads, and each duck (two
    worker threads) checks its request's datagrams and seals its reply over its pool. The
    sum has the bits of the host on one thread, and (fp32) of the local reference."""
    from native.transport import Fleet

    rng = np.random.default_rng(17)
    hidden, n, n_experts, ntok = 1024, 2, 4, 256
    per_duck = split_experts(make_layer(rng, n_experts, 64 * n, hidden), tp=n)
    xf = (rng.standard_normal((ntok, hidden)) * 0.5).astype(np.float32)
    x = torch.from_numpy(xf).to(torch.bfloat16)
    ids, w = routing(rng, ntok, 2, n_experts)
    with Ducks(n, tmp_path, args=["--threads", "2"], workers=1) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        alone = session.forward(0, x, ids, w, out=np.empty((ntok, hidden), out_dtype))
        assert ducks.fleet.workers == 1
        with Fleet([d.address for d in ducks.ducks], ducks.key, workers=4) as shared:
            shared.hello()
            from native.transport.session import Session
            helped = Session(shared, session.id, hidden, {0})
            y = helped.forward(0, x, ids, w, out=np.empty((ntok, hidden), out_dtype))
            assert shared.workers == 4 and helped.last_requests == 1
    assert np.array_equal(y, alone)
    if out_dtype == np.float32:   # the local slices given the same bf16 activations: the same bits
        want = local_reference(per_duck, hidden, x, ids, w)
        assert np.array_equal(y.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))


def test_the_duck_time_per_token_comes_from_the_reply_just_received(tmp_path):
    """A one-datagram reply's kernel time is read once its payload is in the reply: the
    first forward of a fresh fleet sets the duck's time per token to exactly what the duck
    reported (the expected compute of a long forward, and the silence that fails it, follow
    from it). It was once read before the copy, from whatever the buffer held."""
    from native.transport import Fleet
    from native.transport.session import Session

    rng = np.random.default_rng(4)
    hidden = 1024
    per_duck = split_experts(make_layer(rng, 1, 512, hidden), tp=1)
    x = (rng.standard_normal((1, hidden)) * 0.1).astype(np.float32)
    ones = (np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32))
    with Ducks(1, tmp_path) as ducks:
        ducks.fleet.upload(flat(per_duck))
        session = ducks.fleet.open_session({0: per_duck}, hidden)
        with Fleet([ducks[0].address], ducks.key, deadline_ms=1000) as fresh:
            fresh.hello()
            one = Session(fresh, session.id, hidden, {0})
            one.forward(0, x, *ones)
            kernel_us = one.kernel_us_max
            assert kernel_us > 0
            per_ns = kernel_us * 1000                      # the first sample: its variation is half of it
            work_ns = (per_ns + 4 * (per_ns // 2)) * 1000  # a forward of 1000 tokens
            assert fresh.lost_after_ms(0, 1000) == pytest.approx((1000 * 1000 + 4 * work_ns // 1000) / 1000)
