"""The engine inside the daemon: the model loaded with its FFNs on the fleet
(packed through the host's pack cache, synced to the ducks' caches with
progress), and generation for the Chat API. Blocking work; the daemon runs
it in threads."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.fleet_ffn import FleetFfn

from duckd.config import ConfigError
from duckd.packcache import PackCache

log = logging.getLogger("duckd.model")


@dataclass(slots=True)
class Progress:
    phase: str = "idle"          # packing, uploading, done
    done: int = 0
    total: int = 0
    started: float = 0.0

    def rate(self) -> float:
        dt = time.monotonic() - self.started
        return self.done / dt if dt > 0 and self.phase == "uploading" else 0.0

    def eta(self) -> float:
        r = self.rate()
        return (self.total - self.done) / r if r > 0 else 0.0


class SyncedFleetFfn(FleetFfn):
    """The fleet backend with the daemon's pack cache, upload progress and
    per-duck resync after a restart."""

    def __init__(self, fleet, packs: PackCache, progress: Progress, n_layers: int, multiple_of: int, **options):
        super().__init__(fleet=fleet, multiple_of=multiple_of, **options)
        self.packs, self.progress, self.n_layers = packs, progress, n_layers
        self.cache_hits = [0] * fleet.n_ducks
        self.uploaded_bytes = [0] * fleet.n_ducks

    def load_layer(self, layer) -> None:
        tp = self.fleet.n_ducks
        if self.progress.phase != "packing":
            self.progress.phase, self.progress.done, self.progress.total = "packing", 0, self.n_layers
            self.progress.started = time.monotonic()
        cached = [self.packs.load(layer.index, r, f"layers.{layer.index}") for r in range(tp)]
        if all(c is not None for c in cached):
            self.hidden = layer.hidden
            self.layers[layer.index] = cached
        else:
            super().load_layer(layer)
            for r, slices in enumerate(self.layers[layer.index]):
                self.packs.store(layer.index, r, slices)
        self.progress.done += 1
        if self.progress.done % max(1, self.n_layers // 10) == 0 or self.progress.done == self.n_layers:
            log.info("packing: %d/%d layers (%d from the pack cache)", self.progress.done, self.n_layers,
                     self.packs.hits // tp)

    def sync(self, ducks: list[int] | None = None) -> dict:
        """Uploads what the ducks' caches lack, layer by layer, with progress."""
        ducks = list(range(self.fleet.n_ducks)) if ducks is None else ducks
        wanted = [self.tensors(d) if d in ducks else [] for d in range(self.fleet.n_ducks)]
        held = self.fleet.cache_query([[t.digest() for t in ts] for ts in wanted])
        missing = [[t for t in ts if t.digest() not in h] for ts, h in zip(wanted, held)]
        for d in ducks:
            self.cache_hits[d] += len(held[d])
        p = self.progress
        p.phase, p.done, p.total, p.started = "uploading", 0, sum(t.nbytes for ts in missing for t in ts), time.monotonic()
        last_log = 0.0
        batch = 64
        while any(missing):
            part = [ts[:batch] for ts in missing]
            missing = [ts[batch:] for ts in missing]
            result = self.fleet.upload(part)
            p.done += result["bytes"]
            for d, ts in enumerate(part):
                self.uploaded_bytes[d] += sum(t.nbytes for t in ts)
            if time.monotonic() - last_log > 1.0 or not any(missing):
                last_log = time.monotonic()
                log.info("upload: %.1f/%.1f MB, %.1f MB/s, ETA %.0f s", p.done / 1e6, p.total / 1e6,
                         p.rate() / 1e6, p.eta())
        p.phase = "done"
        return {"cached": sum(len(h) for h in held), "uploaded_bytes": p.total}

    def finish_loading(self) -> None:
        self.sync()
        self.open_session()

    def ffn_bytes_per_token(self, experts_per_token: int) -> int:
        per_layer = []
        for slices_per_duck in self.layers.values():
            n = len(slices_per_duck[0])
            per_expert = sum(slices_per_duck[d][0].weight_bytes for d in range(len(slices_per_duck)))
            per_layer.append(per_expert * (1 if n == 1 else experts_per_token))
        return sum(per_layer)


