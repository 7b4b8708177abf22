"""``GET /metrics``: the server's Prometheus metrics (requests, tokens, latencies, the engine's queue and KV blocks)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hfaccel.engine import AsyncEngine, RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Prometheus metrics of one server, in a registry of its own (nothing process-global)."""

    def __init__(self, engine: AsyncEngine):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "hfaccel_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=registry
        )
        self.prompt_tokens = Counter("hfaccel_prompt_tokens", "prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("hfaccel_generation_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram(
            "hfaccel_time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.itl = Histogram(
            "hfaccel_inter_token_latency_seconds",
            "time between tokens of a completion",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "hfaccel_request_latency_seconds", "request arrival to finish", buckets=LATENCY_BUCKETS, registry=registry
        )
        gauges = {
            "hfaccel_queue_depth": ("requests waiting for a slot", lambda s: s["waiting"] + s["queued"]),
            "hfaccel_running_sequences": ("sequences being decoded", lambda s: s["running"]),
            "hfaccel_kv_blocks_used": ("KV cache blocks in use", lambda s: s["blocks_used"]),
            "hfaccel_kv_blocks_free": ("KV cache blocks free", lambda s: s["blocks_free"]),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(lambda read=read: read(engine.stats()))

    def observe(self, output: RequestOutput) -> None:
        """Count a finished request's tokens and record its latencies."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in output.outputs))
        metrics = output.metrics
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        if metrics.finished_time is not None:
            self.latency.observe(metrics.finished_time - metrics.arrival_time)
