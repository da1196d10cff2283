"""The router link's Prometheus metrics."""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class LinkMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "undercurrent_router_link_"
        self.batches_sent = Counter(
            p + "batches_sent", "ActivationBatches written", ["replica"], registry=registry
        )
        self.bytes_sent = Counter(
            p + "bytes_sent", "ActivationBatch bytes written", ["replica"], registry=registry
        )
        self.dropped_batches = Counter(
            p + "dropped_batches", "Batches dropped before sending", ["reason"], registry=registry
        )
        self.dropped_records = Counter(
            p + "dropped_records",
            "Activation rows that never reached a router",
            ["reason"],
            registry=registry,
        )
        self.unscored_records = Counter(
            p + "unscored_records",
            "Activation rows no router scored (dropped, lost, refused, errored, timed out)",
            ["reason"],
            registry=registry,
        )
        self.ignored_messages = Counter(
            p + "ignored_messages",
            "Router messages about a request run that is not live on that replica",
            ["reason"],
            registry=registry,
        )
        self.router_errors = Counter(
            p + "router_errors", "In-band RequestErrors received", ["code"], registry=registry
        )
        self.reconnects = Counter(
            p + "reconnects", "Sessions re-established after a loss", ["replica"], registry=registry
        )
        self.rehomed = Counter(
            p + "rehomed_requests", "Requests moved to another replica", registry=registry
        )
        self.replicas_up = Gauge(
            p + "replicas_up", "Replicas with a live Session", registry=registry
        )
        # Read at each scrape from the links sharing the registry (rows_in_flight).
        self.rows_in_flight = Gauge(
            p + "rows_in_flight", "Probe rows queued or sent and not yet acknowledged or failed",
            registry=registry,
        )
        self.links: weakref.WeakSet = weakref.WeakSet()
        self.rows_in_flight.set_function(lambda: sum(link.rows_in_flight() for link in self.links))
        self.ack_latency = Histogram(
            p + "ack_latency_seconds",
            "Batch written to StepAck received",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )


# Several links may share one registry (e.g. the default one): they share its metrics.
_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, LinkMetrics] = weakref.WeakKeyDictionary()


def metrics_for(registry: CollectorRegistry) -> LinkMetrics:
    if registry not in _METRICS:
        _METRICS[registry] = LinkMetrics(registry)
    return _METRICS[registry]
