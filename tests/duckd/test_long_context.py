"""DeepSeek-V3.2 past index_topk through the daemon: a tiny V3.2 model served by a real
duckd with a real fleet takes a 20,000-token prompt through the OpenAI API (its sparse
attention; the context sized by duckd.context_size, not capped at index_topk) and answers
with the greedy tokens of the independent plain-torch reference (tests/engine/dsa_reference.py)."""
from __future__ import annotations

import re

import openai
import pytest
import torch

from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_deepseek import TINY_DS, hf_deepseek

KIND = "deepseek_v32"
PROMPT_TOKENS = 20_000
ANSWER_TOKENS = 6


@pytest.fixture(scope="module")
def long_v32(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v32-long")
    hf_deepseek(KIND, index_n_heads=16, max_position_embeddings=32768).save_pretrained(folder)
    write_word_tokenizer(folder, TINY_DS[KIND]["vocab_size"])
    return folder


def test_a_20000_token_prompt_is_answered_with_the_references_greedy_tokens(tmp_path, long_v32):
    from tests.duckd_fixture import RunningDaemon, write_config
    from tests.engine.dsa_reference import load_reference

    state = tmp_path / "state"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2,
                                        model={"path": str(long_v32), "device": "cpu", "max_model_len": "auto",
                                               "max_seqs": 2, "kv_cache_budget": "64M", "mtp": False}),
                           state, env={"XDG_STATE_HOME": str(tmp_path)}).start()
    try:
        sized = re.search(r"context: .* allow (\d+) tokens; max_model_len (\d+)", daemon.log())
        assert sized, daemon.log()[-2000:]
        assert int(sized.group(2)) >= PROMPT_TOKENS + ANSWER_TOKENS > TINY_DS[KIND]["index_topk"]
        g = torch.Generator().manual_seed(15)   # a prompt whose greedy answer is six different words
        words = torch.randint(2, TINY_DS[KIND]["vocab_size"], (PROMPT_TOKENS,), generator=g).tolist()
        client = openai.OpenAI(base_url=f"http://{daemon.http_address}/v1", api_key=daemon.token, max_retries=0,
                               timeout=600)
        r = client.completions.create(model="default", prompt=" ".join(f"w{i}" for i in words),
                                      max_tokens=ANSWER_TOKENS, temperature=0)
        assert r.usage.prompt_tokens >= PROMPT_TOKENS
        answer = [int(w[1:]) for w in r.choices[0].text.split()]
        assert len(answer) == ANSWER_TOKENS and r.choices[0].finish_reason == "length"
    finally:
        daemon.stop()
    from engine.loader import load_model
    tokenizer = load_model(long_v32, device="cpu", backend="torch").tokenizer
    prompt = tokenizer.encode(" ".join(f"w{i}" for i in words))
    assert len(prompt) == r.usage.prompt_tokens
    ref = load_reference(long_v32)
    logits = ref.logits(prompt + answer[:-1], fp8=True)
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == answer   # each answer token the reference's greedy pick
