"""Grammar-constrained decoding (engine.grammar, applied in engine.tokens.TokenStream): the masks
equal the slow reference at every step of a walk through a schema's output, bad grammars are
errors that name the problem, the default model's greedy output under a schema parses and
validates alone and in a batch (token-identical either way), and MTP drafts compose with a
grammar: greedy output is the same with and without drafts, and every draft kept is allowed."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from engine.batch import BatchDecoder
from engine.generate import generate
from engine.grammar import GrammarError, Grammars, GrammarSpec, allowed_reference
from engine.loader import load_model
from engine.mtp import generate_mtp
from engine.tokenizer import Tokenizer
from engine.tokens import SamplingParams
from tests.engine.conftest import write_char_tokenizer, write_word_tokenizer
from tests.engine.test_batch import drain_results
from tests.engine.test_deepseek import TINY_DS
from tests.engine.test_deepseek_mtp import KIND, mtp_checkpoint  # noqa: F401 - the fixture

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol():
    return load_model("default", backend="torch")


@pytest.fixture(scope="module")
def grammars(smol):
    return Grammars(smol.tokenizer, smol.model.config.vocab_size)


def test_masks_equal_the_reference_at_every_step(grammars, smol):
    """At every position of a valid output the mask (unpacked on the tensor's device) is the
    matcher's own, read token by token, and only holds tokens the matcher takes; once the object
    is closed only EOS is left."""
    hf = smol.tokenizer.tokenizer
    state = grammars.compile(GrammarSpec.json_schema(PERSON)).start()
    text = json.dumps({"name": "Ada", "age": 36, "tags": ["a", "c"]})
    everyone = range(grammars.vocab)
    while text:    # the allowed token that writes the most of what is left
        mask = state.allowed()
        allowed = set(mask.nonzero().flatten().tolist())
        assert allowed == allowed_reference(state)
        # and each is a token the matcher takes (it may take more: where the grammar forces text,
        # the mask keeps only that text's own tokenization)
        assert allowed <= {t for t in everyone if state.matcher.validate_tokens([t]) == 1}
        token = max((t for t in allowed if text.startswith(hf.decode([t]))), key=lambda t: len(hf.decode([t])))
        text = text[len(hf.decode([token])):]
        assert state.accept(token)
    assert set(state.allowed().nonzero().flatten().tolist()) == set(smol.tokenizer.eos_token_ids)
    logits = torch.randn(grammars.vocab)
    kept = state.constrain(logits)
    assert torch.isfinite(kept).nonzero().flatten().tolist() == list(smol.tokenizer.eos_token_ids)


def test_a_forbidden_token_is_refused_and_bad_grammars_name_their_problem(grammars, smol, tmp_path):
    state = grammars.compile(GrammarSpec("json_object")).start()
    x = smol.tokenizer.tokenizer.encode("x", add_special_tokens=False).ids[0]
    assert not state.accept(x) and state.error
    with pytest.raises(GrammarError, match="json_schema"):
        grammars.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(GrammarError, match="regex"):
        grammars.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(GrammarError, match="lark"):
        grammars.compile(GrammarSpec("lark", "start: undefined_rule"))
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("yaml", "")
    write_word_tokenizer(tmp_path, 20)
    with pytest.raises(GrammarError, match="cannot drive a grammar"):
        Grammars(Tokenizer.from_folder(tmp_path), 20).compile(GrammarSpec("json_object"))


def test_compiled_grammars_are_cached_by_spec(grammars):
    a = grammars.compile(GrammarSpec.json_schema(CITY))
    assert grammars.compile(GrammarSpec.json_schema(json.loads(json.dumps(CITY)))) is a


def _chat(lm, text):
    return lm.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_default_model_output_follows_the_schema_alone_and_batched(smol, grammars):
    """Greedy SmolLM2 under three grammars and none: each output is valid; the batch (the native
    CPU decoder, the grammar masks per sequence) gives the tokens one-at-a-time decoding gives."""
    requests = [
        (_chat(smol, "Describe a person as JSON."), SamplingParams(max_tokens=96, grammar=grammars.compile(
            GrammarSpec.json_schema(PERSON)))),
        (_chat(smol, "Which city is the capital of France?"), SamplingParams(max_tokens=64)),
        (_chat(smol, "Where is the Eiffel tower? Answer in JSON."), SamplingParams(max_tokens=64, grammar=(
            grammars.compile(GrammarSpec.json_schema(CITY))))),
        (_chat(smol, "Give a date."), SamplingParams(max_tokens=24, grammar=grammars.compile(
            GrammarSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")))),
    ]
    alone = [generate(smol.model, smol.tokenizer, p, params) for p, params in requests]
    for (prompt, params), result in zip(requests, alone):
        if params.grammar is None:
            continue
        assert result.finish_reason == "eos", result.text
        if params.grammar.spec.kind == "regex":
            assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", result.text)
        else:
            jsonschema.validate(json.loads(result.text), json.loads(params.grammar.spec.text))
    batch = BatchDecoder(smol.model, smol.tokenizer, slots=3, max_model_len=512, step_tokens=64, path="native")
    batched = drain_results(batch, requests)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]


@pytest.fixture(scope="module")
def mtp_chars(mtp_checkpoint, tmp_path_factory):   # noqa: F811 - the fixture
    """The tiny DeepSeek-V3 + MTP checkpoint with a tokenizer a grammar can drive."""
    folder = tmp_path_factory.mktemp("deepseek_v3_mtp_chars")
    shutil.copytree(mtp_checkpoint, folder, dirs_exist_ok=True)
    write_char_tokenizer(folder, TINY_DS[KIND]["vocab_size"])
    return load_model(folder, device="cpu", backend="fp9")


WORDS = r"[etaoin]{4,40}"


def test_mtp_drafts_compose_with_a_grammar(mtp_chars):
    """A random model under a regex: greedy output with MTP drafts (in the batch, and engine.mtp
    alone) is token-identical to plain decoding under the same grammar, and matches it; drafts
    are verified, some kept."""
    lm = mtp_chars
    grammar = Grammars(lm.tokenizer, TINY_DS[KIND]["vocab_size"]).compile(GrammarSpec("regex", WORDS))
    g = torch.Generator().manual_seed(5)
    requests = [(torch.randint(2, 100, (5 + 3 * i,), generator=g).tolist(), SamplingParams(max_tokens=30,
                 grammar=grammar)) for i in range(4)]
    requests.append((requests[0][0], SamplingParams(max_tokens=30, grammar=grammar, temperature=0.9, seed=3)))

    def batch(mtp: bool) -> BatchDecoder:
        return BatchDecoder(lm.model, lm.tokenizer, slots=3, max_model_len=96, step_tokens=24, path="torch", mtp=mtp)

    with_drafts, plain = drain_results(batch(True), requests), drain_results(batch(False), requests)
    verified = 0
    for (prompt, params), got, want in zip(requests, with_drafts, plain):
        text = got.text
        assert re.fullmatch(WORDS, text) if got.finish_reason == "eos" else re.fullmatch(r"[etaoin]*", text), text
        verified += got.stats.mtp[1]
        if params.temperature == 0:
            assert got.token_ids == want.token_ids
            alone = generate_mtp(lm.model, lm.tokenizer, prompt, params)
            assert alone.token_ids == got.token_ids
    assert verified > 0


def test_a_token_the_grammar_refuses_ends_that_request_only(grammars, smol):
    """A token the grammar does not take (a caller that did not constrain, or the grammar's own
    limits) puts the state in error, whose masks leave only EOS: the request ends at its next token,
    nothing is raised into the loop that serves the others."""
    from engine.tokens import TokenStream
    out = TokenStream(smol.tokenizer, [1, 2, 3], SamplingParams(max_tokens=8, grammar=grammars.compile(
        GrammarSpec("json_object"))), "cpu")
    x = smol.tokenizer.tokenizer.encode("x", add_special_tokens=False).ids[0]
    assert not out.add(x)
    assert out.push(torch.randn(grammars.vocab)) and out.finish == "eos"
