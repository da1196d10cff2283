"""The router's per-probe metrics, kept in arrays and exported as Prometheus families."""

import numpy as np

from router_service.metrics import PROBE_SECONDS_BUCKETS, RouterMetrics


def test_per_probe_rows_and_seconds_are_exported_per_name_with_cumulative_buckets():
    metrics = RouterMetrics()
    names = [f"p{i}" for i in range(40)]  # past the arrays' first 16 rows
    slots = np.array([metrics.probes.slot(name) for name in names])
    assert metrics.probes.slot("p3") == slots[3]  # one row per name, kept
    metrics.probes.record(slots, 10, PROBE_SECONDS_BUCKETS[2])  # on a bound: counted in that bucket (le)
    metrics.probes.record(slots[:2], 4, 0.5)  # over every bound: +Inf only
    metrics.probes.record(slots[39:], 1, 0.0)
    sample = metrics.registry.get_sample_value

    def bucket(name, le):
        return sample("undercurrent_router_probe_seconds_bucket", {"probe": name, "le": le})

    assert [sample("undercurrent_router_probe_rows_total", {"probe": n}) for n in ("p0", "p1", "p2", "p39")] == [
        14, 14, 10, 11]
    assert [bucket("p0", str(b)) for b in PROBE_SECONDS_BUCKETS[:3]] == [0, 0, 1]
    assert bucket("p0", "+Inf") == 2 and bucket("p2", "+Inf") == 1
    assert bucket("p39", str(PROBE_SECONDS_BUCKETS[0])) == 1 and bucket("p39", "+Inf") == 2
    assert sample("undercurrent_router_probe_seconds_count", {"probe": "p0"}) == 2
    assert sample("undercurrent_router_probe_seconds_sum", {"probe": "p0"}) == PROBE_SECONDS_BUCKETS[2] + 0.5
    assert sample("undercurrent_router_probe_rows_total", {"probe": "never"}) is None
