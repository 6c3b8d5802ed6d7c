"""What every causal LM here shares: the gated MLP whose math an FFN backend
runs, and the ForCausalLM plumbing (logits, weight spec, FFN enumeration)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import ops
from engine.config import ModelConfig
from engine.ffn import ExpertWeights, FfnBackend, FfnLayer, ffn_call
from engine.layers import KVCache, RMSNorm, SlotKVCache
from engine.weights import WeightSpec


class NoFfnBackend(FfnBackend):
    """The placeholder of a model built without a backend: any use says what to do."""
    name = "none"

    def load_layer(self, layer):
        self.forward(layer.index, None, None, None)

    def forward(self, layer, x, ids, weights, out=None):
        raise RuntimeError("no FFN backend installed on this model: call engine.ffn.install(model, backend) "
                           "or load it with engine.loader.load_model(..., backend=...)")


NO_FFN = NoFfnBackend()


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); a dense FFN layer, or one routed expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, layer_idx: int = -1):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.layer_idx = layer_idx
        self.ffn: FfnBackend = NO_FFN
        self.resident = None   # engine.placement.ResidentExperts when the GPU computes this layer

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)

    def expert_parameters(self):
        return [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]

    def ffn_layer(self) -> FfnLayer:
        return FfnLayer(self.layer_idx, [self.expert_weights()], self.gate_proj.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        ids = torch.zeros((t, 1), dtype=torch.int32, device=x.device)      # [T, 1]
        weights = torch.ones((t, 1), dtype=torch.float32, device=x.device) # [T, 1]
        if self.resident is not None:
            return self.resident.call(self.ffn, self.layer_idx, x, ids, weights)
        return ffn_call(self.ffn, self.layer_idx, x, ids, weights)


class RoutedExperts(nn.Module):
    """The routed part of a MoE block, shared by every MoE family: the experts
    (HF names: experts.<e>.gate_proj/up_proj/down_proj) that an FFN backend runs.
    Subclasses add their router (self.gate) and any shared experts."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = hidden_size
        self.experts = nn.ModuleList(GatedMLP(hidden_size, moe_intermediate_size) for _ in range(num_experts))
        self.ffn: FfnBackend = NO_FFN
        self.resident = None   # engine.placement.ResidentExperts when the GPU computes some of the experts
        self.histogram = None  # engine.placement.RoutingHistogram counting this layer's choices

    def ffn_layer(self) -> FfnLayer:
        return FfnLayer(self.layer_idx, [e.expert_weights() for e in self.experts], self.hidden_size)

    def expert_parameters(self):
        return [p for e in self.experts for p in e.expert_parameters()]

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.histogram is not None:
            self.histogram.count(self.layer_idx, ids)
        if self.resident is not None:
            return self.resident.call(self.ffn, self.layer_idx, x, ids, weights)
        return ffn_call(self.ffn, self.layer_idx, x, ids, weights)   # [T, H]


class TopKRouter(nn.Module):
    """Softmax router: gate logits [T, E] -> top-k ids [T, k] int32 and weights [T, k]
    fp32, the wire's types (an FFN backend sends them as they are)."""

    MERGEABLE = True     # its logits are a plain linear: engine.merged_linear may stack it with others
    bias = None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.router_topk(logits, self.top_k, self.norm_topk_prob)   # [T, k], [T, k]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(F.linear(x, self.weight))


class DecoderStack(nn.Module):
    """embed_tokens -> decoder layers -> final RMSNorm (the HF `model.` part of Llama-like LMs)."""

    def __init__(self, config: ModelConfig, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None   # [T, H]; the stream is residual + x
        for layer in self.layers:
            x, residual = layer(x, residual, positions, cache)
        return self.norm.add(x, residual)[0]


class CausalLM(nn.Module):
    """Subclasses build self.model (with embed_tokens, layers, norm) and self.lm_head."""

    config: ModelConfig

    def weight_spec(self) -> WeightSpec:
        tied = (("lm_head.weight", "model.embed_tokens.weight"),) if self.config.tie_word_embeddings else ()
        return WeightSpec(tied=tied, ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))

    def adapt_to_checkpoint(self, names: set[str]) -> None:
        """Called by load_weights with the checkpoint's tensor names before loading:
        a model may drop optional parts the checkpoint does not carry."""

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, H] (run compute_logits on the rows you need)."""
        return self.model(input_ids, positions, cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # the family's attention takes an engine.layers.SlotBatch for its cache (continuous
    # batching on the torch path: engine.batch_torch); make_slot_cache gives its slot cache
    slot_batching = False

    def make_cache(self, max_model_len: int) -> KVCache:
        p = self.model.embed_tokens.weight
        return KVCache.allocate(self.config, max_model_len, p.dtype, p.device)

    def make_slot_cache(self, slots: int, max_model_len: int) -> SlotKVCache:
        """The caches of `slots` sequences at once (engine.batch), in the model's dtype and device."""
        p = self.model.embed_tokens.weight
        return SlotKVCache.allocate(self.config, slots, max_model_len, p.dtype, p.device)

    def ffn_modules(self):
        """Every module whose FFN a backend runs (its .ffn is the backend). Found again only when
        the decoder layers change (adapt_to_checkpoint may drop MTP layers; install and set_ffn
        change what the modules call, not which they are): walking every module takes a MoE model
        50-120 ms (Qwen3-30B-A3B: 25k modules), and the decode steps ask for the backend every step."""
        layers = self.model.layers
        key = (id(layers), len(layers))
        found = self.__dict__.get("_ffn_modules")
        if found is None or found[0] != key:
            found = (key, [m for m in self.modules() if hasattr(m, "ffn_layer") and m.layer_idx >= 0])
            self.__dict__["_ffn_modules"] = found
        return list(found[1])

    def set_ffn(self, backend: FfnBackend) -> FfnBackend:
        """Makes every FFN module call backend; returns it."""
        for m in self.ffn_modules():
            m.ffn = backend
        return backend

    def set_resident(self, resident) -> None:
        """Makes the FFN modules of the layers resident holds (engine.placement.ResidentExperts)
        compute the GPU's share and send the rest to their backend; None: all to the backend."""
        for m in self.ffn_modules():
            m.resident = resident if resident is not None and m.layer_idx in resident.layers else None
        self.__dict__["resident"] = resident

    def ffn_backend(self) -> FfnBackend:
        """The backend every FFN module calls (install / set_ffn give them one)."""
        modules = self.ffn_modules()
        if not modules:
            raise ValueError(f"{type(self).__name__} has no FFN layers")
        backend = modules[0].ffn
        if any(m.ffn is not backend for m in modules):
            raise RuntimeError(f"{type(self).__name__}: the FFN modules call different backends")
        return backend

    def ffn_layers(self):
        """(module, FfnLayer) for every FFN the backends may take over (needs the weights)."""
        for m in self.ffn_modules():
            yield m, m.ffn_layer()
