"""Sampling defaults and the repetition penalty against transformers: the penalty is
transformers' RepetitionPenaltyLogitsProcessor, greedy generation with it gives the
tokens transformers' generate gives on the same weights, and a checkpoint's
generation_config.json becomes the defaults (do_sample false: greedy)."""
from __future__ import annotations

import json

import pytest
import torch

from engine.generate import generate
from engine.loader import load_model, sampling_defaults
from engine.tokens import SamplingParams, penalize


def test_penalty_is_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=g) * 3
    seen = [4, 7, 7, 11, 49, 0]
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), logits[None].clone())[0]
    torch.testing.assert_close(penalize(logits, seen, 1.3), want, rtol=0, atol=0)
    assert penalize(logits, seen, 1.0) is logits and penalize(logits, [], 1.3) is logits
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0)


def test_greedy_with_penalty_matches_transformers_generate(tiny_checkpoint):
    folder, hf = tiny_checkpoint("llama")
    lm = load_model(folder)
    prompt = torch.randint(2, lm.config.vocab_size, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=20, ignore_eos=True,
                                                                    repetition_penalty=1.5)).token_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=1.5,
                          eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()
    plain = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
    assert plain != ours, "the penalty changed nothing on this prompt: pick another"


def test_generation_config_gives_the_defaults(tmp_path, tiny_checkpoint):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
         "max_new_tokens": 99}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "repetition_penalty": 1.2}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.0, "repetition_penalty": 1.2}, "do_sample false: greedy"
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json: not valid JSON"):
        sampling_defaults(tmp_path)
    assert sampling_defaults(tmp_path / "none") == {}
    folder, _ = tiny_checkpoint("llama")
    assert load_model(folder).sampling == sampling_defaults(folder)


def test_frequency_and_presence_penalties_are_openais_rule():
    """OpenAI's rule: logit[t] - count[t] * frequency - (count[t] > 0) * presence, over the tokens
    generated so far (not the prompt)."""
    from engine.tokens import penalize_counts
    logits = torch.linspace(-1, 1, 10)
    got = penalize_counts(logits, [3, 3, 5, 3], frequency=0.5, presence=0.25)
    want = logits.clone()
    want[3] -= 3 * 0.5 + 0.25
    want[5] -= 0.5 + 0.25
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert penalize_counts(logits, [], 1.0, 1.0) is logits and penalize_counts(logits, [3], 0, 0) is logits
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=2.5)
    assert not SamplingParams(presence_penalty=0.1).drafts_apply and SamplingParams().drafts_apply


@pytest.mark.parametrize("path", ["generate", "native batch", "torch batch"])
def test_logprobs_are_the_models_log_softmax_of_each_chosen_token(path, tiny_checkpoint, monkeypatch):
    """Each generated token's entry is its log-probability under the model's logits at its
    position (a teacher-forced forward of prompt + output says what they are), with the top
    alternatives in order; the same through generate() and the batch loop on both paths; with
    penalties the logits are the penalized ones, and greedy output moves."""
    from engine.batch import BatchDecoder
    from engine.generate import forward_logits
    from tests.engine.test_batch import drain_results

    folder, _ = tiny_checkpoint("qwen3")
    lm = load_model(folder, backend="fp9")
    prompt = torch.randint(2, lm.config.vocab_size, (9,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(max_tokens=7, ignore_eos=True, logprobs=4)
    if path == "generate":
        run = lambda p: generate(lm.model, lm.tokenizer, prompt, p)  # noqa: E731
    else:
        kind = "native" if path == "native batch" else "torch"
        run = lambda p: drain_results(BatchDecoder(lm.model, lm.tokenizer, slots=2, max_model_len=32,  # noqa: E731
                                                   step_tokens=16, path=kind), [(prompt, p)])[0]
    got = run(params)
    assert [e.token for e in got.logprobs] == got.token_ids and len(got.logprobs) == 7
    want = torch.log_softmax(forward_logits(lm.model, prompt + got.token_ids).float(), -1)[len(prompt) - 1:-1]
    for i, e in enumerate(got.logprobs):
        assert e.logprob == pytest.approx(float(want[i, e.token]), abs=2e-3)
        assert [t for t, _ in e.top] == want[i].topk(4).indices.tolist() and e.top[0][0] == e.token
    assert got.token_ids == run(SamplingParams(max_tokens=7, ignore_eos=True)).token_ids   # logprobs change nothing
    punished = run(SamplingParams(max_tokens=7, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                                  logprobs=0))
    assert all(e.top == () for e in punished.logprobs)
    from engine.tokens import penalize_counts
    raw = forward_logits(lm.model, prompt + punished.token_ids).float()[len(prompt) - 1:-1]
    for i, e in enumerate(punished.logprobs):   # each from the logits penalized by the tokens before it
        lp = torch.log_softmax(penalize_counts(raw[i], punished.token_ids[:i], 2.0, 2.0), -1)
        assert e.logprob == pytest.approx(float(lp[e.token]), abs=2e-3) and e.token == int(lp.argmax())
