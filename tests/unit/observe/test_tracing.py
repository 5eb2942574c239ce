"""Guard tracing without Triton: the real OpenTelemetry SDK and OTLP/HTTP JSON exporter, sending
to a real loopback receiver (tests/otlp.py). Sampling, parents, the span tree of a batch, canary
comparison spans from the real Router, and what happens when the collector is gone."""

from __future__ import annotations

import json
import random
import socket
import time

import numpy as np
import pytest

from tests.otlp import Receiver
from tests.unit.guard.routing.test_router import W1, W2, Linear, Metrics, drain, make, rows
from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.observe.tracing import (
    GUARD_SPAN,
    Tracer,
    TracingConfig,
    parse_traceparent,
    triton_traceparent,
)

TRACE = "0af7651916cd43dd8448eb211c13ab11"
PARENT = "b7ad6b7169203331"


class Trace:
    def __init__(self, ctx):
        self.ctx = ctx

    def get_context(self):
        return self.ctx


class Request:
    """What the guard reads of a pb_utils request for tracing: ``trace().get_context()``."""

    def __init__(self, traceparent=None):
        self._ctx = json.dumps({"traceparent": traceparent}) if traceparent else ""

    def trace(self):
        return Trace(self._ctx)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "t").mkdir(parents=True)
    return r


@pytest.fixture
def receiver():
    with Receiver() as r:
        yield r


def tracer_for(receiver_or_url, ratio=0.0, **kw):
    url = receiver_or_url if isinstance(receiver_or_url, str) else receiver_or_url.url
    cfg = TracingConfig(endpoint=url, sample_ratio=ratio, flush_interval_ms=50, export_timeout_ms=500, **kw)
    return Tracer(cfg, model="digits", instance="digits_0_0", metrics=Metrics(), rng=random.Random(7))


def test_traceparent_parsing_follows_w3c():
    assert parse_traceparent(f"00-{TRACE}-{PARENT}-01") == (int(TRACE, 16), int(PARENT, 16), True)
    assert parse_traceparent(f"00-{TRACE}-{PARENT}-00")[2] is False
    assert parse_traceparent(f"00-{TRACE.upper()}-{PARENT}-01") is not None
    for bad in ("", "garbage", f"00-{TRACE}-{PARENT}", f"00-{'0' * 32}-{PARENT}-01", f"00-{TRACE}-{'0' * 16}-01",
                f"ff-{TRACE}-{PARENT}-01", f"00-{TRACE[:-1]}x-{PARENT}-01", f"00-{TRACE}-{PARENT}-01-extra", None, 7):
        assert parse_traceparent(bad) is None, bad
    # a future version may append fields
    assert parse_traceparent(f"01-{TRACE}-{PARENT}-01-extra") is not None


def test_triton_context_is_read_from_the_request_trace():
    assert triton_traceparent(Request(f"00-{TRACE}-{PARENT}-01")) == f"00-{TRACE}-{PARENT}-01"
    assert triton_traceparent(Request()) is None  # Triton does not trace it
    assert triton_traceparent(object()) is None  # a stub without trace(): never an error


def test_config_is_checked_with_the_key_named():
    assert not TracingConfig().enabled
    with pytest.raises(ConfigError, match="tracing.sample_ratio"):
        from_params(TracingConfig, {"endpoint": "http://127.0.0.1:4318/v1/traces", "sample_ratio": "1.5"},
                    section="tracing", model="m")
    with pytest.raises(ConfigError, match="tracing.endpoint"):
        from_params(TracingConfig, {"endpoint": "127.0.0.1:4318"}, section="tracing", model="m")
    with pytest.raises(ConfigError, match="queue_sise"):
        from_params(TracingConfig, {"queue_sise": "5"}, section="tracing", model="m")


