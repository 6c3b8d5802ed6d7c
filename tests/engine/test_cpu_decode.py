"""The native CPU decoder (engine.cpu) against the torch path of the same model:
tiny random Llama / Qwen3 / Qwen3-MoE models with every kernel set and both
weight types (float16 projections against the torch path on the same weights
rounded to float16), multi-token steps, biases and llama3 rope scaling, thread
counts, generate() with and without it, the errors it gives, and SmolLM2's
greedy answers."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.config import ModelConfig
from engine.cpu.decode import CpuDecoder, NativeDecodeError, cpu_decoder, decoder_on_own_cache, native_cache
from engine.cpu.host_model import UnsupportedModel
from engine.ffn import TorchFfn, install
from engine.generate import generate
from engine.loader import load_model
from engine.models import model_class
from engine.tokens import SamplingParams
from native.host import ops
from tests.engine.conftest import TINY

LOGITS_RTOL = 1e-5   # max |native - torch| / max |torch| per step: fp32 both, sums ordered differently
STEPS = 8
SETS = ["ref", "avx2", "avx512"]


def _kernel_set(name: str) -> str:
    if not ops.available(name):
        pytest.skip(f"this CPU lacks the instructions of the {name} host kernels: not testable here")
    return name


def _prompt(vocab: int, n: int = 11, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def _half_rounded(model):
    """A copy of model whose projections and lm_head hold their float16 roundings (in
    fp32 tensors; lm_head untied from the embedding): what a float16 decoder computes with."""
    rounded = copy.deepcopy(model)
    linears = [rounded.lm_head] + [getattr(layer.self_attn, name) for layer in rounded.model.layers
                                   for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    for lin in linears:
        lin.weight = nn.Parameter(lin.weight.detach().half().float(), requires_grad=False)
    return rounded


@torch.inference_mode()
def _steps_both_ways(model, steps: int = STEPS, tokens: int = 1, weights: str = "float32",
                     **options) -> list[float]:
    """Prefill in torch into two caches, then `steps` steps of `tokens` tokens: torch on
    one cache, native on the other (with float16 weights, torch on them rounded).
    Returns each step's relative logits error."""
    if weights == "float16":
        model, native_model = _half_rounded(model), model
    else:
        native_model = model
    vocab = model.config.vocab_size
    prompt = _prompt(vocab)
    n = len(prompt)
    length = n + steps * tokens
    ref_cache, nat_cache = model.make_cache(length), model.make_cache(length)
    ids, positions = torch.tensor(prompt), torch.arange(n)
    hidden = model(ids, positions, ref_cache)
    model(ids, positions, nat_cache)
    decoder = CpuDecoder(native_model, nat_cache, weights=weights, **options)
    assert decoder.weights == weights
    token, errors = int(model.compute_logits(hidden[-1:]).argmax()), []
    extra = torch.Generator().manual_seed(5)
    for s in range(steps):
        ids = torch.tensor([token] + torch.randint(2, vocab, (tokens - 1,), generator=extra).tolist())
        positions = torch.arange(n + s * tokens, n + (s + 1) * tokens)
        ref = model.compute_logits(model(ids, positions, ref_cache))       # [T, V]
        nat = decoder(ids, positions)                                       # [T, V]
        assert nat.shape == ref.shape and torch.isfinite(nat).all()
        errors.append(((nat - ref).abs().max() / ref.abs().max()).item())
        token = int(ref[-1].argmax())
    assert torch.equal(nat_cache.k, ref_cache.k) or (nat_cache.k - ref_cache.k).abs().max() < 1e-5
    return errors


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            loaded[kind] = load_model(tiny_checkpoint(kind)[0])
        return loaded[kind]

    return get


@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("weights", ["float32", "float16"])
def test_decode_steps_match_torch(kind, name, weights, tiny, report):
    errors = _steps_both_ways(tiny(kind).model, kernel_set=_kernel_set(name), weights=weights)
    if name == "avx512" or not ops.available("avx512"):
        report(f"tiny {kind}: native ({name}, {weights}) vs torch decode logits, worst of {STEPS} steps "
               f"{max(errors):.1e}")
    assert max(errors) <= LOGITS_RTOL, errors


@pytest.mark.parametrize("kind", sorted(TINY))
def test_float16_weights_stay_close_to_the_models_own(kind, tiny):
    """The rounding itself: float16 projections against the unrounded fp32 model."""
    model = tiny(kind).model
    half, full = _half_rounded(model), model
    ids, positions = torch.tensor(_prompt(model.config.vocab_size)), torch.arange(11)
    with torch.inference_mode():
        a = half.compute_logits(half(ids, positions, half.make_cache(11)))
        b = full.compute_logits(full(ids, positions, full.make_cache(11)))
    assert ((a - b).abs().max() / b.abs().max()).item() < 5e-3


