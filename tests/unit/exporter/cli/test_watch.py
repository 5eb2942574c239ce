"""``status --watch``: rates between two readings of the replicas' counters, and the view drawn
from them (tests/functional/test_monitoring.py runs it against a live server)."""

from __future__ import annotations

import io

from rich.console import Console

from exporter.cli.watch import cost_per_1k, rates, view


def _cost(cost: float, requests: float) -> dict:
    return {"cost": cost, "guard_s": 0.0, "target_s": 0.0, "requests": requests, "recent": []}


def _reading(requests: float, **served: float) -> dict:
    # v1's requests cost 2e-5 each, split over two tenants
    cost = {"1": {"acme": _cost(requests * 1e-5, requests / 2), "beta": _cost(requests * 1e-5, requests / 2)}}
    return {"replicas": 1, "breaker": {"1": 0, "2": 2}, "drift": {"1": 0.25}, "errors": {}, "unreachable": [],
            "requests": requests, "rejects": {"range": requests / 10}, "fallbacks": {}, "served": served,
            "cost": cost}


def test_rates_are_per_second_between_readings():
    r = rates(_reading(100, **{"m_raw:1": 90}), _reading(300, **{"m_raw:1": 250, "m_raw:2": 20}), 10.0)
    assert r["requests"] == 20.0
    assert r["rejects"] == {"range": 2.0}
    # m_raw:2 has no earlier reading: its counter was created since, so it counts from 0
    assert r["served"] == {"m_raw:1": 16.0, "m_raw:2": 2.0}


def test_cost_per_1k_is_over_the_interval_and_all_tenants():
    assert cost_per_1k(_reading(100), _reading(300)) == {"1": 1000 * 200 * 2e-5 / 200}
    # a version first seen since the earlier reading counts from 0; one with no new request: unknown
    later = _reading(300)
    later["cost"]["cache"] = {"acme": _cost(0.001, 50)}
    got = cost_per_1k(_reading(300), later)
    assert got["1"] is None and abs(got["cache"] - 0.02) < 1e-12
    assert cost_per_1k(None, _reading(100)) == {"1": None}


def test_first_reading_and_a_restarted_replica_have_no_rate():
    assert rates(None, _reading(100), 2.0)["requests"] is None
    # a counter that went down: the replica restarted, the rate is unknown, not negative
    assert rates(_reading(500), _reading(40), 2.0)["requests"] is None


def test_view_shows_routing_rollout_breakers_and_rates():
    guard = {"model": "m", "target": "m_raw",
             "state": {"primary": {"version": 1}, "candidate": {"version": 2, "share": 0.25}, "arms": [],
                       "shadow_share": 0.0, "breakers": {}},
             "rollout": {"status": "running", "step": 2, "steps": [0.05, 0.25, 1.0], "share": 0.25, "look": 3,
                         "arms": {}, "gates": [{"name": "errors", "verdict": "PASS", "samples": 812}]},
             "metrics": {**_reading(300), "unreachable": ["http://b:8002/metrics: connection refused"]}}
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(view([guard], {"m": rates(_reading(100), _reading(300), 10.0)}, servers=["a:8000", "b:8000"],
                       interval=2.0, taken="12:00:00"))
    text = console.export_text()
    for shown in ("primary v1", "candidate v2 25%", "running step 2/3 25%", "errors PASS (812)",
                  "v1 closed", "v2 open", "20.0", "range 2.0", "v1 25%", "v1 0.02", "cost/1k: priced cost",
                  "unreachable http://b:8002/metrics: connection refused"):
        assert shown in text, f"{shown!r} not in\n{text}"