def test_sampling_follows_the_parent_and_the_ratio(receiver):
    t = tracer_for(receiver, ratio=0.05)
    try:
        sampled_parent = t.parent_of(Request(f"00-{TRACE}-{PARENT}-01"), {})
        assert sampled_parent[0] is True
        assert (sampled_parent[1].trace_id, sampled_parent[1].span_id) == (int(TRACE, 16), int(PARENT, 16))
        assert t.parent_of(Request(f"00-{TRACE}-{PARENT}-00"), {}) == (False, None)
        # a forwarded traceparent header stands in when Triton does not trace the request
        assert t.parent_of(Request(), {"traceparent": f"00-{TRACE}-{PARENT}-01"})[0] is True
        # no parent: the ratio; 20,000 draws at 5 % land within 5 sigma of 1,000
        n = sum(t.parent_of(Request(), {})[0] for _ in range(20000))
        assert abs(n - 1000) < 5 * (20000 * 0.05 * 0.95) ** 0.5
    finally:
        t.close()
    t = tracer_for(receiver, ratio=0.0, follow_parent=False)
    try:
        assert t.parent_of(Request(f"00-{TRACE}-{PARENT}-01"), {}) == (False, None)
    finally:
        t.close()


def _batch(t, requests, params=None):
    t0, p0 = time.time_ns(), time.perf_counter_ns()
    return t.begin(requests, params or [{} for _ in requests], t0, p0)


def test_a_batch_becomes_a_span_tree_under_tritons_span(receiver):
    t = tracer_for(receiver, ratio=0.0)
    reqs = [Request(f"00-{TRACE}-{PARENT}-01"), Request(), Request(f"00-{'1' * 32}-{PARENT}-01")]
    tb = _batch(t, reqs)
    assert set(tb.sampled) == {0, 2}  # the middle one has no parent and the ratio is 0
    tb.marks.append(("validate", time.time_ns(), {}))
    tb.left(2, "validate", "range", "input 'IMAGE' holds 99.0 > 16")
    tb.mark("tenancy")
    p = time.perf_counter_ns()
    tb.cache_tiers.append(("l1", p, p + 1000, 0, 2))
    tb.mark("cache.lookup")
    p2 = time.perf_counter_ns()
    tb.calls = [(1, [0, 1], p2, p2 + 50_000, True)]
    tb.mark("route")
    tb.set(0, **{"tritonguard.tenant": "acme", "tritonguard.served_by": "digits_raw:1"})
    tb.mark("respond")
    tb.finish()
    t.close()

    spans = receiver.wait_for(lambda s: len(s) >= 10)
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    guards = {s["trace_id"]: s for s in by_name[GUARD_SPAN]}
    assert set(guards) == {TRACE, "1" * 32}
    ok, rejected = guards[TRACE], guards["1" * 32]
    assert ok["parent_id"] == PARENT and rejected["parent_id"] == PARENT
    assert ok["service"] == "tritonguard" and ok["resource"]["tritonguard.model"] == "digits"
    assert ok["attributes"]["tritonguard.tenant"] == "acme"
    assert ok["attributes"]["tritonguard.served_by"] == "digits_raw:1"
    assert ok["attributes"]["tritonguard.batch_requests"] == 3
    kids = sorted(s["name"] for s in spans if s["parent_id"] == ok["span_id"])
    assert kids == sorted(["tritonguard.validate", "tritonguard.tenancy", "tritonguard.cache.lookup",
                           "tritonguard.route", "tritonguard.respond"])
    route = next(s for s in spans if s["parent_id"] == ok["span_id"] and s["name"] == "tritonguard.route")
    lookup = next(s for s in spans if s["parent_id"] == ok["span_id"] and s["name"] == "tritonguard.cache.lookup")
    [target] = [s for s in spans if s["parent_id"] == route["span_id"]]
    assert [s["name"] for s in spans if s["parent_id"] == lookup["span_id"]] == ["tritonguard.cache.l1"]
    assert target["attributes"]["tritonguard.target_version"] == "1" and target["end"] - target["start"] == 50_000
    # stages tile the guard span in order
    stages = sorted((s for s in spans if s["parent_id"] == ok["span_id"] and s["name"] in
                     ("tritonguard.validate", "tritonguard.tenancy", "tritonguard.cache.lookup",
                      "tritonguard.route", "tritonguard.respond")), key=lambda s: s["start"])
    assert [s["name"].split(".", 1)[1] for s in stages] == ["validate", "tenancy", "cache.lookup", "route", "respond"]
    assert stages[0]["start"] == ok["start"] and all(a["end"] == b["start"] for a, b in zip(stages, stages[1:], strict=False))
    assert ok["end"] >= stages[-1]["end"]
    # the rejected request stopped at validation: one child, an error status naming the rule
    assert [s["name"] for s in spans if s["parent_id"] == rejected["span_id"]] == ["tritonguard.validate"]
    assert rejected["attributes"]["tritonguard.reject_rule"] == "range"
    assert rejected["status"].get("code") in (2, "STATUS_CODE_ERROR")
    assert t.export.counts["exported"] == len(spans) and t.export.counts["dropped"] == 0


