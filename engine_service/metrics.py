"""The engine's Prometheus metrics, in one registry shared with the router link."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
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
            "Records (activation rows, probe scores) dropped on the way to clients, by queue",
            ["queue"],
            registry=r,
        )
