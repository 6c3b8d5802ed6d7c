"""Link emulation for the netns driver: tc qdiscs on the egress of each end of
a veth, so each direction of a link is shaped where a real NIC would queue.

    rate              tbf (a token bucket of one frame or 8 us at the rate: a
                      layer's fragments are serialized at the link's rate, as
                      on the wire, not passed at once)
    delay/jitter/loss netem, the parent of the tbf

Kernels built without netem (CONFIG_NET_SCH_NETEM; some VM kernels, with no
modules to load) still shape the rate. There a constant delay and loss move
into the duck: duckfw's fault injection sleeps the round trip's delay before
each request and drops the lost fraction in and out; jitter has no such
fallback and is refused.
"""
from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass

log = logging.getLogger("duckd.driver.links")

FRAME_OVERHEAD = 64         # Ethernet and qdisc overhead on top of the MTU
BUCKET_US = 8               # the bucket holds one frame or this long at the rate, whichever is more
QUEUE_MS = 5                # it queues this long at the rate before it drops,
QUEUE_FRAMES = 1000         # and at least this many frames (a NIC's txqueuelen): a layer's burst fits


class LinkError(RuntimeError):
    """A link the kernel cannot emulate as configured; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Shape:
    """One direction of a link."""
    rate_mbit: float = 0.0
    delay_us: float = 0.0
    jitter_us: float = 0.0
    loss: float = 0.0

    @property
    def needs_netem(self) -> bool:
        return bool(self.delay_us or self.jitter_us or self.loss)

    def __bool__(self) -> bool:
        return bool(self.rate_mbit) or self.needs_netem


def tbf_args(rate_mbit: float, mtu: int = 1500) -> list[str]:
    rate_bytes = rate_mbit * 1e6 / 8
    # a message is serialized at the rate, at most a frame or 8 us early; a smaller bucket at 25 Gbit/s
    # would cost a timer per frame (a CPU the emulation's ducks need)
    burst = max(mtu + FRAME_OVERHEAD, int(rate_bytes * BUCKET_US * 1e-6))
    limit = max(QUEUE_FRAMES * (mtu + FRAME_OVERHEAD), int(rate_bytes * QUEUE_MS * 1e-3))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]


def netem_args(shape: Shape) -> list[str]:
    args = ["netem", "limit", "100000"]
    if shape.delay_us or shape.jitter_us:
        args += ["delay", f"{shape.delay_us:g}us"] + ([f"{shape.jitter_us:g}us"] if shape.jitter_us else [])
    if shape.loss:
        args += ["loss", f"{shape.loss * 100:g}%"]
    return args


def _tc(ns: str | None, *args: str) -> subprocess.CompletedProcess:
    cmd = ["tc", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True)


class Shaper:
    """Applies Shapes to devices; knows after its first try whether the kernel has netem."""

    def __init__(self, mtu: int = 1500):
        self.mtu = mtu
        self.netem: bool | None = None      # unknown until a qdisc needs it

    def apply(self, dev: str, shape: Shape, ns: str | None = None) -> None:
        if not shape:
            return
        use_netem = shape.needs_netem and self.netem is not False
        if use_netem:
            r = _tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *netem_args(shape))
            if r.returncode and "unknown" in r.stderr.lower():
                self.netem = False
                log.warning("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): link delay and loss go to "
                            "duckfw's fault injection; tc shapes the rate only")
                use_netem = False
            elif r.returncode:
                raise LinkError(f"tc qdisc netem on {dev}: {r.stderr.strip() or r.returncode}")
            else:
                self.netem = True
        if shape.rate_mbit:
            where = ["parent", "1:1", "handle", "10:"] if use_netem else ["root", "handle", "1:"]
            r = _tc(ns, "qdisc", "replace", "dev", dev, *where, *tbf_args(shape.rate_mbit, self.mtu))
            if r.returncode:
                hint = " (the kernel needs CONFIG_NET_SCH_TBF)" if "unknown" in r.stderr.lower() else ""
                raise LinkError(f"tc qdisc tbf on {dev}: {r.stderr.strip() or r.returncode}{hint}")

    def duck_fallback(self, duck: Shape, port: Shape) -> list[str]:
        """duckfw arguments that stand in for netem where the kernel lacks it: the round trip's
        delay (duck link and host port, both ways) before each request, and the duck link's loss."""
        if self.netem is not False or not (duck.needs_netem or port.needs_netem):
            return []
        if duck.jitter_us or port.jitter_us:
            raise LinkError("fleet.netns.duck_jitter_us needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), "
                            "which this kernel lacks; set it to 0 or run on a kernel with sch_netem")
        args = ["--enable-fault-injection"]
        delay = 2 * (duck.delay_us + port.delay_us)
        if delay:
            args += ["--delay-us", str(int(round(delay)))]
        if duck.loss:
            args += ["--drop-rate", f"{duck.loss:g}"]
        return args
