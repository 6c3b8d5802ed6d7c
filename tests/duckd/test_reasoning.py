"""A reasoning model's <think> text apart from its answer (duckd/reasoning.py), and through the
OpenAI API of a real daemon: a tiny random model whose vocabulary has the tags and whose chat
template opens the thinking block unless chat_template_kwargs says enable_thinking false."""
from __future__ import annotations

import json

import openai
import pytest

from duckd.reasoning import ReasoningSplit, prompt_opens_thinking


def _feed(split: ReasoningSplit, deltas: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for d in [*deltas, None]:
        r, c = split.feed(d) if d is not None else split.flush()
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 100])
def test_the_split_holds_a_tag_cut_anywhere(cut):
    text = "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4. A <b>tag</b> and <thin text stay."
    deltas = [text[i:i + cut] for i in range(0, len(text), cut)]
    assert _feed(ReasoningSplit(), deltas) == ("Let me see: 2 + 2.\n", "It is 4. A <b>tag</b> and <thin text stay.")
    # opened by the prompt: the completion starts inside the block
    assert _feed(ReasoningSplit(inside=True), ["\nHm, ", "4.</th", "ink>\n\n4"]) == ("Hm, 4.", "4")
    assert _feed(ReasoningSplit(), ["no thinking at all <"]) == ("", "no thinking at all <")
    assert prompt_opens_thinking("user: hi\nassistant: <think>\n")
    assert not prompt_opens_thinking("assistant: <think> </think> ") and not prompt_opens_thinking("plain")


TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}assistant "
            "{% if enable_thinking is defined and not enable_thinking %}<think> </think> {% else %}<think> {% endif %}")


@pytest.fixture(scope="module")
def thinking_daemon(tmp_path_factory):
    from tests.duckd_fixture import RunningDaemon, write_config
    from tests.engine.conftest import TINY, hf_model

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    base = tmp_path_factory.mktemp("thinking")
    folder = base / "model"
    hf_model("qwen3").save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(TINY["qwen3"]["vocab_size"] - 2)}
    vocab |= {"<think>": len(vocab), "</think>": len(vocab) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1", "chat_template": TEMPLATE}))
    state = base / "duck"
    daemon = RunningDaemon(write_config(base / "duckd.toml", state, ducks=2, model={"path": str(folder)}), state,
                           env={"XDG_STATE_HOME": str(base)}).start()
    yield daemon
    daemon.stop()


def test_thinking_comes_as_reasoning_content_and_the_template_switch_turns_it_off(thinking_daemon):
    client = openai.OpenAI(base_url=f"http://{thinking_daemon.http_address}/v1", api_key=thinking_daemon.token,
                           max_retries=0)
    ask = dict(model="default", messages=[{"role": "user", "content": "w5 w9"}], max_tokens=8, temperature=0)
    raw = client.completions.create(model="default", prompt="user w5 w9 assistant <think>", max_tokens=8,
                                    temperature=0).choices[0].text
    thinking = client.chat.completions.create(**ask)
    message = thinking.choices[0].message
    assert message.content == "" and message.reasoning_content == raw.strip() and "</think>" not in raw
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == thinking.usage.prompt_tokens + 1      # the template closed the block
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == message.reasoning_content and not any(c.choices[0].delta.content for c in chunks
                                                              if c.choices)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.param == "chat_template_kwargs.messages"
