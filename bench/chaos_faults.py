"""The faults of bench.chaos, one function each. A fault acts on the running
harness (its daemon, its ducks, its load), notes the moments that matter in
its record (the first is when it struck; a SIGSTOP's SIGCONT, a daemon's
exit and its return come after) and says whether its own check held: a 413
for an oversized body, a daemon that ends within its drain bound after
SIGTERM, a damaged cache entry the restarted duck found. Which fault, which
duck and how long come from the seeded schedule, not from here."""
from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field

import grpc

from bench.live_daemon import raw_post
from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc

log = logging.getLogger("duck.bench_chaos")

DUCK_FAULTS = ("kill", "sigstop", "restart", "cachecorrupt", "loss", "delay", "reorder", "duplicate")
NETEM = {   # tc netem arguments of the link faults (netns fleet only), each direction of one duck's link
    "loss": ["loss", "20%"],
    "delay": ["delay", "20ms", "10ms"],
    "reorder": ["delay", "5ms", "reorder", "50%"],
    "duplicate": ["duplicate", "30%"],
}
SLOW_READ_S = 0.25           # the slow client's pause after each event it reads
DRAIN_OVERRUN_S = 15.0       # duckd.main's: a drain still running this long after its grace is forced


@dataclass
class Planned:
    """One entry of the seeded schedule."""
    kind: str
    gap_s: float             # after the previous fault ended
    duck: int
    pick: float              # in [0, 1): which cache entry, which prompt


@dataclass
class FaultRecord:
    n: int
    kind: str
    target: str
    events: list[tuple[float, str]] = field(default_factory=list)   # (monotonic time, what), the strike first
    ok: bool = True          # its own check held
    detail: str = ""

    def note(self, what: str) -> float:
        t = time.monotonic()
        self.events.append((t, what))
        return t


def kill(h, p: Planned, rec: FaultRecord) -> None:
    """kill -9 of a duck; the daemon's fleet notices its exit and starts it again."""
    try:
        pid = h.daemon.duck_pid(p.duck)
        rec.note(f"SIGKILL pid {pid}")
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        rec.detail = "no process (it was being restarted)"


def sigstop(h, p: Planned, rec: FaultRecord) -> None:
    """A duck frozen for h.sigstop_s, then let go (if the fleet has not replaced it meanwhile)."""
    pid = h.daemon.duck_pid(p.duck)
    try:
        rec.note(f"SIGSTOP pid {pid}")
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        rec.detail = "no process (it was being restarted)"
        return
    time.sleep(h.sigstop_s)
    try:
        os.kill(pid, signal.SIGCONT)
        rec.note("SIGCONT")
    except ProcessLookupError:
        rec.detail = "replaced while stopped"


def restart(h, p: Planned, rec: FaultRecord) -> None:
    """The operator's restart (Fleet.Restart, as `duck-console` asks it); it returns once the duck serves."""
    rec.note("Fleet.Restart")
    try:
        rpc.FleetStub(h.target.channel).Restart(pb.RestartDuckRequest(id=p.duck), timeout=120)
        rec.note("restarted")
    except grpc.RpcError as e:
        rec.detail = f"refused: {e.code().name}: {e.details()}"
        rec.ok = e.code() == grpc.StatusCode.FAILED_PRECONDITION and bool(e.details())


def cachecorrupt(h, p: Planned, rec: FaultRecord) -> None:
    """A duck's cache entry damaged on disk, then the duck killed: its restarted self must find the
    entry damaged (its cache_corrupt counter), drop it and take the weights again."""
    cache = h.daemon.state_dir / "ducks" / str(p.duck) / "cache"
    files = sorted(f for f in cache.rglob("*") if f.is_file() and f.stat().st_size > 64)
    if not files:
        rec.detail, rec.ok = f"no cache entries in {cache}", False
        return
    victim = files[int(p.pick * len(files))]
    before = _duck(h, p.duck).cache_corrupt
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    rec.detail = f"flipped a byte of {victim.name}"
    kill(h, p, rec)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        d = _duck(h, p.duck)
        if d.state == pb.SERVING and d.restarts and d.cache_corrupt > before:
            rec.note("duck serves again, the damaged entry found")
            return
        time.sleep(0.25)
    rec.ok = False
    rec.detail += f"; duck {p.duck} did not report a corrupt cache entry within 60 s"