def test_weights_beyond_float16_keep_float32(caplog):
    model = _random_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[3, 2] = 1e6
    decoder = CpuDecoder(model, model.make_cache(4), weights="float16")
    assert decoder.weights == "float32"
    assert "model.layers.1.self_attn.v_proj.weight holds values beyond float16's range" in caplog.text


def test_a_head_dim_off_the_half_panels_keeps_float32(caplog):
    """Packed float16 projections need a head's rows to start a panel of 16: head_dim 24 keeps
    fp32 with a warning, and decodes as the torch path does."""
    model = _random_model("llama", head_dim=24)
    decoder = CpuDecoder(model, model.make_cache(4), weights="float16")
    assert decoder.weights == "float32"
    assert "head_dim 24 is not a multiple of 16" in caplog.text
    assert max(_steps_both_ways(model)) <= LOGITS_RTOL


def test_a_bad_weight_type_is_named(tiny, monkeypatch):
    model = tiny("llama").model
    monkeypatch.setenv("DUCK_CPU_WEIGHTS", "int3")
    with pytest.raises(ValueError, match="DUCK_CPU_WEIGHTS='int3': expected float16"):
        CpuDecoder(model, model.make_cache(4))
    monkeypatch.setenv("DUCK_CPU_WEIGHTS", "fp32")
    assert CpuDecoder(model, model.make_cache(4)).weights == "float32"


@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("tokens", [2, 3])
def test_multi_token_steps_match_torch(kind, tokens, tiny):
    assert max(_steps_both_ways(tiny(kind).model, steps=4, tokens=tokens)) <= LOGITS_RTOL


def _random_model(kind: str, seed: int = 0, **overrides):
    """A tiny model of ours built straight from a config, every weight random
    (norm weights around 1), with the torch FFN backend."""
    fields = dict(TINY[kind], model_type=kind)
    fields.pop("mlp_only_layers", None)
    config = ModelConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = model_class(config)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    install(model, TorchFfn())
    return model.eval().requires_grad_(False)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_attention_biases_and_llama3_rope_scaling(kind):
    model = _random_model(kind, attention_bias=True, rope_scaling=LLAMA3, rope_theta=500000.0)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert max(_steps_both_ways(model)) <= LOGITS_RTOL


def test_results_do_not_depend_on_the_thread_count():
    """Rows, heads and tokens are split between workers, never a sum: bit-identical logits."""
    model = _random_model("qwen3_moe")
    cache = model.make_cache(16)
    outs = []
    for threads in (1, 2, 3, 8):
        cache.k.zero_()
        cache.v.zero_()
        decoder = CpuDecoder(model, cache, threads=threads)
        steps = [decoder(torch.tensor([5, 9, 11]), torch.arange(3))]
        steps += [decoder(torch.tensor([t]), torch.tensor([t])) for t in range(3, 9)]
        outs.append(torch.cat(steps))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_generate_decodes_natively_with_the_torch_path_answers(tiny, monkeypatch):
    monkeypatch.setenv("DUCK_CPU_WEIGHTS", "float32")   # a random tiny model has near-ties float16 may flip
    monkeypatch.setenv("DUCK_CPU_KV", "float32")
    lm = tiny("llama")
    prompt, params = _prompt(TINY["llama"]["vocab_size"], seed=2), SamplingParams(max_tokens=24, ignore_eos=True)
    calls = []
    native_call = CpuDecoder.__call__
    monkeypatch.setattr(CpuDecoder, "__call__", lambda self, *a: calls.append(1) or native_call(self, *a))
    native = generate(lm.model, lm.tokenizer, prompt, params)
    assert len(calls) == params.max_tokens - 1, "every decode step after the prefill runs natively"
    monkeypatch.setenv("DUCK_CPU_NATIVE", "0")
    torch_path = generate(lm.model, lm.tokenizer, prompt, params)
    assert len(calls) == params.max_tokens - 1, "DUCK_CPU_NATIVE=0 keeps the torch path"
    assert native.token_ids == torch_path.token_ids


# -- the native decoder's own cache: float16, heads outer -----------------------------------
HALF_KV_RTOL = 5e-3   # max |logits| error relative to the largest: keys and values rounded to 2^-11


