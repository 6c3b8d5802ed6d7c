"""Pilot tests of the console against a real duckd with a local fleet on
loopback (the duckd_daemon fixture of tests/conftest.py): no mocks, the same
gRPC the operator's console uses."""
from __future__ import annotations

import asyncio
import json

import pytest
from textual.widgets import Input

from console.app import DuckConsole
from console.screens.chat import ChatScreen
from console.screens.duck_detail import DuckDetailScreen
from console.widgets.cache_table import CacheTable
from console.widgets.chat_controls import ChatControls
from console.widgets.chat_transcript import ChatTranscript
from duck_proto.client import Endpoint
from tests.console.pilot_helpers import table_states, wait_for

SIZE = (150, 42)
UP = {"SERVING", "READY"}
BOOT_S = 120.0
pytestmark = pytest.mark.timeout(300)


def console_for(daemon, token: str | None = None) -> DuckConsole:
    # a fast Watch so that a short-lived FAILED (the daemon restarts killed ducks) reaches the table
    return DuckConsole(Endpoint(daemon.address, token or daemon.token, "test fixture"), watch_interval_s=0.05)


async def fleet_up(pilot) -> dict[int, str]:
    app = pilot.app
    return await wait_for(
        pilot, lambda: app.connection.status == "connected" and (s := table_states(app)) and
        set(s.values()) <= UP and s, BOOT_S, "every duck SERVING or READY", seen=lambda: table_states(app))


async def ask(pilot, screen: ChatScreen, text: str, turn: int) -> None:
    transcript = screen.query_one(ChatTranscript)
    prompt = screen.query_one("#prompt", Input)
    prompt.value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(transcript.stats_lines) >= turn or
                   any(b.role == "error" for b in transcript.query("ChatBubble")),
                   BOOT_S, f"the stats line of answer {turn}", seen=lambda: transcript.answers)


def test_chat_round_trip_shows_answer_and_stats(live_daemon):
    async def run():
        app = console_for(live_daemon)
        async with app.run_test(size=SIZE) as pilot:
            await fleet_up(pilot)
            await pilot.press("f2")
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            screen.query_one(ChatControls).query_one("#max-tokens", Input).value = "12"
            transcript = screen.query_one(ChatTranscript)

            await ask(pilot, screen, "What is the capital of France?", 1)
            errors = [b.text for b in transcript.query("ChatBubble") if b.role == "error"]
            assert not errors, errors
            assert transcript.answers[0].strip(), "the answer is empty"
            assert "Generation stats" in transcript.stats_lines[0] or "tok/s" in transcript.stats_lines[0]

            await ask(pilot, screen, "And of Italy?", 2)    # the second turn carries the first
            assert [m.role for m in screen.history] == ["user", "assistant", "user", "assistant"]
            assert screen.history[1].content == transcript.answers[0]
            assert len(transcript.stats_lines) == 2
            assert not screen.generating
    asyncio.run(run())


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


def test_chat_with_tools_shows_the_models_calls(live_daemon):
    """duck-console --tools FILE --tool-choice required: the daemon's ToolCall events show as lines
    of their own, the stats say tool_calls, and the calls stay in the history."""
    async def run():
        app = DuckConsole(Endpoint(live_daemon.address, live_daemon.token, "test fixture"), watch_interval_s=0.05,
                          tools=[WEATHER], tool_choice="required")
        async with app.run_test(size=SIZE) as pilot:
            await fleet_up(pilot)
            await pilot.press("f2")
            screen = app.screen
            screen.query_one(ChatControls).query_one("#max-tokens", Input).value = "96"
            transcript = screen.query_one(ChatTranscript)
            await ask(pilot, screen, "What is the weather in Paris?", 1)
            errors = [b.text for b in transcript.query("ChatBubble") if b.role == "error"]
            assert not errors, errors
            assert transcript.tool_calls, transcript.answers
            for line in transcript.tool_calls:
                assert line.startswith("→ get_weather(") and line.endswith(")"), line
                assert "city" in json.loads(line[len("→ get_weather("):-1])
            assert "finish: tool_calls" in transcript.stats_lines[0]
            answer = screen.history[-1]
            assert answer.role == "assistant" and [c.name for c in answer.tool_calls] == \
                ["get_weather"] * len(transcript.tool_calls)
    asyncio.run(run())


def test_killed_duck_turns_failed_and_recovers(live_daemon):
    async def run():
        app = console_for(live_daemon)
        async with app.run_test(size=SIZE) as pilot:
            await fleet_up(pilot)
            seen: list[str] = []

            def state_of_1() -> str:
                state = table_states(app).get(1, "")
                if not seen or seen[-1] != state:
                    seen.append(state)
                return state

            live_daemon.kill_duck(1)
            await wait_for(pilot, lambda: state_of_1() == "FAILED", 30, "duck 1 FAILED in the table",
                           seen=lambda: seen)
            try:     # the daemon restarts a failed duck by itself where its driver can
                await wait_for(pilot, lambda: state_of_1() != "FAILED", 5, "duck 1 leaving FAILED")
            except AssertionError:  # ... else the operator does, through the console
                await restart_from_detail(pilot, 1)
            await wait_for(pilot, lambda: state_of_1() in UP, BOOT_S, "duck 1 back up", seen=lambda: seen)
            assert any(e.kind == "failed" and e.duck_id == 1 for e in app.events.events)
            await pilot.pause(0.5)
            assert all(s in UP for s in table_states(app).values()), table_states(app)
    asyncio.run(run())


