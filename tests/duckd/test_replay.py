"""Replay protection and session recovery against the real daemon (wol driver: the
ducks are real duckfw processes this test starts, each behind a UDP relay that
records what the daemon sends it, as an attacker on the path would).

A captured SESSION_OPEN and CACHE_INVALIDATE, sent again from the daemon's port
and from another one, change nothing while the daemon runs, while it is stopped,
after it restarted (a new run) and after the duck restarted (a new challenge):
the session stays, chats work, the cache keeps its entries, and every replay is
counted. A duck whose hello names a session that is not the daemon's (another
host opened one) gets the daemon's back, with an event."""
import socket
import struct
import time

import grpc
import pytest

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from native._native import lib
from native.transport import Fleet, write_key_file
from tests.duckd_fixture import RunningDaemon, write_config
from tests.transport.ducks import Duck
from tests.transport.relay import Relay

HEADER = struct.Struct("<IBBHIIHHIII")   # wire_header: magic, version, type, flags, session, sequence, ...


class RecordingRelay(Relay):
    """A relay that keeps every datagram it passes to the duck."""

    def __init__(self, duck):
        super().__init__(duck)
        self.sent: list[bytes] = []

    def _pass(self, data, limit, way, send):
        if way == "to_duck":
            self.sent.append(data)
        super()._pass(data, limit, way, send)

    def captured(self, mtype: int) -> bytes:
        found = [d for d in self.sent if HEADER.unpack_from(d)[2] == mtype]
        assert found, f"the daemon sent no {mtype} through the relay"
        return found[-1]

    def send_from_daemon_port(self, data: bytes) -> None:
        self._back.send(data)   # the duck sees the relay's back socket as the daemon


class Setup:
    def __init__(self, tmp_path):
        self.state = tmp_path / "duck"
        self.state.mkdir(parents=True)
        self.key_file = self.state / "fleet.key"      # the daemon's own key file: the ducks share it
        self.key = write_key_file(self.key_file)
        self.ducks = [Duck(i, tmp_path, self.key_file).start() for i in range(2)]
        self.relays = [RecordingRelay(d.address).__enter__() for d in self.ducks]
        config = write_config(tmp_path / "duckd.toml", self.state, driver="wol")
        with open(config, "a") as f:
            f.write('\n[fleet.wol]\nbroadcast = "127.255.255.255:9"\n')
            for i, r in enumerate(self.relays):
                f.write(f'\n[[fleet.wol.ducks]]\naddress = "127.0.0.1:{r.address[1]}"\nmac = "02:00:00:00:00:0{i}"\n')
        self.daemon = RunningDaemon(config, self.state)
        self.probe = Fleet([self.ducks[0].address], self.key)   # reads only (hello, stats): opens no run

    def close(self):
        if self.daemon.proc is not None and self.daemon.proc.poll() is None:
            self.daemon.stop()
        self.probe.close()
        for r in self.relays:
            r.__exit__(None, None, None)
        for d in self.ducks:
            d.stop()

    def hello(self):
        return self.probe.hello_only()[0]

    def stats(self) -> dict:
        return self.probe.stats()[0]

    def serving(self, timeout: float = 60) -> None:
        for i in range(len(self.ducks)):
            self.daemon.wait_duck(i, pb.SERVING, timeout)

    def chat_works(self) -> None:
        _, stats = self.daemon.chat("Which city is the capital of France?", max_tokens=6)
        assert stats.output_len > 0


@pytest.fixture
def setup(tmp_path):
    s = Setup(tmp_path)
    try:
        s.daemon.start()
        s.serving()
        yield s
    finally:
        s.close()


