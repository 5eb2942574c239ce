"""The guard's metrics pusher (tritonguard.triton.metrics.Metrics) against a stand-in for
python_backend's ``MetricFamily`` (the real one needs a running stub): what reaches Triton, and
when."""

from __future__ import annotations

import threading
import time

import pytest

from tritonguard.triton import backend
from tritonguard.triton.metrics import Metrics


class Family:
    """pb_utils.MetricFamily's surface; every push (an IPC to the server in a stub) is recorded."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    pushes: list[tuple[str, dict, str, float]] = []
    pushed = threading.Condition()

    def __init__(self, name, doc, kind):
        self.name = name

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
        family = self

        class Child:
            def _push(self, op, v):
                with Family.pushed:
                    Family.pushes.append((family.name, labels, op, v))
                    Family.pushed.notify_all()

            def increment(self, v):
                self._push("inc", v)

            def set(self, v):
                self._push("set", v)

            def observe(self, v):
                self._push("obs", v)

        return Child()


@pytest.fixture()
def family(monkeypatch):
    Family.pushes = []
    monkeypatch.setattr(backend, "pb", lambda: type("pb", (), {"MetricFamily": Family}))
    return Family


def wait_for(pred, timeout: float = 10.0) -> bool:
    """Bounded wait for a push the flusher thread makes."""
    deadline = time.monotonic() + timeout
    with Family.pushed:
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            Family.pushed.wait(left)
    return True


def requests_pushed() -> float:
    return sum(v for name, _, op, v in Family.pushes if name == "tritonguard_requests_total" and op == "inc")


def test_a_request_is_pushed_without_waiting_for_the_interval(family):
    """Issue 45: the README's metrics check, pasted right after its requests, read 0: the
    flusher pushed on a fixed tick. An event now wakes it; the 60 s interval never elapses here."""
    m = Metrics("digits", "1", interval=60.0, min_gap=0.0)
    try:
        m.inc("requests", 2)
        assert wait_for(lambda: requests_pushed() == 2), family.pushes
        m.inc("requests", 1)  # the next event after a push wakes it again
        assert wait_for(lambda: requests_pushed() == 3), family.pushes
        m.set("breaker_state", 2, target_version="1")
        assert wait_for(lambda: any(op == "set" and v == 2 for _, _, op, v in family.pushes)), family.pushes
    finally:
        m.close()


def test_a_busy_guard_pushes_at_most_once_per_min_gap_and_close_pushes_the_rest(family):
    m = Metrics("digits", "1", interval=60.0, min_gap=60.0)
    try:
        m.inc("requests", 1)
        assert wait_for(lambda: requests_pushed() == 1)
        for _ in range(50):  # all inside the 60 s rest after that push
            m.inc("requests", 1)
        assert not wait_for(lambda: requests_pushed() > 1, timeout=0.3)
    finally:
        m.close()
    assert requests_pushed() == 51
    assert not m._thread.is_alive()  # close() stopped the flusher before its own last push
