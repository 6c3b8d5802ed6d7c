"""Our Llama / Qwen3 / Qwen3-MoE against transformers on the same random
weights, and the fp9 FFN backend against our fp32 reference."""
from __future__ import annotations

import pytest
import torch

from engine.generate import forward_logits, generate
from engine.loader import load_model
from engine.tokens import SamplingParams
from tests.engine.conftest import TINY

FP32_LOGITS_RTOL = 1e-4        # max |ours - transformers| / max |transformers|, fp32 torch backend
GREEDY_TOKENS = 32             # must be token-identical to transformers' greedy generate
FP9_STEPS = 64
FP9_MIN_TOP1_AGREEMENT = 0.95  # fp9 FFNs vs fp32, teacher-forced on the fp32 greedy continuation

KINDS = sorted(TINY)


def _prompt(kind: str, n: int = 11, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TINY[kind]["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, tiny_checkpoint):
    folder, hf = tiny_checkpoint(kind)
    lm = load_model(folder)
    assert type(lm.model).__name__ == type(hf).__name__
    prompt = _prompt(kind)
    ours = forward_logits(lm.model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ours.shape == ref.shape
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= FP32_LOGITS_RTOL, f"{kind}: logits relative error {rel:.2e} > {FP32_LOGITS_RTOL:.0e}"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(kind, tiny_checkpoint):
    folder, hf = tiny_checkpoint(kind)
    lm = load_model(folder)
    prompt = _prompt(kind, seed=2)
    ours = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                          do_sample=False)[0, len(prompt):].tolist()
    assert ours.token_ids == ref
    assert ours.finish_reason == "length"


@pytest.mark.parametrize("kind", KINDS)
def test_fp9_backend_agrees_with_fp32(kind, tiny_checkpoint, report):
    folder, _ = tiny_checkpoint(kind)
    ref = load_model(folder, backend="torch")
    fp9 = load_model(folder, backend="fp9")
    prompt = _prompt(kind, seed=3)
    gold = generate(ref.model, ref.tokenizer, prompt, SamplingParams(max_tokens=FP9_STEPS, ignore_eos=True)).token_ids
    logits = forward_logits(fp9.model, prompt + gold)[len(prompt) - 1:-1]  # [64, V], teacher-forced
    ref_logits = forward_logits(ref.model, prompt + gold)[len(prompt) - 1:-1]
    top1 = logits.argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(top1, gold)) / FP9_STEPS
    # random models have near-uniform logits: show how close to a tie each disagreement was
    margins = [f"{(ref_logits[i, g] - ref_logits[i, t]).item():.1e}" for i, (t, g) in enumerate(zip(top1, gold)) if t != g]
    free = generate(fp9.model, fp9.tokenizer, prompt, SamplingParams(max_tokens=FP9_STEPS, ignore_eos=True)).token_ids
    same_prefix = next((i for i, (a, b) in enumerate(zip(free, gold)) if a != b), FP9_STEPS)
    report(f"tiny {kind}: fp9 top-1 agreement with fp32 {agree:.1%} over {FP9_STEPS} steps; "
           f"free-running fp9 greedy identical for {same_prefix}/{FP9_STEPS} tokens; "
           f"fp32 margins where they differ: {margins or 'none'}")
    assert fp9.ffn.bytes_streamed > 0, "the fp9 backend was not used"
    assert agree >= FP9_MIN_TOP1_AGREEMENT, f"{kind}: fp9 top-1 agreement {agree:.1%}"


@pytest.mark.parametrize("kind", ["qwen3_moe"])
def test_bf16_runs_close_to_fp32(kind, tiny_checkpoint):
    folder, _ = tiny_checkpoint(kind)
    prompt = _prompt(kind, seed=4)
    ref = forward_logits(load_model(folder).model, prompt)
    bf = forward_logits(load_model(folder, dtype="bfloat16").model, prompt).float()
    rel = ((bf - ref).abs().max() / ref.abs().max()).item()
    assert rel < 5e-2, f"bf16 logits relative error {rel:.2e}"


def test_ffn_modules_are_found_once_and_follow_the_layers(tiny_checkpoint):
    """model.ffn_modules() (what ffn_backend() reads every decode step) is the walk over every
    module, kept until the decoder layers change (a checkpoint with fewer MTP layers trims them)."""
    from engine.ffn import TorchFfn

    model = load_model(tiny_checkpoint("qwen3_moe")[0]).model
    walk = [m for m in model.modules() if hasattr(m, "ffn_layer") and m.layer_idx >= 0]
    assert model.ffn_modules() == walk and model.ffn_modules() is not model.ffn_modules()
    backend = model.set_ffn(TorchFfn())
    assert model.ffn_backend() is backend and all(m.ffn is backend for m in walk)
    model.model.layers = model.model.layers[:1]
    assert model.ffn_modules() == [m for m in walk if m.layer_idx == 0]
