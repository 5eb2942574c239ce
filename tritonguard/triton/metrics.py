"""Triton custom metrics of a model, kept off the serving path: counters, gauges and histograms
(from :mod:`tritonguard.core.catalogue`) kept in process and pushed to python_backend's
``MetricFamily`` by a daemon thread."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tritonguard.core import catalogue
from tritonguard.triton import backend

log = logging.getLogger(__name__)


class Metrics:
    """Triton custom metrics for one model, kept off the serving path.

    ``inc``/``observe`` only touch in-process counters (each call into pb_utils metrics is an
    IPC round trip to the server: measured ~0.3 ms p50 added at c=1 with three per batch). A
    daemon thread pushes the deltas: woken by the first event after a push, so a scrape right
    after a request already counts it (a flusher on a fixed 1 s tick showed zeros to the
    README's metrics check), then resting ``min_gap`` seconds, so a busy guard pushes at most
    1/``min_gap`` times a second; ``interval`` bounds the wait without events. Latency
    observations wait in a bounded deque; overflow is counted in
    ``tritonguard_metric_drops_total``, never blocks.
    """

    # the guard's families (tritonguard.core.catalogue, the one list of every exported metric)
    LATENCY_BUCKETS = catalogue.LATENCY_BUCKETS
    FAMILIES = catalogue.GUARD_COUNTERS
    ZERO_AT_LOAD = catalogue.GUARD_ZERO_AT_LOAD
    GAUGES = catalogue.GUARD_GAUGES

    def __init__(self, model: str, version: str, interval: float = 1.0, max_pending: int = 8192, *,
                 min_gap: float = 0.1,
                 counters: Mapping[str, tuple[str, str]] | None = None,
                 gauges: Mapping[str, tuple[str, str]] | None = None,
                 histograms: Mapping[str, tuple[str, str, Sequence[float]]] | None = None,
                 zero_at_load: Iterable[str | tuple[str, Mapping[str, str]]] | None = None):
        """Without the keyword arguments: the guard's families (``FAMILIES``, ``GAUGES``, the
        target latency histogram, ``ZERO_AT_LOAD``). Another backend passes its own instead:
        ``counters``/``gauges`` ``{key: (name, doc)}``, ``histograms`` ``{key: (name, doc,
        buckets)}``, ``zero_at_load`` keys or ``(key, labels)`` created at 0. The drops counter
        is always registered (the flusher reports queue overflow through it)."""
        import collections  # noqa: PLC0415
        import threading  # noqa: PLC0415

        counter_families = dict(self.FAMILIES) if counters is None else {"drops": self.FAMILIES["drops"], **counters}
        gauge_families = dict(self.GAUGES) if gauges is None else dict(gauges)
        histogram_families = dict(catalogue.GUARD_HISTOGRAMS) if histograms is None else dict(histograms)
        zeros = list(self.ZERO_AT_LOAD if zero_at_load is None else zero_at_load)
        self._buckets = {key: tuple(buckets) for key, (_, _, buckets) in histogram_families.items()}
        self.labels = {"model": model, "version": str(version)}
        self.interval = interval
        self.min_gap = min_gap
        self._children: dict[tuple, Any] = {}
        self._families: dict[str, Any] = {}
        self._counts: dict[tuple, float] = {}
        self._gauges: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self._observations: collections.deque = collections.deque(maxlen=max_pending)
        self._dropped = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the serving path's first event after a push
        self.enabled = True
        try:
            mf = backend.pb().MetricFamily
            for key, (name, doc) in counter_families.items():
                self._families[key] = mf(name, doc, mf.COUNTER)
            for key, (name, doc) in gauge_families.items():
                self._families[key] = mf(name, doc, mf.GAUGE)
            for key, (name, doc, _) in histogram_families.items():
                try:
                    self._families[key] = mf(name, doc, mf.HISTOGRAM)
                except (AttributeError, TypeError):
                    self._families[key] = None
        except Exception:  # noqa: BLE001 - metrics are optional, serving is not
            log.exception("custom metrics unavailable; serving without them")
            self.enabled = False
            return
        try:
            # counters without labels of their own start at 0, so a scrape (and an alert on
            # their increase) sees them before their first event
            for entry in zeros:
                key, labels = (entry, {}) if isinstance(entry, str) else entry
                self._child(key, tuple(sorted(labels.items())))
        except Exception:  # noqa: BLE001
            log.exception("custom metrics: zero series not created")
        self._thread = threading.Thread(target=self._run, name=f"metrics-{model}", daemon=True)
        self._thread.start()

    # -- hot path: no IPC ------------------------------------------------------------
    def inc(self, family: str, value: float = 1, **labels: str) -> None:
        if not self.enabled or value <= 0:
            return
        key = (family, *sorted(labels.items()))
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + value
        if not self._wake.is_set():  # an attribute read; the flusher does the IPC
            self._wake.set()

    def set(self, family: str, value: float, **labels: str) -> None:
        """A gauge's latest value; pushed by the flusher like the counters."""
        if not self.enabled:
            return
        key = (family, *sorted(labels.items()))
        with self._lock:
            self._gauges[key] = value
        if not self._wake.is_set():
            self._wake.set()

    def observe(self, family: str, value: float, **labels: str) -> None:
        if not self.enabled:
            return
        if len(self._observations) == self._observations.maxlen:
            self._dropped += 1  # a deque with maxlen would silently evict the oldest
            return
        self._observations.append((family, value, tuple(sorted(labels.items()))))
        if not self._wake.is_set():
            self._wake.set()

    # -- flusher thread --------------------------------------------------------------
    def _child(self, family: str, labels: tuple) -> Any:
        key = (family, *labels)
        child = self._children.get(key)
        if child is None:
            fam = self._families[family]
            all_labels = {**self.labels, **dict(labels)}
            buckets = self._buckets.get(family)
            if buckets is not None:
                child = fam.Metric(labels=all_labels, buckets=list(buckets))
            else:
                child = fam.Metric(labels=all_labels)
            self._children[key] = child
        return child

    def flush(self) -> None:
        with self._lock:
            counts, self._counts = self._counts, {}
            gauges, self._gauges = self._gauges, {}
        if self._dropped:
            counts[("drops",)] = counts.get(("drops",), 0) + self._dropped
            self._dropped = 0
        try:
            for (family, *labels), value in counts.items():
                self._child(family, tuple(labels)).increment(value)
            for (family, *labels), value in gauges.items():
                self._child(family, tuple(labels)).set(value)
            while self._observations:
                family, value, labels = self._observations.popleft()
                if self._families.get(family) is not None:
                    self._child(family, labels).observe(value)
        except Exception:  # noqa: BLE001
            log.exception("flushing metrics failed")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()  # an event from here on wakes the next round
            if self._stop.is_set():
                break  # close() pushes the rest
            self.flush()
            self._stop.wait(self.min_gap)  # events meanwhile are pushed together, next round

    def close(self) -> None:
        if self.enabled:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=5)  # one flusher at a time: children are made once
            self.flush()
