"""exporter/stream/metrics.py: the stream serves the catalogue's families (the docs table and the
dashboard's stream row are checked against the catalogue), each series labelled with its model."""

from __future__ import annotations

from prometheus_client import generate_latest

from exporter.stream.metrics import StreamMetrics
from tritonguard.core import catalogue


def test_the_stream_registers_exactly_the_catalogues_consumer_families():
    m = StreamMetrics("digits")
    served = {f.name + ("_total" if f.type == "counter" else ""): f.type for f in m.registry.collect()}
    assert served == {name: catalogue.families()[name] for name in catalogue.consumer_families()}
    for f in m.registry.collect():
        if f.type == "histogram":
            bounds = sorted({float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")})
            assert tuple(bounds[:-1]) == catalogue.E2E_BUCKETS  # the last is +Inf


def test_every_series_carries_the_model_and_the_run_loops_calls_keep_their_shape():
    m = StreamMetrics("digits")
    m.consumed.labels("events").inc()
    m.produced.labels("scores").inc(2)
    m.dead.labels("scores.dlq", "BAD_EVENT").inc()
    m.retries.labels("UNAVAILABLE").inc()
    m.pauses.inc()
    m.paused.set(1)
    m.inflight.set(5)
    m.lag.labels("events", "3").set(7)
    m.latency.observe(0.02)
    text = generate_latest(m.registry).decode()
    series = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert series and all('model="digits"' in ln for ln in series)
    assert 'tritonguard_stream_consumer_lag{model="digits",partition="3",topic="events"} 7.0' in series
    assert 'tritonguard_stream_results_produced_total{model="digits",topic="scores"} 2.0' in series
    m.lag.remove("events", "3")  # a revoked partition's series goes
    assert "tritonguard_stream_consumer_lag{" not in generate_latest(m.registry).decode()
