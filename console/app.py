"""duck-console: the operator console of duckd.

The app owns the connection: one worker consumes Fleet.Watch and sets the
reactives every screen watches (snapshot, model_info, connection,
events_total); a lost stream shows the banner and is retried with backoff, and
a refused token says "authentication failed". Screens: fleet (F1), chat (F2),
events (F3); Enter on a duck opens its detail screen. --tools FILE (OpenAI's
tools list) offers those tools in the chat, whose calls it shows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

import grpc
from textual import work
from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from console.api import ActionOutcome, Connection, DaemonApi, call_error_text, describe_error
from console.fleet_state import EventBook, FleetHistory
from console.screens.chat import ChatScreen
from console.screens.events import EventsScreen
from console.screens.fleet import FleetScreen
from duck_proto import client
from duck_proto import duck_pb2 as pb

log = logging.getLogger("console")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0


class DuckConsole(App):
    CSS_PATH = "duck.tcss"
    TITLE = "duck-console"
    MODES = {"fleet": FleetScreen, "chat": ChatScreen, "events": EventsScreen}
    DEFAULT_MODE = "fleet"
    BINDINGS = [
        Binding("f1", "switch_mode('fleet')", "Fleet"),
        Binding("f2", "switch_mode('chat')", "Chat"),
        Binding("f3", "switch_mode('events')", "Events"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    snapshot: reactive[pb.FleetSnapshot | None] = reactive(None, always_update=True)
    model_info: reactive[pb.ModelInfo | None] = reactive(None)
    connection: reactive[Connection] = reactive(Connection("connecting"))
    events_total: reactive[int] = reactive(0)
    action_outcome: reactive[ActionOutcome | None] = reactive(None, always_update=True)

    def __init__(self, endpoint: client.Endpoint | None = None, rediscover=None, watch_interval_s: float = 0.0,
                 tools: list | None = None, tool_choice: str = ""):
        """endpoint None: no daemon; data arrives only through apply_snapshot (tests, demos).
        tools: OpenAI's tools list, offered with every chat question (tool_choice as pb.ChatRequest's)."""
        super().__init__()
        self.tool_names = [t.get("function", {}).get("name", "?") for t in tools or [] if isinstance(t, dict)]
        self.chat_options = ({"tools": json.dumps(tools)} if tools else {}) | \
            ({"tool_choice": tool_choice} if tool_choice else {})
        self.endpoint, self._rediscover = endpoint, rediscover
        self.watch_interval_s = watch_interval_s
        self.api: DaemonApi | None = None
        self.history = FleetHistory()
        self.events = EventBook()

    def on_mount(self) -> None:
        if self.endpoint is not None:
            self.api = DaemonApi(self.endpoint, self._rediscover)
            self.connection = Connection("connecting", f"connecting to duckd at {self.endpoint.address} "
                                                       f"({self.endpoint.source})…")
            self.watch_fleet()

    async def on_unmount(self) -> None:
        if self.api is not None:
            await self.api.close()

    def apply_snapshot(self, snapshot: pb.FleetSnapshot) -> None:
        """One Watch snapshot into the console's state: the path of the live stream and of tests."""
        self.history.add(snapshot)
        self.events.add(snapshot.events)
        self.snapshot = snapshot
        self.events_total = self.events.total

    def note(self, message: str) -> None:
        """An event of the console itself (connection lost / back) in the events log."""
        self.events.add([pb.FleetEvent(unix_time=time.time(), duck_id=-1, kind="console", message=message)])
        self.events_total = self.events.total

    @work(exclusive=True, group="watch")
    async def watch_fleet(self) -> None:
        delay, model = BACKOFF_FIRST_S, None
        while True:
            call = self.api.fleet.Watch(pb.WatchRequest(interval_s=self.watch_interval_s, with_history=True))
            try:
                async for snapshot in call:
                    if snapshot.model != model:
                        model = snapshot.model
                        self.model_info = await self._model_info()
                    self.apply_snapshot(snapshot)
                    if self.connection.status != "connected":
                        self.connection, delay = Connection("connected"), BACKOFF_FIRST_S
                        self.note(f"connected to duckd at {self.api.endpoint.address}")
                lost = Connection("lost", f"duckd at {self.api.endpoint.address} ended the fleet stream")
            except grpc.aio.AioRpcError as e:
                lost = describe_error(e, self.api.endpoint)
            finally:
                call.cancel()
            if self.connection.status == "connected":
                self.note(f"lost the connection: {lost.message}")
            log.warning("%s; retrying in %.1f s", lost.message, delay)
            self.connection = Connection(lost.status, f"{lost.message} — retrying in {delay:g} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
            await self.api.reopen()
            model = None

    def watch_action_outcome(self, outcome: ActionOutcome | None) -> None:
        if outcome is not None:
            self.notify(outcome.text, severity="information" if outcome.ok else "error", timeout=8)

    # The actions run on the app, not on the screen that asked: leaving the duck's
    # screen must not cancel a restart half-way.
    @work(group="duck-action")
    async def restart_duck(self, duck_id: int) -> None:
        try:
            reply = await self.api.fleet.Restart(pb.RestartDuckRequest(id=duck_id), timeout=300)
            self.action_outcome = ActionOutcome("restart", duck_id, True, f"duck {duck_id} restarted: now "
                                                f"{pb.DuckState.Name(reply.duck.state)}")
        except grpc.aio.AioRpcError as e:
            self.action_outcome = ActionOutcome("restart", duck_id, False,
                                                f"restart duck {duck_id}: {call_error_text(e)}")

    @work(group="duck-action")
    async def invalidate_duck(self, duck_id: int) -> None:
        try:
            reply = await self.api.cache.Invalidate(pb.InvalidateRequest(duck_id=duck_id), timeout=120)
            self.action_outcome = ActionOutcome("invalidate", duck_id, True, reply.message or
                                                f"duck {duck_id}: {reply.entries_removed} cache entries removed")
        except grpc.aio.AioRpcError as e:
            self.action_outcome = ActionOutcome("invalidate", duck_id, False,
                                                f"invalidate duck {duck_id}: {call_error_text(e)}")

    async def _model_info(self) -> pb.ModelInfo | None:
        try:
            return await self.api.model.Info(pb.ModelInfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.info("no model info: %s", e.details())
            return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="duck-console", description=__doc__.split("\n\n")[0])
    client.add_connection_arguments(p)
    p.add_argument("--interval", type=float, default=0.0, help="seconds between fleet snapshots (0: the daemon's)")
    p.add_argument("--log-file", help="write the console's log here (the terminal belongs to the UI)")
    p.add_argument("--tools", metavar="FILE", help="a JSON file holding OpenAI's tools list, offered with every "
                                                   "chat question; the calls the model makes are shown")
    p.add_argument("--tool-choice", metavar="{auto,none,required,NAME}", default="",
                   help="with --tools: auto (the default), none, required, or a tool's name")
    return p.parse_args(client.join_option_values(sys.argv[1:] if argv is None else argv))


def load_tools(path: str) -> list:
    """The tools list in path; ValueError naming the file when it is not one (the daemon checks the rest)."""
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as e:
        raise ValueError(f"--tools {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"--tools {path}: not JSON ({e})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              for t in tools):
        raise ValueError(f'--tools {path}: expected OpenAI\'s tools list, [{{"type": "function", "function": '
                         '{"name", "description", "parameters"}}, ...]')
    return tools


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tools = load_tools(args.tools) if args.tools else None
    except ValueError as e:
        sys.stderr.write(f"duck-console: {e}\n")
        return 2
    if args.tool_choice and not tools and args.tool_choice != "none":
        sys.stderr.write(f"duck-console: --tool-choice {args.tool_choice} needs --tools FILE\n")
        return 2
    if args.log_file:
        logging.basicConfig(filename=args.log_file, level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        from textual.logging import TextualHandler
        logging.basicConfig(level=logging.WARNING, handlers=[TextualHandler()])

    def find() -> client.Endpoint:
        return client.discover_from(args)
    try:
        endpoint = find()
    except (client.DiscoveryError, OSError, ValueError) as e:
        sys.stderr.write(f"duck-console: {e}\n")
        return 2
    rediscover = find if endpoint.source.startswith("runtime file") else None
    DuckConsole(endpoint, rediscover, args.interval, tools, args.tool_choice).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
