"""DeepSeek-V3.2's sparse attention (engine.models.deepseek_dsa) past index_topk tokens:
with the indexer's keys unrounded it gives transformers' DeepseekV32 logits and greedy
tokens; every path (one sequence, prefill in chunks, the batch's mixed, decode-row and
graph-static steps, MTP drafts) gives what one sequence alone gets; the fp8 keys and
the Hadamard turn as DeepSeek's inference code computes them."""
from __future__ import annotations

import pytest
import torch

from engine.batch import BatchDecoder
from engine.generate import forward_logits, generate
from engine.loader import load_model
from engine.models import deepseek_dsa as dsa
from engine.tokens import SamplingParams
from tests.engine.test_batch import drain
from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_deepseek import FP32_LOGITS_RTOL, TINY_DS, _prompt, hf_deepseek

KIND = "deepseek_v32"
TOPK = TINY_DS[KIND]["index_topk"]        # 96: prompts of 150-300 tokens select from past it
# 16 indexer heads: with 4, one key in 16 has every head's ReLU at zero, and the ties at score 0
# that makes fall to the top-k's order (torch's for transformers, the earlier position here)
INDEX_HEADS = 16


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v32")
    hf = hf_deepseek(KIND, index_n_heads=INDEX_HEADS)
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, TINY_DS[KIND]["vocab_size"])
    hf.config._attn_implementation = "eager"     # its sparse mask on the attention scores
    return folder, hf


