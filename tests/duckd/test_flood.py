"""A forged-fragment flood against a duck while the real daemon decodes: forward
fragments of the open session with a wrong link MAC, ~30k datagrams/s from a
Python socket. The duck drops each one after a CRC and a MAC check, before
reassembly, answers none, and counts them; decode keeps >= 0.8x of its rate
without the flood. Short chats alternate flooded and clean and their medians
are compared, so a loaded 2-core machine's noise falls on both sides alike."""
import logging
import multiprocessing
import os
import socket
import statistics
import time

from native._native import ffi, lib
from native.transport import Fleet, read_key_file
from tests.firmware.test_wire import seal

log = logging.getLogger(__name__)

RATE = 30000          # datagrams per second
BURST = 50            # sent back to back, then a sleep to the next tick (every 1.7 ms)


class Flood:
    """The attacker: a process of its own at the lowest priority (it stands for another
    machine, so its own sending, loopback delivery included, must not take the CPU that
    the comparison is about), sending bursts at RATE until stopped."""

    def __init__(self, address, datagrams):
        self.address, self.datagrams = address, datagrams
        self.sent, self.seconds = 0, 0.0
        self._sent = multiprocessing.Value("q", 0)
        self._seconds = multiprocessing.Value("d", 0.0)
        self._stop = multiprocessing.Event()
        self._proc = multiprocessing.get_context("fork").Process(target=self._run, name="flood", daemon=True)

    def __enter__(self):
        self._proc.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._proc.join(10)
        self.sent, self.seconds = self._sent.value, self._seconds.value

    def _run(self):
        os.nice(19)
        sent = 0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            send, address, datagrams = s.sendto, self.address, self.datagrams
            t0 = tick = time.monotonic()
            while not self._stop.is_set():
                for i in range(BURST):
                    send(datagrams[(sent + i) % len(datagrams)], address)
                sent += BURST
                tick += BURST / RATE
                time.sleep(max(0.0, tick - time.monotonic()))
            self._sent.value, self._seconds.value = sent, time.monotonic() - t0


def forged_fragments(session: int, n: int = 512) -> list[bytes]:
    stranger = ffi.new("wire_key *")   # the attacker's guess at a link key
    stranger.bytes[0:32], stranger.len = os.urandom(32), 32
    lib.wire_link_set(stranger, os.urandom(16), os.urandom(16))
    return [seal(os.urandom(1400), stranger, mtype=lib.WIRE_T_FORWARD, session=session, sequence=(1 << 31) + i,
                 frag_index=i % 8, frag_count=8, total=8 * 1400) for i in range(n)]


def decode_rate(daemon) -> float:
    _, stats = daemon.chat("Tell me about ducks.", max_tokens=24)
    assert stats.output_len > 4
    return stats.decode_tok_s


def test_forged_fragment_flood_leaves_decode_at_speed(duckd_daemon):
    duck = duckd_daemon.ducks()[0]
    host, port = duck.address.rsplit(":", 1)
    address = (host, int(port))
    key = read_key_file(duckd_daemon.state_dir / "fleet.key")
    with Fleet([address], key) as probe:   # reads only: the session id an attacker would sniff, the counters
        session = probe.hello_only()[0].session
        assert session, "the daemon's session is not open on duck 0"
        datagrams = forged_fragments(session)
        decode_rate(duckd_daemon)   # warm
        before = probe.stats()[0]
        clean, flooded, sent, seconds = [], [], 0, 0.0
        for _ in range(8):
            clean.append(decode_rate(duckd_daemon))
            with Flood(address, datagrams) as flood:
                flooded.append(decode_rate(duckd_daemon))
            sent, seconds = sent + flood.sent, seconds + flood.seconds
        time.sleep(0.2)
        after = probe.stats()[0]
    rate = sent / seconds
    assert rate > 0.6 * RATE, f"the flood reached only {rate:.0f} datagrams/s"
    assert after["bad_mac"] - before["bad_mac"] >= 0.8 * sent, (sent, before, after)
    # none was held for reassembly: what stale counts here are the host's own copies (a retransmit
    # of a request the slowed duck had answered, late by a retransmit floor of 0.5 ms), a handful
    assert after["stale"] - before["stale"] <= max(16, sent // 1000), (sent, before, after)
    ratio = statistics.median(flooded) / statistics.median(clean)
    log.info("flood of %.0f datagrams/s: decode %.2fx (clean %s, flooded %s)", rate, ratio, clean, flooded)
    assert ratio >= 0.8, f"decode {statistics.median(flooded):.1f} tok/s flooded, " \
                         f"{statistics.median(clean):.1f} clean ({rate:.0f} datagrams/s): {clean} {flooded}"
