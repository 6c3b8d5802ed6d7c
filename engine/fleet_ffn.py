"""The fleet FFN backend: a thin adapter over native.transport. Every FFN layer
is split into tp = n_ducks tensor-parallel fp9 slices of width multiple_of
(zero-padded), uploaded once (what a duck's cache holds is skipped), made
resident in one session, and run per layer as one request whose partials the
transport sums: one C call per layer (engine.host_ffn, the FFN host contract)."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

import torch

from engine.ffn import FfnLayer
from engine.host_ffn import HostFfn

log = logging.getLogger(__name__)


class FleetFfn(HostFfn):
    name = "fleet"
    overlaps_host = True   # the ducks compute; the transport waits without the GIL

    def __init__(self, fleet=None, *, addresses=None, key: bytes | None = None, key_file: str | None = None,
                 multiple_of: int = 64, local_ducks: int = 0, replicas: int = 1, cover_bytes: int | None = None,
                 cover_threads: int = 1, **fleet_options):
        """fleet: an open native.transport.Fleet; or addresses [(host, port)] with key /
        key_file; or local_ducks=N to start N duckfw processes on this host (development).
        replicas: 2 keeps each slice on a second duck (the next one), which computes it
        when its duck is lost; cover_bytes: the most bytes of lost ducks' slices this host
        computes (native/transport/cover.py); None: none (a lost duck fails the forward)."""
        from native.transport import Fleet, read_key_file

        super().__init__()
        self.local = None
        if fleet is None:
            if local_ducks:
                self.local = LocalDucks(local_ducks)
                addresses, key = self.local.addresses, self.local.key
            if key is None and key_file:
                key = read_key_file(key_file)
            if not addresses or key is None:
                raise ValueError("the fleet backend needs a Fleet, or duck addresses and a key (or key_file), "
                                 "or local_ducks=N")
            fleet = Fleet(addresses, key, **fleet_options)
        self.fleet = fleet
        self.multiple_of = multiple_of
        if replicas not in (1, 2) or (replicas == 2 and fleet.n_ducks < 2):
            raise ValueError(f"replicas = {replicas}: expected 1, or 2 with at least two ducks "
                             f"(the fleet has {fleet.n_ducks})")
        n = fleet.n_ducks
        self.replica_of = [(d + 1) % n for d in range(n)] if replicas == 2 else None   # slice d's second duck
        self.cover_bytes, self.cover_threads, self.cover = cover_bytes, cover_threads, None
        self.on_lost = None        # (lost ducks, host ms in that forward), from the forwarding thread
        self.hidden = 0
        self.layers: dict[int, list] = {}
        self.session = None
        self.fleet.hello()  # link check: a duck that is down raises DuckTimeout naming it

    def load_layer(self, layer: FfnLayer) -> None:
        from native.transport import split_experts

        if self.hidden and layer.hidden != self.hidden:
            raise ValueError(f"FFN layer {layer.index} has hidden size {layer.hidden}, others {self.hidden}")
        self.hidden = layer.hidden
        self._warn_idle_ducks(layer.index, layer.experts[0].gate.shape[0])
        experts = [(e.gate.detach().cpu(), e.up.detach().cpu(), e.down.detach().cpu()) for e in layer.experts]
        self.layers[layer.index] = split_experts(experts, self.fleet.n_ducks, self.multiple_of,
                                                 name=f"layers.{layer.index}")

    def _warn_idle_ducks(self, index: int, intermediate: int) -> None:
        """A tp that the padding leaves some ducks nothing but zeros to stream: said once."""
        from native.transport import slice_width

        tp = self.fleet.n_ducks
        width = slice_width(intermediate, tp, self.multiple_of)
        idle = tp - -(-intermediate // width)
        if idle > 0 and not getattr(self, "_warned_idle", False):
            self._warned_idle = True
            log.warning("layer %d: intermediate size %d in slices of %d units leaves %d of %d ducks only zero "
                        "padding (they stream and compute nothing useful); a smaller multiple_of or fewer ducks "
                        "spreads the work", index, intermediate, width, idle, tp)

    def load_synthetic_layer(self, index: int, n_experts: int, hidden: int, intermediate: int, seed: int) -> None:
        """Benchmarks only: registers FFN layer `index` as n_experts random experts
        [intermediate, hidden] that the ducks generate themselves at finish_loading
        (no torch weights, nothing uploaded). Same slices and padding as load_layer."""
        from native.transport import synth_experts, synth_seed

        if self.hidden and hidden != self.hidden:
            raise ValueError(f"FFN layer {index} has hidden size {hidden}, others {self.hidden}")
        self.hidden = hidden
        self.layers[index] = synth_experts(n_experts, hidden, intermediate, self.fleet.n_ducks, self.multiple_of,
                                           seed=synth_seed(seed, index), name=f"layers.{index}")

    def holders(self, d: int) -> list[int]:
        """The ducks that hold slice d: its own, and its replica."""
        return [d] + ([self.replica_of[d]] if self.replica_of else [])

    def tensors(self, duck: int):
        """What the duck holds: its slice of every layer, and the slice it is the replica of."""
        held = [d for d in range(self.fleet.n_ducks) if duck in self.holders(d)]
        return [t for layer in sorted(self.layers) for d in held for e in self.layers[layer][d]
                for t in (e.gate_up, e.down)]

    def finish_loading(self) -> None:
        done = self.fleet.upload([self.tensors(d) for d in range(self.fleet.n_ducks)])
        log.info("fleet of %d ducks: %d tensors uploaded (%.1f MB), %d synthesized (%.1f MB), %d already cached",
                 self.fleet.n_ducks, done["uploaded"], done["bytes"] / 1e6, done["synthesized"],
                 done["synth_bytes"] / 1e6, done["skipped"])
        self.open_session()

    def open_session(self) -> None:
        """The session on every duck, and the cover for lost ducks where one is asked for."""
        from native.transport.cover import HostCover
        from native.transport.session import REPLICA_LAYER_OFFSET

        self.session = self.fleet.open_session(self.layers, self.hidden, replicas=self.replica_of)
        self.session.on_lost = self._lost
        if self.cover is None and (self.cover_bytes is not None or self.replica_of):
            self.cover = HostCover(self.fleet, self.layers, self.hidden, self.cover_bytes or 0,
                                   replicas=self.replica_of, replica_layer_offset=REPLICA_LAYER_OFFSET,
                                   threads=self.cover_threads)

    def _lost(self, ducks: list[int], host_ms: float) -> None:
        if self.on_lost is not None:
            self.on_lost(ducks, host_ms)

    def take_back(self, duck: int) -> None:
        """A lost duck serves again: the session on it, then its slices back (between two forwards)."""
        self.session.reopen_duck(duck)
        self.fleet.set_lost(duck, False)

    def run(self, layer, x, ids, weights, out):
        self.session.forward(layer, x, ids, weights, out=out)   # partials in out's dtype, summed in fp32

    def step_session(self):
        """The open session, for a decode step driven from C (engine.gpu.graphs.GraphLane.native_step)."""
        return self.session

    @property
    def kernel_us_total(self) -> int:
        """The slowest duck's kernel microseconds, summed over every forward so far."""
        return self.session.kernel_us_total if self.session else 0

    @property
    def bytes_streamed(self) -> int:
        return self.session.bytes_streamed if self.session else 0

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self.fleet.close()
        if self.local:
            self.local.stop()
            self.local = None


