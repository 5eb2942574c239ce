"""The stream process's own Prometheus metrics (a registry of its own, served by
``--metrics-port``; Triton's /metrics says nothing about Kafka)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# event timestamp (producer's clock) -> result acknowledged by the broker
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class StreamMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.consumed = Counter("tritonguard_stream_events_consumed", "Events read from the input topic", ["topic"], registry=r)
        self.produced = Counter("tritonguard_stream_results_produced",
                                "Results acknowledged by the broker on the output topic", ["topic"], registry=r)
        self.dead = Counter("tritonguard_stream_dead_letters", "Events acknowledged on the dead-letter topic, by error code",
                            ["topic", "code"], registry=r)
        self.retries = Counter("tritonguard_stream_retries", "Triton requests sent again after a transient error (UNAVAILABLE...)",
                               ["code"], registry=r)
        self.pauses = Counter("tritonguard_stream_pauses", "Times the consumer paused its partitions because Triton was unavailable",
                              registry=r)
        self.paused = Gauge("tritonguard_stream_paused", "1 while the partitions are paused (Triton unavailable), else 0", registry=r)
        self.inflight = Gauge("tritonguard_stream_inflight", "Events read and not yet acknowledged on an output topic", registry=r)
        self.lag = Gauge("tritonguard_stream_consumer_lag", "High watermark minus the consumer's position, per assigned partition",
                         ["topic", "partition"], registry=r)
        self.latency = Histogram("tritonguard_stream_e2e_latency_seconds",
                                 "Event timestamp to its result or dead letter acknowledged by the broker",
                                 buckets=E2E_BUCKETS, registry=r)

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        start_http_server(port, addr=address, registry=self.registry)
