"""Host-side FFN backends (engine.ffn.Fp9Ffn, engine.fleet.FleetFfn, TorchFfn on the
CPU) under a model whose host part is on the GPU: the activation goes out through
pinned host buffers (asynchronous copies, one event wait) and the partial sums
come back the same way, instead of a pageable .cpu() / .to(device) per tensor.

HostStaging holds the buffers of one caller; PinnedFfn wraps a backend for the
model's FFN modules (the loader installs it); engine.gpu.graphs' lanes use
HostStaging directly around their graph replays.
"""
from __future__ import annotations

import threading

import torch

from engine.ffn import FfnBackend, FfnLayer, TorchFfn, innermost_backend


def runs_on_host(backend: FfnBackend) -> bool:
    """Whether backend computes on the CPU and so takes host tensors: Fp9Ffn and the
    fleet do, TorchFfn(device='cpu') does; TorchFfn() computes where the model is.
    Wrappers (anything with .backend: LaneFfn, PinnedFfn, timing wrappers) are looked through."""
    backend = innermost_backend(backend)
    if getattr(backend, "captures_in_graph", False):   # engine.gpu.moe: on the GPU
        return False
    if isinstance(backend, TorchFfn):
        return backend.device is not None and backend.device.type == "cpu"
    return True


class HostStaging:
    """Host buffers for FFN calls of up to `tokens` tokens: x, ids and weights out,
    y back; pinned when CUDA is present. Per expert count k its own ids/weights pair
    (a dense layer has k=1), so every buffer handed out is contiguous."""

    def __init__(self, tokens: int, hidden: int, x_dtype: torch.dtype, ids_dtype: torch.dtype,
                 weights_dtype: torch.dtype, y_dtype: torch.dtype | None = None):
        self.tokens, self.hidden = tokens, hidden
        self.pinned = torch.cuda.is_available()
        self.ids_dtype, self.weights_dtype = ids_dtype, weights_dtype
        self.x = self._empty(tokens, hidden, dtype=x_dtype)
        self.y = self._empty(tokens, hidden, dtype=y_dtype or x_dtype)
        self._routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._x_ready = torch.cuda.Event() if self.pinned else None
        self._y_free = torch.cuda.Event() if self.pinned else None   # the last copy out of self.y is done
        self._y_pending = False

    def _empty(self, *shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def fits(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> bool:
        return (x.shape[0] <= self.tokens and x.shape[1] == self.hidden and x.dtype == self.x.dtype
                and ids.dtype == self.ids_dtype and weights.dtype == self.weights_dtype)

    def _routing_buffers(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k not in self._routing:
            self._routing[k] = (self._empty(self.tokens, k, dtype=self.ids_dtype),
                                self._empty(self.tokens, k, dtype=self.weights_dtype))
        return self._routing[k]

    def to_host(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies x [T, H], ids / weights [T, k] into the buffers (on stream, after the
        work queued there) and waits for them; returns the host views [T, ...]."""
        t, k = x.shape[0], ids.shape[1]
        if not self.fits(x, ids, weights):
            raise ValueError(f"FFN call of {t} tokens, hidden {x.shape[1]}, {x.dtype}/{ids.dtype}/{weights.dtype} "
                             f"does not fit staging for {self.tokens} tokens, hidden {self.hidden}, "
                             f"{self.x.dtype}/{self.ids_dtype}/{self.weights_dtype}")
        ids_buf, w_buf = self._routing_buffers(k)
        xh, ih, wh = self.x[:t], ids_buf[:t], w_buf[:t]
        if stream is None or x.device.type != "cuda":
            xh.copy_(x)
            ih.copy_(ids)
            wh.copy_(weights)
            return xh, ih, wh
        with torch.cuda.stream(stream):
            xh.copy_(x, non_blocking=True)
            ih.copy_(ids, non_blocking=True)
            wh.copy_(weights, non_blocking=True)
            self._x_ready.record(stream)
        self._x_ready.synchronize()
        return xh, ih, wh

    def to_device(self, y: torch.Tensor, out: torch.Tensor, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """y [T, H] (host) into out (device) through the pinned y buffer, queued on stream; returns out."""
        if y.device.type != "cpu" or stream is None:
            return out.copy_(y)
        if self._y_pending:
            self._y_free.synchronize()   # the previous copy may still be reading the buffer
        yh = self.y[:y.shape[0]]
        yh.copy_(y)
        with torch.cuda.stream(stream):
            out.copy_(yh, non_blocking=True)
            self._y_free.record(stream)
        self._y_pending = True
        return out


class PinnedFfn(FfnBackend):
    """A host-side backend for a model on the GPU (see the module docstring). Calls
    with host tensors go straight through. Buffers are per calling thread: FFN calls
    come from the model's thread, lane threads or the FFN worker."""
    name = "pinned"

    def __init__(self, backend: FfnBackend):
        self.backend = backend
        self._local = threading.local()

    def load_layer(self, layer: FfnLayer) -> None:
        self.backend.load_layer(layer)

    def finish_loading(self) -> None:
        self.backend.finish_loading()

    def close(self) -> None:
        self.backend.close()

    @property
    def frees_torch_weights(self) -> bool:
        return self.backend.frees_torch_weights

    @property
    def kernel_us_total(self) -> float:
        return float(getattr(self.backend, "kernel_us_total", 0.0))

    @property
    def bytes_streamed(self) -> int:
        return int(getattr(self.backend, "bytes_streamed", 0))

    def _staging(self, x, ids, weights) -> HostStaging:
        st = getattr(self._local, "staging", None)
        if st is None or not st.fits(x, ids, weights):
            tokens = max(x.shape[0], 2 * st.tokens if st is not None else 1)
            st = HostStaging(tokens, x.shape[1], x.dtype, ids.dtype, weights.dtype)
            self._local.staging = st
        return st

    def forward(self, layer, x, ids, weights):
        if x.device.type != "cuda":
            return self.backend.forward(layer, x, ids, weights)
        stream = torch.cuda.current_stream(x.device)
        st = self._staging(x, ids, weights)
        y = self.backend.forward(layer, *st.to_host(x, ids, weights, stream))
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return st.to_device(y, out, stream)


def pin_host_backend(model, backend: FfnBackend) -> FfnBackend:
    """Puts a PinnedFfn in front of backend on every FFN module of a GPU model when
    backend computes on the host; returns what the modules call."""
    if not runs_on_host(backend):
        return backend
    return model.set_ffn(PinnedFfn(backend))
