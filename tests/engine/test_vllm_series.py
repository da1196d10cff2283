"""vLLM's own `vllm:*` series on the engine's metrics endpoint, beside Undercurrent's."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from engine_service.service.metrics import EngineMetrics, VllmSeries


def test_vllm_series_are_served_with_the_engines_and_nothing_else_of_vllms_registry():
    vllm_registry = CollectorRegistry()
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", ["model_name"],
                     buckets=(0.1, 1.0), registry=vllm_registry)
    ttft.labels("tiny").observe(0.25)
    Counter("process_unrelated", "not vLLM's", registry=vllm_registry).inc()

    metrics = EngineMetrics()
    metrics.registry.register(VllmSeries(vllm_registry))
    metrics.requests_started.inc()
    text = generate_latest(metrics.registry).decode()

    assert 'vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="tiny"} 1.0' in text
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 0.0' in text
    assert "undercurrent_engine_requests_started_total 1.0" in text
    assert "process_unrelated" not in text


def test_without_include_vllm_only_undercurrents_series_are_served():
    text = generate_latest(EngineMetrics().registry).decode()
    assert "vllm:" not in text
    assert "undercurrent_engine_requests_started_total 0.0" in text
