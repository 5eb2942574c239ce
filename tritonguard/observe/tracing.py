"""OpenTelemetry spans for the guard's stages, joined to Triton's own trace.

Off by default and then free: the guard holds no tracer and every hook is one ``is None`` test
per batch. With ``tracing.endpoint`` set, each ``execute()`` batch decides per request whether it
is traced:

- Triton traces it (``--trace-config mode=opentelemetry``; the client's W3C ``traceparent`` is
  honoured there): ``request.trace().get_context()`` names Triton's span for this model, and the
  guard's spans become its children, sampled as Triton sampled it;
- otherwise a ``traceparent`` request parameter (the header, forwarded by
  ``--http-header-forward-pattern``) is the parent, sampled as its flags say;
- otherwise ``tracing.sample_ratio`` of the requests start a trace of their own.

``tracing.follow_parent = false`` ignores both parents and samples every request by the ratio.

A traced request gets one ``tritonguard.guard.model`` span over the whole batch it rode in, with a
child per stage it went through (validate, tenancy, redact, cache lookup and one per tier, route,
one per target call, redact of outputs, respond, cache fill, audit) and, later, a
``tritonguard.compare`` span when the canary/shadow worker compares it. Stages work on whole
batches, so a stage span covers that stage's work for the batch (``tritonguard.batch_requests``
says how many requests shared it). Attributes name the tenant, served version, cache result and
tier, rejection rule; never an input or output value.

Spans are built as the SDK's ``ReadableSpan`` records and leave through a background thread and
the SDK's OTLP/HTTP JSON exporter — the encoding Triton's own exporter uses, accepted by the
OpenTelemetry Collector's ``otlp`` receiver. A full queue drops spans and counts them (``tritonguard_trace_spans_total``
``{outcome="dropped"}``); an unreachable collector costs the export thread a timeout, never the
serving path.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

GUARD_SPAN = "tritonguard.guard"
_HEX = set("0123456789abcdef")


@dataclass(kw_only=True)
class TracingConfig:
    """``tracing.*`` parameters of a guard."""

    endpoint: str = ""  # OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces; empty: off
    sample_ratio: float = 0.01  # requests without a parent that start a trace
    follow_parent: bool = True  # Triton's trace / a traceparent parameter decides when present
    service_name: str = "tritonguard"
    queue_size: int = 4096  # spans waiting for export; beyond, spans are dropped and counted
    export_timeout_ms: int = 2000
    flush_interval_ms: int = 1000

    def __post_init__(self) -> None:
        if self.endpoint and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"tracing.endpoint must be an http(s) URL of an OTLP/HTTP receiver "
                             f"(e.g. http://127.0.0.1:4318/v1/traces), got {self.endpoint!r}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"tracing.sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if self.queue_size < 1 or self.export_timeout_ms < 1 or self.flush_interval_ms < 1:
            raise ValueError("tracing.queue_size, tracing.export_timeout_ms and tracing.flush_interval_ms "
                             "must be >= 1")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


def parse_traceparent(value: Any) -> tuple[int, int, bool] | None:
    """W3C ``traceparent`` -> (trace id, parent span id, sampled); None when malformed."""
    if not isinstance(value, str):
        return None
    parts = value.strip().lower().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    version, trace_id, span_id, flags = parts[:4]
    if (len(trace_id) != 32 or len(span_id) != 16 or len(flags) != 2
            or not set(version + trace_id + span_id + flags) <= _HEX):
        return None
    tid, sid = int(trace_id, 16), int(span_id, 16)
    if tid == 0 or sid == 0 or (version == "00" and len(parts) != 4):
        return None
    return tid, sid, bool(int(flags, 16) & 1)


def triton_traceparent(request: Any) -> str | None:
    """The traceparent of Triton's span for ``request`` (python_backend's
    ``InferenceTrace.get_context()``: a JSON object), or None when Triton does not trace it."""
    try:
        raw = request.trace().get_context()
    except Exception:  # noqa: BLE001 - older stubs have no get_context; a mock has no trace()
        return None
    if not raw:
        return None
    try:
        ctx = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return None
    tp = ctx.get("traceparent") if isinstance(ctx, Mapping) else None
    return tp if isinstance(tp, str) else None


class _Export:
    """A bounded queue of finished spans and one daemon thread that sends them in batches.

    The SDK's tracer and batch processor cost ~36 µs per span on the serving thread here
    (sampler, attribute cleaning, locks, processor hooks): ~290 µs for one traced request. Spans
    built as ``ReadableSpan`` records cost ~2.4 µs each, so this module builds those itself and
    keeps the SDK's OTLP exporter for the wire. Past ``queue_size`` waiting spans, new ones are
    dropped and counted; every span's fate goes to ``tritonguard_trace_spans_total``.
    """

    def __init__(self, exporter: Any, config: TracingConfig, metrics: Any, name: str):
        from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: PLC0415

        self._ok = SpanExportResult.SUCCESS
        self._exporter = exporter
        self._metrics = metrics
        self.queue_size = config.queue_size
        self.batch = min(512, config.queue_size)
        self.interval = config.flush_interval_ms / 1000
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self.counts = {"exported": 0, "failed": 0, "dropped": 0}
        self._counts_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"tracing-{name}", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def put(self, spans: list[Any]) -> None:
        """Queue ``spans`` (never blocks; what does not fit is dropped and counted)."""
        room = self.queue_size - len(self._queue)
        if room < len(spans):
            dropped = len(spans) - max(room, 0)
            spans = spans[:max(room, 0)]
            self._count("dropped", dropped)
        if spans:
            self._queue.extend(spans)
            if len(self._queue) >= self.batch:
                with self._cond:
                    self._cond.notify()

    def _count(self, outcome: str, n: int) -> None:
        with self._counts_lock:  # drops come from the serving thread and the compare worker, the rest from ours
            self.counts[outcome] += n
        if self._metrics is not None:
            self._metrics.inc("trace_spans", n, outcome=outcome)

    def _send(self) -> None:
        while self._queue:
            chunk = []
            while self._queue and len(chunk) < self.batch:
                chunk.append(self._queue.popleft())
            try:
                ok = self._exporter.export(chunk) == self._ok
            except Exception:  # noqa: BLE001 - a broken collector costs spans, never the guard
                log.debug("tracing: export of %d spans failed", len(chunk), exc_info=True)
                ok = False
            self._count("exported" if ok else "failed", len(chunk))

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._stop:
                    self._cond.wait(self.interval)
                stop = self._stop
            self._send()
            if stop:
                return

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)
        try:
            self._exporter.shutdown()
        except Exception:  # noqa: BLE001
            log.debug("tracing: exporter shutdown failed", exc_info=True)


class Tracer:
    """One per guard process: the sampling decision, span records, export."""

    def __init__(self, config: TracingConfig, *, model: str, instance: str = "", metrics: Any = None,
                 exporter: Any = None, rng: random.Random | None = None):
        # imported here: a guard with tracing off never loads the SDK
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import ReadableSpan  # noqa: PLC0415
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # noqa: PLC0415
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags  # noqa: PLC0415

        self.config = config
        self.model = model
        self.rng = rng or random.Random()
        if exporter is None:
            from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

            exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_ms / 1000)
        self._span_context, self._readable, self._kind = SpanContext, ReadableSpan, SpanKind.INTERNAL
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        self._status, self._error = Status, StatusCode.ERROR
        self._resource = Resource.create({"service.name": config.service_name, "tritonguard.model": model,
                                          **({"service.instance.id": instance} if instance else {})})
        self._scope = InstrumentationScope("tritonguard")
        self.export = _Export(exporter, config, metrics, model)

    # -- sampling -------------------------------------------------------------------------
    def parent_of(self, request: Any, params: Mapping[str, Any]) -> tuple[bool, Any]:
        """(traced?, parent SpanContext or None for a new trace) for one request."""
        if self.config.follow_parent:
            tp = triton_traceparent(request) or params.get("traceparent")
            parsed = parse_traceparent(tp) if tp else None
            if parsed is not None:
                tid, sid, sampled = parsed
                if not sampled:
                    return False, None
                return True, self._span_context(trace_id=tid, span_id=sid, is_remote=True, trace_flags=self._flags)
        ratio = self.config.sample_ratio
        return (ratio > 0 and self.rng.random() < ratio), None

    def begin(self, requests: Sequence[Any], params: Sequence[Mapping[str, Any]], t0_ns: int, p0_ns: int
              ) -> BatchTrace | None:
        """The traced requests of one batch (None when none is: the usual case at low ratios)."""
        sampled: dict[int, Span] = {}
        for i, r in enumerate(requests):
            traced, parent = self.parent_of(r, params[i])
            if traced:
                sampled[i] = self.start(GUARD_SPAN, parent, t0_ns)
        return BatchTrace(self, sampled, len(requests), t0_ns, p0_ns) if sampled else None

    # -- spans ------------------------------------------------------------------------------
    def _span_id(self) -> int:
        return self.rng.getrandbits(64) or 1

    def start(self, name: str, parent: Any, start_ns: int) -> Span:
        """A span under ``parent`` (a SpanContext; None: the root of a new trace)."""
        trace_id = parent.trace_id if parent is not None else (self.rng.getrandbits(128) or 1)
        ctx = self._span_context(trace_id=trace_id, span_id=self._span_id(), is_remote=False, trace_flags=self._flags)
        return Span(name, ctx, parent, start_ns)

    def record(self, span: Span, end_ns: int, attributes: Mapping[str, Any], error: str | None = None) -> Any:
        status = self._status(self._error, error) if error else None
        return self._readable(name=span.name, context=span.context, parent=span.parent, resource=self._resource,
                              attributes=dict(attributes), kind=self._kind, status=status,
                              start_time=span.start_ns, end_time=end_ns, instrumentation_scope=self._scope)

    def child(self, parent: Span, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any],
              error: str | None = None) -> tuple[Span, Any]:
        span = self.start(name, parent.context, start_ns)
        return span, self.record(span, end_ns, attributes, error)

    def compared(self, tokens: Sequence[Span], kind: str, version: int, start_ns: int, end_ns: int,
                 verdict: str | None) -> None:
        """A canary/shadow comparison of traced requests (called by the router's worker)."""
        attrs = {"tritonguard.compare.kind": kind, "tritonguard.target_version": str(version)}
        if verdict:
            attrs["tritonguard.compare.verdict"] = verdict
        try:
            self.export.put([self.child(span, "tritonguard.compare", start_ns, end_ns, attrs)[1] for span in tokens])
        except Exception:  # noqa: BLE001 - tracing never fails a comparison
            log.debug("tracing: compare spans not recorded", exc_info=True)

    def close(self, timeout_s: float = 2.0) -> None:
        try:
            self.export.close(timeout_s)
        except Exception:  # noqa: BLE001 - shutdown must not hang or raise in finalize()
            log.warning("tracing: shutdown failed", exc_info=True)


@dataclass(slots=True)
class Span:
    """A span being built: its ids and start; it becomes a ``ReadableSpan`` when recorded."""

    name: str
    context: Any  # SpanContext
    parent: Any  # SpanContext or None
    start_ns: int


class BatchTrace:
    """What one batch's traced requests went through; spans are built in :meth:`finish`."""

    def __init__(self, tracer: Tracer, sampled: dict[int, Span], n: int, t0_ns: int, p0_ns: int):
        self.tracer = tracer
        self.sampled = sampled  # request index -> its tritonguard.guard.model Span
        self.n = n
        self.t0_ns = t0_ns
        self._offset = t0_ns - p0_ns  # perf_counter_ns -> epoch ns
        self.marks: list[tuple[str, int, dict[str, Any]]] = []  # (stage, end ns, attrs); starts at the last end
        self.left_at: dict[int, str] = {}  # request -> stage where it was answered or refused
        self.errors: dict[int, tuple[str, str]] = {}  # request -> (rule or code, message)
        self.attrs: dict[int, dict[str, Any]] = {}
        self.calls: list[tuple[int, list[int], int, int, bool]] = []  # router.calls, request indices
        self.cache_tiers: list[tuple[str, int, int, int, int]] = []  # tier, start, end, hits, misses

    def epoch(self, perf_ns: int) -> int:
        return perf_ns + self._offset

    def mark(self, stage: str, **attrs: Any) -> None:
        self.marks.append((stage, time.time_ns(), attrs))

    def left(self, i: int, stage: str, rule: str = "", message: str = "") -> None:
        if i in self.sampled and i not in self.left_at:
            self.left_at[i] = stage
            if rule:
                self.errors[i] = (rule, message)

    def set(self, i: int, **attrs: Any) -> None:
        if i in self.sampled:
            self.attrs.setdefault(i, {}).update(attrs)

    def finish(self, end_ns: int | None = None) -> None:
        end_ns = end_ns or time.time_ns()
        base = {"tritonguard.model": self.tracer.model, "tritonguard.batch_requests": self.n}
        spans: list[Any] = []
        for i, guard_span in self.sampled.items():
            try:
                self._finish_one(i, guard_span, base, end_ns, spans)
            except Exception:  # noqa: BLE001 - tracing never fails a request
                log.debug("tracing: spans of one request not recorded", exc_info=True)
        self.tracer.export.put(spans)

    def _finish_one(self, i: int, guard_span: Span, base: dict[str, Any], end_ns: int, out: list[Any]) -> None:
        t = self.tracer
        stop = self.left_at.get(i)
        start = self.t0_ns
        for stage, end, attrs in self.marks:
            end = max(end, start)
            err = self.errors.get(i) if stage == stop else None
            span, rec = t.child(guard_span, f"tritonguard.{stage}", start, end, {**base, **attrs},
                                error=err[0] if err else None)
            out.append(rec)
            if stage == "route":  # the target calls this request rode in, under the route span
                for version, idx, s, e, ok in self.calls:
                    if i in idx:
                        out.append(t.child(span, "tritonguard.target", self.epoch(s), self.epoch(e),
                                           {"tritonguard.target_version": str(version),
                                            "tritonguard.call_requests": len(idx), "tritonguard.ok": ok},
                                           error=None if ok else "target call failed")[1])
            elif stage == "cache.lookup":  # one span per tier asked, under the lookup span
                for tier, s, e, hits, misses in self.cache_tiers:
                    out.append(t.child(span, f"tritonguard.cache.{tier}", self.epoch(s), self.epoch(e),
                                       {"tritonguard.cache.tier": tier, "tritonguard.cache.hits": hits,
                                        "tritonguard.cache.misses": misses})[1])
            start = end
            if stage == stop:
                break
        attrs = {**base, **self.attrs.get(i, {})}
        err = self.errors.get(i)
        if err is not None:
            attrs["tritonguard.reject_rule"] = err[0]
        out.append(t.record(guard_span, end_ns, attrs, error=(err[1] or err[0]) if err else None))


__all__ = ["TracingConfig", "Tracer", "BatchTrace", "Span", "parse_traceparent", "triton_traceparent", "GUARD_SPAN"]