def slowclient(h, p: Planned, rec: FaultRecord) -> None:
    """A client that reads its stream slowly, beside the load: the others must not wait for it, and
    its text is the undisturbed one."""
    rec.note(f"slow chat, {SLOW_READ_S} s per event")
    prompt = int(p.pick * len(h.load.texts))
    h.load.spawn(prompt, "slowclient", SLOW_READ_S)


def oversize(h, p: Planned, rec: FaultRecord) -> None:
    """An HTTP body past daemon.max_request_mb: 413, naming the setting, before it is all read."""
    n = int((h.max_request_mb + 1) * 2**20)
    rec.note(f"POST of {n} bytes")
    try:
        status, body = raw_post(h.daemon.http_address, h.daemon.token, f"Content-Length: {n}\r\n".encode(),
                                (b"x" * 2**20 for _ in range(n // 2**20)))
    except OSError as e:
        rec.ok, rec.detail = False, f"no answer: {e}"
        return
    rec.note(f"HTTP {status}")
    rec.ok = status == 413 and b"daemon.max_request_mb" in body
    rec.detail = f"HTTP {status}: {body[:200].decode(errors='replace')}"


def sighup(h, p: Planned, rec: FaultRecord) -> None:
    """SIGHUP: duckd reloads what it can; the chats go on."""
    rec.note("SIGHUP")
    h.daemon.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    rec.ok = h.daemon.proc.poll() is None
    if not rec.ok:
        rec.detail = f"duckd exited with {h.daemon.proc.returncode} on SIGHUP"


def sigterm(h, p: Planned, rec: FaultRecord) -> None:
    """SIGTERM of the daemon under load: it drains (chats still running at the grace end with
    finish_reason "cancelled"), ends within grace + the drain bound, and is started again."""
    h.target.detach()                    # no new chats until it is back
    bound = h.grace_s + DRAIN_OVERRUN_S
    rec.note("SIGTERM")
    rc = h.daemon.stop(signal.SIGTERM, timeout=bound)
    rec.note(f"duckd exited ({rc})")
    if rc != 0:
        rec.ok, rec.detail = False, f"duckd did not end cleanly within {bound:.0f} s of SIGTERM: status {rc}"
    h.daemon.start()
    h.target.attach()
    rec.note("duckd serves again")


def netem(h, p: Planned, rec: FaultRecord) -> None:
    """Loss, delay, reorder or duplication on both directions of one duck's link for h.netem_s."""
    ns, host_end, duck_end = (f"{h.netns_name}{p.duck}", f"{h.netns_name}h{p.duck}", f"{h.netns_name}d{p.duck}")
    args = ["netem", "limit", "100000", *NETEM[p.kind]]
    rec.note(f"tc netem {' '.join(NETEM[p.kind])}")
    for cmd in (["tc", "qdisc", "replace", "dev", host_end, "root", *args],
                ["tc", "-n", ns, "qdisc", "replace", "dev", duck_end, "root", *args]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            rec.ok, rec.detail = False, f"{' '.join(cmd)}: {r.stderr.strip()}"
    time.sleep(h.netem_s)
    for cmd in (["tc", "qdisc", "del", "dev", host_end, "root"], ["tc", "-n", ns, "qdisc", "del", "dev", duck_end, "root"]):
        subprocess.run(cmd, capture_output=True, text=True)
    rec.note("link clean")


def _duck(h, i: int) -> pb.DuckStatus:
    return h.daemon.ducks()[i]


FAULTS = {"kill": kill, "sigstop": sigstop, "restart": restart, "cachecorrupt": cachecorrupt,
          "slowclient": slowclient, "oversize": oversize, "sighup": sighup, "sigterm": sigterm,
          **{k: netem for k in NETEM}}


def netem_available() -> str | None:
    """Why the link faults cannot run here, or None when they can (root, network namespaces, netem)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veths, tc)"
    probe = "chaosprobe"      # a namespace of its own, to ask the kernel for netem on its loopback
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"`ip netns` does not work here: {r.stderr.strip()}"
    try:
        r = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if r.returncode:
        return f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): tc said {r.stderr.strip()!r}"
    return None


def schedule(kinds: list[str], count: int, seed: int, gap: tuple[float, float], ducks: int) -> list[Planned]:
    rng = random.Random(seed)
    return [Planned(rng.choice(kinds), round(rng.uniform(*gap), 3), rng.randrange(ducks), rng.random())
            for _ in range(count)]