@torch.inference_mode()
def _own_cache_steps(model, kv: str, monkeypatch, steps: int = STEPS) -> tuple[list[float], torch.Tensor]:
    """The prompt prefilled natively into native_cache (DUCK_CPU_KV=kv), then decode steps,
    against torch on an fp32 cache: each step's relative logits error, and the native logits."""
    monkeypatch.setenv("DUCK_CPU_KV", kv)
    prompt = _prompt(model.config.vocab_size)
    n = len(prompt)
    decoder, cache = decoder_on_own_cache(model, n + steps, weights="float32", max_tokens=n)
    assert decoder is not None and cache.k.dtype == getattr(torch, kv)
    assert cache.k.stride(-2) == (n + steps) * model.config.head_dim, "the heads outer in memory"
    ref_cache = model.make_cache(n + steps)
    ids, positions = torch.tensor(prompt), torch.arange(n)
    ref = model.compute_logits(model(ids, positions, ref_cache))[-1:]
    nat = decoder(ids, positions)[-1:]
    errors, logits = [], [nat]
    for s in range(steps):
        errors.append(((nat - ref).abs().max() / ref.abs().max()).item())
        token = torch.tensor([int(ref[-1].argmax())])
        positions = torch.tensor([n + s])
        ref, nat = model.compute_logits(model(token, positions, ref_cache)), decoder(token, positions)
        logits.append(nat)
    return errors, torch.cat(logits)


@pytest.mark.parametrize("kind", sorted(TINY))
def test_the_own_cache_of_halves_stays_close_to_torch(kind, tiny, monkeypatch, report):
    errors, _ = _own_cache_steps(tiny(kind).model, "float16", monkeypatch)
    report(f"tiny {kind}: native on its float16 cache vs torch (fp32 cache), worst of {STEPS} steps "
           f"{max(errors):.1e}")
    assert max(errors) <= HALF_KV_RTOL, errors


@pytest.mark.parametrize("kind", sorted(TINY))
def test_a_cache_with_the_heads_outer_gives_the_same_bits(kind, tiny, monkeypatch):
    """Only where the cache's elements lie changes: the float32 cache with the heads outer
    against the plain one, on the same native decoder."""
    model = tiny(kind).model
    _, outer = _own_cache_steps(model, "float32", monkeypatch)
    prompt = _prompt(model.config.vocab_size)
    decoder = CpuDecoder(model, model.make_cache(len(prompt) + STEPS), weights="float32", max_tokens=len(prompt))
    plain = [decoder(torch.tensor(prompt), torch.arange(len(prompt)))[-1:]]
    # the same tokens _own_cache_steps fed: the torch path's argmax at each step
    ref_cache = model.make_cache(len(prompt) + STEPS)
    ref = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), ref_cache))[-1:]
    for s in range(STEPS):
        token, pos = torch.tensor([int(ref[-1].argmax())]), torch.tensor([len(prompt) + s])
        ref = model.compute_logits(model(token, pos, ref_cache))
        plain.append(decoder(token, pos))
    assert torch.equal(torch.cat(plain), outer)


def test_the_own_cache_type_is_named(tiny, monkeypatch):
    model = tiny("llama").model
    assert native_cache(model, 8).k.dtype == torch.float16
    assert native_cache(model, 8, slots=3).k.shape == (3, 3, 8, 2, 16)
    monkeypatch.setenv("DUCK_CPU_KV", "fp32")
    assert native_cache(model, 8).k.dtype == torch.float32
    monkeypatch.setenv("DUCK_CPU_KV", "int4")
    with pytest.raises(ValueError, match="DUCK_CPU_KV='int4': expected float16"):
        native_cache(model, 8)


def test_a_model_the_native_decoder_does_not_run_keeps_its_own_cache(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], dtype="bfloat16").model
    decoder, cache = decoder_on_own_cache(model, 8)
    assert decoder is None and cache.k.dtype == torch.bfloat16 and cache.k.is_contiguous()


def test_logits_argmax_gives_the_logits_and_torchs_argmax(tiny):
    """The batch's greedy tokens: found in C right after the lm_head, the same as torch.argmax
    of the same logits, which are logits()'s bit for bit."""
    model = tiny("qwen3").model
    prompt = _prompt(model.config.vocab_size)
    outs = []
    for _ in range(2):
        decoder = CpuDecoder(model, model.make_cache(16), max_tokens=len(prompt))
        y = decoder.layers(torch.tensor(prompt), torch.arange(len(prompt)))
        outs.append((decoder, y))
    (a, ya), (b, yb) = outs
    rows = [0, 3, 10]
    plain = a.logits(ya, rows)
    logits, top = b.logits_argmax(yb, rows)
    assert torch.equal(plain, logits)
    assert top == logits.argmax(dim=-1).tolist()


# -- errors ---------------------------------------------------------------------------------
def test_a_cache_too_short_is_named(tiny):
    model = tiny("llama").model
    decoder = CpuDecoder(model, model.make_cache(4))
    with pytest.raises(NativeDecodeError, match=r"position 4 is beyond the KV cache \(max_model_len=4\)"):
        decoder(torch.tensor([3]), torch.tensor([4]))


