"""The CPU host decoder's step driven from C over the fleet (native/transport/host_step.h)
against the same decoder's loop in Python (DUCK_NATIVE_STEP=0, the reference): tiny
Llama, Qwen3 and Qwen3-MoE models (a dense layer among routed ones) on two real local
ducks, batches of decode tokens and prefill chunks in several slots, the same logits
bit for bit; the step's times and counters; what it says when a duck is gone or the
decoder refuses a layer."""
from __future__ import annotations

import pytest
import torch

from engine.cpu.decode import CpuDecoder, NativeDecodeError
from engine.fleet_ffn import FleetFfn
from engine.loader import load_model
from native.transport import DuckTimeout
from native.transport.step import HostStep, HostStepError
from tests.engine.conftest import TINY


@pytest.fixture(scope="module")
def fleet_models(tiny_checkpoint):
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = load_model(tiny_checkpoint(kind)[0], device="cpu", backend=FleetFfn(local_ducks=2))
        return made[kind]
    yield get
    for lm in made.values():
        lm.ffn.close()


def _steps(vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Steps of a batch: slot 0 reads a prompt of 9 tokens while slots 1..3 start with one
    each; then every slot decodes a token, twice."""
    g = torch.Generator().manual_seed(seed)
    first = (torch.randint(2, vocab, (12,), generator=g), torch.tensor(list(range(9)) + [0, 0, 0]),
             torch.tensor([0] * 9 + [1, 2, 3], dtype=torch.int32))
    slots = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    return [first] + [(torch.randint(2, vocab, (4,), generator=g), torch.tensor([9 + s, 1 + s, 1 + s, 1 + s]), slots)
                      for s in range(2)]


def _logits_of_steps(lm, steps, native_step: str, monkeypatch) -> tuple[list[torch.Tensor], CpuDecoder]:
    monkeypatch.setenv("DUCK_NATIVE_STEP", native_step)
    cache = lm.model.make_slot_cache(4, 32)
    decoder = CpuDecoder(lm.model, cache, max_tokens=16)
    out = []
    for ids, positions, slots in steps:
        y = decoder.layers(ids, positions, slots)
        out.append(decoder.logits(y))
    return out, decoder


@pytest.mark.parametrize("kind", sorted(TINY))
def test_the_c_step_gives_the_python_loops_logits_bit_for_bit(kind, fleet_models, monkeypatch):
    lm = fleet_models(kind)
    steps = _steps(TINY[kind]["vocab_size"], seed=1)
    reference, py = _logits_of_steps(lm, steps, "0", monkeypatch)
    k0 = lm.ffn.kernel_us_total
    streamed = lm.ffn.bytes_streamed
    native, c = _logits_of_steps(lm, steps, "1", monkeypatch)
    assert py._fleet is None and c._fleet is not None      # the reference ran in Python, the other from C
    for a, b in zip(native, reference):
        assert torch.equal(a, b)
    assert lm.ffn.bytes_streamed > streamed and lm.ffn.kernel_us_total >= k0   # the session's counters kept


def test_the_c_step_reports_each_layers_times_to_a_timed_backend(fleet_models, monkeypatch):
    from bench.timed_ffn import TimedFfn

    lm = fleet_models("qwen3_moe")
    timed = TimedFfn(lm.ffn)
    lm.model.set_ffn(timed)
    try:
        _, decoder = _logits_of_steps(lm, _steps(TINY["qwen3_moe"]["vocab_size"], seed=3)[:1], "1", monkeypatch)
        assert decoder._fleet is not None
        layers = TINY["qwen3_moe"]["num_hidden_layers"]
        assert [c[0] for c in timed.calls] == list(range(layers))
        assert all(wall > 0 and 0 <= kernel <= wall for _, wall, kernel in timed.calls)
    finally:
        lm.model.set_ffn(lm.ffn)


def test_a_layer_the_decoder_refuses_is_named(fleet_models, monkeypatch):
    lm = fleet_models("llama")
    monkeypatch.setenv("DUCK_NATIVE_STEP", "1")
    decoder = CpuDecoder(lm.model, lm.model.make_slot_cache(1, 16), max_tokens=4)
    backend, session, step = decoder._fleet_step()
    with pytest.raises(HostStepError, match="layer 0: layer step 0 without duck_host_begin"):
        step.run(2)   # not begun: the decoder refuses the first layer
    with pytest.raises(ValueError, match="5 tokens, its buffers hold 4"):
        step.run(5)
    with pytest.raises(ValueError, match="fp32"):
        HostStep(session, decoder._d, 3, decoder.ffn_in.half(), decoder.ffn_out, decoder._dense)
    ids, positions = torch.tensor([5, 6]), torch.tensor([0, 1])
    with pytest.raises(NativeDecodeError, match="position"):   # past the cache: refused before any layer
        decoder.layers(ids, positions + 15)


def test_a_duck_gone_mid_step_is_named(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("DUCK_NATIVE_STEP", "1")
    ffn = FleetFfn(local_ducks=2, deadline_ms=300, retransmit_ms=20)
    try:
        lm = load_model(tiny_checkpoint("qwen3")[0], device="cpu", backend=ffn)
        decoder = CpuDecoder(lm.model, lm.model.make_slot_cache(1, 16), max_tokens=4)
        ids, positions = torch.tensor([5, 6]), torch.tensor([0, 1])
        decoder.logits(decoder.layers(ids, positions))
        ffn.local.procs[1].kill()
        ffn.local.procs[1].wait()
        with pytest.raises(DuckTimeout, match="duck 1"):
            decoder.layers(ids, positions + 2)
        ffn.session = None   # no session to close on a duck that is gone
    finally:
        ffn.close()
