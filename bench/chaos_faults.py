"""The faults of bench.chaos, one function each. A fault acts on the running
harness (its daemon, its ducks, its load), notes the moments that matter in
its record (the first is when it struck; a SIGSTOP's SIGCONT, a daemon's
exit and its return come after) and says whether its own check held: a 413
for an oversized body, a daemon that ends within its drain bound after
SIGTERM, a damaged cache entry the restarted duck found, a full disk's
write refused with its path and ENOSPC and the duck whole again once space
returns. Which fault, which duck and how long come from the seeded
schedule, not from here."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.live_daemon import raw_post
from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc

log = logging.getLogger("duck.bench_chaos")

DUCK_FAULTS = ("kill", "sigstop", "restart", "cachecorrupt", "diskfull", "loss", "delay", "reorder", "duplicate")
NETEM = {   # tc netem arguments of the link faults (netns fleet only), each direction of one duck's link
    "loss": ["loss", "20%"],
    "delay": ["delay", "20ms", "10ms"],
    "reorder": ["delay", "5ms", "reorder", "50%"],
    "duplicate": ["duplicate", "30%"],
}
SLOW_READ_S = 0.25           # the slow client's pause after each event it reads
DRAIN_OVERRUN_S = 15.0       # duckd.main's: a drain still running this long after its grace is forced
STATE_FS_SIZE = "50%"        # the state folder's tmpfs (diskfull): of RAM, taken only as it is used
DISKFULL_LEAVE = 32 << 10    # what the ballast leaves free: a duck start's own small files fit, no cache entry
ENOSPC_TEXT = os.strerror(28)    # "No space left on device", as duckfw and duckd print it


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


def diskfull(h, p: Planned, rec: FaultRecord) -> None:
    """The state folder's filesystem full (a tmpfs of its own, StateFs) for h.diskfull_s, under load.
    Serving writes nothing there but the ducks' log lines, so the chats must go on unchanged. To make
    a write necessary, one of a duck's cache entries is first removed from disk, then the disk filled
    and the duck killed: its restarted self lacks that entry and must store it again while the disk
    is full. That must fail with an error naming the cache folder and ENOSPC (the duck FAILED, its
    slices computed elsewhere), never a hang, a crash or a partial file. Once the ballast is gone,
    the next restart (Fleet.Restart) must bring it back SERVING with its whole cache: every entry on
    disk hashes to its name, none missing, no *.tmp anywhere in the state folder, the host's pack
    cache and the runtime file untouched."""
    fs, state = h.state_fs, h.daemon.state_dir
    if fs is None:
        rec.ok, rec.detail = False, "the state folder is not on a filesystem of the harness's own"
        return
    before = _wait_duck(h, p.duck, lambda d: d.state == pb.SERVING, 60.0)   # not mid-restart from a fault before
    if before is None:
        rec.ok, rec.detail = False, f"duck {p.duck} was not SERVING within 60 s, before the disk was filled"
        return
    cache = state / "ducks" / str(p.duck) / "cache"
    entries = sorted(cache.glob("*.fp9"))
    if not entries:
        rec.ok, rec.detail = False, f"no cache entries in {cache}"
        return
    packs, runtime = _listing(state / "packed"), (state / "duckd.json").read_bytes()
    victim = entries[int(p.pick * len(entries))]
    size = victim.stat().st_size
    victim.unlink()
    problems: list[str] = []
    try:
        ballast = fs.fill(leave=min(DISKFULL_LEAVE, size // 2))
        t_full = rec.note(f"disk full: {ballast} bytes of ballast, {fs.free_bytes()} left; {victim.name} "
                          f"({size} bytes) removed from duck {p.duck}'s cache")
        kill(h, p, rec)
        d = _wait_duck(h, p.duck, lambda d: d.restarts > before.restarts and d.state in (pb.FAILED, pb.SERVING),
                       60.0)
        if d is None:
            problems.append("the restarted duck neither failed nor served within 60 s of its kill")
        elif d.state == pb.SERVING:
            problems.append(f"the duck served again while the disk was full ({fs.free_bytes()} bytes free): "
                            f"its removed entry ({size} bytes) cannot have been stored")
        else:
            rec.note(f"duck FAILED: {d.reason}")
            if ENOSPC_TEXT not in d.reason or str(cache) not in d.reason:
                problems.append(f"its failure does not name {cache} and ENOSPC: {d.reason!r}")
        time.sleep(max(0.0, t_full + h.diskfull_s - time.monotonic()))
    finally:
        fs.free()
        rec.note("space back")
    try:
        back = rpc.FleetStub(h.target.channel).Restart(pb.RestartDuckRequest(id=p.duck), timeout=120).duck
        rec.note(f"Fleet.Restart: {pb.DuckState.Name(back.state)}")
        if back.state != pb.SERVING:
            problems.append(f"after space returned, Fleet.Restart left it {pb.DuckState.Name(back.state)}: "
                            f"{back.reason}")
    except grpc.RpcError as e:
        problems.append(f"after space returned, Fleet.Restart refused: {e.code().name}: {e.details()}")
    whole = _wait_duck(h, p.duck, lambda d: d.state == pb.SERVING and d.cache_entries >= before.cache_entries, 20.0)
    if whole is None:
        d = _duck(h, p.duck)
        problems.append(f"not SERVING with its {before.cache_entries} cache entries 20 s after its restart: "
                        f"{pb.DuckState.Name(d.state)} ({d.reason}), {d.cache_entries} entries")
    problems += _verify_state(state, cache, len(entries), victim, size, packs, runtime)
    if h.daemon.proc.poll() is not None:
        problems.append(f"duckd exited with {h.daemon.proc.returncode}")
    rec.ok = not problems
    rec.detail = "; ".join(problems) if problems else (
        f"the restarted duck failed with {ENOSPC_TEXT!r} naming its cache folder, and after space returned "
        f"served again with its {len(entries)} entries verified")


def _wait_duck(h, i: int, cond, timeout: float) -> pb.DuckStatus | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = _duck(h, i)
        if cond(d):
            return d
        time.sleep(0.1)
    return None


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns)
            for f in folder.rglob("*") if f.is_file()} if folder.exists() else {}


def _verify_state(state: Path, cache: Path, count: int, victim: Path, size: int, packs: dict,
                  runtime: bytes) -> list[str]:
    """What diskfull checks after space returned: the duck's cache whole (every entry's file hashes
    to its name, as duckfw names them: blake2b-128 of the content), no *.tmp left in the state
    folder, the host's pack cache and the runtime file as they were."""
    problems = []
    entries = sorted(cache.glob("*.fp9"))
    bad = [f.name for f in entries if hashlib.blake2b(f.read_bytes(), digest_size=16).hexdigest() != f.stem]
    if bad:
        problems.append(f"{len(bad)} cache entries do not hash to their names: {', '.join(bad[:3])}")
    if len(entries) != count or not victim.exists() or victim.stat().st_size != size:
        problems.append(f"{len(entries)} cache entries in {cache}, expected {count} with {victim.name} "
                        f"({size} bytes) stored again")
    tmp = sorted(str(f.relative_to(state)) for f in state.rglob("*.tmp"))
    if tmp:
        problems.append(f"partial files left: {', '.join(tmp[:5])}")
    if _listing(state / "packed") != packs:
        problems.append("the host's pack cache changed")
    try:
        ok = (state / "duckd.json").read_bytes() == runtime and json.loads(runtime).get("address")
    except (OSError, ValueError):
        ok = False
    if not ok:
        problems.append("the runtime file duckd.json changed or is unreadable")
    return problems


