"""Bounded inputs, against the shared real daemon: a request body past daemon.max_request_mb
is 413 before it is read (declared) or as soon as it passes the bound (chunked), the daemon's
memory does not grow with it, and the event loop keeps answering /health within 100 ms
while the largest body it takes is read, parsed and tokenized."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

from tests.duckd_fixture import raw_post

MiB = 2**20


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _raw_post(daemon, head: bytes, body_parts) -> tuple[int, bytes]:
    return raw_post(daemon.http_address, daemon.token, head, body_parts)


def test_a_50_mb_body_is_413_at_once_and_costs_no_memory(duckd_daemon):
    pid = duckd_daemon.proc.pid
    before = _rss_mb(pid)
    t0 = time.monotonic()
    parts = (b"x" * MiB for _ in range(50))
    status, body = _raw_post(duckd_daemon, f"Content-Length: {50 * MiB}\r\n".encode(), parts)
    assert status == 413 and time.monotonic() - t0 < 5.0
    err = json.loads(body)["error"]
    assert "daemon.max_request_mb" in err["message"] and str(50 * MiB) in err["message"], err
    assert _rss_mb(pid) - before < 100


def test_a_chunked_body_is_cut_where_it_passes_the_bound(duckd_daemon):
    pid = duckd_daemon.proc.pid
    before = _rss_mb(pid)
    chunk = b"x" * MiB
    parts = (b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(50))
    status, body = _raw_post(duckd_daemon, b"Transfer-Encoding: chunked\r\n", parts)
    assert status == 413
    assert b"daemon.max_request_mb" in body
    assert _rss_mb(pid) - before < 100


def test_health_answers_within_100_ms_while_the_largest_body_is_taken(duckd_daemon):
    """A body just under the bound, one 4 MB prompt: read, parsed and tokenized (in threads, with the
    GIL released), then refused for its length; /health is asked all the while."""
    prompt = ("The quick brown duck jumps over the lazy dog. " * 100000)[:4 * MiB - 200]
    data = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}).encode()
    assert len(data) <= 4 * MiB
    result = {}

    def post():
        req = urllib.request.Request(f"http://{duckd_daemon.http_address}/v1/chat/completions", data=data,
                                     headers={"Authorization": f"Bearer {duckd_daemon.token}",
                                              "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120)
        except urllib.error.HTTPError as e:
            result["status"], result["body"] = e.code, e.read()
    worker = threading.Thread(target=post)
    worker.start()
    latencies = []
    while worker.is_alive():
        t = time.perf_counter()
        with urllib.request.urlopen(f"http://{duckd_daemon.http_address}/health", timeout=10) as r:
            assert r.status == 200
        latencies.append(time.perf_counter() - t)
        time.sleep(0.02)
    worker.join()
    assert result["status"] == 400 and b"max_model_len" in result["body"], result
    assert len(latencies) >= 10 and max(latencies) < 0.1, (len(latencies), max(latencies))
