"""A plain-torch reference forward pass of DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention)
for tiny random test models, written independently of the engine.

It follows DeepSeek's published V3.2 description and its inference demo
(DeepSeek-V3.2-Exp `inference/model.py` / `kernel.py`), with the layout, weight names and
conventions of Hugging Face transformers' `DeepseekV32ForCausalLM` (which it matches to
fp32 rounding when `fp8=False`):

* per layer  x += MLA(RMSNorm(x));  x += FFN(RMSNorm(x));  then RMSNorm and lm_head.
* MLA with a query latent: qr = RMSNorm(q_a(x)), q = q_b(qr) -> [nope | rope] per head;
  kv_a(x) -> RMSNorm'd latent (-> kv_b -> k_nope, v) and one k_rope shared by the heads.
  MLA rotary is interleaved (pairs (x0,x1),(x2,x3).. written back as [evens | odds]);
  the softmax scale is qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2 under YaRN.
  Rotary tables are transformers' (YaRN inv_freq, cos/sin times YaRN's attention_factor);
  DeepSeek's demo puts no factor on cos/sin (its configs have mscale == mscale_all_dim,
  where the factor is 1) and only applies YaRN when max_seq_len > original_seq_len.
* Indexer: q = wq_b(qr) [T, Hi, Di], k = LayerNorm(wk(x)) [T, Di]; the first rope dims of
  both get half-split (rotate_half) rotary (DeepSeek's 2025-11-17 fix: not interleaved);
  score[t, s] = sum_h w[t, h] * relu(Di**-0.5 * q[t, h].k[s]), w = weights_proj(x) * Hi**-0.5;
  future keys get -inf and the top min(index_topk, T) of the full row are kept, as
  transformers does; MLA then attends to the selected keys that are not in the future.
* fp8=True adds what DeepSeek's inference does and transformers skips: q and k go through
  a Sylvester Walsh-Hadamard rotation (`rotate_activation`, scaled by Di**-0.5), are
  quantized per block of min(128, Di) to float8_e4m3fn (`act_quant`: scale =
  max(amax, 1e-4) / 448, rounded up to a power of two when scale_fmt is "ue8m0"), and
  scored like `fp8_index`: k_scale[s] * sum_h (w * q_scale * Di**-0.5)[t, h] * relu(q8.k8).
  With several blocks per row (Di > 128; DeepSeek has exactly one), q and k are instead
  dequantized block by block and scored with the exact formula.
* FFN: SwiGLU; MoE layers (`mlp_layer_types`, else i >= first_k_dense_replace) use sigmoid
  router scores, the correction bias for the choice only, group-limited top-k (group score =
  sum of its best two), unbiased weights normalized (+1e-20) when norm_topk_prob, times
  routed_scaling_factor, plus the shared experts.

Everything runs in fp32, batch of one, no cache. Queries go in chunks of `query_chunk`; the
indexer scores them in row blocks of at most INDEX_FLOATS values and MLA gathers only the
selected keys, so nothing [T, T]-sized exists (a 16k-token forward of a tiny model: ~0.5 GB).
Ties in the indexer scores (exactly 0 where relu zeroes every head: frequent in random tiny
models) are broken by torch.topk on the full masked row [T], as transformers does, which
reproduces its choice; `index_ties` flags the rows where that choice is arbitrary.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

FP8_MAX = 448.0
FP8_BLOCK = 128
AMAX_MIN = 1e-4          # DeepSeek's act_quant clamps the block amax here
GATHER_FLOATS = 1 << 24  # bound on the gathered [rows, keys, heads, dim] keys/values of one step
INDEX_FLOATS = 1 << 21   # bound on the indexer's [rows, heads, T] scores of one step


def hadamard(n: int) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard matrix of order n (a power of two), scaled by n**-0.5:
    orthogonal and symmetric, what fast_hadamard_transform(x, scale=n**-0.5) applies."""
    assert n > 0 and n & (n - 1) == 0, f"Hadamard order {n} is not a power of two"
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n ** -0.5


