"""exporter.tune.session.perf_analyzer's retry policy. perf_analyzer's own failures depend on
the machine's load (CI failed once on 'No valid requests recorded within time interval' for a
freshly loaded model in a 500 ms window), so its replies are replayed here from what it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.tune import session
from exporter.tune.knobs import TuneError

ROW = {"Inferences/Second": "120.5", "p50 latency": "3000", "p99 latency": "9000"}
EMPTY = ("Failed to obtain stable measurement within 3 measurement windows for concurrency 4. "
         "Please try to increase the --measurement-interval.\nNo valid requests recorded within "
         "time interval. Please use a larger time window.")
UNSTABLE = "Failed to obtain stable measurement within 3 measurement windows for concurrency 4."


def _replay(monkeypatch, replies):
    calls = []

    def fake(url, model, concurrency, data, *, window_ms, trials, stability_pct, timeout):
        calls.append((window_ms, stability_pct))
        return replies[len(calls) - 1]

    monkeypatch.setattr(session, "perf_analyzer_run", fake)
    return calls


def test_an_empty_window_is_measured_again_four_times_longer(monkeypatch):
    calls = _replay(monkeypatch, [(None, EMPTY), (ROW, "ok")])
    stat = session.perf_analyzer("http://x", "digits", 4, Path("d.json"), window_ms=500, trials=3, stability_pct=30)
    assert calls == [(500, 30), (2000, 30)]
    assert (stat.throughput, stat.p50_ms, stat.p99_ms) == (120.5, 3.0, 9.0)


def test_an_unstable_window_drops_the_stability_bound(monkeypatch):
    calls = _replay(monkeypatch, [(None, UNSTABLE), (ROW, "ok")])
    session.perf_analyzer("http://x", "digits", 4, Path("d.json"), window_ms=500, trials=3, stability_pct=30)
    assert calls == [(500, 30), (500, 1000)]


def test_a_window_that_stays_empty_fails_with_perf_analyzers_line(monkeypatch):
    calls = _replay(monkeypatch, [(None, EMPTY)] * 4)
    with pytest.raises(TuneError, match="larger time window"):
        session.perf_analyzer("http://x", "digits", 4, Path("d.json"), window_ms=500, trials=3, stability_pct=30)
    assert [w for w, _ in calls] == [500, 2000, 8000]


def test_any_other_failure_is_not_retried(monkeypatch):
    calls = _replay(monkeypatch, [(None, "error: failed to get model metadata: model 'digits' not found")])
    with pytest.raises(TuneError, match="not found"):
        session.perf_analyzer("http://x", "digits", 4, Path("d.json"), window_ms=500, trials=3, stability_pct=30)
    assert len(calls) == 1
