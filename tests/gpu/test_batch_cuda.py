"""Continuous batching on a GPU host (engine.batch_torch: every request on a GPU host):
tiny models on CUDA over a slot cache, decode steps from CUDA graphs per batch-size bucket
(engine.gpu.batch_graphs) where the cache is a SlotKVCache, other steps eager, the FFNs on
the host-side fp9 kernels through the pinned host contract. fp32 (TF32 off): every
request's tokens are those generate() gives it alone (CUDA graphs) and those of the eager
batch; bf16: the batch runs and each request gets max_tokens tokens. Skipped without CUDA."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from engine.batch import batch_decoder
from engine.generate import generate
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.conftest import TINY, hf_model, write_word_tokenizer
from tests.engine.test_batch import drain
from tests.engine.test_deepseek_mtp import mtp_checkpoint  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextmanager
def _tiny_on_cuda(tmp_path, kind: str, dtype: str):
    """A tiny random checkpoint of `kind` loaded on CUDA with the fp9 backend, TF32 off meanwhile."""
    folder = tmp_path / kind
    hf_model(kind).save_pretrained(folder)
    write_word_tokenizer(folder, TINY[kind]["vocab_size"])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield load_model(folder, device="cuda", dtype=dtype, backend="fp9")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_batch_gives_each_request_what_it_gets_alone(kind, dtype, tmp_path):
    with _tiny_on_cuda(tmp_path, kind, dtype) as lm:
        batch = batch_decoder(lm.model, lm.tokenizer, 3, 64, 16)
        assert batch.path == "torch"
        g = torch.Generator().manual_seed(4)
        requests = [(torch.randint(2, TINY[kind]["vocab_size"], (3 + 4 * i,), generator=g).tolist(),
                     SamplingParams(max_tokens=5 + 2 * i, ignore_eos=True)) for i in range(5)]
        together = drain(batch, requests)
        assert [len(t) for t in together] == [p.max_tokens for _, p in requests]
        assert batch.decoder.graphs is not None and batch.decoder.graphs.buckets == [1, 2, 3]
        assert batch.decoder.graph_steps > 0, "decode steps replay the bucket graphs"
        if dtype == "float32":
            alone = [generate(lm.model, lm.tokenizer, prompt, params, max_model_len=64).token_ids
                     for prompt, params in requests]
            assert together == alone


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
def test_gpu_batch_graphs_give_the_eager_batch_tokens(kind, tmp_path, monkeypatch):
    """Six requests over four slots, fp32 (TF32 off): the tokens of the batch with its decode
    steps from the bucket graphs (padded rows: 3 sequences in the bucket of 4) are those of
    the batch run eagerly (DUCK_CUDA_GRAPHS=0)."""
    with _tiny_on_cuda(tmp_path, kind, "float32") as lm:
        g = torch.Generator().manual_seed(9)
        requests = [(torch.randint(2, TINY[kind]["vocab_size"], (2 + 3 * i,), generator=g).tolist(),
                     SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True)) for i in range(6)]
        graphs = batch_decoder(lm.model, lm.tokenizer, 4, 64, 16)
        with_graphs = drain(graphs, requests)
        assert graphs.decoder.graph_steps > 0
        monkeypatch.setenv("DUCK_CUDA_GRAPHS", "0")
        eager = batch_decoder(lm.model, lm.tokenizer, 4, 64, 16)
        assert eager.decoder.graphs is None
        assert with_graphs == drain(eager, requests)


def _ds_folder(tmp_path, kind: str):
    from tests.engine.test_deepseek import TINY_DS, hf_deepseek
    folder = tmp_path / kind
    hf_deepseek(kind).save_pretrained(folder)
    write_word_tokenizer(folder, TINY_DS[kind]["vocab_size"])
    return folder, TINY_DS[kind]["vocab_size"]


def _q35_folder(tmp_path, kind: str):
    from tests.engine.test_qwen3_5 import TINY as TINY_Q35, _hf_model
    folder = tmp_path / kind
    _hf_model(kind).save_pretrained(folder)
    write_word_tokenizer(folder, TINY_Q35[kind]["vocab_size"])
    return folder, TINY_Q35[kind]["vocab_size"]


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v32", "qwen3_5", "qwen3_5_moe"])
def test_gpu_batch_of_the_latent_and_hybrid_caches(kind, tmp_path):
    """DeepSeek's latent cache and Qwen3.5's DeltaNet states per slot on CUDA, fp32 (TF32 off):
    each request's tokens in a batch of three are those it gets in a batch of one."""
    folder, vocab = (_ds_folder if kind.startswith("deepseek") else _q35_folder)(tmp_path, kind)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lm = load_model(folder, device="cuda", dtype="float32", backend="fp9")
        g = torch.Generator().manual_seed(6)
        requests = [(torch.randint(2, vocab, (3 + 6 * i,), generator=g).tolist(),
                     SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True)) for i in range(5)]
        batch = batch_decoder(lm.model, lm.tokenizer, 3, 64, 16)
        together = drain(batch, requests)
        assert [len(t) for t in together] == [p.max_tokens for _, p in requests]
        # the latent cache's decode steps replay the bucket graphs; the DeltaNet state's run eagerly
        assert (batch.decoder.graph_steps > 0) == kind.startswith("deepseek")
        assert together == [drain(batch_decoder(lm.model, lm.tokenizer, 1, 64, 16), [r])[0]
                            for r in requests]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_gpu_batch_with_mtp_drafts_is_greedy_identical(mtp_checkpoint, monkeypatch):
    """MTP1 drafts inside the batch on CUDA, fp32: the same greedy tokens as the batch without them,
    its pair steps (each sequence's token and draft) replayed from the bucket graphs, and the same
    as the batch with drafts run eagerly (DUCK_CUDA_GRAPHS=0)."""
    from tests.engine.test_deepseek import TINY_DS
    from tests.engine.test_deepseek_mtp import KIND

    folder = mtp_checkpoint
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lm = load_model(folder, device="cuda", dtype="float32", backend="fp9")
        g = torch.Generator().manual_seed(8)
        requests = [(torch.randint(2, TINY_DS[KIND]["vocab_size"], (4 + 5 * i,), generator=g).tolist(),
                     SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(4)]
        with_mtp = batch_decoder(lm.model, lm.tokenizer, 3, 64, 16, mtp=True)
        assert with_mtp.mtp
        got = drain(with_mtp, requests)
        assert with_mtp.decoder.graph_steps > 0
        assert got == drain(batch_decoder(lm.model, lm.tokenizer, 3, 64, 16), requests)
        monkeypatch.setenv("DUCK_CUDA_GRAPHS", "0")
        eager = batch_decoder(lm.model, lm.tokenizer, 3, 64, 16, mtp=True)
        assert eager.decoder.graphs is None and got == drain(eager, requests)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
def test_gpu_batch_prefix_cache_gives_the_uncached_tokens(kind, tmp_path):
    """The prefix cache on CUDA (slot copies on the device, decode steps from the bucket graphs),
    fp32: a chat's second turn and a request sharing its first turn's prompt beside it get the
    tokens they get with the cache off, and say how much they found."""
    from tests.engine.test_prefix_cache import _two_turns
    with _tiny_on_cuda(tmp_path, kind, "float32") as lm:
        on = _two_turns(lm, "torch", cache=True)
        off = _two_turns(lm, "torch", cache=False)
        assert [r.token_ids for r in [on[0], *on[1]]] == [r.token_ids for r in [off[0], *off[1]]]
        assert all(r.stats.cached > 16 for r in on[1]) and on[2].decoder.graph_steps > 0
