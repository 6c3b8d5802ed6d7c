"""bench.e2e's rate while every stream decodes: the window from the last stream's first
token to the first stream's last, and the token events inside it."""
from bench.e2e import all_decoding


def test_window_counts_only_the_events_while_all_streams_decode():
    # stream 0 decodes from 0 to 4 s, one event every 0.1 s; stream 1 starts at 1 s and ends at 3 s
    s0 = [i * 0.1 for i in range(41)]
    s1 = [1.0 + i * 0.2 for i in range(11)]
    r = all_decoding([s0, s1])
    assert abs(r["all_decoding_window_s"] - 2.0) < 1e-9
    # in (1, 3]: 20 events of stream 0, 10 of stream 1
    assert abs(r["all_decoding_tok_s"] - 30 / 2.0) < 1e-9


def test_window_too_short_or_a_stream_without_tokens_gives_none():
    assert all_decoding([[0.0, 1.0], [0.9, 1.2]])["all_decoding_tok_s"] is None   # overlap 0.1 s
    assert all_decoding([[0.0, 1.0], []])["all_decoding_tok_s"] is None
    assert all_decoding([])["all_decoding_tok_s"] is None