def test_sparse_attention_matches_transformers_past_index_topk(v32, report):
    folder, hf = v32
    lm = load_model(folder)
    lm.model.exact_indexer()
    prompt = _prompt(KIND, 3 * TOPK + 12, seed=1)
    ours = forward_logits(lm.model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    report(f"tiny V3.2, {len(prompt)} tokens, index_topk {TOPK}: fp32 logits rel err vs transformers {rel:.1e}")
    assert rel <= FP32_LOGITS_RTOL
    dense = load_model(folder)
    dense.model.exact_indexer()
    for layer in dense.model.model.layers:
        layer.self_attn.args = type(layer.self_attn.args)(**{**_fields(layer.self_attn.args), "index_topk": 10**6})
    assert ((forward_logits(dense.model, prompt) - ref).abs().max() / ref.abs().max()).item() > 1e-3, \
        "the selection must matter at this length"
    prompt = _prompt(KIND, TOPK + 60, seed=2)
    got = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert got == want


def _fields(args) -> dict:
    return {f: getattr(args, f) for f in args.__dataclass_fields__}


def test_prefill_in_chunks_and_decode_give_one_forwards_logits(v32):
    """A prompt read 7, 40 and all tokens at a time against one forward (keys unrounded: fp8
    rounding turns the last bit's noise of another call's shape into another selection)."""
    lm = load_model(v32[0])
    lm.model.exact_indexer()
    prompt = _prompt(KIND, 2 * TOPK + 30, seed=3)
    whole = forward_logits(lm.model, prompt)
    for chunk in (7, 40):
        cache = lm.model.make_cache(len(prompt))
        rows = []
        with torch.inference_mode():
            for a in range(0, len(prompt), chunk):
                ids = torch.tensor(prompt[a:a + chunk])
                rows.append(lm.model.compute_logits(lm.model(ids, torch.arange(a, a + len(ids)), cache)))
        torch.testing.assert_close(torch.cat(rows), whole, rtol=1e-4, atol=1e-4)


def test_batch_steps_past_index_topk_give_each_sequence_alone(v32):
    """A slot cache full of NaN; a mixed step (two slots decoding past index_topk, one
    prefilling), a decode-rows step, and the graph's static step with an MTP-style pair and a
    padding row, against each sequence alone."""
    from engine.batch_torch import TorchSlotDecoder
    from engine.layers import SlotBatch, static_decode

    lm = load_model(v32[0], device="cpu", backend="fp9")
    lm.model.exact_indexer()
    size = 3 * TOPK
    prompts = [_prompt(KIND, n, seed=10 + n) for n in (TOPK + 40, 2 * TOPK + 5, 30)]
    cache = lm.model.make_slot_cache(4, size)
    for t in cache.per_position():
        if t.dtype == dsa.FP8:
            t.view(torch.uint8).fill_(0x7f)      # e4m3 NaN
        else:
            t.fill_(float("nan"))
    dec = TorchSlotDecoder(lm.model, cache, max_tokens=size)
    for slot, p in ((3, prompts[0]), (0, prompts[1])):
        dec.layers(torch.tensor(p[:-1]), torch.arange(len(p) - 1), torch.full((len(p) - 1,), slot))
    ids = [prompts[0][-1], prompts[1][-1]] + prompts[2]
    positions = [len(prompts[0]) - 1, len(prompts[1]) - 1] + list(range(len(prompts[2])))
    y = dec.layers(torch.tensor(ids), torch.tensor(positions), torch.tensor([3, 0] + [2] * len(prompts[2])))
    nxt = [int(row.argmax()) for row in dec.logits(y, [0, 1, len(ids) - 1])]
    before = [t.clone() for t in cache.per_position()]
    y = dec.layers(torch.tensor(nxt), torch.tensor([len(p) for p in prompts]), torch.tensor([3, 0, 2]))
    assert dec.last_batch.decode_rows is not None
    rows = dec.logits(y)
    for t, saved in zip(cache.per_position(), before):
        t.copy_(saved)
    # the static step: slot 3's token and a second token after it (a pair), slot 0's token, a padding row
    pair = [nxt[0], 11, nxt[1]]
    pos = [len(prompts[0]), len(prompts[0]) + 1, len(prompts[1])]
    slots = [3, 3, 0]
    batch = SlotBatch.static(cache, 4, "cpu")
    batch.positions.copy_(torch.tensor(pos + pos[:1]))
    batch.slots.copy_(torch.tensor(slots + slots[:1]))
    batch.flat.copy_(torch.tensor([s * size + p for s, p in zip(slots, pos)] + [slots[0] * size + size - 1]))
    with torch.inference_mode(), static_decode():
        static = lm.model.compute_logits(lm.model(torch.tensor(pair + pair[:1]), batch.positions, batch))
    assert torch.isfinite(rows).all() and torch.isfinite(static).all()
    for i, (p, t) in enumerate(zip(prompts, nxt)):
        alone = lm.model.make_cache(size)
        with torch.inference_mode():
            lm.model(torch.tensor(p), torch.arange(len(p)), alone)
            want = lm.model.compute_logits(lm.model(torch.tensor([t]), torch.tensor([len(p)]), alone))[0]
            if i == 0:
                want_pair = lm.model.compute_logits(lm.model(torch.tensor([11]), torch.tensor([len(p) + 1]), alone))[0]
        torch.testing.assert_close(rows[i], want, rtol=1e-5, atol=1e-5)
        if i < 2:
            torch.testing.assert_close(static[2 if i else 0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static[1], want_pair, rtol=1e-5, atol=1e-5)


def test_a_batch_past_index_topk_gives_each_request_what_it_gets_alone(v32):
    lm = load_model(v32[0], device="cpu", backend="fp9")
    lm.model.exact_indexer()
    requests = [(_prompt(KIND, n, seed=n), SamplingParams(max_tokens=m, ignore_eos=True))
                for n, m in ((TOPK + 50, 12), (20, 30), (2 * TOPK, 8))]
    together = drain(BatchDecoder(lm.model, lm.tokenizer, slots=3, max_model_len=3 * TOPK, step_tokens=64,
                                  path="torch"), requests)
    for (prompt, params), got in zip(requests, together):
        assert got == generate(lm.model, lm.tokenizer, prompt, params).token_ids


def test_mtp_drafts_past_index_topk_keep_the_greedy_tokens(tmp_path):
    """V3.2 with a nextn layer (its own indexer): MTP drafts alone and in the batch give the
    tokens of plain decoding, on a prompt past index_topk (fp8 keys: every path the same)."""
    from engine.mtp import generate_mtp
    from tests.engine.test_deepseek_mtp import write_mtp_checkpoint

    lm = load_model(write_mtp_checkpoint(tmp_path, KIND, index_n_heads=INDEX_HEADS), backend="fp9")
    assert lm.model.mtp_layers and hasattr(lm.model.mtp_layers[0].self_attn, "indexer")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    requests = [(_prompt(KIND, n, seed=n), params) for n in (TOPK + 70, 2 * TOPK + 9)]
    plain = [generate(lm.model, lm.tokenizer, p, s).token_ids for p, s in requests]
    spec = generate_mtp(lm.model, lm.tokenizer, *requests[0])
    assert spec.token_ids == plain[0] and spec.stats.mtp[1] > 0
    batch = BatchDecoder(lm.model, lm.tokenizer, slots=2, max_model_len=3 * TOPK, step_tokens=64, path="torch",
                         mtp=True)
    assert batch.mtp
    assert drain(batch, requests) == plain


def _with_and_without_the_kernel(folder) -> float:
    """In an interpreter worker: the tiny V3.2's logits past index_topk with the indexer's scores
    from engine.gpu.dsa_index's kernel (one sequence's prefill, then a batch's decode rows over a
    slot cache: its rows_slot variant) and from the torch path; the largest difference."""
    from engine.batch_torch import TorchSlotDecoder

    lm = load_model(folder, device="cpu", backend="fp9")
    lm.model.exact_indexer()
    prompts = [_prompt(KIND, n, seed=n) for n in (TOPK + 30, TOPK + 9)]

    def run():
        cache = lm.model.make_slot_cache(2, 2 * TOPK)
        dec = TorchSlotDecoder(lm.model, cache, max_tokens=2 * TOPK)
        out = []
        for slot, p in enumerate(prompts):
            out.append(dec.logits(dec.layers(torch.tensor(p), torch.arange(len(p)), torch.full((len(p),), slot))))
        y = dec.layers(torch.tensor([5, 7]), torch.tensor([len(p) for p in prompts]), torch.tensor([0, 1]))
        assert dec.last_batch.decode_rows is not None
        return torch.cat(out + [dec.logits(y)])

    assert dsa._kernel(torch.zeros(1)) is not None, "the interpreter runs the kernel on CPU tensors"
    kernel = run()
    dsa._kernel_module.cache_clear()
    real = dsa._kernel_module
    dsa._kernel_module = lambda: None
    try:
        torch_path = run()
    finally:
        dsa._kernel_module = real
    return ((kernel - torch_path).abs().max() / torch_path.abs().max()).item()


def test_the_engine_reads_the_triton_kernels_scores_as_its_own(v32, interpreted):
    assert interpreted(_with_and_without_the_kernel, v32[0]) <= 1e-5


def test_hadamard_and_fp8_keys():
    h = dsa.hadamard(32, torch.device("cpu"))
    torch.testing.assert_close(h @ h.T, torch.eye(32), rtol=0, atol=1e-6)
    x = torch.randn(50, 32) * torch.logspace(-3, 2, 50)[:, None]
    for ue8m0 in (False, True):
        q, scale = dsa.quantize(x, ue8m0)
        assert q.dtype == dsa.FP8 and scale.shape == (50,)
        back = q.float() * scale[:, None]
        assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 16 + 1e-9).all()   # e4m3: 3 mantissa bits
        if ue8m0:
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    with pytest.raises(ValueError, match="power of two"):
        dsa.hadamard(48, torch.device("cpu"))


# -- against the independent reference (tests/engine/dsa_reference.py) ------------------------------------------
EXACT_RTOL = 1e-5        # keys unrounded: max |ours - reference| / max |reference| over every row,
EXACT_MAX_TOKENS = 4096  # up to this length (at 16k tokens a row's top-k edge is fp32-noise close: 1.1e-3 seen)
# fp8 keys, as DeepSeek rounds them: the two implementations' last-bit noise (another order of the same sums)
# moves a few keys across an fp8 rounding step, and a key at the edge of a row's top-k then changes places, so
# some rows differ by a key's share of attention. Named bounds: most rows stay within FP8_ROW_RTOL, the greedy
# pick agrees on nearly every row, and the decoded tokens are the reference's.
FP8_ROW_RTOL, FP8_ROWS_WITHIN, FP8_ARGMAX_AGREE = 1e-3, 0.95, 0.995
REFERENCE_TOKENS = 8     # greedy tokens decoded past the prompt


@pytest.fixture(scope="module")
def v32_long(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v32-long")
    hf_deepseek(KIND, index_n_heads=INDEX_HEADS, max_position_embeddings=32768).save_pretrained(folder)
    write_word_tokenizer(folder, TINY_DS[KIND]["vocab_size"])
    return folder


@pytest.mark.parametrize("n", [4096, 16384])
def test_long_prompts_give_the_references_logits_and_greedy_tokens(n, v32_long, report):
    from tests.engine.dsa_reference import load_reference

    lm, ref = load_model(v32_long), load_reference(v32_long)
    prompt = _prompt(KIND, n, seed=n)
    out = generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True))
    seq = prompt + out.token_ids
    want = ref.logits(seq[:-1], fp8=True)
    assert want[n - 1:].argmax(-1).tolist() == out.token_ids     # each token the reference's greedy pick
    got = forward_logits(lm.model, prompt)
    err = (got - want[:n]).abs().amax(-1) / want[:n].abs().max()
    within, agree = (err <= FP8_ROW_RTOL).float().mean().item(), (got.argmax(-1) == want[:n].argmax(-1)).float().mean().item()
    said = ""
    if n <= EXACT_MAX_TOKENS:
        lm.model.exact_indexer()
        exact = ((forward_logits(lm.model, prompt) - ref.logits(prompt, fp8=False)).abs().max()
                 / want.abs().max()).item()
        said = f"keys unrounded rel err {exact:.1e}; "
        assert exact <= EXACT_RTOL
    report(f"tiny V3.2, {n}-token prompt (index_topk {TOPK}): vs the reference, {said}fp8 keys {within:.1%} of rows "
           f"within {FP8_ROW_RTOL:.0e}, greedy pick agrees on {agree:.2%}, {REFERENCE_TOKENS} decoded tokens equal")
    assert within >= FP8_ROWS_WITHIN and agree >= FP8_ARGMAX_AGREE
