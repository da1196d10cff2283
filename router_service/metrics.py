"""Prometheus metrics of one router, in its own registry (tests run several routers)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from router_service.rollout import DELTA_BUCKETS, Agreement
from router_service.verdict_log import LogMetrics

PROBE_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


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
        self.probes = ProbeMetrics()
        r.register(self.probes)
        self.aborts = Counter(
            "undercurrent_router_aborts", "Abort verdicts sent", ["probe"], registry=r
        )
        self.errors = Counter(
            "undercurrent_router_request_errors", "In-band RequestErrors sent", ["code"], registry=r
        )
        self.probes_loaded = Gauge("undercurrent_router_probes", "Probes loaded", registry=r)
        self.agreement = Agreement()
        r.register(AgreementMetrics(self.agreement))
        self.verdict_log = LogMetrics(r)


class AgreementMetrics(Collector):
    """Shadow versions against their serving versions, from rollout.Agreement:
    `undercurrent_router_shadow_requests_total{probe,version,serving,shadow}`
    (each "fired" or "quiet"), `undercurrent_router_shadow_disagreements_total
    {probe,version}` (requests whose two verdicts differ) and the histogram
    `undercurrent_router_shadow_score_delta{probe,version}` (shadow minus
    serving score, per row both scored). `version` is the shadow's."""

    def __init__(self, agreement: Agreement):
        self.agreement = agreement

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("undercurrent_router_shadow_requests",
                                       "Ended requests a shadow scored, by each version's verdict",
                                       labels=["probe", "version", "serving", "shadow"])
        disagreements = CounterMetricFamily("undercurrent_router_shadow_disagreements",
                                            "Ended requests on which a shadow's verdict differs from the "
                                            "serving version's", labels=["probe", "version"])
        differing: dict[tuple[str, str], int] = {}
        for (probe, version, serving, shadow), count in sorted(self.agreement.outcomes().items()):
            requests.add_metric([probe, version, _verdict(serving), _verdict(shadow)], count)
            differing[(probe, version)] = differing.get((probe, version), 0) + (count if serving != shadow else 0)
        for (probe, version), count in differing.items():
            disagreements.add_metric([probe, version], count)
        deltas = HistogramMetricFamily("undercurrent_router_shadow_score_delta",
                                       "Shadow score minus serving score, per row both scored",
                                       labels=["probe", "version"])
        bounds = [*(str(b) for b in DELTA_BUCKETS), "+Inf"]
        for (probe, version), counts in sorted(self.agreement.histograms().items()):
            # Buckets below 0 leave out _sum and _count (Prometheus' rule); the +Inf bucket counts all.
            deltas.add_metric([probe, version], list(zip(bounds, np.cumsum(counts).tolist())), None)
        yield requests
        yield disagreements
        yield deltas


def _verdict(fired: bool) -> str:
    return "fired" if fired else "quiet"


class ProbeMetrics(Collector):
    """Rows scored and seconds spent per probe and batch, one row of arrays per probe
    name, so one batch records every probe it scored with a few numpy calls.

    A labelled prometheus_client child costs a few microseconds per probe and
    batch; with a thousand probes per request that alone was 8% of a router's
    batch. Exported as `undercurrent_router_probe_rows_total{probe}` and the
    histogram `undercurrent_router_probe_seconds{probe}`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # batches are scored on the event loop and on scoring threads
        self._slots: dict[str, int] = {}
        self._rows = np.zeros(0, dtype=np.float64)
        self._seconds = np.zeros(0, dtype=np.float64)
        self._buckets = np.zeros((0, len(PROBE_SECONDS_BUCKETS) + 1), dtype=np.int64)  # the last: +Inf

    def slot(self, probe: str) -> int:
        """The probe name's row, made on first use; kept, as a counter's labels are."""
        with self._lock:
            slot = self._slots.get(probe)
            if slot is None:
                slot = self._slots[probe] = len(self._slots)
                if slot == self._rows.size:
                    grow = max(16, slot)
                    self._rows = np.concatenate([self._rows, np.zeros(grow)])
                    self._seconds = np.concatenate([self._seconds, np.zeros(grow)])
                    self._buckets = np.concatenate([self._buckets, np.zeros((grow, self._buckets.shape[1]),
                                                                            dtype=np.int64)])
            return slot

    def record(self, slots: np.ndarray, rows: int, seconds: float) -> None:
        """Each of the probes at `slots` (distinct) scored `rows` rows in `seconds`."""
        bucket = int(np.searchsorted(PROBE_SECONDS_BUCKETS, seconds))  # the first bound >= seconds
        with self._lock:
            self._rows[slots] += rows
            self._seconds[slots] += seconds
            self._buckets[slots, bucket] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            names = list(self._slots.items())
            rows, seconds, buckets = self._rows.copy(), self._seconds.copy(), np.cumsum(self._buckets, axis=1)
        rows_metric = CounterMetricFamily("undercurrent_router_probe_rows", "Rows scored per probe",
                                          labels=["probe"])
        seconds_metric = HistogramMetricFamily(
            "undercurrent_router_probe_seconds",
            "Time per batch after the shared matrix product (ordering, scope, scores, rule); "
            "probes scored together are each charged an equal share",
            labels=["probe"])
        bounds = [*(str(b) for b in PROBE_SECONDS_BUCKETS), "+Inf"]
        for name, slot in names:
            rows_metric.add_metric([name], rows[slot])
            seconds_metric.add_metric([name], list(zip(bounds, buckets[slot].tolist())), seconds[slot])
        yield rows_metric
        yield seconds_metric