def _duck(h, i: int) -> pb.DuckStatus:
    return h.daemon.ducks()[i]


FAULTS = {"kill": kill, "sigstop": sigstop, "restart": restart, "cachecorrupt": cachecorrupt, "diskfull": diskfull,
          "slowclient": slowclient, "oversize": oversize, "sighup": sighup, "sigterm": sigterm,
          **{k: netem for k in NETEM}}


class StateFs:
    """The daemon's state folder on a tmpfs of its own (diskfull needs root): mounted before duckd
    starts, unmounted after it ends (what it held goes with it). fill() makes it full: the tmpfs
    shrunk to what it holds plus a little (so the ballast is small, whatever the model's size),
    then a ballast file takes all of that but `leave` bytes; free() removes the ballast and gives
    the tmpfs its size back."""

    def __init__(self, path: Path):
        self.path = path
        self.ballast = path / "chaos-ballast"
        self.mounted = False

    def mount(self) -> "StateFs":
        self.path.mkdir(parents=True, exist_ok=True)
        if any(self.path.iterdir()):
            raise SystemExit(f"bench.chaos: diskfull mounts a filesystem of its own on the state folder, and "
                             f"{self.path} is not empty: give an empty or new --state-dir")
        _mount("-t", "tmpfs", "-o", f"size={STATE_FS_SIZE},mode=0700", "duck-chaos", str(self.path))
        self.mounted = True
        return self

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int) -> int:
        """Fills it but `leave` bytes; the ballast's size."""
        st = os.statvfs(self.path)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        _mount("-o", f"remount,size={used + leave + (1 << 20)}", str(self.path))   # what a log line adds meanwhile fits
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(1, self.free_bytes() - leave))
        finally:
            os.close(fd)
        return self.ballast.stat().st_size

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)
        _mount("-o", f"remount,size={STATE_FS_SIZE}", str(self.path))

    def unmount(self) -> None:
        if not self.mounted:
            return
        for _ in range(20):      # the ducks end with duckd, a moment after it
            if subprocess.run(["umount", str(self.path)], capture_output=True).returncode == 0:
                self.mounted = False
                return
            time.sleep(0.25)
        r = subprocess.run(["umount", "--lazy", str(self.path)], capture_output=True, text=True)
        self.mounted = r.returncode != 0
        log.warning("the state folder's tmpfs %s was busy: %s", self.path,
                    "detached (lazy unmount)" if not self.mounted else f"left mounted: {r.stderr.strip()}")


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode:
        raise OSError(f"mount {' '.join(args)}: {r.stderr.strip() or f'status {r.returncode}'}")


def diskfull_available() -> str | None:
    """Why diskfull cannot run here, or None when it can (root, and a tmpfs that mounts and resizes)."""
    if os.geteuid() != 0:
        return "needs root (it mounts a tmpfs of limited size for the daemon's state folder)"
    probe = tempfile.mkdtemp(prefix="duck-chaos-probe-")
    try:
        _mount("-t", "tmpfs", "-o", "size=1m", "duck-chaos", probe)
        try:
            _mount("-o", "remount,size=2m", probe)
        finally:
            subprocess.run(["umount", probe], capture_output=True)
    except OSError as e:
        return f"cannot mount a tmpfs here: {e}"
    finally:
        os.rmdir(probe)
    return None


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
