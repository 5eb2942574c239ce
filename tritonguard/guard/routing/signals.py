"""What the router learns from serving, and what it tells: each call's outcome fed to its
version's breaker (errors, NaN/Inf, fused failures, latency, and a candidate's latency against the
primary's in the same process), the primary's input drift, and alerts (webhook or callable) on
golden failures, trips and drift. Nothing here blocks the serving path: trips are stored and
drift is scored by the comparison worker."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.guard.routing.breakers import Breakers
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.routing.view import RolloutView
from tritonguard.rollout.breaker import CLOSED, Breaker
from tritonguard.rollout.drift import REFERENCE_FILE, DriftMonitor, ReferenceSummary, featurize
from tritonguard.rollout.validators import AlertDispatcher, load_callable

log = logging.getLogger(__name__)


class Alerts:
    """Alert events (a webhook POST and/or a callable), fired off the serving path."""

    def __init__(self, *, guard: str, target: str, config: RoutingConfig, clock: Callable[[], float]):
        self.guard, self.target, self.clock = guard, target, clock
        self.dispatcher = AlertDispatcher(
            [load_callable(config.alert_callable)] if config.alert_callable else [], config.alert_webhook)

    def __call__(self, kind: str, version: int | None, figures: dict[str, Any]) -> None:
        if self.dispatcher.callables or self.dispatcher.webhook_url:
            self.dispatcher.fire({"event": kind, "guard": self.guard, "target": self.target, "version": version,
                                  "figures": figures, "at": self.clock()})

    def flush(self, timeout: float = 1.0) -> None:
        self.dispatcher.flush(timeout=timeout)


class Signals:
    def __init__(self, *, guard: str, repo: Path, target: str, config: RoutingConfig, min_requests: int,
                 view: RolloutView, breakers: Breakers, metrics: Any, alert: Alerts,
                 submit: Callable[[tuple], bool], clock: Callable[[], float]):
        self.guard, self.repo, self.target, self.config = guard, repo, target, config
        self.min_requests, self.view, self.breakers, self.metrics = min_requests, view, breakers, metrics
        self.alert, self.submit, self.clock = alert, submit, clock
        self._drift_lock = threading.Lock()
        self._input_drift: tuple[int, DriftMonitor | None] | None = None
        self._last_drift_score = 0.0
        self._drift_flagged: dict[int, bool] = {}  # per version: flagged at the last scoring

    # -- breakers ---------------------------------------------------------------------------
    def record(self, version: int, n: int, *, errors: int = 0, non_finite: int = 0, latency_ms: float | None = 0.0,
               verdicts: Any = (), fused: int = 0) -> None:
        """``n`` requests of one call to ``version`` and how it went."""
        now = self.clock()
        with self.breakers.lock:
            b = self.breakers.get(version)
            trip = b.record_batch(now, n, errors=errors, non_finite=non_finite,
                                  latency_ms=None if fused else latency_ms, verdicts=verdicts, fused=fused)
            if trip is None:
                trip = self.latency_vs_primary(version, b, now)
            shared = b.to_dict() if trip else None
        if trip is not None:
            self.breakers.tripped(version, trip)
            self.submit(("breaker", version, shared))

    def latency_vs_primary(self, version: int, b: Breaker, now: float) -> Any:
        """A trip when ``version`` (under test) is slower than the primary by more than
        ``routing.latency_ratio`` at its p95 and half that at its median; None otherwise, and
        None while the primary serves no requests (a 100 % step: nothing at the same load)."""
        ratio = self.config.latency_ratio
        if ratio <= 0 or version not in self.view.experiments() or b.state != CLOSED or b.shielded(now):
            return None
        if self.view.call_share(version) < self.config.latency_min_share:
            return None  # cache-cold at this share: its latency would blame the version for its share
        if self.view.primary_share() <= 0:
            # at 100 % the primary serves nothing: its window holds calls from an earlier, lighter
            # step, and a genuine retrain read 2.38x of it at load 15 and was rolled back (the 200k
            # stream scenario, 2026-11-28). The rollout's latency gate skips this step too
            return None
        need = max(self.min_requests, 50)  # p95 of fewer is one outlier
        primary = self.breakers.get(self.view.primary())
        c95 = b.latency_p95(need)
        p95 = primary.latency_p95(need)
        if c95 is None or p95 is None or c95 <= ratio * p95:
            return None
        # A few slow calls (a scheduling hiccup on a busy host) can double a sub-millisecond p95
        # on their own: a good candidate measured 1.77x the primary's p95 once in CI. A slower
        # version is slower on most calls, so its median must have moved too, at least half as far.
        c50, p50 = b.latency_quantile(0.5, need), primary.latency_quantile(0.5, need)
        if c50 is None or p50 is None or c50 <= (1 + (ratio - 1) / 2) * p50:
            return None
        return b.trip(now, "latency", {"p95_ms": c95, "primary_p95_ms": p95, "ratio": c95 / p95, "max_ratio": ratio,
                                       "p50_ms": c50, "primary_p50_ms": p50})

    # -- input drift ------------------------------------------------------------------------
    def _drift_monitor(self, version: int) -> DriftMonitor | None:
        if self._input_drift is None or self._input_drift[0] != version:
            path = self.repo / self.target / str(version) / REFERENCE_FILE
            monitor = None
            if path.exists():
                try:
                    monitor = DriftMonitor(ReferenceSummary.from_dict(json.loads(path.read_text())))
                except (ValueError, KeyError, OSError):
                    log.exception("guard %s: unreadable drift reference %s", self.guard, path)
            self._input_drift = (version, monitor)
        return self._input_drift[1]

    def prepare(self, version: int) -> None:
        """Build ``version``'s drift monitor now (at load), not on the first request."""
        if version > 0:
            self._drift_monitor(version)

    def observe_inputs(self, fused: dict[str, np.ndarray], version: int) -> None:
        """Add the batch to the primary's drift window (a ring-buffer write); scoring runs on
        the worker every ``input_drift_interval_s``."""
        monitor = self._drift_monitor(version)
        if monitor is None:
            return
        X = featurize(fused)
        if X is not None:
            with self._drift_lock:
                monitor.update(X)
        now = self.clock()
        if now - self._last_drift_score >= self.config.input_drift_interval_s:
            self._last_drift_score = now
            self.submit(("drift", version))

    def score_drift(self, version: int) -> None:
        monitor = self._drift_monitor(version)
        if monitor is None:
            return
        # the request path's update() takes this lock: copy the window under it (a few hundred
        # KB at most) and score the copy outside it (tens of ms that held up serving before)
        with self._drift_lock:
            live = monitor.window().copy()
        report = monitor.check(live)
        if report.n < monitor.config.min_samples:
            return
        self.metrics.set("drift", report.fraction, target_version=str(version))
        tv = str(version)
        for feature, psi, ks in zip(report.features.tolist(), report.psi.tolist(), report.ks_stat.tolist(), strict=True):
            self.metrics.set("drift_psi", psi, target_version=tv, feature=str(feature))
            self.metrics.set("drift_ks", ks, target_version=tv, feature=str(feature))
        # log and alert when drift starts (and log when it ends), not at every scoring pass
        was = self._drift_flagged.get(version, False)
        self._drift_flagged[version] = report.flagged
        if report.flagged and not was:
            log.warning("guard %s: input drift on %s v%d: %s", self.guard, self.target, version, report.to_dict(top=3))
            self.alert("input_drift", version, report.to_dict(top=5))
        elif was and not report.flagged:
            log.info("guard %s: input drift on %s v%d has cleared (fraction %.3f)", self.guard, self.target,
                     version, report.fraction)