def act_quant(x: torch.Tensor, block: int, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block float8_e4m3fn quantization of the last dim, as DeepSeek's act_quant kernel:
    returns (values [..., n] fp8, scales [..., n // block] fp32) with x ~ values * scale."""
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt={scale_fmt!r}: only None and 'ue8m0' are known")
    xb = x.float().unflatten(-1, (-1, block))
    scale = xb.abs().amax(-1).clamp_min(AMAX_MIN) * (1.0 / FP8_MAX)
    if scale_fmt == "ue8m0":  # round up to a power of two (the kernel's fast_log2_ceil / fast_pow2)
        mant, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - (mant == 0.5).int())
    q = (xb / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    block = q.shape[-1] // scale.shape[-1]
    return (q.float().unflatten(-1, (-1, block)) * scale[..., None]).flatten(-2)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(cfg: dict, n: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(cos, sin) [n, rope_dim // 2] for positions 0..n-1 and the MLA softmax scale,
    computed as transformers does for DeepseekV32Config (rope_parameters; default or YaRN)."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    base, dim = rp.get("rope_theta", cfg.get("rope_theta", 10000.0)), cfg["qk_rope_head_dim"]
    scale = (cfg["qk_nope_head_dim"] + dim) ** -0.5
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    attention_factor = 1.0
    if kind == "default":
        inv_freq = 1.0 / pos_freqs
    elif kind == "yarn":
        orig = rp["original_max_position_embeddings"]
        factor = rp.get("factor") or cfg["max_position_embeddings"] / orig
        attention_factor = rp.get("attention_factor")
        if attention_factor is None:
            ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
            attention_factor = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all
                                else _yarn_mscale(factor))

        def corr_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(rp.get("beta_fast") or 32), corr_dim(rp.get("beta_slow") or 1)
        if rp.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        extra = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        inv_freq = 1.0 / (factor * pos_freqs) * (1 - extra) + 1.0 / pos_freqs * extra
        if rp.get("mscale_all_dim"):  # transformers' yarn_apply_mscale, DeepSeek's softmax_scale
            scale *= _yarn_mscale(factor, rp["mscale_all_dim"]) ** 2
    else:
        raise NotImplementedError(f"rope type {kind!r}")
    freqs = torch.arange(n).float()[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor, scale


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA rotary on [T, heads, d]: pairs (x0, x1), (x2, x3).. rotated, output [evens | odds]."""
    c, s, a, b = cos[:, None], sin[:, None], x[..., 0::2], x[..., 1::2]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer rotary on [T, heads, d]: the halves (x[:d/2], x[d/2:]) are the pairs."""
    c, s, (a, b) = cos[:, None], sin[:, None], x.chunk(2, -1)
    return torch.cat([a * c - b * s, b * c + a * s], -1)


class Reference:
    """The forward pass of one checkpoint. `topk` (config index_topk) and `scale_fmt` (None or
    "ue8m0"; from config scale_fmt or quantization_config.scale_fmt) may be set on an instance."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor]):
        if cfg.get("hidden_act", "silu") != "silu" or not cfg.get("q_lora_rank"):
            raise NotImplementedError("needs hidden_act silu and a q_lora_rank (the indexer reads qr)")
        self.cfg, self.w = cfg, weights
        self.n_layers, self.heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        self.nope, self.rope, self.dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.kv_rank, self.eps = cfg["kv_lora_rank"], cfg.get("rms_norm_eps", 1e-6)
        self.i_heads, self.i_dim, self.topk = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]
        self.i_block = min(FP8_BLOCK, self.i_dim)
        self.scale_fmt = cfg.get("scale_fmt") or (cfg.get("quantization_config") or {}).get("scale_fmt")
        n_dense = min(cfg.get("first_k_dense_replace", 0), self.n_layers)
        self.mlp_types = cfg.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (self.n_layers - n_dense)
        self.lm_head = weights.get("lm_head.weight", weights["embed_tokens.weight"])

    # ---- public API ----
    def logits(self, tokens: list[int], *, fp8: bool = True, query_chunk: int = 256) -> torch.Tensor:
        """[T, vocab] fp32 logits of a full forward over `tokens`."""
        x = self._run(tokens, fp8, query_chunk)
        return _rms(x, self.w["norm.weight"], self.eps) @ self.lm_head.T

    def index_topk(self, tokens: list[int], layer: int, *, fp8: bool = True, query_chunk: int = 256) -> torch.Tensor:
        """[T, min(index_topk, T)] key positions the indexer of `layer` selects, sorted ascending.
        Rows t < k - 1 have every past key selected; the rest of such a row is the smallest
        future positions (stand-ins for the arbitrary masked picks that attention ignores),
        so those rows read 0..k-1."""
        sel = self._probe(tokens, layer, fp8, query_chunk)["sel"].sort(-1).values
        sel[: sel.shape[1] - 1] = torch.arange(sel.shape[1])
        return sel

    def index_ties(self, tokens: list[int], layer: int, *, fp8: bool = True, query_chunk: int = 256) -> torch.Tensor:
        """[T] bool: rows whose k-th best index score is shared by a key left out, so that which
        of the tied keys are kept is torch.topk's (unspecified) choice. Compare selections, or
        logits downstream of them, with another implementation on the other rows only."""
        return self._probe(tokens, layer, fp8, query_chunk)["ties"]

    def index_scores(self, tokens: list[int], layer: int, *, fp8: bool = True) -> torch.Tensor:
        """[T, T] indexer scores of `layer` (-inf above the diagonal): for short sequences."""
        return self._probe(tokens, layer, fp8, 256, scores=True)["scores"]

    # ---- internals ----
    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _probe(self, tokens, layer: int, fp8: bool, chunk: int, scores: bool = False) -> dict:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} of {self.n_layers}")
        probe = {"sel": [], "ties": [], "scores": [] if scores else None}
        self._run(tokens, fp8, chunk, probe_layer=layer, probe=probe)
        return {k: torch.cat(v) if v is not None else None for k, v in probe.items()}

    def _run(self, tokens, fp8: bool, chunk: int, probe_layer: int = -1, probe: dict | None = None):
        self.cos, self.sin, self.scale = rope_tables(self.cfg, len(tokens))
        x = self.w["embed_tokens.weight"][torch.as_tensor(tokens, dtype=torch.long)]
        for i in range(self.n_layers):
            p = f"layers.{i}."
            h = _rms(x, self.w[p + "input_layernorm.weight"], self.eps)
            if i == probe_layer:
                return self._attention(p + "self_attn.", h, fp8, chunk, probe)
            x = x + self._attention(p + "self_attn.", h, fp8, chunk)
            h = _rms(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
            x = x + (self._moe(p + "mlp.", h) if self.mlp_types[i] == "sparse" else self._mlp(p + "mlp.", h))
        return x

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return self._lin(F.silu(self._lin(x, p + "gate_proj")) * self._lin(x, p + "up_proj"), p + "down_proj")

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        cfg, n_exp = self.cfg, self.cfg["n_routed_experts"]
        n_group, top_k = cfg.get("n_group") or 1, cfg["num_experts_per_tok"]
        scores = (x @ self.w[p + "gate.weight"].T).sigmoid()
        choice = scores + self.w[p + "gate.e_score_correction_bias"]
        group_score = choice.view(-1, n_group, n_exp // n_group).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.get("topk_group") or 1, -1, sorted=False).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(n_exp // n_group, 1), float("-inf"))
        ids = choice.topk(top_k, -1, sorted=False).indices
        wts = scores.gather(1, ids)
        if cfg.get("norm_topk_prob", True):
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * cfg.get("routed_scaling_factor", 1.0)
        out = torch.zeros_like(x)
        for e in range(n_exp):
            tok, slot = torch.where(ids == e)
            if len(tok):
                out.index_add_(0, tok, self._mlp(f"{p}experts.{e}.", x[tok]) * wts[tok, slot, None])
        return out + self._mlp(p + "shared_experts.", x)

    def _indexer_inputs(self, p: str, x: torch.Tensor, qr: torch.Tensor, fp8: bool):
        """(q [T, Hi, Di], k.T [Di, T], head weights [T, Hi], per-key scale [T] or None, dot scale)."""
        t, r = x.shape[0], self.rope
        q = self._lin(qr, p + "wq_b").view(t, self.i_heads, self.i_dim)
        k = F.layer_norm(self._lin(x, p + "wk"), (self.i_dim,), self.w[p + "k_norm.weight"],
                         self.w[p + "k_norm.bias"], 1e-6)[:, None]
        q = torch.cat([rope_half(q[..., :r], self.cos, self.sin), q[..., r:]], -1)
        k = torch.cat([rope_half(k[..., :r], self.cos, self.sin), k[..., r:]], -1)[:, 0]
        w = self._lin(x, p + "weights_proj") * self.i_heads ** -0.5
        if not fp8:
            return q, k.T.contiguous(), w, None, self.i_dim ** -0.5
        had = hadamard(self.i_dim)
        (q8, qs), (k8, ks) = (act_quant(v @ had, self.i_block, self.scale_fmt) for v in (q, k))
        if qs.shape[-1] > 1:  # several blocks: dequantized values, exact scoring
            return dequant(q8, qs), dequant(k8, ks).T.contiguous(), w, None, self.i_dim ** -0.5
        return q8.float(), k8.float().T.contiguous(), w * qs[..., 0] * self.i_dim ** -0.5, ks[:, 0], 1.0

    def _select(self, ix, r0: int, r1: int, probe: dict | None = None) -> torch.Tensor:
        """Top-min(index_topk, T) key positions [r1 - r0, k] of queries r0..r1-1 (unsorted).
        torch.topk sees the full masked row [T] as in transformers (its choice among equal
        scores depends on the row); only the causal prefix is computed, in row blocks."""
        q, kt, w, key_scale, dot_scale = ix
        t = kt.shape[1]
        k, step = min(self.topk, t), max(1, min(r1 - r0, INDEX_FLOATS // (self.i_heads * t)))
        row = torch.full((step, t), float("-inf"))  # columns >= the block's end stay -inf
        future = torch.ones(step, step, dtype=torch.bool).triu_(1)
        out = []
        for a in range(r0, r1, step):
            b = min(a + step, r1)
            s = torch.matmul(q[a:b], kt[:, :b])                              # [rows, Hi, b]
            s = (s if dot_scale == 1.0 else s.mul_(dot_scale)).relu_()
            score = torch.matmul(w[a:b, None, :], s).squeeze(1)            # [rows, b]
            if key_scale is not None:
                score.mul_(key_scale[:b])
            score[:, a:].masked_fill_(future[: b - a, : b - a], float("-inf"))
            row[: b - a, :b] = score
            best, idx = row[: b - a].topk(k, -1)
            out.append(idx)
            if probe is not None:
                probe["ties"].append(((row[: b - a] >= best[:, -1:]).sum(-1) > k) & (torch.arange(a, b) >= k - 1))
                if probe["scores"] is not None:
                    probe["scores"].append(row[: b - a].clone())
        return torch.cat(out)

    def _attention(self, p: str, x: torch.Tensor, fp8: bool, chunk: int, probe: dict | None = None):
        t, h = x.shape[0], self.heads
        qr = _rms(self._lin(x, p + "q_a_proj"), self.w[p + "q_a_layernorm.weight"], 1e-6)
        ix = self._indexer_inputs(p + "indexer.", x, qr, fp8)
        if probe is not None:
            probe["sel"] = [self._select(ix, c0, min(c0 + chunk, t), probe) for c0 in range(0, t, chunk)]
            return None
        q = self._lin(qr, p + "q_b_proj").view(t, h, self.nope + self.rope)
        q = torch.cat([q[..., :self.nope], rope_interleaved(q[..., self.nope:], self.cos, self.sin)], -1)
        latent, k_pe = self._lin(x, p + "kv_a_proj_with_mqa").split([self.kv_rank, self.rope], -1)
        k_pe = rope_interleaved(k_pe[:, None], self.cos, self.sin)
        kv = self._lin(_rms(latent, self.w[p + "kv_a_layernorm.weight"], 1e-6), p + "kv_b_proj")
        k_nope, v = kv.view(t, h, self.nope + self.dv).split([self.nope, self.dv], -1)
        k = torch.cat([k_nope, k_pe.expand(t, h, self.rope)], -1).transpose(0, 1).contiguous()  # [H, T, qk]
        q, v = q.transpose(0, 1), v.transpose(0, 1).contiguous()                               # [H, T, .]
        out = torch.empty(t, h, self.dv)
        for c0 in range(0, t, chunk):
            c1 = min(c0 + chunk, t)
            sel = self._select(ix, c0, c1)
            step = max(1, GATHER_FLOATS // (sel.shape[1] * h * (k.shape[-1] + self.dv)))
            for r0 in range(c0, c1, step):  # gather only the selected keys: O(T * index_topk)
                r1, s = min(r0 + step, c1), sel[r0 - c0: r0 - c0 + step]
                att = torch.matmul(q[:, r0:r1, None], k[:, s].transpose(-1, -2)) * self.scale  # [H, rows, 1, keys]
                att = att.masked_fill((s > torch.arange(r0, r1)[:, None])[:, None], float("-inf"))
                out[r0:r1] = torch.matmul(att.softmax(-1), v[:, s]).squeeze(2).transpose(0, 1)
        return self._lin(out.reshape(t, h * self.dv), p + "o_proj")


def load_reference(folder) -> Reference:
    """A Reference from folder/config.json and the *.safetensors written by save_pretrained
    (per-expert or fused `experts.gate_up_proj`/`down_proj` tensors); weights cast to fp32."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(f))
    if any(n.endswith(("weight_scale_inv", ".scale")) for n in raw):
        raise NotImplementedError("quantized checkpoints are not supported: the reference wants fp32 weights")
    w = {n.removeprefix("model."): t.float() for n, t in raw.items()}
    for n in [n for n in w if n.endswith("experts.gate_up_proj")]:   # fused layout -> per expert
        p, gate_up, down = n[: -len("gate_up_proj")], w.pop(n), w.pop(n[: -len("gate_up_proj")] + "down_proj")
        for e, (g, u) in enumerate(zip(*gate_up.chunk(2, 1))):
            w[f"{p}{e}.gate_proj.weight"], w[f"{p}{e}.up_proj.weight"] = g, u
            w[f"{p}{e}.down_proj.weight"] = down[e]
    if cfg.get("tie_word_embeddings"):
        w.pop("lm_head.weight", None)
    return Reference(cfg, w)
