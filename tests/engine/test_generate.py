"""Generation: sampling with a seed, stop conditions, streaming, the stats line."""
from __future__ import annotations

import re

import pytest
import torch

from engine.generate import generate
from engine.loader import load_model
from engine.tokens import GenerationStats, SamplingParams, sample

STATS_LINE = re.compile(r"^Generation stats: time \d+\.\d{3}s, input_len \d+, output_len \d+, ttft \d+\.\d{3}s, "
                        r"tpot \d+\.\d{3}s, prefill \d+\.\d{3} tok/s, decode \d+\.\d{3} tok/s$")
PROMPT = [5, 17, 42, 8, 99, 3, 150]


@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    return load_model(folder)


def test_stats_line_format_and_arithmetic():
    s = GenerationStats(input_len=16, output_len=1022, time=303.530, ttft=11.378)
    assert str(s) == ("Generation stats: time 303.530s, input_len 16, output_len 1022, ttft 11.378s, "
                      "tpot 0.286s, prefill 1.406 tok/s, decode 3.495 tok/s")  # the seeds' Qwen3.5-27B line


def test_sampling_is_seeded_and_cut_by_top_k_top_p():
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0, 0.5])
    p = SamplingParams(temperature=1.0)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [sample(logits, p, g1) for _ in range(50)] == [sample(logits, p, g2) for _ in range(50)]
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)} == {1, 2}
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g) for _ in range(200)} <= {1, 2}
    assert {sample(logits, SamplingParams(temperature=5.0), g) for _ in range(400)} == {0, 1, 2, 3, 4}
    assert sample(logits, SamplingParams(), None) == 1
    assert {sample(logits, SamplingParams(temperature=1.0, top_k=1), g) for _ in range(20)} == {1}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_generate_seeded_sampling_repeats(lm):
    p = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    a = generate(lm.model, lm.tokenizer, PROMPT, p)
    b = generate(lm.model, lm.tokenizer, PROMPT, p)
    c = generate(lm.model, lm.tokenizer, PROMPT, SamplingParams(**{**{f: getattr(p, f) for f in p.__slots__}, "seed": 99}))
    greedy = generate(lm.model, lm.tokenizer, PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids or a.token_ids != greedy.token_ids


def test_stop_conditions_and_streaming(lm):
    greedy = generate(lm.model, lm.tokenizer, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    assert STATS_LINE.match(str(greedy.stats)), str(greedy.stats)
    assert greedy.stats.input_len == len(PROMPT) and greedy.stats.output_len == 12

    # EOS: make the 5th greedy token the end of sequence
    eos_id = greedy.token_ids[4]
    first = greedy.token_ids.index(eos_id)
    saved = lm.tokenizer.eos_token_ids
    lm.tokenizer.eos_token_ids = (eos_id,)
    try:
        r = generate(lm.model, lm.tokenizer, PROMPT, SamplingParams(max_tokens=12))
    finally:
        lm.tokenizer.eos_token_ids = saved
    assert r.finish_reason == "eos" and r.token_ids == greedy.token_ids[:first + 1]

    # a stop string: the text of tokens 6..7; streamed pieces add up to the final text
    stop = lm.tokenizer.decode(greedy.token_ids[6:8])
    pieces = []
    r = generate(lm.model, lm.tokenizer, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)),
                 on_text=pieces.append)
    full = lm.tokenizer.decode(greedy.token_ids)
    assert r.finish_reason == "stop"
    assert r.text == full[:full.find(stop)] and stop not in r.text
    assert "".join(pieces) == r.text

    pieces = []
    r = generate(lm.model, lm.tokenizer, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), on_text=pieces.append)
    assert "".join(pieces) == r.text == full


def test_kv_cache_bounds(lm):
    r = generate(lm.model, lm.tokenizer, PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), max_model_len=10)
    assert r.finish_reason == "length" and len(r.token_ids) == 10 - len(PROMPT) + 1
    with pytest.raises(ValueError, match="does not fit max_model_len=5"):
        generate(lm.model, lm.tokenizer, PROMPT, max_model_len=5)
