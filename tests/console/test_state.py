"""The console's memory between snapshots: history windows, sparklines, events."""
from __future__ import annotations

from console.fleet_state import EventBook, FleetHistory, sparkline
from duck_proto import duck_pb2 as pb


def snap(t: float, gbps: list[float]) -> pb.FleetSnapshot:
    return pb.FleetSnapshot(unix_time=t, ducks=[pb.DuckStatus(id=i, gbps=g, rtt_us=100 + i) for i, g in enumerate(gbps)])


def test_sparkline_scales_to_top_and_leaves_gaps_blank():
    assert sparkline([0.0, 5.0, 10.0]) == "▁▅█"
    assert sparkline([None, 10.0, None, 0.0]) == " █ ▁"
    assert sparkline([5.0, 5.0], top=10.0) == "▅▅"
    assert sparkline([0.0, 0.0]) == "▁▁"
    assert sparkline([20.0], top=10.0) == "█"


def test_binned_means_per_slice_and_none_before_the_first_sample():
    h = FleetHistory()
    for t in range(30, 61):           # the console connected at t=30
        h.add(snap(float(t), [float(t), 1.0]))
    bins = h.binned(0, 60.0, 6)       # 10 s per bin, newest last
    assert bins[:2] == [None, None]
    assert bins[-1] == sum(range(51, 61)) / 10       # (t in (50, 60]) -> the last bin
    assert h.binned(1, 60.0, 6)[2:] == [1.0] * 4
    assert h.binned(9, 60.0, 3) == [None] * 3


def test_history_drops_old_samples_and_repeated_instants():
    h = FleetHistory()
    for t in range(0, 1000, 10):
        h.add(snap(float(t), [1.0]))
    h.add(snap(990.0, [2.0]))        # the same instant again: replaced, not added
    series = h.samples[0]
    assert series[-1].gbps == 2.0 and series[-1].unix_time == 990.0
    assert series[0].unix_time >= 990.0 - 600.0
    assert [s.unix_time for s in h.window(0, 30.0)] == [960.0, 970.0, 980.0, 990.0]


def test_event_book_dedupes_and_reports_what_is_new():
    book = EventBook(limit=3)
    e = [pb.FleetEvent(unix_time=float(i), duck_id=i, kind="link", message=f"up {i}") for i in range(5)]
    assert book.add(e[:2]) == 2
    assert book.add(e[:3]) == 1                      # a reconnect sends the history again
    assert [x.duck_id for x in book.since(2)] == [2]
    assert book.add(e[3:]) == 2
    assert [x.duck_id for x in book.events] == [2, 3, 4]   # bounded
    assert [x.duck_id for x in book.since(0)] == [2, 3, 4]  # older ones are gone
    assert book.since(book.total) == []
