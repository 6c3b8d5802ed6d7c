"""Grammar-constrained decoding: a request's output held to a JSON schema, any JSON object, a
regular expression or a Lark grammar. The grammar library is llguidance: measured against
xgrammar 0.2.9 on this project's 2-core machine (docs/api.md, *Structured output*), its per-token
masks cost the same order (tens of microseconds, against a decode step of milliseconds), its
compile is lazy (1.2-1.4 ms to a first mask where xgrammar compiles in 14-44 ms), and its wheel
brings no dependency (xgrammar's brings triton and a second FFI runtime).

    grammars = Grammars(tokenizer, vocab)    # one per model: the vocabulary's token trie, built once, lazily
    grammar = grammars.compile(spec)         # a GrammarSpec -> Grammar, cached by spec; GrammarError names the problem
    state = grammar.start()                  # one per sequence (engine.tokens.TokenStream does this)
    logits = state.constrain(logits)         # the tokens the grammar forbids here at -inf
    state.accept(token)                      # the chosen token; the state moves on

A grammar's end is the model's EOS: once the output is complete the mask leaves only the EOS
tokens. allowed_reference() is the slow path that the masks are tested against.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON written the way models read it most (json.dumps' separators) and no other whitespace: a
# grammar that lets whitespace in anywhere lets a small model pad an object with newlines until
# max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64   # compiled grammars kept per model, least recently used dropped first


class GrammarError(ValueError):
    """A grammar that cannot be compiled: the message says which part and why."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match: kind (KINDS) and its text (the schema as JSON, the regex, the
    Lark grammar; json_object's is empty)."""
    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r}: expected one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema))   # key order kept: properties are written in it


def _llg():
    import llguidance
    return llguidance


class Grammars:
    """A model's grammar compiler: the vocabulary as llguidance sees it (built on first use: 0.2 s
    for a 49k vocabulary, 0.8 s for Qwen3's 151k) and the compiled grammars, cached by spec."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        """vocab: the width of the model's logits (it may exceed the tokenizer's ids)."""
        self.tokenizer, self.vocab = tokenizer, vocab
        self._lock = threading.Lock()
        self._ll = None
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                t0 = time.perf_counter()
                hf = self.tokenizer.tokenizer
                n = max(self.vocab, hf.get_vocab_size(with_added_tokens=True))
                eos = list(self.tokenizer.eos_token_ids)
                try:
                    self._ll = _llg().LLTokenizer(hf.to_str(), n_vocab=n, eos_token=eos)
                except ValueError as e:   # e.g. a word-level tokenizer: grammars need its tokens' bytes
                    raise GrammarError(f"this model's tokenizer ({self.tokenizer.source}) cannot drive a "
                                       f"grammar: {e}") from None
                log.info("grammar vocabulary of %d tokens ready in %.2f s", n, time.perf_counter() - t0)
            return self._ll

    def compile(self, spec: GrammarSpec) -> "Grammar":
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        grammar = Grammar(self, spec, _source(spec))
        err = _llg().LLMatcher.validate_grammar(grammar.source, self.ll_tokenizer)
        if err:
            raise GrammarError(f"{spec.kind}: {err.strip().splitlines()[0][:300]}")
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar


def _source(spec: GrammarSpec) -> str:
    """The spec as llguidance's grammar text."""
    matcher = _llg().LLMatcher
    try:
        if spec.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, dict):
                raise GrammarError("json_schema: the schema must be a JSON object")
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.text)
        return matcher.grammar_from_lark(spec.text)
    except ValueError as e:
        raise GrammarError(f"{spec.kind}: {e}") from None


class Grammar:
    """A compiled grammar; start() gives a sequence its own state."""

    def __init__(self, grammars: Grammars, spec: GrammarSpec, source: str):
        self.grammars, self.spec, self.source = grammars, spec, source

    def start(self) -> "GrammarState":
        return GrammarState(self)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, grammar: Grammar):
        grammars = grammar.grammars
        self.vocab = grammars.vocab
        self.matcher = _llg().LLMatcher(grammars.ll_tokenizer, grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"{grammar.spec.kind}: {self.matcher.get_error()[:300]}")
        n = grammars.ll_tokenizer.vocab_size
        self.words = torch.zeros((n + 31) // 32, dtype=torch.int32)
        # On the CPU the mask is spread and applied with numpy: torch runs element-wise ops of this
        # size on its OpenMP threads, which then spin and take the cores from the native decoder's
        # next step (its layers 30 % slower on the 2-core host, where the masks themselves cost 1 %).
        # Elsewhere (CUDA) per device: the bit positions, the words spread to bits, the mask; and
        # the constrained logits, made once.
        self._buffers: dict = {}
        self._out: torch.Tensor | None = None

    def bitmask(self) -> torch.Tensor:
        """The allowed tokens as 32-token words (bit t % 32 of word t // 32)."""
        w = self.words
        self.matcher.unsafe_compute_mask_ptr(w.data_ptr(), w.numel() * w.element_size())
        return w

    def allowed(self, device=None) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (this state's buffer: valid until its
        next call)."""
        device = torch.device(device or "cpu")
        words = self.bitmask()
        if device.type == "cpu":   # numpy's one thread (see __init__)
            bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:self.vocab]
            return torch.from_numpy(bits.view(np.bool_))
        buffers = self._buffers.get(device)
        if buffers is None:
            buffers = self._buffers[device] = (torch.arange(32, dtype=torch.int32, device=device),
                                               torch.empty((words.numel(), 32), dtype=torch.int32, device=device),
                                               torch.empty(words.numel() * 32, dtype=torch.bool, device=device))
        bits, spread, mask = buffers
        torch.bitwise_right_shift(words.to(device).unsqueeze(1), bits, out=spread)
        torch.bitwise_and(spread, 1, out=spread)
        torch.ne(spread.view(-1), 0, out=mask)
        return mask[:self.vocab]

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar forbids here at -inf (this state's buffer, valid
        until its next call; logits itself is left as it was)."""
        allowed = self.allowed(logits.device)[:logits.shape[-1]]
        out = self._out
        if out is None or out.shape != logits.shape or out.dtype != logits.dtype or out.device != logits.device:
            out = self._out = torch.empty_like(logits)
        if logits.device.type == "cpu" and logits.dtype != torch.bfloat16:
            mine = out.numpy()
            np.copyto(mine, logits.numpy())
            np.copyto(mine, -np.inf, where=~allowed.numpy())
            return out
        return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device),
                           out=out)

    def accept(self, token: int) -> bool:
        """The chosen token moves the state on; False when the grammar forbids it (the state is
        then in error and allows nothing more)."""
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def allowed_reference(state: GrammarState) -> set[int]:
    """The slow path of allowed(): the matcher's mask as bytes (bit t % 8 of byte t // 8), read one
    token at a time."""
    mask = state.matcher.compute_bitmask()
    return {t for t in range(min(state.vocab, 8 * len(mask))) if mask[t // 8] >> (t % 8) & 1}
