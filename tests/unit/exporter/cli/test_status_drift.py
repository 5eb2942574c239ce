"""status: an input drift share says what it means and what to do (issue 45 item 6: "input drift
v1: 64 % of features" with no hint after a benchmark's traffic)."""

from __future__ import annotations

from rich.console import Console

from exporter.cli.status import print_live


def _shown(drift: dict[str, float]) -> str:
    st = {"revision": 2, "primary": {"version": 1}, "candidate": None, "shadow_share": 0.0,
          "fallback": ["candidate", "primary"], "breakers": {}}
    met = {"replicas": 1, "served": {"m_raw:1": 50}, "breaker": {}, "drift": drift, "errors": {}, "unreachable": []}
    console = Console(record=True, width=100)
    print_live(console, [{"model": "m", "target": "m_raw", "state": st, "stages": None, "rollout": None,
                          "metrics": met}])
    return console.export_text()


def test_a_drift_share_comes_with_its_meaning_and_what_to_do():
    line = next(ln for ln in _shown({"1": 0.64}).splitlines() if "input drift" in ln)  # soft wrap: one line
    assert line.strip().startswith("input drift v1: 64% of features whose live values are unlike the data"), line
    assert "benchmark" in line and "retrain" in line, line
    calm = next(ln for ln in _shown({"1": 0.0}).splitlines() if "input drift" in ln)
    assert calm.strip() == "input drift v1: 0% of features", calm  # nothing drifts: no advice
