"""Grammar-constrained decoding on a GPU host (engine.grammar's CUDA masks): the mask spread on the
device equals the CPU's at every step of a schema's walk and forbids what it must in fp32 and
bf16 logits; a tiny DeepSeek-V3 + MTP on CUDA, batched (CUDA graphs where they apply), gives under
a regex the same greedy tokens with MTP drafts as without, and its output matches. Skipped
without CUDA."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from engine.batch import batch_decoder
from engine.grammar import Grammars, GrammarSpec
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.conftest import write_char_tokenizer
from tests.engine.test_batch import drain_results
from tests.engine.test_deepseek import TINY_DS
from tests.engine.test_deepseek_mtp import KIND, mtp_checkpoint  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
WORDS = r"[etaoin]{4,40}"


@pytest.fixture(scope="module")
def lm(mtp_checkpoint, tmp_path_factory):   # noqa: F811 - the fixture
    folder = tmp_path_factory.mktemp("deepseek_v3_mtp_chars_cuda")
    shutil.copytree(mtp_checkpoint, folder, dirs_exist_ok=True)
    write_char_tokenizer(folder, TINY_DS[KIND]["vocab_size"])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield load_model(folder, device="cuda", backend="fp9")
    torch.backends.cuda.matmul.allow_tf32 = tf32


def test_cuda_masks_equal_the_cpu_masks(lm):
    vocab = TINY_DS[KIND]["vocab_size"]
    grammar = Grammars(lm.tokenizer, vocab).compile(GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["toe", "tea"]}},
         "required": ["a", "b"]}))
    state = grammar.start()
    for token in lm.tokenizer.tokenizer.encode(json.dumps({"a": 12, "b": "tea"}), add_special_tokens=False).ids:
        cpu = state.allowed().clone()
        assert torch.equal(state.allowed("cuda").cpu(), cpu)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(vocab, device="cuda", dtype=dtype)
            kept = state.constrain(logits)
            assert torch.equal(torch.isfinite(kept).cpu(), cpu) and torch.equal(kept[cpu.cuda()], logits[cpu.cuda()])
        assert cpu[token] and state.accept(token)


def test_cuda_batch_with_mtp_drafts_under_a_grammar(lm):
    grammar = Grammars(lm.tokenizer, TINY_DS[KIND]["vocab_size"]).compile(GrammarSpec("regex", WORDS))
    g = torch.Generator().manual_seed(5)
    requests = [(torch.randint(2, 100, (5 + 3 * i,), generator=g).tolist(),
                 SamplingParams(max_tokens=30, grammar=grammar)) for i in range(4)]

    def batch(mtp: bool):
        return batch_decoder(lm.model, lm.tokenizer, 3, 96, 24, mtp=mtp)

    with_drafts, plain = drain_results(batch(True), requests), drain_results(batch(False), requests)
    verified = 0
    for got, want in zip(with_drafts, plain):
        assert got.token_ids == want.token_ids
        assert re.fullmatch(WORDS if got.finish_reason == "eos" else r"[etaoin]*", got.text), got.text
        verified += got.stats.mtp[1] if got.stats.mtp else 0
    assert verified > 0
