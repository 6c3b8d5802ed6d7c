"""How long a conversation the daemon takes: the decode cache's bytes per token (every
layer's k/v, or MLA's latents and rotary keys, and DeepSeek-V3.2's indexer keys) for
model.max_seqs sequences, against the memory model.kv_cache_budget gives it, bounded by
the checkpoint's max_position_embeddings. model.max_model_len = "auto" takes the longest
that fits; a number is kept, with a warning where it exceeds either bound."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from duckd.config import parse_budget

log = logging.getLogger(__name__)

ROUND = 256                  # an auto context is a multiple of this
AUTO_SHARE = 0.5             # auto budget: this share of what is free on the model's device after loading
PROBE_POSITIONS = 16         # the small cache the bytes per token are measured on


@dataclass(frozen=True, slots=True)
class ContextPlan:
    bytes_per_token: int     # one position of one sequence, every layer
    sequences: int           # the batch's slots (model.max_seqs)
    budget: int              # bytes for the cache
    checkpoint_limit: int    # max_position_embeddings
    longest: int             # the longest context that fits both
    max_model_len: int       # what the daemon takes

    def describe(self) -> str:
        return (f"decode cache {self.bytes_per_token / 1024:.1f} KiB per token x {self.sequences} sequences; "
                f"{self.budget / 2**30:.2f} GiB budget and the checkpoint's {self.checkpoint_limit} positions "
                f"allow {self.longest} tokens; max_model_len {self.max_model_len}")


def cache_bytes_per_token(model) -> int:
    """One position's bytes in the model's own slot cache (or single-sequence cache), all layers."""
    make = getattr(model, "make_slot_cache", None)
    cache = make(1, PROBE_POSITIONS) if make is not None else model.make_cache(PROBE_POSITIONS)
    return sum(t.numel() * t.element_size() for t in cache.per_position()) // PROBE_POSITIONS


def free_memory(device: torch.device) -> int:
    """Bytes free on the model's device: the GPU's, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_context(model, max_model_len: int | str, sequences: int, budget_text: str = "auto") -> ContextPlan:
    per_token = cache_bytes_per_token(model)
    device = model.model.embed_tokens.weight.device
    budget = parse_budget(budget_text, int(free_memory(device) * AUTO_SHARE), key="model.kv_cache_budget")
    limit = model.config.max_position_embeddings
    longest = min(limit, budget // max(1, per_token * sequences))
    if max_model_len == "auto":
        take = max(ROUND, longest // ROUND * ROUND) if longest >= ROUND else longest
        if take < 2:
            raise ValueError(f"model.max_model_len = auto: {budget} bytes of model.kv_cache_budget hold no context "
                             f"for {sequences} sequences at {per_token} bytes per token")
    else:
        take = int(max_model_len)
        if take > longest:
            log.warning("model.max_model_len = %d exceeds what fits (%d tokens: %s)", take, longest,
                        "the checkpoint's max_position_embeddings" if longest == limit else "model.kv_cache_budget")
    return ContextPlan(per_token, sequences, budget, limit, longest, take)
