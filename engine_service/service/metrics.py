"""The engine's Prometheus metrics, in one registry shared with the router link.

With include_vllm, the registry also serves vLLM's own `vllm:*` series (time to
first token, end-to-end latency, queue time, KV-cache use, ...), which vLLM's stat
loggers keep in a registry of their own: one scrape endpoint has both.

The engine's own latency histograms measure what vLLM's cannot see: a request
as its client lives it (tokenizing, capture registration and token gating
included) and the capture drain that runs beside vLLM's loop.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

VLLM_PREFIX = "vllm:"
# Seconds; from one token on a small model to a long generation on a loaded host.
REQUEST_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)
# Seconds; one drain per engine step, so well under a step when healthy.
DRAIN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class VllmSeries:
    """A collector that yields the `vllm:*` families of vLLM's metrics registry."""

    def __init__(self, source: CollectorRegistry | None = None):
        self._source = source

    def collect(self):
        source = self._source
        if source is None:
            from vllm.v1.metrics.prometheus import get_prometheus_registry

            source = get_prometheus_registry()
        for family in source.collect():
            if family.name.startswith(VLLM_PREFIX):
                yield family


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, include_vllm: bool = False):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if include_vllm:
            r.register(VllmSeries())
        self.requests_started = Counter(
            "undercurrent_engine_requests_started", "Generate requests accepted", registry=r
        )
        self.requests_finished = Counter(
            "undercurrent_engine_requests_finished", "Requests finished, by reason", ["reason"], registry=r
        )
        self.tokens_generated = Counter(
            "undercurrent_engine_tokens_generated", "Tokens generated", registry=r
        )
        self.captured_rows = Counter(
            "undercurrent_engine_captured_rows", "Activation rows drained from workers", registry=r
        )
        self.captured_bytes = Counter(
            "undercurrent_engine_captured_bytes", "Activation bytes drained from workers", registry=r
        )
        self.aborts = Counter(
            "undercurrent_engine_aborts", "Requests the engine aborted, by reason", ["reason"], registry=r
        )
        self.drain_failures = Counter(
            "undercurrent_engine_drain_failures",
            "Capture drain iterations that failed (and the drain loop stopping)",
            registry=r,
        )
        self.dropped_records = Counter(
            "undercurrent_engine_dropped_records",
            "Records (activation rows, probe scores) dropped on the way to clients, by queue "
            "(capture_backlog: rows a worker dropped before the engine service read them; "
            "capture_lost: probe rows capture owed a computed position and never delivered)",
            ["queue"],
            registry=r,
        )
        self.recomputed_rows = Counter(
            "undercurrent_engine_recomputed_rows_discarded",
            "Captured rows discarded as duplicates: vLLM computed their positions again after "
            "preempting a request, and an earlier drain had delivered them, so each row reaches "
            "routers and clients once. Not a loss (a row that never arrives counts in "
            "dropped_records, queue capture_lost)",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "undercurrent_engine_time_to_first_token_seconds",
            "From accepting a Generate request to its first token on the client stream "
            "(tokenizing, capture registration and token gating included)",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "undercurrent_engine_request_duration_seconds",
            "From accepting a Generate request to its finished message, by finish reason",
            ["reason"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.drain_duration = Histogram(
            "undercurrent_engine_drain_duration_seconds",
            "Capture drain iterations that delivered rows: waiting for a step's rows, merging "
            "them and handing them to clients and routers",
            buckets=DRAIN_BUCKETS,
            registry=r,
        )
