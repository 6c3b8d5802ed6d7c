"""DeepSeek-V3.2's sparse attention on CUDA (engine.models.deepseek_dsa with the Triton scorer,
engine.gpu.dsa_index): a tiny V3.2 past index_topk, fp32 with TF32 off and the indexer's keys
unrounded, decodes the tokens the CPU gives (one request's CUDA-graph lane, the batch's bucket
graphs with their slot scorer), every request in a batch what it gets alone; with fp8 keys in
bf16 it runs, graphs and all. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine.batch import batch_decoder
from engine.generate import generate
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_batch import drain
from tests.engine.test_deepseek import TINY_DS, _prompt, hf_deepseek

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

KIND = "deepseek_v32"
TOPK = TINY_DS[KIND]["index_topk"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("v32-cuda")
    hf_deepseek(KIND, index_n_heads=16, max_position_embeddings=4096).save_pretrained(f)
    write_word_tokenizer(f, TINY_DS[KIND]["vocab_size"])
    return f


@pytest.fixture
def no_tf32():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def test_one_request_past_index_topk_decodes_the_cpus_tokens(folder, no_tf32):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = _prompt(KIND, 2 * TOPK + 40, seed=3)
    cpu = load_model(folder, device="cpu", dtype="float32", backend="fp9")
    cpu.model.exact_indexer()
    gpu = load_model(folder, device="cuda", dtype="float32", backend="fp9")
    gpu.model.exact_indexer()
    want = generate(cpu.model, cpu.tokenizer, prompt, params).token_ids
    assert generate(gpu.model, gpu.tokenizer, prompt, params, max_model_len=1024).token_ids == want


def test_a_gpu_batch_past_index_topk_gives_each_request_what_it_gets_alone(folder, no_tf32):
    lm = load_model(folder, device="cuda", dtype="float32", backend="fp9")
    lm.model.exact_indexer()
    requests = [(_prompt(KIND, n, seed=n), SamplingParams(max_tokens=m, ignore_eos=True))
                for n, m in ((TOPK + 50, 14), (20, 30), (2 * TOPK, 10), (TOPK - 3, 12))]
    batch = batch_decoder(lm.model, lm.tokenizer, 3, 4 * TOPK, 64)
    together = drain(batch, requests)
    assert batch.decoder.graph_steps > 0, "decode steps replay the bucket graphs"
    assert together == [generate(lm.model, lm.tokenizer, p, s, max_model_len=4 * TOPK).token_ids
                        for p, s in requests]


def test_fp8_keys_in_bf16_run_alone_and_batched(folder):
    lm = load_model(folder, device="cuda", dtype="bfloat16", backend="fp9")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = _prompt(KIND, 3 * TOPK, seed=5)
    alone = generate(lm.model, lm.tokenizer, prompt, params, max_model_len=1024).token_ids
    batch = batch_decoder(lm.model, lm.tokenizer, 2, 1024, 64)
    together = drain(batch, [(prompt, params), (_prompt(KIND, 30, seed=6), params)])
    assert len(alone) == 16 and [len(t) for t in together] == [16, 16]
    assert batch.decoder.graph_steps > 0
