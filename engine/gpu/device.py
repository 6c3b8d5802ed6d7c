"""Where the host part of a model runs (everything but the expert FFNs): the choice
of device, and putting a loaded model there.

The choice: CUDA when it is present, unless switched off. The switch is the
`gpu` argument ("auto", "on", "off"; the loader and the daemon pass it) and, for
"auto", the environment variable DUCK_GPU (0/off or 1/on). "on" without CUDA is
an error, never a silent CPU run. An explicit device ("cpu", "cuda:1") is taken
as given.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

GPU_ENV = "DUCK_GPU"
_SWITCH = {"auto": "auto", "": "auto", "on": "on", "1": "on", "true": "on", "yes": "on",
           "off": "off", "0": "off", "false": "off", "no": "off"}
ROTARY_TABLES = ("inv_freq",)   # computed tensors kept as plain attributes (not parameters or buffers)


class GpuUnavailable(RuntimeError):
    """The GPU was asked for and CUDA is not there."""


def gpu_switch(gpu: str | bool | None = "auto") -> str:
    """'auto', 'on' or 'off': an explicit gpu wins; 'auto' (or None) defers to DUCK_GPU."""
    if isinstance(gpu, bool):
        return "on" if gpu else "off"
    mode = _SWITCH.get(str(gpu if gpu is not None else "auto").strip().lower())
    if mode is None:
        raise ValueError(f"gpu={gpu!r}: expected 'auto', 'on' or 'off'")
    if mode != "auto":
        return mode
    env = os.environ.get(GPU_ENV, "")
    mode = _SWITCH.get(env.strip().lower())
    if mode is None:
        raise ValueError(f"{GPU_ENV}={env!r}: expected 0/off, 1/on or auto")
    return mode


def host_device(gpu: str | bool | None = "auto") -> torch.device:
    """The device for the model's host part: cuda when present (and not switched off), else cpu."""
    mode = gpu_switch(gpu)
    if mode == "off":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if mode == "on":
        why = (f"this torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU")
        explicit = gpu is not None and (isinstance(gpu, bool) or _SWITCH.get(str(gpu).strip().lower()) != "auto")
        source = f"gpu={gpu!r}" if explicit else f"{GPU_ENV}={os.environ.get(GPU_ENV)!r}"
        raise GpuUnavailable(f"the GPU was asked for ({source}) but {why}; "
                             f"use gpu='auto' or 'off' (or unset {GPU_ENV}) to run on the CPU")
    return torch.device("cpu")


def resolve_device(device: str | torch.device | None = None, gpu: str | bool | None = "auto") -> torch.device:
    """device None or 'auto': host_device(gpu); anything else as given (cuda checked to be present)."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return host_device(gpu)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GpuUnavailable(f"device={str(device)!r} but CUDA is not available here; use device='cpu' or 'auto'")
    return device


def place_on_device(model: nn.Module, device: torch.device | str, keep_experts: bool = False) -> None:
    """Moves the model's parameters, buffers and rotary tables to device, in place (the
    Parameter objects stay the same, so tied weights stay tied). keep_experts leaves the
    expert tensors where they are: a host-side FFN backend holds them (or they were freed)."""
    device = torch.device(device)
    keep = {id(p) for m in model.ffn_modules() for p in m.expert_parameters()} if keep_experts else set()
    moved = 0
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in keep and p.device != device:
                _move_parameter(p, device)
                moved += p.numel()
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)
        for holder in (module, *(v for v in vars(module).values() if not isinstance(v, nn.Module))):
            for attr in ROTARY_TABLES:
                t = getattr(holder, attr, None)
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.device != device:
                    setattr(holder, attr, t.to(device))
    log.info("%s: %.3f G parameters moved to %s%s", type(model).__name__, moved / 1e9, device,
             " (expert tensors stay with the FFN backend)" if keep_experts else "")


def _move_parameter(p: nn.Parameter, device: torch.device) -> None:
    """Moves p's data, p staying the same object (ties and backends holding it see the move)."""
    data = p.data.to(device)
    if torch._has_compatible_shallow_copy_type(p.data, data):   # cpu <-> cuda: as Module.cuda() does it
        p.data = data
    else:   # e.g. to the meta device
        torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