def test_bad_steps_are_named(tiny):
    model = tiny("qwen3").model
    decoder = CpuDecoder(model, model.make_cache(64), max_tokens=4)
    with pytest.raises(NativeDecodeError, match="token id 223 is outside the vocabulary of 223"):
        decoder(torch.tensor([223]), torch.tensor([0]))
    with pytest.raises(NativeDecodeError, match="5 tokens in one step: this decoder takes 1 to 4"):
        decoder(torch.arange(5), torch.arange(5))
    with pytest.raises(ValueError, match="must be one"):
        decoder(torch.tensor([[1]]), torch.tensor([[0]]))


def test_a_cache_that_does_not_fit_is_named(tiny):
    model = tiny("llama").model
    cache = model.make_cache(8)
    cache.k = cache.k[:, :, :1]
    with pytest.raises(UnsupportedModel, match=r"KV cache k has shape \(3, 8, 1, 16\); this model needs \(3, 8, 2, 16\)"):
        CpuDecoder(model, cache)
    cache = model.make_cache(8)
    cache.v = cache.v.double()
    with pytest.raises(UnsupportedModel, match="KV cache v is torch.float64 on cpu"):
        CpuDecoder(model, cache)


def test_bf16_keeps_the_torch_path_unless_forced(tiny_checkpoint, monkeypatch):
    model = load_model(tiny_checkpoint("llama")[0], dtype="bfloat16").model
    cache = model.make_cache(8)
    assert cpu_decoder(model, cache) is None
    monkeypatch.setenv("DUCK_CPU_NATIVE", "1")
    with pytest.raises(UnsupportedModel, match="model.embed_tokens.weight is torch.bfloat16 on cpu"):
        cpu_decoder(model, cache)


def test_an_unsupported_family_is_named_when_forced(tiny_family, monkeypatch):
    model = load_model(tiny_family("deepseek_v3")).model
    cache = model.make_cache(8)
    assert cpu_decoder(model, cache) is None
    monkeypatch.setenv("DUCK_CPU_NATIVE", "1")
    with pytest.raises(UnsupportedModel, match=r"DeepseekV3ForCausalLM \(deepseek_v3\) is not supported"):
        cpu_decoder(model, cache)


def test_a_bad_switch_value_is_named(tiny, monkeypatch):
    monkeypatch.setenv("DUCK_CPU_NATIVE", "maybe")
    model = tiny("llama").model
    with pytest.raises(ValueError, match="DUCK_CPU_NATIVE='maybe'"):
        cpu_decoder(model, model.make_cache(4))


def test_layer_steps_out_of_order_are_refused(tiny):
    from native._native import ffi, lib

    model = tiny("llama").model
    decoder = CpuDecoder(model, model.make_cache(4))
    assert lib.duck_host_layer_step(decoder._d, 0, ffi.NULL) == -1
    assert "without duck_host_begin" in ffi.string(lib.duck_host_decoder_error(decoder._d)).decode()
    ids, pos = torch.tensor([1]), torch.tensor([0])
    assert lib.duck_host_begin(decoder._d, 1, ffi.cast("int64_t *", ids.data_ptr()),
                               ffi.cast("int64_t *", pos.data_ptr())) == 0
    assert lib.duck_host_layer_step(decoder._d, 1, ffi.NULL) == -1
    assert "out of order: layer 0 comes next" in ffi.string(lib.duck_host_decoder_error(decoder._d)).decode()


# -- the default model ----------------------------------------------------------------------
SMOLLM2_PROMPTS = ["Which city is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("default", backend="torch")


@pytest.mark.parametrize("prompt", SMOLLM2_PROMPTS)
def test_smollm2_greedy_answers_are_those_of_the_torch_path(prompt, smollm2, monkeypatch, report):
    ids = smollm2.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=32)
    native = generate(smollm2.model, smollm2.tokenizer, ids, params)
    monkeypatch.setenv("DUCK_CPU_NATIVE", "0")
    torch_path = generate(smollm2.model, smollm2.tokenizer, ids, params)
    report(f"SmolLM2 {prompt!r}: native {native.stats.decode_tps:.1f} tok/s, torch path "
           f"{torch_path.stats.decode_tps:.1f} tok/s (torch FFNs), answers "
           f"{'identical' if native.token_ids == torch_path.token_ids else 'DIFFERENT'}")
    assert native.token_ids == torch_path.token_ids


@pytest.mark.parametrize("preset,want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_engine_puts_torchs_openmp_workers_to_sleep_unless_told(preset, want):
    """engine/__init__.py sets OMP_WAIT_POLICY=PASSIVE before torch loads libgomp (its spinning
    workers held a core the ducks and the native decoder needed); a value already set is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    out = subprocess.run([sys.executable, "-c", "import engine, os, torch; print(os.environ['OMP_WAIT_POLICY'])"],
                         capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.strip() == want
