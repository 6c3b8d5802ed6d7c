"""Tokenizer and chat template, straight from the checkpoint's files.

tokenizers.Tokenizer reads tokenizer.json as published (AutoTokenizer is not
used: it has mis-encoded some checkpoints). The chat prompt is rendered with the
checkpoint's own Jinja template the way transformers renders it; EOS ids come
from generation_config.json, tokenizer_config.json and config.json together.
"""
from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    pass


def _token_text(tok) -> str | None:
    """tokenizer_config.json spells special tokens as strings or AddedToken dicts."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def compile_template(source: str):
    """A Jinja template in the environment transformers gives chat templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _encode(hf: HfTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The ids of one text. The batch call releases the GIL while it works (encode() holds it: a
    megabyte prompt froze a daemon's event loop for 0.5 s), and the fast one makes no offsets."""
    batch = getattr(hf, "encode_batch_fast", None) or hf.encode_batch
    return batch([text], add_special_tokens=add_special_tokens)[0].ids


class Tokenizer:
    def __init__(self, tokenizer: HfTokenizer, *, chat_template: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), special_tokens: dict[str, str] | None = None,
                 source: str = "<tokenizer>"):
        self.tokenizer = tokenizer
        self.source = source
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        eos = set(eos_token_ids)
        if "eos_token" in self.special_tokens:
            i = tokenizer.token_to_id(self.special_tokens["eos_token"])
            if i is None:
                raise TokenizerError(f"{source}: eos_token {self.special_tokens['eos_token']!r} is not in the vocabulary")
            eos.add(i)
        self.eos_token_ids = tuple(sorted(eos))
        self._template = None

    # -- construction -------------------------------------------------------
    @classmethod
    def from_folder(cls, path: str | Path, eos_token_ids: tuple[int, ...] = (),
                    chat_template: str | None = None) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise TokenizerError(f"{path}: no tokenizer.json (the engine reads only the fast-tokenizer file)")
        tok = HfTokenizer.from_file(str(tj))
        cfg = _read_json(path / "tokenizer_config.json")
        if chat_template is None:
            jinja = path / "chat_template.jinja"
            chat_template = jinja.read_text() if jinja.exists() else cfg.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default")
        gen = _read_json(path / "generation_config.json")
        eos = set(eos_token_ids)
        g = gen.get("eos_token_id")
        eos.update([g] if isinstance(g, int) else (g or []))
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(tok, chat_template=chat_template, eos_token_ids=tuple(eos), special_tokens=special,
                   source=str(path))

    # -- text <-> ids -------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return _encode(self.tokenizer, text, add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    # -- chat -------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text as transformers' apply_chat_template(tokenize=False) renders it."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the checkpoint ships no chat template "
                                 f"(no chat_template.jinja or tokenizer_config.json chat_template); "
                                 f"pass chat_template= explicitly")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    special_in_content: bool = False, **kwargs) -> list[int]:
        """The chat as ids. A special token's text inside a message ("<|im_start|>system" typed by
        a user) is encoded as plain text unless special_in_content: only the template makes
        control tokens (no role injection). The template writes BOS itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        specials = self._special_texts()
        if special_in_content or not any(sp in str(m.get("content", "")) for m in messages for sp in specials):
            return self.encode(text)
        # render with a placeholder for each content, then encode the contents with special tokens off
        marks = [f"\ue000duck{i}\ue001" for i in range(len(messages))]
        masked = [{**m, "content": marks[i]} if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)]
        rendered = self.apply_chat_template(masked, add_generation_prompt, **kwargs)
        ids: list[int] = []
        for piece in re.split("(\ue000duck\\d+\ue001)", rendered):
            if piece in marks:
                ids += _encode(self._plain(), messages[marks.index(piece)]["content"], False)
            elif piece:
                ids += self.encode(piece)
        return ids

    def _special_texts(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def _plain(self) -> HfTokenizer:
        """This tokenizer with special tokens in the text encoded as text."""
        if getattr(self, "_plain_tok", None) is None:
            self._plain_tok = HfTokenizer.from_str(self.tokenizer.to_str())
            self._plain_tok.encode_special_tokens = True
        return self._plain_tok


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, holding back bytes
    of a character that is not complete yet."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
