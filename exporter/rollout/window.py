"""One gated window of a rollout: the readers a look reads (every replica's metrics, the
exact latencies and the labels the guards keep in the state's store) and one look at a
window, judged by :func:`exporter.rollout.gates.evaluate.evaluate` since the window's baseline.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from exporter.rollout.gates.evaluate import evaluate
from exporter.rollout.gates.readings import GuardReadings, scrape
from exporter.rollout.gates.reasons import trip_reason
from exporter.rollout.gates.verdict import FAIL, GateReport
from exporter.rollout.progress import RolloutConfig
from tritonguard.rollout.feedback import LABEL, open_feedback_log, tally
from tritonguard.rollout.latency import open_latency_log
from tritonguard.rollout.state import RolloutState

log = logging.getLogger(__name__)

BREAKER_CODES = {"closed": 0, "half_open": 1, "open": 2}
WINDOW = ("baseline", "look", "reference", "last_report", "reason")  # one gated window's fields
Reader = Callable[[int, int], GuardReadings]  # (primary, candidate) -> readings
# (version, since) -> that version's exact per-call latencies since a wall-clock time
LatencyReader = Callable[[int, float], Any]
# (versions, since) -> their labelled rows answered since then (tritonguard.rollout.feedback.Tally)
LabelsReader = Callable[[Sequence[int], float], Any]


def _name_the_trip(report: GateReport, breaker: dict[str, Any] | None) -> None:
    """A failing breaker gate says why the breaker tripped (the figure against its limit), from
    the breaker document the guards share in the rollout state."""

    last = (breaker or {}).get("last_trip")
    if not last:
        return
    for g in report.gates:
        if g.name == "breaker" and g.verdict == FAIL:
            g.reason = f"{g.reason}; last trip {trip_reason(last)}"


def metrics_reader(urls: Sequence[str], model: str, *, target: str | None = None,
                   timeout: float = 5.0) -> Reader:
    """A reader scraping every Triton metrics URL (one per replica) and summing them."""
    def read(primary: int, candidate: int) -> GuardReadings:
        r = GuardReadings.from_scrapes([scrape(u, timeout) for u in urls], model, primary,
                                       candidate, target=target)
        r.taken_at = time.time()  # the guards stamp latency samples with wall-clock time too
        return r
    return read


def store_labels_reader(model: str, repo: str | os.PathLike) -> LabelsReader:
    """Labelled rows the guards of ``model`` recorded (labels sent with requests) and ``exporter
    feedback`` joined (labels that came later), from the state's store."""

    log_ = open_feedback_log(model, repo)

    def read(versions: Sequence[int], since: float) -> Any:
        return tally(log_.read(LABEL), versions, since=since)
    return read


def store_latency_reader(model: str, repo: str | os.PathLike) -> LatencyReader:
    """Exact per-call latencies the guards of ``model`` keep in the state's store (files beside
    the model, or Redis), every instance and replica together."""

    log_ = open_latency_log(model, repo)

    def read(version: int, since: float) -> Any:
        return log_.read(version, since=since)
    return read


def look(window: dict[str, Any], readings: GuardReadings, cfg: RolloutConfig, mode: str,
          latency: Callable[[float], tuple[Any, Any]] | None = None,
          share: float | None = None, trip: dict[str, Any] | None = None,
          labels: Any = None) -> GateReport | None:
    """One look at a window (the :data:`WINDOW` fields of a candidate's progress, or of one
    arm); None while only its start was taken (the first look) or retaken (a counter reset)."""
    if window["baseline"] is None:
        window["baseline"], window["reason"] = readings.to_dict(), "baseline taken"
        return None
    window["look"] += 1
    ref = {float(k): v for k, v in window["reference"].items()} if window["reference"] else None
    samples = None
    if latency is not None and mode == "split" and cfg.gates.latency:
        try:
            samples = latency(float(window["baseline"].get("taken_at", 0.0)))
        except Exception as exc:  # noqa: BLE001 - samples unavailable: the bucket gate judges
            log.warning("latency samples unavailable (%s: %s); judging histogram buckets", type(exc).__name__, exc)
    report = evaluate(GuardReadings.from_dict(window["baseline"]), readings, cfg.gates, look=window["look"],
                      mode=mode, primary_reference=ref, latency_samples=samples, share=share,
                      labels=labels)
    _name_the_trip(report, trip)
    window["last_report"], window["reason"] = report.to_dict(), report.summary()
    if report.reset:
        window["baseline"], window["look"] = readings.to_dict(), 0
        return None
    used = report.primary_latency
    if used and ref is None and max(used.values(), default=0) >= cfg.gates.min_latency_samples:
        window["reference"] = used
    return report


def breaker_from_state(readings: GuardReadings, state: RolloutState, candidate: int) -> None:
    # guards share tripped breakers through the state document: count them even when the
    # breaker gauge is missing or was scraped from a replica that has not seen the trip
    doc = state.breakers.get(str(candidate))
    if doc is not None:
        code = BREAKER_CODES.get(doc.get("state", "closed"), 2)
        readings.breaker_state = max(code, readings.breaker_state or 0)
