"""Prometheus metrics of one router, in its own registry (tests run several routers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions = Gauge("undercurrent_router_sessions", "Open engine sessions", registry=r)
        self.live_requests = Gauge(
            "undercurrent_router_live_requests", "Requests with probe state", registry=r
        )
        self.batches = Counter("undercurrent_router_batches", "Activation batches scored", registry=r)
        self.rows = Counter("undercurrent_router_rows", "Activation rows received", registry=r)
        self.bytes = Counter(
            "undercurrent_router_activation_bytes", "Activation tensor bytes received", registry=r
        )
        self.batch_seconds = Histogram(
            "undercurrent_router_batch_seconds",
            "Time to decode and score one batch, all probes included",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.probe_seconds = Histogram(
            "undercurrent_router_probe_seconds",
            "Time one probe spends on one batch after the shared matrix product "
            "(ordering, scope, scores, rule); probes scored together share the common part equally",
            ["probe"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
        self.probe_rows = Counter(
            "undercurrent_router_probe_rows", "Rows scored per probe", ["probe"], registry=r
        )
        self.aborts = Counter(
            "undercurrent_router_aborts", "Abort verdicts sent", ["probe"], registry=r
        )
        self.errors = Counter(
            "undercurrent_router_request_errors", "In-band RequestErrors sent", ["code"], registry=r
        )
        self.probes_loaded = Gauge("undercurrent_router_probes", "Probes loaded", registry=r)
