"""The daemon's core: fleet + weights + engine, behind the API of
duckd.server. Everything that blocks (model load, generation, uploads)
runs in threads; the asyncio loop stays free for the API and the monitor."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path

from duck_proto import duck_pb2 as pb
from duck_proto.client import RUNTIME_FILE
from duckd.config import TWICE
from duckd.drivers import make_driver
from duckd.events import EventLog
from duckd.fleet_manager import FleetManager, State
from duckd.health import StepWatch
from duckd.lost import LostDucks
from duckd.model_host import ModelHost
from duckd.packcache import PackCache, model_key
from duckd.cache import CacheService
from duckd.chat_service import ChatService
from duckd.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

log = logging.getLogger("duckd")


class Daemon:
    def __init__(self, cfg):
        self.cfg = cfg
        self.state_dir = cfg.state_path
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog()
        from native.transport import read_key_file, write_key_file
        self.key_file = self.state_dir / "fleet.key"
        if self.key_file.exists() and self.key_file.stat().st_mode & 0o077:
            self.key_file.chmod(0o600)
            log.warning("fleet key %s was readable by others: now 0600 (consider a new key: remove it)",
                        self.key_file)
        key = read_key_file(self.key_file) if self.key_file.exists() else write_key_file(self.key_file)
        self.driver = make_driver(cfg.fleet, self.state_dir, self.key_file)
        self.key = key
        self.lost = LostDucks(self)
        self.fleet = FleetManager(cfg.fleet, self.driver, key, self.events, on_ready=self._duck_ready,
                                  on_failed=self.lost.failed, on_healthy=self.lost.healthy, session=self._session_id)
        self.model = ModelHost(cfg.model, cfg.fleet, self.state_dir)
        self.packs: PackCache | None = None
        self.transport = None
        self.stopping = threading.Event()
        self.active_chats = 0
        self.ready = False
        self.roofline_gbps = 0.0
        self.chat = ChatService(self, cfg.model.max_queued)
        self.cache = CacheService(self)
        self.health = StepWatch(self, cfg.daemon.stall_after_s)

    @property
    def serving(self) -> bool:
        """Started, and not stalled (duckd.health): what /health and gRPC Health say."""
        return self.ready and self.health.ok

    def _measure_roofline(self) -> None:
        """Ducks on this host (local, netns) share its memory: their roofline is the
        host's read bandwidth with all their threads reading at once. Real ducks
        (wol) would have to measure their own: unknown (0) here."""
        if self.cfg.fleet.driver in ("local", "netns"):
            from native.kernels import measure_read_gbps
            threads = min(self.cfg.fleet.ducks * self.cfg.fleet.threads_per_duck, len(os.sched_getaffinity(0)))
            self.roofline_gbps = measure_read_gbps(threads)
            self.events.add("fleet", f"roofline: {self.roofline_gbps:.1f} GB/s read bandwidth "
                            f"({threads} threads on this host)")

    # -- start / stop ---------------------------------------------------------
    async def start(self) -> None:
        if self.cfg.model.backend == "fleet":
            self.events.add("boot", f"booting {self.cfg.fleet.ducks} ducks ({self.cfg.fleet.driver} driver)")
            await asyncio.to_thread(self._measure_roofline)
            await self.fleet.start()
        else:
            self.events.add("boot", f"the model's FFNs run on this host (backend {self.cfg.model.backend}): "
                            "no ducks started")
        if self.cfg.model.backend == "fleet":
            from native.transport import Fleet
            from native._native import lib
            self.transport = Fleet(self.fleet.addresses(), self.key, mtu=self.cfg.fleet.mtu,
                                   deadline_ms=self.cfg.fleet.fail_after_s * 1000,
                                   retransmit_ms=self.cfg.fleet.retransmit_ms,
                                   spin_us=self.cfg.fleet.host_spin_us, mac_data=self.cfg.fleet.data_mac,
                                   twice=TWICE[self.cfg.fleet.send_twice])
            path = self._model_path()
            self.packs = PackCache(self.state_dir / "packed", model_key(path, self.cfg.fleet.tp,
                                                                        self.cfg.fleet.multiple_of, lib.WIRE_ABI))
            await asyncio.to_thread(self._implied_invalidation)
            for d in self.fleet.ducks:
                self.fleet.set_state(d, State.SYNCING)
        await asyncio.to_thread(self.model.load, self.transport, self.packs)
        await asyncio.to_thread(self.chat.batch_runner)   # its KV cache (GBs) is not allocated on the event loop
        if self.transport is not None:
            for d in self.fleet.ducks:
                d.cache_hits = self.model.ffn.cache_hits[d.id]
            self._write_manifest()
            self.lost.attach()
        for d in self.fleet.ducks:
            if d.state in (State.READY, State.SYNCING):
                self.fleet.set_state(d, State.SERVING)
        self.ready = True
        self.events.add("state", f"serving {self.model.name} on {self.cfg.fleet.ducks} ducks")

    def _model_path(self) -> Path:
        from engine.loader import default_model_path
        return default_model_path() if self.cfg.model.path == "default" else Path(self.cfg.model.path).expanduser()

    def _implied_invalidation(self) -> None:
        """A different model, tp, multiple_of or ABI than last time: the old slices go."""
        manifest = self.state_dir / "manifest.json"
        old = json.loads(manifest.read_text()).get("key") if manifest.exists() else None
        if old and old != self.packs.key:
            counts = self.transport.invalidate(None)
            removed = self.packs.drop_others()
            self.events.add("cache", f"model, tp, multiple_of or firmware ABI changed: dropped {sum(counts)} "
                            f"duck cache entries and {removed} host packs")

    def _write_manifest(self) -> None:
        per_duck = [[(t.digest(), t.name, t.nbytes) for t in self.model.ffn.tensors(d)]
                    for d in range(self.transport.n_ducks)]
        (self.state_dir / "manifest.json").write_text(json.dumps({"key": self.packs.key, "model": self.model.name,
                                                                  "ducks": per_duck}))

    def _session_id(self) -> int:
        """The session the daemon holds open on its ducks (0: none yet)."""
        ffn = self.model.ffn
        session = getattr(ffn, "session", None) if self.ready else None
        return session.id if session is not None else 0

    async def _duck_ready(self, duck) -> None:
        """A restarted duck is READY: sync what it lacks, reopen the session."""
        if self.model.ffn is None or self.transport is None:
            self.fleet.set_state(duck, State.SERVING)
            return
        self.fleet.set_state(duck, State.SYNCING)
        before = self.model.ffn.uploaded_bytes[duck.id]
        await asyncio.to_thread(self.model.resync, duck.id)
        uploaded = self.model.ffn.uploaded_bytes[duck.id] - before
        duck.cache_hits = self.model.ffn.cache_hits[duck.id]
        self.events.add("upload", "cache hit: nothing to upload" if uploaded == 0 else
                        f"uploaded {uploaded / 1e6:.1f} MB", duck.id)
        self.fleet.set_state(duck, State.SERVING)
        self.lost.back(duck)

    async def stop(self) -> None:
        self.stopping.set()
        self.ready = False
        await asyncio.to_thread(self.chat.close)    # the batch runner ends its sequences at the next step
        await asyncio.to_thread(self.model.close)
        if self.transport is not None:
            self.transport.close()
        await self.fleet.stop()

    def write_runtime_file(self, address: str, token_file: Path, http_address: str = "", tls=None) -> Path:
        """Where clients find this daemon (duck_proto.client): its addresses, token file, and with
        TLS (a duckd.tls.ServerCert) the certificate's path and fingerprint, which they verify."""
        path = self.state_dir / RUNTIME_FILE
        text = json.dumps({"address": address, "token_file": str(token_file), "pid": os.getpid(),
                           "http_address": http_address, "scheme": "https" if tls else "http",
                           "tls_cert": str(tls.cert_file) if tls else "",
                           "tls_fingerprint": tls.fingerprint if tls else ""})
        # whole or not at all: a client never reads a partial file (a full disk left an empty one,
        # and said only "[Errno 28] No space left on device")
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OSError(f"cannot write the runtime file {path}: {e.strerror or e}; clients find duckd there "
                          "(free space in daemon.state_dir or move it)") from None
        return path

    # -- the API (duckd.server.Core) -----------------------------------------
    def snapshot(self) -> pb.FleetSnapshot:
        p = self.model.progress
        ducks = [d.status() for d in self.fleet.ducks]
        now = time.monotonic()
        requests = [pb.RequestStatus(id=r.id, state=r.state, prompt_tokens=r.prompt_tokens,
                                     generated_tokens=r.generated, tok_s=r.tok_s(now), age_s=now - r.arrived)
                    for r in list(self.chat.active.values())]
        return pb.FleetSnapshot(
            ducks=ducks, aggregate_gbps=sum(d.gbps for d in ducks), roofline_gbps=self.roofline_gbps,
            decode_tok_s=self.model.last_decode_tps, model=self.model.name, unix_time=time.time(),
            sync=pb.SyncProgress(bytes_done=p.done if p.phase == "uploading" else 0,
                                 bytes_total=p.total if p.phase == "uploading" else 0,
                                 bytes_per_s=p.rate(), eta_s=p.eta(), phase=p.phase),
            requests=requests)

    def events_since(self, cursor: int):
        return self.events.since(cursor)

    def duck(self, duck_id: int):
        if not 0 <= duck_id < len(self.fleet.ducks):
            raise NotFound(f"duck {duck_id}: no such duck (the fleet has "
                           f"{len(self.fleet.ducks)}, ids 0..{len(self.fleet.ducks) - 1})")
        return self.fleet.ducks[duck_id]

    async def restart_duck(self, duck_id: int) -> pb.DuckStatus:
        duck = self.duck(duck_id)
        try:
            await self.fleet.restart(duck)
        except RuntimeError as e:
            raise FailedPrecondition(str(e)) from None
        return duck.status()

    def model_info(self) -> pb.ModelInfo:
        if self.model.loaded is None:
            raise Unavailable("the model is still loading")
        c = self.model.loaded.config
        experts = getattr(c, "num_experts", 0) or 0
        k = getattr(c, "num_experts_per_tok", 0) or 0
        ffn = self.model.ffn
        per_token = ffn.ffn_bytes_per_token(k or 1) if hasattr(ffn, "ffn_bytes_per_token") else 0
        plan = self.model.placement() or {}
        return pb.ModelInfo(name=self.model.name, architecture=c.model_type, layers=c.num_hidden_layers,
                            hidden_size=c.hidden_size, experts=experts, experts_per_token=k,
                            tp=self.cfg.fleet.tp, multiple_of=self.cfg.fleet.multiple_of,
                            ffn_bytes_per_token=per_token, max_model_len=self.cfg.model.max_model_len,
                            backend=ffn.name, gpu_ffn_gb=plan.get("gpu_gb", 0.0),
                            duck_gb_per_token=plan.get("duck_gb_per_token", per_token / 1e9),
                            gpu_layers_whole=len(plan.get("gpu_layers_whole", ())),
                            gpu_experts=plan.get("gpu_experts", 0),
                            duck_calls_per_token=plan.get("duck_calls_per_token", len(getattr(ffn, "layers", ()))))

    async def place(self, budget: str, by_routing: bool) -> pb.ModelInfo:
        """Model.Place: placement again between two steps (ModelHost.replace)."""
        from duckd.config import ConfigError
        if self.model.loaded is None:
            raise Unavailable("the model is still loading")
        if not hasattr(self.model, "histogram"):
            raise FailedPrecondition(f"placement needs the fleet backend (model.backend = {self.cfg.model.backend!r})")
        try:   # a bad budget is refused before anything changes
            plan = await asyncio.to_thread(self.model.replace, budget, by_routing)
        except ConfigError as e:
            raise InvalidArgument("budget", str(e).replace("model.gpu_ffn_budget", "budget")) from None
        s = plan or {"gpu_gb": 0.0, "gpu_layers_whole": [], "duck_gb_per_token": 0.0}
        self.events.add("model", f"placement: {s['gpu_gb']:.2f} GB on the GPU, {len(s['gpu_layers_whole'])} layers "
                                 f"whole, {s['duck_gb_per_token']:.3f} GB per token from the ducks"
                                 + (" (by the routing counted)" if by_routing else ""))
        return self.model_info()

    def drop_host_packs(self) -> None:
        if self.packs is not None:
            self.packs.drop_all()
