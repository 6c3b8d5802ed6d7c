"""duckd.fleet_manager's health monitor with a real duck: a restart's link wait closes the duck's
probe while a health check may be using it. The check then says nothing of the duck (it is not
failed), and the monitor goes on checking every duck: it once ended for good at the first such
check, and every duck's status froze (a chaos run saw a restarted duck stuck at the cache count of
its link-up, although it held every entry)."""
import asyncio
import time

from duckd.config import FleetConfig
from duckd.drivers import make_driver
from duckd.events import EventLog
from duckd.fleet_manager import FleetManager, State
from native.transport import Fleet, write_key_file


def test_a_probe_closed_under_the_monitor_fails_nothing_and_the_checks_go_on(tmp_path):
    key_file = tmp_path / "key"
    key = write_key_file(key_file)
    cfg = FleetConfig(driver="local", ducks=1, health_interval_s=0.05)

    async def scenario():
        fm = FleetManager(cfg, make_driver(cfg, tmp_path, key_file), key, EventLog())
        await fm.start()
        try:
            duck = fm.ducks[0]
            assert duck.state == State.READY
            deadline = time.monotonic() + 10
            while duck.checks < 3 and time.monotonic() < deadline:   # the monitor runs
                await asyncio.sleep(0.05)
            assert duck.checks >= 3
            duck.probe.close()                  # what a restart's link wait does first
            await asyncio.sleep(0.5)            # about ten rounds meet the closed probe
            assert duck.state == State.READY, duck.reason
            duck.probe = Fleet([duck.spec.address], key, retransmit_ms=20, deadline_ms=1500)   # and then
            before = duck.checks
            deadline = time.monotonic() + 10
            while duck.checks < before + 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert duck.checks >= before + 3, "the health monitor stopped"
        finally:
            await fm.stop()

    asyncio.run(scenario())
