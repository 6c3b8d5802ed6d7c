"""Checkpoint reading and the one generic weight loader.

A checkpoint is a set of named tensors read one at a time (safetensors are
memory-mapped), so a model is never held twice in memory. Models declare how
checkpoint names map onto their parameters (see WeightSpec); the loader makes
every missing, unexpected or mis-shaped tensor an error that names it and its file.
"""
from __future__ import annotations

import abc
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)


class WeightError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor and file."""


# -- fp8 e4m3 with block scales -------------------------------------------------
def block_scales(rows: int, cols: int, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """The weight_scale_inv of a [rows, cols] weight as float32 [ceil(rows/bR), ceil(cols/bC)]
    (a single row of scales may come 1-D); a wrong shape is a WeightError naming the tensor."""
    want = (-(-rows // block[0]), -(-cols // block[1]))
    scale = scale_inv.float()
    if scale.dim() == 1 and want[0] == 1:
        scale = scale.reshape(1, -1)
    if tuple(scale.shape) != want:
        raise WeightError(f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} "
                          f"for a {rows}x{cols} weight in {block[0]}x{block[1]} blocks")
    return scale


def dequantize_fp8_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                          name: str = "<tensor>") -> torch.Tensor:
    """fp8 e4m3 weight [R, C] times its weight_scale_inv [ceil(R/bR), ceil(C/bC)] -> fp32.
    The last block of a dimension is short when the dimension is not a multiple
    of the block: scales are expanded and then cut to [R, C], never the reverse."""
    if codes.dim() != 2:
        raise WeightError(f"{name}: fp8 weight must be 2-D, got shape {tuple(codes.shape)}")
    rows, cols = codes.shape
    br, bc = block
    scale = block_scales(rows, cols, scale_inv, block, name)
    full = scale.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]  # [R, C]
    return codes.float() * full


# -- checkpoints ---------------------------------------------------------------
class Checkpoint(abc.ABC):
    """Named tensors, read lazily. Subclasses: safetensors folders, GGUF files."""

    path: Path
    fp8_block: tuple[int, int] | None = None

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Every tensor name the checkpoint holds."""

    @abc.abstractmethod
    def file_of(self, name: str) -> str:
        """The file a tensor lives in (for messages)."""

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading it."""

    @abc.abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (fp8 stays fp8)."""

    def nbytes(self, name: str) -> int:
        return 0

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face folder: model.safetensors.index.json, or every *.safetensors in it."""

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] | None = None):
        from safetensors import safe_open

        self.path = Path(path)
        self.fp8_block = fp8_block
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise WeightError(f"{index}: not a safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise WeightError(f"{self.path}: no *.safetensors files (is this a Hugging Face checkpoint folder?)")
        self._files = {}
        self._where: dict[str, str] = {}
        for f in files:
            fp = self.path / f
            if not fp.exists():
                raise WeightError(f"{index}: names {f}, which is not in {self.path}")
            handle = safe_open(str(fp), framework="pt", device="cpu")
            self._files[f] = handle
            for key in handle.keys():
                if weight_map is not None and weight_map.get(key) != f:
                    raise WeightError(f"tensor {key!r} is in {f} but the index says {weight_map.get(key)!r}")
                if key in self._where:
                    raise WeightError(f"tensor {key!r} appears in both {self._where[key]} and {f}")
                self._where[key] = f
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self._where))
            if absent:
                raise WeightError(f"{index}: lists {absent[0]!r} in {weight_map[absent[0]]}, which lacks it "
                                  f"({len(absent)} such tensors)")

    def names(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> str:
        return self._where.get(name, "<none>")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._files[self._where[name]].get_tensor(name)

    def nbytes(self, name: str) -> int:
        s = self._files[self._where[name]].get_slice(name)
        n = 1
        for d in s.get_shape():
            n *= d
        return n * {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4}.get(s.get_dtype(), 4)

    def close(self) -> None:
        self._files.clear()


# -- the declarative mapping ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class WeightSpec:
    """How checkpoint names map onto a model's parameters.

    renames: (parameter-name regex, checkpoint-name template) pairs for the
        parameters whose names differ from the checkpoint's; all others load by
        their own name (our modules use Hugging Face attribute names).
    tied: parameter name -> the parameter it shares storage with; a checkpoint
        may carry or omit the tied copy.
    ignored: checkpoint-name regexes that are known and deliberately unused.
    """
    renames: tuple[tuple[str, str], ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()

    def checkpoint_name(self, param: str) -> str:
        for pattern, template in self.renames:
            m = re.fullmatch(pattern, param)
            if m:
                return m.expand(template)
        return param


def load_weights(model: nn.Module, ckpt: Checkpoint, spec: WeightSpec) -> set[str]:
    """Copies every parameter of model from ckpt; returns the checkpoint names used.
    fp8 weights are dequantized with their weight_scale_inv; the source of each
    is remembered on the parameter (fp8_source) so an fp9 packer can read the
    codes again bit-exactly instead of the rounded float."""
    adapt = getattr(model, "adapt_to_checkpoint", None)
    if adapt is not None:  # optional parts (e.g. an MTP layer) a checkpoint may lack
        adapt(set(ckpt.names()))
    tied = dict(spec.tied)
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False) if n not in tied}
    available = set(ckpt.names())
    used: set[str] = set()
    total = len(params)
    t0 = last = time.perf_counter()
    done_bytes = 0
    for i, (pname, param) in enumerate(params.items()):
        cname = spec.checkpoint_name(pname)
        if cname not in available:
            near = [n for n in available if n.rsplit(".", 2)[-2:] == cname.rsplit(".", 2)[-2:]][:3]
            raise WeightError(f"checkpoint {ckpt.path} has no tensor {cname!r} for parameter {pname!r} "
                              f"(shape {tuple(param.shape)})" + (f"; similar names: {near}" if near else ""))
        shape = ckpt.shape(cname)
        if tuple(shape) != tuple(param.shape):
            raise WeightError(f"tensor {cname!r} in {ckpt.file_of(cname)} has shape {tuple(shape)}, "
                              f"the model expects {tuple(param.shape)}; does config.json match the weights?")
        tensor = ckpt.get(cname)
        used.add(cname)
        if tensor.dtype == torch.float8_e4m3fn:
            sname = cname + "_scale_inv"
            if sname not in available or ckpt.fp8_block is None:
                raise WeightError(f"fp8 tensor {cname!r} in {ckpt.file_of(cname)} has no {sname!r} "
                                  f"or the config has no quantization_config.weight_block_size")
            tensor = dequantize_fp8_blocks(tensor, ckpt.get(sname), ckpt.fp8_block, name=cname)
            used.add(sname)
            param.fp8_source = (ckpt, cname, sname)
        with torch.no_grad():
            param.copy_(tensor)
        done_bytes += ckpt.nbytes(cname)
        now = time.perf_counter()
        if now - last > 5.0:
            last = now
            log.info("loading weights: %d/%d tensors, %.2f GiB, %.0fs", i + 1, total, done_bytes / 2**30, now - t0)
    for pname, target in spec.tied:
        cname = spec.checkpoint_name(pname)
        if cname in available:
            used.add(cname)
    ignored = [re.compile(p) for p in spec.ignored]
    unexpected = sorted(n for n in available - used if not any(p.fullmatch(n) for p in ignored))
    if unexpected:
        n = unexpected[0]
        raise WeightError(f"tensor {n!r} in {ckpt.file_of(n)} is not used by {type(model).__name__} "
                          f"({len(unexpected)} unexpected tensors); is it the right model_type/config?")
    log.info("loaded %d tensors (%.2f GiB) from %s in %.1fs", len(used), done_bytes / 2**30, ckpt.path,
             time.perf_counter() - t0)
    return used