async def restart_from_detail(pilot, duck_id: int) -> None:
    app = pilot.app
    table = app.screen_stack[0].query_one("FleetTable")
    table.move_cursor(row=table._ids.index(duck_id))
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(app.screen, DuckDetailScreen), 5, "the duck detail screen")
    await pilot.press("r")
    await pilot.pause()
    await pilot.press("y")
    await pilot.pause()
    await pilot.press("escape")


def test_operator_restart_through_the_confirmation(live_daemon):
    async def run():
        app = console_for(live_daemon)
        async with app.run_test(size=SIZE) as pilot:
            await fleet_up(pilot)
            before = {d.id: d.restarts for d in app.snapshot.ducks}[0]
            await pilot.press("enter")      # the cursor starts on duck 0
            screen = app.screen
            assert isinstance(screen, DuckDetailScreen) and screen.duck_id == 0
            cache = screen.query_one(CacheTable)
            await wait_for(pilot, lambda: cache.border_title.startswith("cache: ") and
                           "loading" not in cache.border_title, 10, "duck 0's cache list",
                           seen=lambda: cache.border_title)
            assert "entries" in cache.border_title, cache.border_title
            await pilot.press("r")
            await pilot.press("n")          # no: nothing happens
            await pilot.pause(0.3)
            assert {d.id: d.restarts for d in app.snapshot.ducks}[0] == before
            await pilot.press("r")
            await pilot.press("y")
            await wait_for(pilot, lambda: {d.id: d.restarts for d in app.snapshot.ducks}[0] > before,
                           BOOT_S, "duck 0's restart count to grow")
            await pilot.press("escape")     # leaving the screen must not cancel the restart
            await wait_for(pilot, lambda: app.action_outcome, BOOT_S, "the restart's outcome")
            assert app.action_outcome.ok and app.action_outcome.duck_id == 0, app.action_outcome
            await fleet_up(pilot)
    asyncio.run(run())


def test_wrong_token_says_authentication_failed(live_daemon):
    async def run():
        app = console_for(live_daemon, token="not-the-token")
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.connection.status == "auth", 20, "the auth banner",
                           seen=lambda: app.connection)
            banner = app.screen.query_one("ConnectionBanner")
            assert banner.display
            assert "authentication failed" in str(banner.render())
            assert app.snapshot is None
    asyncio.run(run())


def test_lost_daemon_shows_the_banner_and_the_console_reconnects(tmp_path):
    """A daemon of its own (the shared one must stay up): stopped, the banner shows;
    started again (a new port, found through its runtime file), the console is back."""
    from duck_proto.client import discover
    from tests.duckd_fixture import RunningDaemon, write_config

    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2), state,
                           env={"XDG_STATE_HOME": str(tmp_path)})

    async def run():
        await asyncio.to_thread(daemon.start)
        app = DuckConsole(discover(state_dir=state), rediscover=lambda: discover(state_dir=state),
                          watch_interval_s=0.1)
        async with app.run_test(size=SIZE) as pilot:
            await fleet_up(pilot)
            await asyncio.to_thread(daemon.stop)
            await wait_for(pilot, lambda: app.connection.status == "lost", 30, "the lost-connection banner",
                           seen=lambda: app.connection)
            assert app.screen.query_one("ConnectionBanner").display
            assert "retrying in" in app.connection.message
            await asyncio.to_thread(daemon.start)
            await fleet_up(pilot)
            assert app.api.endpoint.address == daemon.address
            assert not app.screen.query_one("ConnectionBanner").display
            notes = [e.message for e in app.events.events if e.kind == "console"]
            assert any(n.startswith("lost the connection") for n in notes), notes
            assert notes[-1] == f"connected to duckd at {daemon.address}", notes
    try:
        asyncio.run(run())
    finally:
        daemon.stop()


def test_console_over_tls_chats_and_a_wrong_certificate_says_so(tls_daemon, tmp_path):
    """A daemon with daemon.tls: the console finds and trusts its certificate through the
    runtime file and chats; given another certificate to trust, the banner says TLS."""
    from duck_proto.client import discover
    from tests.tls_fixture import make_ca

    async def run():
        app = DuckConsole(discover(state_dir=tls_daemon.state_dir), watch_interval_s=0.1)
        async with app.run_test(size=SIZE) as pilot:
            await fleet_up(pilot)
            await pilot.press("f2")
            screen = app.screen
            screen.query_one(ChatControls).query_one("#max-tokens", Input).value = "12"
            await ask(pilot, screen, "What is the capital of France?", 1)
            transcript = screen.query_one(ChatTranscript)
            assert not [b.text for b in transcript.query("ChatBubble") if b.role == "error"]
            assert transcript.answers[0].strip(), "the answer is empty"
        other, _, _ = make_ca(tmp_path, "not the daemon")
        wrong = DuckConsole(discover(tls_daemon.address, tls_daemon.token, ca=str(other), state_dir=tmp_path))
        async with wrong.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: wrong.connection.status == "auth", 30, "the TLS banner",
                           seen=lambda: wrong.connection)
            assert f"--ca {other} does not vouch for" in wrong.connection.message
    asyncio.run(run())
