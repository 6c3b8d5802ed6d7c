"""Fixtures of the engine tests: tiny random checkpoints written by transformers,
and a report of measured agreements printed at the end of the run."""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

# Odd sizes on purpose: intermediate sizes that no tp*64 divides, an expert count
# that is not a power of two, head_dim * heads != hidden, a dense layer inside an MoE model.
TINY = {
    "llama": dict(vocab_size=211, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False),
    "qwen3": dict(vocab_size=223, hidden_size=80, intermediate_size=136, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=True),
    "qwen3_moe": dict(vocab_size=197, hidden_size=64, intermediate_size=120, moe_intermediate_size=72,
                      num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False),
}

_REPORT: list[str] = []
INTERPRETER_START_S = 120


@pytest.fixture(scope="module", autouse=True)
def _host_part_on_the_cpu():
    """This suite is the CPU path (its models take host tensors and are compared with
    transformers on the CPU): load_model's automatic device choice stays off the GPU
    even on a host with CUDA. tests/gpu covers the CUDA path."""
    before = os.environ.get("DUCK_GPU")
    os.environ["DUCK_GPU"] = "0"
    yield
    if before is None:
        os.environ.pop("DUCK_GPU", None)
    else:
        os.environ["DUCK_GPU"] = before


@pytest.fixture(scope="session")
def report():
    """report(line): a measured figure worth seeing in every run's summary."""
    return _REPORT.append


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("engine measurements")
        for line in _REPORT:
            terminalreporter.write_line(line)


def hf_model(kind: str, seed: int = 0):
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**TINY[kind]))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """kind -> (folder of a saved random transformers model, the transformers model)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"tiny_{kind}")
            model = hf_model(kind)
            model.save_pretrained(folder)
            write_word_tokenizer(folder, TINY[kind]["vocab_size"])
            made[kind] = (folder, model)
        return made[kind]

    return make


def write_word_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer.json ('w0' ... 'wN'; 'w1' is EOS) for the random models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "w1"}')


def write_char_tokenizer(folder, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json of vocab_size tokens for the random models, one a grammar
    can drive (engine.grammar; a word-level one cannot): 0 '<unk>', 1 '</s>' (EOS), then the
    printable ASCII characters, then merges of letter pairs up to vocab_size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    chars = [c for c in ByteLevel.alphabet() if len(c.encode()) == 1 or c == "\u0120"]   # 'Ġ' is the space
    chars = sorted(set(chars) | {"\u0120"})
    assert vocab_size >= 2 + len(chars), vocab_size
    vocab = {"<unk>": 0, "</s>": 1} | {c: 2 + i for i, c in enumerate(chars)}
    merges, letters = [], "etaoinsrhl"
    pairs = [("\u0120", b) for b in letters] + [(a, b) for a in letters for b in letters]
    for a, b in pairs[:vocab_size - len(vocab)]:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("</s>", special=True, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')


@pytest.fixture(scope="module")
def interpreted():
    """run(fn, *args): fn (a module-level function of a test module) called in a worker
    process started with TRITON_INTERPRET=1, where engine.gpu's Triton kernels run in
    Triton's interpreter on CPU tensors; its exceptions (assertion messages included)
    come back as they were raised. A worker, not this process: triton decides between
    interpreter and compiler when a kernel is defined, and this process may hold
    compiled kernels (the GPU tests). Spawned: nothing imported here is inherited."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"   # copied by the worker when it starts, in submit()
    try:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        started = pool.submit(interpreter_state)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    try:
        state = started.result(timeout=INTERPRETER_START_S)
        assert state == (True, True), f"worker (triton imported, kernels interpreted) = {state}"
        yield lambda fn, *args: pool.submit(fn, *args).result()
    finally:
        pool.shutdown(cancel_futures=True)


def interpreter_state() -> tuple[bool, bool]:
    """(triton imported, every engine.gpu kernel module interpreted), in the worker."""
    from engine.gpu import decode_attention, fp8, ops_triton

    return fp8.triton is not None, fp8.INTERPRETED and ops_triton.INTERPRETED and decode_attention.INTERPRETED
