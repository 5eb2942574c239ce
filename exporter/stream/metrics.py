"""The stream process's own Prometheus metrics (a registry of its own, served by
``--metrics-port``; Triton's /metrics says nothing about Kafka).

Names, help texts and buckets come from the catalogue (``tritonguard.core.catalogue``, whose table
is docs/monitoring.md's), like the guard's. Every series carries the ``model`` label of the model
the stream scores, so one dashboard's model picker selects a model's guard and its streams; the
attributes below have it filled in (``metrics.consumed.labels(topic).inc()``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tritonguard.core import catalogue

E2E_BUCKETS = catalogue.E2E_BUCKETS


class _ForModel:
    """A labelled family with its ``model`` label filled in: ``labels(*rest)`` and ``remove(*rest)``."""

    def __init__(self, family: Any, model: str) -> None:
        self._family, self._model = family, model

    def labels(self, *values: str) -> Any:
        return self._family.labels(self._model, *values)

    def remove(self, *values: str) -> None:
        self._family.remove(self._model, *values)


class StreamMetrics:
    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry()
        self.families: dict[str, Any] = {}
        for table, kind in ((catalogue.CONSUMER_COUNTERS, Counter), (catalogue.CONSUMER_GAUGES, Gauge)):
            for key, (name, doc) in table.items():
                self.families[key] = kind(name, doc, ["model", *catalogue.CONSUMER_LABELS[key]], registry=r)
        for key, (name, doc, buckets) in catalogue.CONSUMER_HISTOGRAMS.items():
            self.families[key] = Histogram(name, doc, ["model", *catalogue.CONSUMER_LABELS[key]], buckets=buckets,
                                           registry=r)
        # a family without labels of its own is its model's child (inc/set/observe); the others
        # keep .labels(...) for theirs
        bound = {key: (_ForModel(f, model) if catalogue.CONSUMER_LABELS[key] else f.labels(model))
                 for key, f in self.families.items()}
        self.consumed, self.produced, self.dead = bound["consumed"], bound["produced"], bound["dead_letters"]
        self.retries, self.pauses, self.paused = bound["retries"], bound["pauses"], bound["paused"]
        self.inflight, self.lag, self.latency = bound["inflight"], bound["lag"], bound["e2e"]

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        start_http_server(port, addr=address, registry=self.registry)
