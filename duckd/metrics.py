"""Prometheus metrics of the daemon (served at /metrics by duckd.http_api):
per-duck state and counters read from the fleet at each scrape, the chat service's
queue and running requests, the placement of the FFNs (engine.placement), and per-request latency histograms and token counters
observed as requests finish (MTP1 acceptance too)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from duck_proto import duck_pb2 as pb

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _FleetCollector:
    """What the fleet manager and the chat service hold now, at every scrape."""

    def __init__(self, daemon):
        self.daemon = daemon

    def collect(self):
        d = self.daemon
        state = GaugeMetricFamily("duck_state", "1 for the state a duck is in", labels=["duck", "state"])
        gbps = GaugeMetricFamily("duck_read_gbps", "fp9 weights streamed per second over the last health interval",
                                 labels=["duck"])
        rtt = GaugeMetricFamily("duck_rtt_seconds", "round trip of the last health ping", labels=["duck"])
        errors = CounterMetricFamily("duck_errors", "malformed, unauthenticated and refused requests", labels=["duck"])
        resends = CounterMetricFamily("duck_retransmits", "replies a duck resent", labels=["duck"])
        restarts = CounterMetricFamily("duck_restarts", "restarts of the duck by the daemon", labels=["duck"])
        streamed = CounterMetricFamily("duck_bytes_streamed", "fp9 bytes the duck's kernels read", labels=["duck"])
        corrupt = CounterMetricFamily("duck_cache_corrupt", "cache entries the duck found damaged and dropped",
                                      labels=["duck"])
        for duck in d.fleet.ducks:
            s, i = duck.status(), str(duck.id)
            for name, value in pb.DuckState.items():
                state.add_metric([i, name], 1.0 if s.state == value else 0.0)
            gbps.add_metric([i], s.gbps)
            rtt.add_metric([i], s.rtt_us * 1e-6)
            errors.add_metric([i], s.errors)
            resends.add_metric([i], s.retransmits)
            restarts.add_metric([i], s.restarts)
            streamed.add_metric([i], s.bytes_streamed)
            corrupt.add_metric([i], s.cache_corrupt)
        yield from (state, gbps, rtt, errors, resends, restarts, streamed, corrupt)
        if d.transport is not None:   # the host's side of the wire (docs/wire.md, Reliability)
            t = d.transport.transport_stats(wait=0.1)
            for key, name, text in (("retransmits", "duck_host_retransmits", "requests the host sent again"),
                                    ("timeouts", "duck_host_timeouts", "calls no duck answered within the deadline"),
                                    ("twice_calls", "duck_host_sent_twice", "calls sent twice on a lossy link"),
                                    ("twice_starts", "duck_host_lossy_verdicts",
                                     "times a duck's link was found lossy (its decode forwards then went twice)")):
                if key in t:
                    yield CounterMetricFamily(name, text, value=t[key])
        chat = d.chat
        yield GaugeMetricFamily("duck_requests_queued", "chat requests waiting for the model", value=chat.queued)
        yield GaugeMetricFamily("duck_requests_running", "chat requests generating", value=chat.running)
        yield GaugeMetricFamily("duck_ready", "1 once the fleet serves the model", value=1.0 if d.ready else 0.0)
        plan = d.model.placement() or {}
        yield GaugeMetricFamily("duck_placement_gpu_bytes", "FFN weights the GPU computes beside the ducks (bf16)",
                                value=plan.get("gpu_gb", 0.0) * 1e9)
        if plan:
            yield GaugeMetricFamily("duck_placement_duck_bytes_per_token",
                                    "expected fp9 bytes the ducks read per decoded token under the placement",
                                    value=plan["duck_gb_per_token"] * 1e9)
            yield GaugeMetricFamily("duck_placement_gpu_layers_whole", "FFN layers the GPU computes alone",
                                    value=len(plan["gpu_layers_whole"]))


class Metrics:
    """The daemon's registry; observe() is a chat-service observer."""

    def __init__(self, daemon):
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(daemon))
        r = self.registry
        self.ttft = Histogram("duck_time_to_first_token_seconds", "request start to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("duck_time_per_output_token_seconds", "mean time between output tokens of a request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("duck_request_seconds", "request start to its last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.tokens_in = Counter("duck_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.tokens_cached = Counter("duck_prompt_tokens_cached", "prompt tokens found in the prefix cache "
                                     "(not read again), of duck_prompt_tokens", registry=r)
        self.tokens_out = Counter("duck_generated_tokens", "tokens generated", registry=r)
        self.requests = Counter("duck_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.mtp_accepted = Counter("duck_mtp_drafts_accepted", "MTP1 drafts accepted", registry=r)
        self.mtp_verified = Counter("duck_mtp_drafts_verified", "MTP1 drafts verified", registry=r)
        daemon.chat.observers.append(self.observe)

    def observe(self, done) -> None:
        s = done.stats
        self.requests.labels(done.finish_reason).inc()
        self.tokens_in.inc(s.input_len)
        self.tokens_cached.inc(s.cached)
        self.tokens_out.inc(s.output_len)
        if s.output_len:
            self.ttft.observe(s.ttft)
            self.e2e.observe(s.time)
        if s.output_len > 1:
            self.tpot.observe(s.tpot)
        if s.mtp:
            self.mtp_accepted.inc(s.mtp[0])
            self.mtp_verified.inc(s.mtp[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)
