"""An emulated LAN of ducks for the benchmarks: duckd's netns driver (one
namespace per duck, per-subnet bridges, tc link limits) started without the
daemon, so `duckctl bench transport --netns` measures the wire of a real
fleet's shape on one machine. Needs root and iproute2."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from native.transport import write_key_file

log = logging.getLogger("duck.bench_netns")


def netns_config(args):
    """A FleetConfig for args.netns ducks with the link limits of args (validated as duckd's config is)."""
    from duckd.config import FleetConfig, NetnsConfig
    netns = NetnsConfig(subnets=args.subnets, prefix=args.netns_prefix, name=args.netns_name,
                        duck_rate_mbit=args.duck_rate_mbit, duck_delay_us=args.duck_delay_us,
                        duck_jitter_us=args.duck_jitter_us, duck_loss=args.duck_loss,
                        port_rate_mbit=args.port_rate_mbit, port_delay_us=args.port_delay_us,
                        link_mtu=args.link_mtu)
    return FleetConfig(driver="netns", ducks=args.netns, threads_per_duck=args.threads, mtu=args.mtu,
                       spin=bool(args.duck_spin_us), spin_us=args.duck_spin_us or 1000, data_mac=False,
                       link_timeout_s=60.0, netns=netns)


def check_can_run() -> None:
    if os.geteuid() != 0:
        raise SystemExit("duckctl bench transport --netns: needs root (network namespaces, veths, tc)")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise SystemExit(f"duckctl bench transport --netns: `{tool}` not found; install iproute2")


@contextmanager
def netns_ducks(args):
    """args.netns ducks behind emulated links: (addresses, key, subnet of each, the driver, their pids);
    all removed after."""
    from duckd.drivers.netns import NetnsDriver
    check_can_run()
    cfg = netns_config(args)
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the namespaces and veths below are removed
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="duck-bench-netns-") as tmp:
        key_file = Path(tmp) / "key"
        key = write_key_file(key_file)
        driver = NetnsDriver(cfg, Path(tmp), key_file)
        specs = driver.specs()

        async def boot_all():
            await asyncio.gather(*(driver.boot(d) for d in specs))

        try:
            asyncio.run(boot_all())
            log.info("%d ducks in %d subnets booted", len(specs), cfg.netns.subnets)
            yield [d.address for d in specs], key, [d.subnet for d in specs], driver, [d.handle.pid for d in specs]
        finally:
            async def stop_all():
                await asyncio.gather(*(driver.stop(d) for d in specs))
                await driver.close()
            asyncio.run(stop_all())
            signal.signal(signal.SIGTERM, previous)


def own_cpu_s(pids: list[int]) -> float:
    """CPU seconds of this process and of the ducks so far (softirq work lands on whoever runs)."""
    import resource
    me = resource.getrusage(resource.RUSAGE_SELF)
    total = me.ru_utime + me.ru_stime
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def link_limits(driver) -> dict:
    """The links as emulated: the config's limits, and where the delay and loss were made."""
    n = driver.n
    where = {True: "netem", False: "duckfw fault injection (the kernel has no netem)", None: "none asked"}
    return {"delay_and_loss_by": where[driver.shaper.netem], "subnets": n.subnets,
            "duck_rate_mbit": n.duck_rate_mbit, "duck_delay_us": n.duck_delay_us, "duck_jitter_us": n.duck_jitter_us, "duck_loss": n.duck_loss, "port_rate_mbit": n.port_rate_mbit,
            "port_delay_us": n.port_delay_us, "link_mtu": n.link_mtu}
