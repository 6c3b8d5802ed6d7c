"""Deterministic fleet data for the console's snapshot tests: what a Watch
stream of a small loopback fleet could send over one minute."""
from __future__ import annotations

import math

from duck_proto import duck_pb2 as pb

T0 = 1_767_225_600.0     # 2026-01-01 00:00:00 UTC
DUCKS = 8


def duck(i: int, t: int) -> pb.DuckStatus:
    failed = i == 5 and t >= 40
    gbps = 0.0 if failed else 14.0 + 3.0 * math.sin((t + 7 * i) / 6.0) - 0.4 * i
    return pb.DuckStatus(
        id=i, address=f"127.0.0.1:{47000 + i}", subnet="loopback" if i < 4 else "10.77.1.0/24",
        state=pb.FAILED if failed else (pb.SYNCING if i == 7 else pb.SERVING),
        reason="no reply to 3 pings (process exited, status -9)" if failed else "",
        time_to_link_ms=180.0 + 37 * i, rtt_us=0.0 if failed else 95.0 + 10 * i + (t % 5) * 4,
        gbps=gbps, kernel_ms=0.0 if failed else 1.8 + 0.05 * i,
        cache_entries=96 - (i == 7) * 40, cache_hits=1200 + 10 * i, errors=3 if failed else 0,
        bytes_streamed=int(1.5e12) + i * 10**10, requests=50_000 + i, retransmits=i % 3, drops=0,
        restarts=1 if i == 2 else 0)


def events_at(t: int) -> list[pb.FleetEvent]:
    at = T0 + t
    if t == 0:
        return [pb.FleetEvent(unix_time=at - 9, duck_id=-1, kind="boot", message="booting 8 ducks (local driver)")] + [
            pb.FleetEvent(unix_time=at - 8 + 0.1 * i, duck_id=i, kind="link",
                          message=f"link up in {180 + 37 * i} ms") for i in range(DUCKS)] + [
            pb.FleetEvent(unix_time=at - 2, duck_id=7, kind="upload", message="uploading 40 slices: 1.2 GiB")]
    if t == 20:
        return [pb.FleetEvent(unix_time=at, duck_id=7, kind="upload", message="1.2 GiB / 2.0 GiB (60%)")]
    if t == 40:
        return [pb.FleetEvent(unix_time=at, duck_id=5, kind="failed",
                              message="no reply to 3 pings (process exited, status -9); restarting it in 0.5 s, "
                                      "attempt 1 of 5 (see the duck log)")]
    return []


def snapshot(t: int) -> pb.FleetSnapshot:
    ducks = [duck(i, t) for i in range(DUCKS)]
    return pb.FleetSnapshot(
        ducks=ducks, aggregate_gbps=sum(d.gbps for d in ducks), roofline_gbps=8 * 17.7,
        decode_tok_s=5.2 if t >= 40 else 6.1, model="Qwen3-30B-A3B", unix_time=T0 + t,
        sync=pb.SyncProgress(bytes_done=int(1.2 * 2**30), bytes_total=2 * 2**30, bytes_per_s=180 * 2**20,
                             eta_s=4.6, phase="uploading"),
        events=events_at(t), requests=requests_at(t))


def requests_at(t: int) -> list[pb.RequestStatus]:
    """Two chats running, one queued, from second 30 on."""
    if t < 30:
        return []
    return [pb.RequestStatus(id=41, state="running", prompt_tokens=512, generated_tokens=3 * (t - 30) + 40,
                             tok_s=5.4, age_s=t - 22.0),
            pb.RequestStatus(id=42, state="running", prompt_tokens=37, generated_tokens=2 * (t - 30),
                             tok_s=5.1, age_s=t - 29.5),
            pb.RequestStatus(id=43, state="queued", prompt_tokens=1480, age_s=1.5)]


def minute() -> list[pb.FleetSnapshot]:
    return [snapshot(t) for t in range(61)]


MODEL_INFO = pb.ModelInfo(name="Qwen3-30B-A3B", architecture="Qwen3MoeForCausalLM", layers=48,
                          hidden_size=2048, experts=128, experts_per_token=8, tp=8, multiple_of=64,
                          ffn_bytes_per_token=int(1.8e9 * 1.125), max_model_len=32768, backend="fleet")

CACHE = pb.CacheListResponse(entries=[
    pb.CacheEntry(digest=f"{0xabc0123 * (k + 1):016x}{k:048x}", name=f"layers.{k}.mlp/tp3", bytes=(25 + k) * 2**20,
                  ducks=[3], model="Qwen3-30B-A3B") for k in range(6)], host_cache_bytes=2 * 2**30)
