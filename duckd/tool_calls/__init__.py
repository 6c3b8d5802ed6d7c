"""Tool (function) calls the way each model family writes them: the system-prompt text that
describes the tools to a model whose chat template does not, the history (past calls and their
results) in the shape the family's template reads, a grammar that holds the model to well-formed
calls (tool_choice "required" or a named function), and a parser that takes the completion's
text deltas as they come and gives the content apart from the calls.

    fmt = tool_format(tokenizer)                    # the family, from the chat template and vocabulary
    tools = check_tools(request_tools)              # ToolFormatError names the bad field
    messages = fmt.template_messages(messages)      # OpenAI history -> what the template expects
    prompt = tokenizer.apply_chat_template(messages, tools=tools)   # when fmt.renders_tools,
    # else the first system message gets fmt.tools_prompt(tools)
    grammar = fmt.lark(tools, names=["get_weather"], parallel=False)   # a forced call (Lark, llguidance)
    parser = fmt.parser(tools)
    content, calls = parser.feed(delta)             # ... for each delta
    content, calls = parser.flush()                 # at the end: held-back text, an unfinished call's text

The package, shared pieces first:
    tools      the request's tools: check_tools, closed_schema, ToolFormatError
    grammar    the pieces of the grammars (Lark literals, %json rules, the start rule, MAX_CALLS)
    parser     the streaming parser (ToolCallParser) and the ToolCall it gives
    format     ToolFormat, the interface every family implements, and the history readers
and a module a family:
    hermes     Qwen2.5, Qwen3, QwQ: <tool_call> JSON </tool_call>; also the fallback for a template
               that renders no tools, which then gets a Qwen2.5-like tools prompt
    qwen3_xml  Qwen3.5 / Qwen3.6: <function=NAME><parameter=P>VALUE</parameter>
    deepseek   deepseek-v3 (V3 / R1: function<｜tool▁sep｜>NAME and a ```json fence) and deepseek-v3.1
               (NAME<｜tool▁sep｜>ARGS)
    llama3     llama3-json (Llama 3.1, 3.2, 3.3: {"name": NAME, "parameters": ARGS} as the answer,
               no marker around it) and its parser of bare JSON calls (JsonCallParser)
tool_format (here) tells the family from the chat template.

A marker that is one token of the vocabulary is written in a grammar as that token (<[id]>):
llguidance does not match an added token's text as a string.
"""
from __future__ import annotations

import re

from duckd.tool_calls.deepseek import (
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
    DeepSeekV3Format,
    DeepSeekV31Format,
)
from duckd.tool_calls.format import ToolFormat
from duckd.tool_calls.grammar import JSON_OPTIONS, MAX_CALLS
from duckd.tool_calls.hermes import HERMES_TEMPLATE, TOOL_CALL, TOOL_CALL_END, HermesFormat
from duckd.tool_calls.llama3 import LLAMA3_TEMPLATE, PYTHON_TAG, JsonCallParser, Llama3JsonFormat
from duckd.tool_calls.parser import ToolCall, ToolCallParser
from duckd.tool_calls.qwen3_xml import Qwen3XmlFormat
from duckd.tool_calls.tools import ToolFormatError, check_tools, closed_schema

__all__ = [
    "DS_CALL", "DS_CALL_END", "DS_CALLS", "DS_CALLS_END", "DS_SEP", "JSON_OPTIONS", "MAX_CALLS", "PYTHON_TAG",
    "TOOL_CALL", "TOOL_CALL_END", "DeepSeekV3Format", "DeepSeekV31Format", "HermesFormat", "JsonCallParser",
    "Llama3JsonFormat", "Qwen3XmlFormat", "ToolCall", "ToolCallParser", "ToolFormat", "ToolFormatError",
    "check_tools", "closed_schema", "tool_format",
]


def tool_format(tokenizer) -> ToolFormat:
    """The family from the tokenizer's chat template; the vocabulary says which markers are tokens."""
    source = getattr(tokenizer, "chat_template", None) or ""
    if "<function=" in source and TOOL_CALL in source:
        return Qwen3XmlFormat(tokenizer, renders_tools=re.search(r"\btools\b", source) is not None)
    if "tool▁call▁begin" in source:
        return DeepSeekV3Format(tokenizer) if "```json" in source else DeepSeekV31Format(tokenizer)
    if HERMES_TEMPLATE.search(source):
        return HermesFormat(tokenizer, renders_tools=True)
    if PYTHON_TAG in source or (LLAMA3_TEMPLATE.search(source) and "ipython" in source):
        return Llama3JsonFormat(tokenizer)
    return HermesFormat(tokenizer, renders_tools=False)