class LocalDucks:
    """N duckfw processes on 127.0.0.1 for development runs (duckd's 'local' boot
    driver is the product's way): one worker thread each, blocking when idle."""

    def __init__(self, n: int, workdir: str | None = None, threads: int = 1, timeout: float = 20.0,
                 cache_capacity: str | None = None, cpus: list[list[int]] | None = None, spin_us: int = 0):
        """cpus: per duck, the CPUs it may run on (its workers pinned one per CPU);
        spin_us: ducks spin this long for the next request before blocking."""
        from native.transport import duckfw_path, write_key_file

        self._own_workdir = workdir is None    # a temporary folder (keys, caches, logs) goes with stop()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="duck-local-"))
        key_file = self.workdir / "key"
        self.key = write_key_file(key_file)
        self.procs, self.addresses = [], []
        # stopped when this object goes, or at the interpreter's exit: a script that never calls
        # stop() (or close() of its fleet) must not leave its ducks running after it
        self._stop = weakref.finalize(self, _stop_ducks, self.procs, self.workdir if self._own_workdir else None)
        try:
            for i in range(n):
                port_file = self.workdir / f"port{i}"
                cmd = [str(duckfw_path()), "--bind", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
                       "--id", str(i), "--cache-dir", str(self.workdir / f"cache{i}"), "--key-file", str(key_file),
                       "--threads", str(threads), "--idle", "block"]
                if cache_capacity:
                    cmd += ["--cache-capacity", cache_capacity]
                if spin_us:
                    cmd[cmd.index("block")] = "spin"
                    cmd += ["--spin-us", str(spin_us)]
                mine = cpus[i % len(cpus)] if cpus else None
                if mine:
                    cmd += ["--pin"]
                with open(self.log_path(i), "ab") as out:
                    self.procs.append(subprocess.Popen(
                        cmd, stdout=out, stderr=out,
                        preexec_fn=(lambda cpus=tuple(mine): os.sched_setaffinity(0, cpus)) if mine else None))
                deadline = time.monotonic() + timeout
                while not port_file.exists() or not port_file.read_text().strip():
                    if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"local duck {i} did not start; see {self.log_path(i)}")
                    time.sleep(0.01)
                self.addresses.append(("127.0.0.1", int(port_file.read_text())))
        except BaseException:
            self.stop()
            raise

    def log_path(self, i: int) -> Path:
        """Duck i's output (its start line, its log)."""
        return self.workdir / f"duck{i}.log"

    def stop(self) -> None:
        self._stop()


def _stop_ducks(procs: list[subprocess.Popen], workdir: Path | None) -> None:
    """LocalDucks' processes terminated (killed after 10 s), and its own folder removed."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    procs.clear()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
