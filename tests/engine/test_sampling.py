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