def test_canary_comparisons_of_traced_requests_get_spans(repo, receiver):
    """The real Router: a traced request served by the candidate is compared in the worker, and
    that comparison is a child span of its guard span, with kind and version."""
    t = tracer_for(receiver, ratio=1.0)
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W2)}, candidate=2, share=1.0)
    router.tracer = t
    try:
        tb = _batch(t, [Request(), Request()])
        assert set(tb.sampled) == {0, 1}
        routed = router.infer({"X": rows(2)}, [1, 1], traced=dict(tb.sampled))
        assert routed.served_by == ["t:2", "t:2"]
        assert [c[0] for c in router.calls] == [2] and router.calls[0][1] == [0, 1] and router.calls[0][4]
        tb.calls = list(router.calls)
        tb.mark("route")
        tb.finish()
        drain(router)
    finally:
        router.close()
        t.close()
    spans = receiver.wait_for(lambda s: sum(x["name"] == "tritonguard.compare" for x in s) >= 2)
    guards = {s["span_id"] for s in spans if s["name"] == GUARD_SPAN}
    compares = [s for s in spans if s["name"] == "tritonguard.compare"]
    assert len(compares) == 2 and {s["parent_id"] for s in compares} == guards
    assert all(s["attributes"]["tritonguard.compare.kind"] == "canary" for s in compares)
    assert all(s["attributes"]["tritonguard.target_version"] == "2" for s in compares)
    assert all(s["attributes"].get("tritonguard.compare.verdict") for s in compares)


def test_untraced_batches_queue_no_comparison_spans(repo):
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W2)}, candidate=2, share=1.0)
    router.worker.stop(timeout=5)  # the worker stops, so the queued job can be looked at
    try:
        router.infer({"X": rows(2)}, [1, 1])
        # the job carries no span list: the worker takes the untraced path
        job = router.worker.jobs.get(timeout=2)
        assert len(job) == 5
    finally:
        router.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_unreachable_collector_costs_dropped_spans_not_requests():
    """No collector: spans beyond the queue are dropped and counted at once; export failures
    are counted by the export thread; building spans never raises."""
    t = tracer_for(f"http://127.0.0.1:{_closed_port()}/v1/traces", ratio=1.0, queue_size=20)
    try:
        for _ in range(10):
            tb = _batch(t, [Request() for _ in range(8)])
            tb.marks.append(("validate", time.time_ns(), {}))
            tb.finish()
        c = t.export.counts
        assert c["dropped"] > 0 and t.export.pending <= 20
        deadline = time.monotonic() + 10
        while c["failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c["failed"] > 0
    finally:
        t.close(timeout_s=5.0)
    # every span accounted for: 10 batches of 8 guard spans + 8 validate spans
    assert sum(c.values()) + t.export.pending == 160 and c["exported"] == 0
    assert t.export._metrics.total("trace_spans", outcome="dropped") == c["dropped"]
    assert t.export._metrics.total("trace_spans", outcome="failed") == c["failed"]


def test_no_input_values_in_any_attribute(receiver):
    """Attributes are names, ids and counts: a request's tensor values never reach a span."""
    t = tracer_for(receiver, ratio=1.0)
    x = np.random.default_rng(3).integers(0, 17, size=(1, 64)).astype(np.float32)
    tb = _batch(t, [Request()], [{"label": "7"}])
    tb.marks.append(("validate", time.time_ns(), {}))
    tb.set(0, **{"tritonguard.tenant": "acme"})
    tb.finish()
    t.close()
    spans = receiver.wait_for(lambda s: len(s) >= 2)
    text = json.dumps([s["attributes"] for s in spans])
    assert "acme" in text
    for v in x.ravel()[:16]:
        assert f"{v:.1f}" not in text
