"""The dashboard and the alert rules query what a live tritonserver really exports.

Triton shows a metric family only once it has a series, so traffic comes first: an answered
request, a rejected one and one whose target is missing (a target error, then the chain's end).
Families that need rarer events (a breaker trip, drift, a cache tier) are checked against the
families the guard declares, and that declaration against what this server exports."""

from __future__ import annotations

import io
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from rich.console import Console
from tritonclient.utils import InferenceServerException

from exporter.cli.watch import watch
from exporter.rollout.gates.readings import parse
from tests.functional.test_serving import http_input
from tests.unit.test_prometheus_rules import declared_families, family, named_metrics

pytestmark = pytest.mark.functional

FLUSH_S = 10.0  # the guard pushes its counters every second; a loaded machine may take longer
# what the traffic below must make the guard export
AFTER_TRAFFIC = {"tritonguard_requests_total", "tritonguard_rejects_total", "tritonguard_served_total",
                 "tritonguard_target_errors_total", "tritonguard_fallbacks_total",
                 "tritonguard_target_latency_seconds_bucket", "tritonguard_breaker_state"}


def _exported(server) -> set[str]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return {name for name, _ in parse(text)}


@pytest.fixture(scope="module")
def exported(server, http) -> set[str]:
    """Sample names on the metrics port after an answered, a rejected and a failed request."""
    http.infer("digits", [http_input("IMAGE", np.zeros((1, 8, 8), np.float32))])
    with pytest.raises(InferenceServerException, match="violates range"):
        http.infer("digits", [http_input("IMAGE", np.full((1, 8, 8), 99, np.float32))])
    with pytest.raises(InferenceServerException, match="no_such_model"):
        http.infer("orphan", [http_input("IMAGE", np.ones((1, 8, 8), np.float32))])
    deadline = time.monotonic() + FLUSH_S
    while not AFTER_TRAFFIC <= (names := _exported(server)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return names


def test_traffic_made_its_series(exported):
    assert AFTER_TRAFFIC - exported == set()


def test_every_queried_metric_is_exported(exported):
    named = named_metrics()
    live = named & exported
    # Triton's own metrics, and the guard's that this traffic made: queried and on this server, now
    assert {m for m in named if m.startswith("nv_")} - live == set(), "Triton does not export these"
    assert AFTER_TRAFFIC - live == set()
    # the rest appear with their first event; the guard declares each of them
    assert {family(m) for m in named - live} - declared_families() == set()


def test_declared_families_are_what_the_server_exports(exported):
    """The declaration the rest is checked against is the server's truth, not a stale copy."""
    guard = {family(m) for m in exported if m.startswith("tritonguard_")}
    assert guard, "the guard exports nothing"
    assert guard - declared_families() == set(), "exported but not declared in tritonguard.core.catalogue"


def test_watch_shows_routing_breakers_and_live_rates(server, test_repo, exported):
    """Two readings of ``status --watch`` while digits takes traffic: its primary, its breaker
    from the metrics port, and a request rate measured between the readings."""
    stop = threading.Event()

    def traffic() -> None:
        with httpclient.InferenceServerClient(server.http_url) as c:
            while not stop.is_set():
                c.infer("digits", [http_input("IMAGE", np.zeros((2, 8, 8), np.float32))])

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    console = Console(record=True, width=200, file=io.StringIO())
    try:
        watch(console, test_repo, [server.http_url], [server.metrics_url], interval=3.0, readings=2)
    finally:
        stop.set()
        sender.join(timeout=30)
    text = console.export_text()
    assert text.count("cost/1k: priced cost") == 2, text  # not a terminal: each reading printed
    text = text[text.rindex("tritonguard "):]  # the second reading
    rows = [line.strip() for line in text.splitlines() if line.strip().startswith("digits ")]
    assert len(rows) == 2, text  # its routing row, its traffic row
    assert re.match(r"digits\s+primary v1\s+none\s+v1 closed$", rows[0]), text
    # a rate, not "…" (one reading) nor 0 (no traffic between the readings)
    m = re.match(r"digits\s+(\d+\.\d)\s", rows[1])
    assert m and float(m.group(1)) > 0, text
    # the last column: v1's cost of 1000 requests over the interval, a positive figure (default prices)
    c = re.search(r"\bv1 ([0-9.]+(?:e-\d+)?)$", rows[1])
    assert c and float(c.group(1)) > 0, text