class ModelHost:
    """Owns the loaded model; one generation (or session change) at a time."""

    def __init__(self, model_cfg, fleet_cfg, state_dir: Path):
        self.cfg, self.fleet_cfg, self.state_dir = model_cfg, fleet_cfg, state_dir
        self.lock = threading.Lock()
        self.loaded = None
        self.ffn = None
        self.progress = Progress()
        self.name = ""
        self.last_decode_tps = 0.0
        self._grammars = self._tool_format = None
        self.context = None   # duckd.context_size.ContextPlan, once loaded

    @property
    def grammars(self):
        """The model's grammar compiler (engine.grammar.Grammars; its vocabulary is built on first use)."""
        if self._grammars is None:
            from engine.grammar import Grammars
            model = self.loaded.model
            head = getattr(model, "lm_head", None)
            vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
            self._grammars = Grammars(self.loaded.tokenizer, vocab)
        return self._grammars

    @property
    def tool_format(self):
        """How this model family writes tool calls (duckd.tool_calls)."""
        if self._tool_format is None:
            from duckd.tool_calls import tool_format
            self._tool_format = tool_format(self.loaded.tokenizer)
        return self._tool_format

    def load(self, fleet=None, packs: PackCache | None = None) -> None:
        from engine.loader import default_model_path, load_model

        path = default_model_path() if self.cfg.path == "default" else Path(self.cfg.path).expanduser()
        self.name = path.name
        device = self.cfg.device   # "auto": engine.gpu.device decides (CUDA when present, unless DUCK_GPU=0)
        backend = self.cfg.backend
        if backend == "fleet":
            from engine.config import ModelConfig  # noqa: F401  (layer count for progress)
            n_layers = _layer_count(path)
            fc = self.fleet_cfg
            backend = SyncedFleetFfn(fleet, packs, self.progress, n_layers, fc.multiple_of, replicas=fc.replicas,
                                     cover_bytes=fc.host_cover_mb << 20, cover_threads=fc.host_cover_threads)
        t0 = time.monotonic()
        self.loaded = load_model(path, device=device, backend=backend)
        self.ffn = self.loaded.ffn
        log.info("model %s loaded in %.1f s (backend %s)", self.name, time.monotonic() - t0, self.ffn.name)
        self._size_context()
        self._place()
        self._streamed_prefill()

    def _size_context(self) -> None:
        """model.max_model_len against the decode cache's bytes per token and model.kv_cache_budget
        (duckd.context_size): "auto" becomes the longest context that fits; the operator is told."""
        from duckd.context_size import plan_context

        try:
            self.context = plan_context(self.loaded.model, self.cfg.max_model_len, self.cfg.max_seqs,
                                        self.cfg.kv_cache_budget)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.cfg.max_model_len = self.context.max_model_len
        log.info("context: %s", self.context.describe())

    def _place(self) -> None:
        """With a fleet: the GPU's share of the FFNs within model.gpu_ffn_budget (engine.placement).
        auto leaves room for the streamed prefill's two GPU buffers (a layer's experts each)."""
        from engine.placement import RoutingHistogram

        if not hasattr(self.ffn, "layers") or not hasattr(self.ffn, "session"):
            return
        self.histogram = RoutingHistogram().attach(self.loaded.model)   # counted while serving (replace)
        self._place_now(self.cfg.gpu_ffn_budget)

    def _place_now(self, text: str, histogram=None) -> None:
        from duckd.config import parse_budget
        from engine.placement import auto_budget, place

        model = self.loaded.model
        device = model.lm_head.weight.device
        budget = parse_budget(text, auto_budget(model, self.ffn, self.cfg.gpu_prefill != "off"))
        self.budget_text = text
        t0 = time.monotonic()
        resident = place(model, self.ffn, budget, histogram, threads=max(1, (os.cpu_count() or 2) - 1),
                         on_progress=lambda done, total: log.info("placement: %d/%d layers on %s", done, total,
                                                                  device) if done == total or done % 8 == 0 else None)
        streamed = getattr(model, "streamed_prefill", None)
        if streamed is not None:
            streamed.placed(resident)
        if resident is not None:
            s = resident.plan.summary()
            log.info("placement: %.2f GB of FFN weights on %s in %.1f s (%d layers whole, %d experts), %.3f GB per "
                     "token from the ducks in %d calls", s["gpu_gb"], device, time.monotonic() - t0,
                     len(s["gpu_layers_whole"]), s["gpu_experts"], s["duck_gb_per_token"], s["duck_calls_per_token"])

    def replace(self, budget: str = "", by_routing: bool = False) -> dict | None:
        """Placement again between two steps (the chat's lock): another budget ("": the current one), or
        each layer's experts by the routing counted while serving. The ducks keep every slice: nothing is
        uploaded; the decode graphs are captured again at their next use. Raises ConfigError on a bad budget."""
        from duckd.config import parse_budget

        if self.loaded is None or not hasattr(self, "histogram"):
            raise RuntimeError("placement needs the model loaded with the fleet backend")
        text = budget or self.budget_text
        parse_budget(text, 0)     # a bad budget is refused before anything changes
        with self.lock:
            self._place_now(text, self.histogram if by_routing else None)
        return self.placement()

    def placement(self) -> dict | None:
        """The plan's summary (engine.placement.PlacementPlan.summary), None when the ducks compute every FFN."""
        resident = self.loaded.model.__dict__.get("resident") if self.loaded else None
        return resident.plan.summary() if resident is not None else None

    def _streamed_prefill(self) -> None:
        """On a CUDA host with a fleet: the experts' host copy for long prompts (model.gpu_prefill)."""
        cfg, model = self.cfg, self.loaded.model
        device = model.lm_head.weight.device
        if cfg.gpu_prefill == "off" or device.type != "cuda" or not hasattr(self.ffn, "layers"):
            return
        from engine.gpu.expert_stream import ExpertStream, pinned_copy_gbps
        from engine.gpu.hybrid_prefill import StreamedPrefill
        resident = model.__dict__.get("resident")      # layers the GPU holds whole never reach the stream
        layers = {i: v for i, v in self.ffn.layers.items() if resident is None or not resident.whole(i)}
        if not layers:
            return
        stream = ExpertStream(layers, self.ffn.hidden, device,
                              max_bytes=cfg.gpu_prefill_host_mb << 20 if cfg.gpu_prefill_host_mb else None)
        gbps = pinned_copy_gbps(device)
        model.streamed_prefill = StreamedPrefill(stream, self.ffn, "gpu" if cfg.gpu_prefill == "gpu" else "hybrid",
                                                 gbps, cfg.gpu_prefill_chunk, cfg.gpu_prefill_min_tokens)
        log.info("streamed prefill: %.1f GB of experts held for the GPU, pinned copies at %.1f GB/s",
                 model.streamed_prefill.pass_bytes / 1e9, gbps)

    def resync(self, duck: int) -> dict:
        """A restarted duck (or one another host took): it holds no run of ours, so the run is
        opened on it first (its new challenge); what its cache lacks is uploaded (beside any
        generation: the transport takes one call at a time); then, between two steps, the
        session on it and its slices back."""
        self.ffn.fleet.open_run([duck])   # the other ducks are not asked: one of them may be down now
        result = self.ffn.sync([duck])
        with self.lock:
            self.ffn.take_back(duck)
        return result

    def take_back(self, duck: int) -> None:
        """A lost duck that still serves computes its slices again, between two steps."""
        with self.lock:
            self.ffn.take_back(duck)

    def close(self) -> None:
        with self.lock:
            streamed = getattr(self.loaded.model, "streamed_prefill", None) if self.loaded else None
            if streamed is not None:
                streamed.close()
            if self.ffn is not None:
                self.ffn.close()
                self.ffn = None


def _layer_count(path: Path) -> int:
    import json
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        return int(cfg.get("num_hidden_layers", 0)) or 1
    from engine.gguf_file import GgufCheckpoint
    return int(GgufCheckpoint(path).config_dict().get("num_hidden_layers", 1))
