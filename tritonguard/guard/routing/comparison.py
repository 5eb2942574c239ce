"""Canary and shadow comparisons, off the serving path.

The router queues jobs on a bounded queue (a full one drops the job and counts it in
``tritonguard_compare_drops_total``); one worker thread per guard process runs them: a
comparison (the other version run on the same rows, judged by the workload's validator for a
version judged on equivalence, or counted AGREE / DISAGREE for one judged on the task), storing a
breaker's new state, or scoring the input-drift window. A comparison feeds the candidate's breaker
(validator FAILs, NaN/Inf, the output-drift EWMA of FAIL shares) and, for a canary with a latency
log, times the candidate beside the primary on the same rows (paired timings for the rollout's
latency gate).

:class:`ComparisonWorker` is the queue and the thread; :class:`BatchComparator` compares tensors.
A stream guard hands the same worker a comparator of texts
(:class:`tritonguard.guard.routing.stream.TextComparator`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tritonguard.core.errors import TargetError
from tritonguard.guard.routing.breakers import Breakers
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.routing.signals import Signals
from tritonguard.guard.routing.view import RolloutView
from tritonguard.rollout.breaker import CLOSED
from tritonguard.rollout.drift import Ewma
from tritonguard.rollout.latency import paired_key
from tritonguard.rollout.validators import (
    FAIL,
    PASS,
    ValidatorConfig,
    ValidatorRegistry,
    row_cosine,
)

log = logging.getLogger(__name__)


class ComparisonWorker:
    """The bounded job queue and its thread. Jobs: ``("breaker", version, shared)``,
    ``("drift", version)``, or a comparison ``(kind, other, served_version, inputs, served_out
    [, spans])`` for the comparator."""

    def __init__(self, *, guard: str, size: int, metrics: Any):
        self.guard, self.metrics = guard, metrics
        self.jobs: queue.Queue = queue.Queue(maxsize=size)
        self.dropped = 0
        self.tracer: Any = None  # a tritonguard.observe.tracing.Tracer when the guard traces
        self.compare: Callable[..., str | None] | None = None
        self.share_breaker: Callable[[int, dict[str, Any]], None] | None = None
        self.score_drift: Callable[[int], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name=f"compare-{self.guard}", daemon=True)
        self._thread.start()

    def submit(self, job: tuple) -> bool:
        """Queue ``job``; never waits (a full queue drops it, counted)."""
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            self.dropped += 1
            self.metrics.inc("compare_drops", 1)
            return False

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                job = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.run(job)
            except Exception:  # noqa: BLE001 - comparisons must never take serving down
                log.exception("guard %s: comparison job failed", self.guard)

    def run(self, job: tuple) -> None:
        if job[0] == "breaker":
            self.share_breaker(job[1], job[2])
        elif job[0] == "drift":
            self.score_drift(job[1])
        elif len(job) > 5:  # traced requests among the compared: a span each
            t0 = time.time_ns()
            verdict = self.compare(*job[:5])
            if self.tracer is not None:
                cand = job[2] if job[0] == "canary" else job[1]
                self.tracer.compared(job[5], job[0], cand, t0, time.time_ns(), verdict)
        else:
            self.compare(*job)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)


class BatchComparator:
    """Tensor comparisons of a request/response guard (the worker's ``compare``)."""

    def __init__(self, *, guard: str, target: str, config: RoutingConfig, view: RolloutView, breakers: Breakers,
                 signals: Signals, target_for: Callable[[int], Any], validator_for: Callable[[int], ValidatorConfig],
                 registry: ValidatorRegistry, output_names: list[str], metrics: Any, latency: Any,
                 clock: Callable[[], float]):
        self.guard, self.target, self.config, self.view = guard, target, config, view
        self.breakers, self.signals, self.target_for = breakers, signals, target_for
        self.validator_for, self.registry, self.output_names = validator_for, registry, output_names
        self.metrics, self.latency, self.clock = metrics, latency, clock
        # paired canary timings so far, per version under test: the order alternates for each
        # (one counter for several A/B/n arms can put one arm first in every pair it gets)
        self._pairs: dict[int, int] = {}
        self._output_drift: dict[int, Ewma] = {}
        self._output_rows: dict[int, int] = {}

    def compare(self, kind: str, other: int, served_v: int, inputs: dict[str, np.ndarray],
                served_out: dict[str, np.ndarray]) -> str | None:
        """canary: ``served_out`` came from the candidate, ``other`` is the primary (the
        reference); shadow: ``served_out`` came from the primary, ``other`` is the candidate."""
        cand = served_v if kind == "canary" else other
        if cand not in self.view.experiments():
            # queued while ``cand`` was under test, and the rollout has moved on since (promoted,
            # rolled back): its judge is gone, and judged by the default validator a promoted
            # retrain would trip its own breaker as primary
            return None
        now = self.clock()
        t0 = time.perf_counter()
        try:
            if kind == "canary" and self.latency is not None:
                other_out = self.paired_run(cand, other, inputs)
            else:
                other_out = self.target_for(other).infer(inputs)
        except TargetError:
            if kind == "shadow":  # the candidate failed on mirrored traffic: count it
                rows = len(next(iter(inputs.values())))
                self.signals.record(cand, rows, errors=rows, latency_ms=(time.perf_counter() - t0) * 1000)
            return "ERROR"
        cand_out, ref_out = (served_out, other_out) if kind == "canary" else (other_out, served_out)
        cfg = self.validator_for(cand)
        name = cfg.output or self.output_names[0]
        judge = self.view.state.judge_of(cand)
        if judge["judge"] == "task":
            self._compare_task(kind, cand, cand_out[name], ref_out[name], cfg, judge, now)
            return "task"
        verdict = self.registry.validate(cand_out[name], ref_out[name], cfg)
        rows = len(verdict.per_row)
        self.metrics.inc("compared", rows, kind=kind, verdict=verdict.status, target_version=str(cand))
        for figure, value in verdict.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
                self.metrics.set("validator_score", float(value), target_version=str(cand), kind=kind, figure=figure)
        non_finite = int(sum(not np.isfinite(r).all() for r in np.asarray(cand_out[name]).reshape(rows, -1)))
        with self.breakers.lock:
            b = self.breakers.get(cand)
            was_closed = b.state == CLOSED
            if b.wants_probe(now):
                trip = b.record_probe(now, list(verdict.per_row))
                if b.state == CLOSED:
                    log.info("guard %s: %s v%d closed again after passing probes", self.guard, self.target, cand)
                shared = b.to_dict()
                changed = True
            else:
                # no latency from here: worker-thread timings include GIL waits and validation;
                # only serving-path calls feed the latency window
                trip = b.record_batch(now, rows if kind == "shadow" else 0, non_finite=non_finite if kind == "shadow" else 0,
                                      verdicts=verdict.per_row)
                shared = b.to_dict() if trip else None
                changed = trip is not None
            # the batch that trips a closed breaker counts in the FAIL-share gauge too: skipped, a
            # candidate tripped by its first wrong row (validator_fail) showed a share of 0
            tripped_now = trip is not None and was_closed
            if rows and ((trip is None and b.state == CLOSED) or tripped_now):
                ewma = self._output_drift.setdefault(
                    cand, Ewma(self.config.output_drift_alpha, self.config.output_drift_threshold))
                ewma.update((verdict.per_row == FAIL).astype(np.float64))
                self.metrics.set("output_drift", float(ewma.value), target_version=str(cand))
                seen = self._output_rows[cand] = self._output_rows.get(cand, 0) + rows
                if tripped_now:  # open now: a fresh average once it closes again, as after a drift trip
                    self._output_drift.pop(cand, None)
                    self._output_rows.pop(cand, None)
                elif ewma.exceeded and seen >= self.config.output_drift_min_rows:
                    trip = b.trip(now, "drift", {"fail_share_ewma": ewma.value,
                                                  "limit": self.config.output_drift_threshold, "kind": kind,
                                                  **verdict.metrics})
                    self._output_drift.pop(cand, None)
                    self._output_rows.pop(cand, None)
                    shared, changed = b.to_dict(), True
        self.after(cand, trip, shared, changed)
        return verdict.status

    def paired_run(self, cand: int, primary: int, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The primary's outputs for a canary comparison, and a paired timing on the way: the
        candidate runs again on the same rows right before or after the primary (alternating), both
        timed here (:func:`tritonguard.rollout.latency.paired_key`)."""
        k = self._pairs[cand] = self._pairs.get(cand, 0) + 1
        order = (cand, primary) if k % 2 else (primary, cand)
        outs, took = {}, {}
        for version in order:
            t0 = time.perf_counter()
            outs[version] = self.target_for(version).infer(inputs)
            took[version] = time.perf_counter() - t0
        rows = len(next(iter(inputs.values())))
        now = self.clock()
        self.latency.record(paired_key(cand, "candidate"), rows, took[cand], now)
        self.latency.record(paired_key(cand, "primary"), rows, took[primary], now)
        return outs[primary]

    def _compare_task(self, kind: str, cand: int, cand_out: Any, ref_out: Any, cfg: ValidatorConfig,
                      judge: dict[str, Any], now: float) -> None:
        """A new model (another training) judged on the task: its answers are not expected to
        match the primary's numerically, so rows are counted as AGREE / DISAGREE (top-1 for a
        classifier, cosine above the rollout's floor for embeddings, the validator's tolerance for
        the rest) and the rollout's gates weigh the disagreement against the operator's limit.
        Disagreement never trips the breaker: it is not a fault, and the gates decide on enough
        rows. Non-finite outputs still are a hard fault."""
        c, r = np.asarray(cand_out), np.asarray(ref_out)
        rows = len(r) if r.ndim else 1
        c2 = c.reshape(rows, -1).astype(np.float64)
        r2 = r.reshape(rows, -1).astype(np.float64)
        finite = np.isfinite(c2).all(axis=1)
        if cfg.workload == "classifier":
            agree = c2.argmax(axis=1) == r2.argmax(axis=1)
        elif cfg.workload == "embedding":
            agree = row_cosine(c2, r2) >= float(judge.get("cosine", cfg.cosine_marginal))
        else:
            agree = self.registry.validate(c, r, cfg).per_row != FAIL
        agree &= finite
        n_agree = int(agree.sum())
        for verdict, k in (("AGREE", n_agree), ("DISAGREE", rows - n_agree)):
            if k:
                self.metrics.inc("compared", k, kind=kind, verdict=verdict, target_version=str(cand))
        self.metrics.set("validator_score", n_agree / rows if rows else 1.0, target_version=str(cand), kind=kind,
                         figure="task_agreement")
        non_finite = int(rows - finite.sum())
        with self.breakers.lock:
            b = self.breakers.get(cand)
            if b.wants_probe(now):
                # a probe fails on a hard fault only; agreement neither closes nor reopens it
                per_row = np.where(~finite, FAIL, np.where(agree, PASS, "MARGINAL"))
                trip = b.record_probe(now, list(per_row))
                shared, changed = b.to_dict(), True
            else:
                trip = b.record_batch(now, rows if kind == "shadow" else 0,
                                      non_finite=non_finite if kind == "shadow" else 0)
                shared, changed = (b.to_dict() if trip else None), trip is not None
        self.after(cand, trip, shared, changed)

    def after(self, cand: int, trip: Any, shared: dict[str, Any] | None, changed: bool) -> None:
        """What a comparison did to the candidate's breaker: count and alert a trip, share a
        change (this is the worker thread already: stored here)."""
        if trip is not None:
            self.breakers.tripped(cand, trip)
        if changed:
            self.breakers.share(cand, shared)
