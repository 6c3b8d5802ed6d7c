"""Lanes (engine.lanes): a forward stopped at every FFN call gives the model's own
result, and the dual lane (token and draft one stage apart, FFN calls on a worker
thread) gives exactly the 2-token forward, for every family's cache kind
(KV, MLA latents, DeltaNet conv/recurrent state)."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.lanes import (
    EagerLane,
    FfnWorker,
    StepTrace,
    run_lane,
    run_two_lanes,
)
from engine.loader import load_model


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v32", "qwen3_5_moe"])
def test_lanes_reproduce_the_forward(family, tiny_family):
    lm = load_model(tiny_family(family), backend="torch")
    model, vocab = lm.model, lm.model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, vocab, (9,), generator=g)
    steps = torch.randint(2, vocab, (6,), generator=g)
    ref_cache, cache = model.make_cache(32), model.make_cache(32)
    with torch.inference_mode():
        model(prompt, torch.arange(9), ref_cache)
        model(prompt, torch.arange(9), cache)
    backend = model.ffn_backend()
    lane_a, lane_b = EagerLane(model, cache, "a"), EagerLane(model, cache, "b")
    worker = FfnWorker(backend)
    threads_seen = set()
    forward = backend.forward

    def spy(layer, x, ids, w, out=None):
        threads_seen.add(threading.current_thread().name)
        return forward(layer, x, ids, w, out=out)
    backend.forward = spy
    try:
        pos = 9
        for step in range(3):   # single lane, then two lanes, alternating
            ids = steps[2 * step:2 * step + 2]
            positions = torch.arange(pos, pos + 2)
            with torch.inference_mode():
                ref = model(ids, positions, ref_cache)                          # the 2-token forward
            trace = StepTrace()
            if step % 2 == 0:
                got = run_two_lanes(lane_a, lane_b, worker, ids, positions, trace)
                n_ffn = len(model.ffn_modules())
                assert trace.calls == 2 * n_ffn and trace.wall > 0 and trace.host > 0
            else:
                got = run_lane(lane_a, backend, ids, positions, trace)
                assert trace.calls == len(model.ffn_modules())
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            pos += 2
        assert "duck-ffn-worker" in threads_seen
    finally:
        backend.forward = forward
        for part in (lane_a, lane_b, worker):
            part.close()


def test_lane_errors_reach_the_caller(tiny_family):
    lm = load_model(tiny_family("llama"), backend="torch")
    cache = lm.model.make_cache(8)
    lane = EagerLane(lm.model, cache)
    try:
        with pytest.raises(ValueError, match="beyond the KV cache"):
            run_lane(lane, lm.ffn, torch.tensor([3]), torch.tensor([8]))
        with pytest.raises(RuntimeError, match="no FFN call was pending"):
            lane.resume(torch.zeros(1, 1))
        out = run_lane(lane, lm.ffn, torch.tensor([3]), torch.tensor([0]))   # the lane still works
        assert out.shape == (1, lm.model.config.hidden_size)
    finally:
        lane.close()
