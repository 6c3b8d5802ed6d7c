"""The console's behaviour without a daemon: the same methods the workers call,
and a real channel to an address where nothing listens."""
from __future__ import annotations

import asyncio
import json
import socket

from console.app import DuckConsole, main
from console.screens.chat import ChatScreen
from console.widgets.chat_controls import ChatControls
from console.widgets.chat_transcript import ChatTranscript
from console.widgets.fleet_table import FleetTable
from textual.worker import WorkerState

from duck_proto import duck_pb2 as pb
from duck_proto.client import Endpoint
from tests.console import fleet_data
from tests.console.pilot_helpers import wait_for

SIZE = (150, 42)


def test_table_follows_snapshots_and_keeps_the_cursor_on_its_duck():
    async def run():
        app = DuckConsole()
        async with app.run_test(size=SIZE) as pilot:
            app.apply_snapshot(fleet_data.snapshot(0))
            await pilot.pause()
            table = app.screen.query_one(FleetTable)
            await pilot.press("down", "down", "down")
            assert table.selected_duck == 3
            assert table.state_of(5) == "SERVING"
            app.apply_snapshot(fleet_data.snapshot(45))
            await pilot.pause()
            assert table.state_of(5) == "FAILED"
            smaller = fleet_data.snapshot(46)
            del smaller.ducks[0]                      # duck 0 leaves: rows are rebuilt
            app.apply_snapshot(smaller)
            await pilot.pause()
            assert table.selected_duck == 3
            assert table.row_count == 7
    asyncio.run(run())


def test_chat_sends_the_whole_conversation_and_cancel_keeps_the_partial_answer():
    async def run():
        app = DuckConsole()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f2")
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            first = screen.begin_turn("hi", 0.7, 32)
            assert [(m.role, m.content) for m in first.messages] == [("user", "hi")]
            assert abs(first.temperature - 0.7) < 1e-6 and first.max_tokens == 32
            for t in ["Hel", "lo"]:
                screen.apply_chat_event(pb.ChatEvent(token=t))
            screen.apply_chat_event(pb.ChatEvent(stats=pb.GenerationStats(output_len=2, finish_reason="eos")))
            assert not screen.generating
            second = screen.begin_turn("more", 0.0, 0)
            assert [(m.role, m.content) for m in second.messages] == [
                ("user", "hi"), ("assistant", "Hello"), ("user", "more")]
            screen.apply_chat_event(pb.ChatEvent(token="Par"))
            await pilot.press("escape")
            assert not screen.generating
            assert screen.history[-1].role == "assistant" and screen.history[-1].content == "Par"
            screen.begin_turn("third", 0.0, 0)
            screen.fail_turn("UNAVAILABLE: duckd is starting")     # no answer: the question leaves the history
            assert [m.content for m in screen.history] == ["hi", "Hello", "more", "Par"]
            transcript = screen.query_one(ChatTranscript)
            assert transcript.answers[:2] == ["Hello", "Par"]
            assert len(transcript.stats_lines) == 2                 # the stats and the cancel note
            await pilot.press("ctrl+n")
            assert screen.history == [] and not transcript.children
    asyncio.run(run())


def test_unreachable_daemon_shows_the_banner_and_keeps_retrying():
    with socket.socket() as s:          # a port where, a moment later, nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run():
        app = DuckConsole(Endpoint(f"127.0.0.1:{port}", "t", "test"))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.connection.status == "lost", 10, "the lost-connection banner",
                           seen=lambda: app.connection)
            banner = app.screen.query_one("ConnectionBanner")
            assert banner.display
            assert f"127.0.0.1:{port}" in app.connection.message and "retrying" in app.connection.message
            first = app.connection.message
            await wait_for(pilot, lambda: app.connection.message != first, 10, "a second attempt with a longer delay",
                           seen=lambda: app.connection)
            assert [w.state for w in app.workers if w.group == "watch"] == [WorkerState.RUNNING]
    asyncio.run(run())


def test_chat_controls_read_the_settings_and_fall_back_on_nonsense():
    async def run():
        app = DuckConsole()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f2")
            controls = app.screen.query_one(ChatControls)
            temperature, max_tokens = controls.query_one("#temperature"), controls.query_one("#max-tokens")
            temperature.value, max_tokens.value = "0.8", "16"
            await pilot.pause()
            assert abs(controls.temperature - 0.8) < 1e-9 and controls.max_tokens == 16
            temperature.value = "11"           # out of range: the default, not 11
            await pilot.pause()
            assert controls.temperature == 0.0
    asyncio.run(run())


def test_main_says_where_it_looked_when_no_daemon_is_found(tmp_path, monkeypatch, capsys):
    for name in ("DUCK_ADDRESS", "DUCK_TOKEN", "DUCK_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "no running duckd found" in err and str(tmp_path / "duck" / "duckd.json") in err


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_chat_shows_tool_calls_and_keeps_them_in_the_history():
    async def run():
        app = DuckConsole(tools=[WEATHER], tool_choice="required")
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f2")
            screen = app.screen
            assert "get_weather" in screen.query_one("#prompt").border_title
            first = screen.begin_turn("Weather in Paris?", 0.0, 64)
            assert json.loads(first.tools) == [WEATHER] and first.tool_choice == "required"
            call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
            screen.apply_chat_event(pb.ChatEvent(tool_call=call))
            screen.apply_chat_event(pb.ChatEvent(stats=pb.GenerationStats(output_len=9, finish_reason="tool_calls")))
            await pilot.pause()
            transcript = screen.query_one(ChatTranscript)
            assert transcript.tool_calls == ['→ get_weather({"city": "Paris"})']
            assert transcript.answers == []                 # no empty bubble for an answer of calls alone
            assert "finish: tool_calls" in transcript.stats_lines[0]
            second = screen.begin_turn("And its time?", 0.0, 64)
            assert [(m.role, list(m.tool_calls)) for m in second.messages] == [
                ("user", []), ("assistant", [call]), ("user", [])]
            screen.apply_chat_event(pb.ChatEvent(token="Let me check."))
            screen.apply_chat_event(pb.ChatEvent(tool_call=call))
            await pilot.press("escape")                     # cancelled: text and call stay in the history
            assert screen.history[-1].content == "Let me check." and list(screen.history[-1].tool_calls) == [call]
            assert transcript.answers == ["Let me check."] and len(transcript.tool_calls) == 2
    asyncio.run(run())


def test_bad_tools_file_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "tools.json"
    for text, want in [("{not json", "not JSON"), ('{"a": 1}', "expected OpenAI's tools list")]:
        bad.write_text(text)
        assert main(["--address", "127.0.0.1:1", "--token", "t", "--tools", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"--tools {bad}: {want}" in err, err
    assert main(["--address", "127.0.0.1:1", "--token", "t", "--tools", str(tmp_path / "none.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(["--address", "127.0.0.1:1", "--token", "t", "--tool-choice", "required"]) == 2
    assert "needs --tools FILE" in capsys.readouterr().err
