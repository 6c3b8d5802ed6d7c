"""Snapshots of each screen at a fixed terminal size, fed deterministic Watch
snapshots and Chat events through the same methods the workers call (no network)."""
from __future__ import annotations

import pytest

from console.api import Connection
from console.app import DuckConsole
from console.screens.chat import ChatScreen
from console.screens.duck_detail import DuckDetailScreen
from duck_proto import duck_pb2 as pb
from tests.console import fleet_data

SIZE = (150, 42)


def fed_app() -> DuckConsole:
    return DuckConsole()


async def feed_minute(pilot) -> None:
    app = pilot.app
    app.connection = Connection("connected")
    app.model_info = fleet_data.MODEL_INFO
    for snap in fleet_data.minute():
        app.apply_snapshot(snap)
    await pilot.pause()


@pytest.fixture(autouse=True)
def _utc(utc):
    yield


def test_fleet_screen(snap_compare):
    assert snap_compare(fed_app(), terminal_size=SIZE, run_before=feed_minute)


def test_fleet_screen_lost_connection(snap_compare):
    async def run_before(pilot):
        await feed_minute(pilot)
        pilot.app.connection = Connection(
            "lost", "no connection to duckd at 127.0.0.1:7433: failed to connect to all addresses — retrying in 4 s")
        await pilot.pause()
    assert snap_compare(fed_app(), terminal_size=SIZE, run_before=run_before)


def test_fleet_screen_auth_failed(snap_compare):
    async def run_before(pilot):
        pilot.app.connection = Connection(
            "auth", "authentication failed: duckd at 127.0.0.1:7433 refused the token from arguments/environment "
                    "(missing or wrong bearer token); pass --token or set DUCK_TOKEN — retrying in 8 s")
        await pilot.pause()
    assert snap_compare(fed_app(), terminal_size=SIZE, run_before=run_before)


async def open_duck_5(pilot) -> None:
    await feed_minute(pilot)
    await pilot.press(*["down"] * 5, "enter")
    await pilot.pause()
    screen = pilot.app.screen
    assert isinstance(screen, DuckDetailScreen) and screen.duck_id == 5
    screen.cache_response = fleet_data.CACHE
    await pilot.pause()


def test_duck_detail_screen(snap_compare):
    assert snap_compare(fed_app(), terminal_size=SIZE, run_before=open_duck_5)


def test_duck_restart_confirmation(snap_compare):
    assert snap_compare(fed_app(), terminal_size=SIZE, run_before=open_duck_5, press=["r"])


def test_chat_screen(snap_compare):
    async def run_before(pilot):
        await feed_minute(pilot)
        await pilot.press("f2")
        screen = pilot.app.screen
        assert isinstance(screen, ChatScreen)
        screen.begin_turn("What is a duck?", 0.0, 64)
        for token in ["A", " duck", " is", " a", " cheap", " CPU", " node", " that", " streams", " expert",
                      " weights", "."]:
            screen.apply_chat_event(pb.ChatEvent(token=token))
        screen.apply_chat_event(pb.ChatEvent(stats=pb.GenerationStats(
            time_s=2.41, input_len=14, output_len=12, ttft_s=0.182, tpot_s=0.19, prefill_tok_s=76.9,
            decode_tok_s=5.3, finish_reason="eos",
            line="Generation stats: time 2.41 s, input 14 tokens, output 12 tokens, TTFT 182 ms, "
                 "prefill 76.9 tok/s, decode 5.3 tok/s")))
        screen.begin_turn("And how many are there?", 0.0, 64)
        for token in ["Eight", " in", " this"]:
            screen.apply_chat_event(pb.ChatEvent(token=token))
        await pilot.pause()
    assert snap_compare(fed_app(), terminal_size=SIZE, run_before=run_before)


def test_events_screen(snap_compare):
    async def run_before(pilot):
        await feed_minute(pilot)
        await pilot.press("f3")
        await pilot.pause()
    assert snap_compare(fed_app(), terminal_size=SIZE, run_before=run_before)