def replay(setup: Setup, datagrams: list[bytes]) -> int:
    """Each datagram from the daemon's port and from another; returns how many went."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        for d in datagrams:
            setup.relays[0].send_from_daemon_port(d)
            other.sendto(d, setup.ducks[0].address)
    time.sleep(0.3)
    return 2 * len(datagrams)


def refused(before: dict, after: dict, reasons=("replayed", "bad_mac", "no_run")) -> int:
    return sum(after[k] - before.get(k, 0) for k in reasons)


def replays_change_nothing(setup: Setup, captured: list[bytes], session: int, entries: int, reasons=None) -> None:
    """Replays the captured datagrams; each is counted (under reasons, or any refusal) and
    the duck keeps its session and cache entries."""
    before = setup.stats()
    n = replay(setup, captured)
    after = setup.stats()
    assert refused(before, after, *([reasons] if reasons else [])) >= n - 1, (before, after)
    info = setup.hello()
    assert (info.session, info.cache_entries) == (session, entries)


def wait_session(setup: Setup, ok, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while True:
        session = setup.hello().session
        if ok(session):
            return session
        assert time.monotonic() < deadline, f"duck 0 reports session {session:08x}"
        time.sleep(0.1)


def test_captured_control_messages_replayed_change_nothing(setup):
    try:
        rpc.CacheStub(setup.daemon.channel()).Invalidate(pb.InvalidateRequest(duck_id=0), timeout=30)
    except grpc.RpcError as e:   # every entry is in use by the session: kept, and said so
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
    captured = [setup.relays[0].captured(lib.WIRE_T_SESSION_OPEN), setup.relays[0].captured(lib.WIRE_T_CACHE_INVALIDATE)]
    first = setup.hello()
    assert first.session and first.cache_entries > 0
    setup.chat_works()   # the forwards push the captured messages' replies out of the duck's last-reply cache

    # 1. while the daemon runs: the sequences were taken
    replays_change_nothing(setup, captured, first.session, first.cache_entries, ("replayed",))
    setup.chat_works()

    # 2. the daemon stopped (its session closed, the entries no longer in use): still taken
    setup.daemon.stop()
    replays_change_nothing(setup, captured, 0, first.cache_entries)

    # 3. a new daemon run: another link key, the old MACs do not verify
    (setup.state / "duckd.json").unlink(missing_ok=True)
    setup.daemon.start()
    setup.serving()
    second = setup.hello()
    assert second.session not in (0, first.session)
    replays_change_nothing(setup, captured, second.session, first.cache_entries, ("bad_mac",))
    setup.chat_works()

    # 4. the duck restarted: a new challenge, no run until the daemon opens its own again
    setup.ducks[0].stop()
    setup.ducks[0].start()
    n = replay(setup, captured)
    assert refused({}, setup.stats()) >= n - 1
    third = wait_session(setup, lambda s: s not in (0, first.session))   # duckd reopened it
    replays_change_nothing(setup, captured, third, first.cache_entries, ("bad_mac",))
    setup.chat_works()
    assert setup.daemon.proc.poll() is None and setup.ducks[0].proc.poll() is None


def test_a_foreign_session_is_reopened_with_an_event(setup):
    ours = setup.hello().session
    watch = rpc.FleetStub(setup.daemon.channel()).Watch(pb.WatchRequest(interval_s=0.2), timeout=60)
    with Fleet([setup.ducks[0].address], setup.key) as other:   # another host with the key opens its own
        other.hello()
        session = other.open_session({0: [[]]}, 64)
        assert setup.hello().session == session.id != ours
        events = []
        for snap in watch:
            events += [ev for ev in snap.events if ev.duck_id == 0 and ev.kind == "session"]
            if events:
                break
        watch.cancel()
    assert f"reports session {session.id:08x}, not the daemon's {ours:08x}" in events[0].message, events
    back = wait_session(setup, lambda s: s not in (0, session.id))
    assert back == ours   # the daemon's own session back on that duck (the others keep it: nothing to redo there)
    setup.serving()
    setup.chat_works()


def test_a_failed_duck_of_the_wol_driver_comes_back_when_it_answers(setup):
    """The wol driver cannot restart a duck: one that stopped answering (a box that rebooted)
    is FAILED until its hello answers again, then it gets the run, its weights and the
    daemon's session back and serves."""
    ours = setup.hello().session
    setup.ducks[0].stop()
    setup.daemon.wait_duck(0, pb.FAILED, timeout=20)
    setup.ducks[0].start()
    setup.serving()
    assert wait_session(setup, lambda s: s != 0) == ours
    setup.chat_works()
