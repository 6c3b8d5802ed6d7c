"""Waiting on a live app: poll a condition between Pilot pauses, and fail with
what was awaited and what was seen instead."""
from __future__ import annotations

import time

from console.widgets.fleet_table import FleetTable


async def wait_for(pilot, predicate, timeout_s: float, what: str, seen=lambda: None):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:.0f} s still waiting for {what}; "
                                 f"seen: {seen()!r}; connection: {pilot.app.connection}")
        await pilot.pause(0.02)


def table_states(app) -> dict[int, str]:
    """Duck id -> the state word the fleet table shows now."""
    assert app.current_mode == "fleet", app.current_mode
    table = app.screen_stack[0].query_one(FleetTable)
    return {duck_id: table.state_of(duck_id) for duck_id in table._ids}
