"""The engine's Prometheus metrics, in one registry shared with the router link.

With include_vllm, the registry also serves vLLM's own `vllm:*` series (time to
first token, end-to-end latency, queue time, KV-cache use, ...), which vLLM's stat
loggers keep in a registry of their own: one scrape endpoint has both.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

VLLM_PREFIX = "vllm:"


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
            "(capture_backlog: rows a worker dropped before the engine service read them)",
            ["queue"],
            registry=r,
        )
