"""Version routing inside the guard: rollout state, golden checks, breakers, fallback, canary.

Per ``execute()`` batch the router
1. re-reads the rollout state (rate-limited; a file ``stat`` or one Redis GET),
2. assigns each request to the candidate (its traffic share, if its breaker is closed and its
   goldens passed) or, in an A/B/n split, to the arm its draw falls in (same conditions), or to
   the primary,
3. calls each version once with its fused sub-batch,
4. sends requests whose route failed (error, NaN/Inf outputs, open breaker) down the fallback
   chain — candidate → primary → previous primary → default — and records who served each,
5. hands canary and shadow comparisons to a background worker (bounded queue, drop counter),
   which runs the other version, judges with the workload validator and feeds the breakers.

Golden checks run once per version, before the version gets traffic; a failing version is
never routed to. Breaker open/closed state is shared through the store; each process keeps
its own sliding window (see :mod:`tritonguard.rollout.breaker`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core import repository
from tritonguard.core.errors import InvalidInput, TargetError, TritonGuardError
from tritonguard.core.tensors import concat, offsets, rows_any, split
from tritonguard.rollout.breaker import CLOSED, Breaker, BreakerConfig
from tritonguard.rollout.drift import (
    REFERENCE_FILE,
    DriftMonitor,
    Ewma,
    ReferenceSummary,
    featurize,
)
from tritonguard.rollout.latency import paired_key
from tritonguard.rollout.state import RolloutState, StateError, StateStore
from tritonguard.rollout.validators import (
    FAIL,
    PASS,
    AlertDispatcher,
    ValidatorConfig,
    ValidatorRegistry,
    load_callable,
    row_cosine,
)

log = logging.getLogger(__name__)

SKIPPED = "SKIPPED"
# a golden check that could not reach its target (not loaded yet, loading, unloaded) is no
# verdict: the version is not routable meanwhile, nothing is stored, and it is tried again after
UNREADY_RETRY_S = 2.0
UNREADY_CODES = ("UNAVAILABLE", "NOT_FOUND")
TASK_TO_WORKLOAD = {"classifier": "classifier", "embedding": "embedding", "regression": "regression"}


@dataclass(kw_only=True)
class RoutingConfig:
    """``routing.*`` parameters of a guard model."""

    poll_interval_s: float = 1.0  # how often the rollout state is re-read
    compare_queue: int = 64  # pending canary/shadow comparisons; more are dropped and counted
    canary_compare: bool = True  # also run the primary on candidate-served requests, and compare
    golden_check: bool = True
    # output drift: EWMA of the FAIL share over canary/shadow comparisons; over it, the
    # candidate's breaker trips with reason "drift"
    output_drift_alpha: float = 0.05  # per compared row
    output_drift_threshold: float = 0.2
    output_drift_min_rows: int = 50  # no judgement on fewer compared rows
    # latency judged against the primary, in the same process and window: the candidate trips
    # when its p95 exceeds this multiple of the primary's (0 = off). Robust where an absolute
    # budget is not: both versions see the same load. breaker.latency_budget_ms stays absolute.
    latency_ratio: float = 0.0
    # ... but only while the version gets at least this share of calls (its traffic share, plus
    # the shadow share for a candidate): a version called rarely runs cache-cold, and on a
    # sub-millisecond model that alone put an identical copy's p95 at 2.1x the primary's at a
    # 15 % share. The rollout's latency gate skips below the same share (gates.latency_min_share)
    latency_min_share: float = 0.25
    input_drift_interval_s: float = 5.0  # how often the input-drift window is scored
    # a loop in each instance that, without waiting for traffic, re-reads the state, checks the
    # goldens of versions it names and publishes breaker gauges every this many seconds (0 = off)
    reconcile_interval_s: float = 2.0
    alert_webhook: str = ""  # POSTed JSON on golden FAIL, trips, input drift
    alert_callable: str = ""  # "package.module:callable", called with the same event

    def __post_init__(self) -> None:
        if not 0 < self.output_drift_alpha <= 1:
            raise ValueError("routing.output_drift_alpha must be in (0, 1]")
        if not 0 < self.output_drift_threshold <= 1:
            raise ValueError("routing.output_drift_threshold must be in (0, 1]")
        if self.poll_interval_s < 0:
            raise ValueError("routing.poll_interval_s must be >= 0")
        if self.compare_queue < 1:
            raise ValueError("routing.compare_queue must be >= 1")
        if self.reconcile_interval_s < 0:
            raise ValueError("routing.reconcile_interval_s must be >= 0 (0 = off)")
        if not 0 <= self.latency_min_share <= 1:
            raise ValueError("routing.latency_min_share must be in [0, 1]")


@dataclass
class Routed:
    """The answer for one batch: fused outputs (rows of served requests) and per-request facts."""

    outputs: dict[str, np.ndarray]
    served_by: list[str]  # per request, "" when it failed
    errors: list[TritonGuardError | None]  # per request
    fallbacks: frozenset[int] = frozenset()  # requests answered further down the chain than their first hop


class Router:
    def __init__(self, *, guard: str, repo: Path, target: str, make_target: Callable[[int], Any],
                 output_names: list[str], store: StateStore, config: RoutingConfig,
                 validator: ValidatorConfig, registry: ValidatorRegistry, breaker: BreakerConfig,
                 metrics: Any, clock: Callable[[], float] = time.time, seed: int | None = None,
                 pin: int = -1, ready: Callable[[int], bool] | None = None, max_batch: int = 0,
                 latency: Any = None):
        self.guard, self.repo, self.target = guard, repo, target
        self.make_target = make_target
        self.output_names = output_names
        self.store, self.config = store, config
        self.validator, self.registry = validator, registry
        self.breaker_config = breaker
        self.metrics = metrics
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.max_batch = max_batch  # goldens also run at this batch size (0: not known)
        # exact per-call latencies, shared through the store for the rollout's latency gate
        # (a tritonguard.rollout.latency.LatencyRecorder; None: not kept)
        self.latency = latency
        # paired canary timings so far, per version under test: the order alternates for each
        # (one counter for several A/B/n arms can put one arm first in every pair it gets)
        self._pairs: dict[int, int] = {}
        self._targets: dict[int, Any] = {}
        self._breakers: dict[int, Breaker] = {}
        self._lock = threading.Lock()  # breakers are fed by execute() and by the worker
        self._refresh_lock = threading.Lock()  # execute() and the reconciler re-read the state
        self._golden_lock = threading.Lock()  # one golden check at a time, never two of a version
        self._unready: dict[int, float] = {}  # version -> when its target last could not be reached
        self._published_revision = -1  # the state revision whose shares the gauges show
        self._published_shares: set[tuple[int, str]] = set()
        self._target_lock = threading.Lock()
        # whether goldens of version N may run ahead of traffic (a BLS guard: once it has served)
        self.ready = ready or (lambda _v: True)
        self._drift_lock = threading.Lock()
        self._last_poll = 0.0
        self._state_errors = 0  # store errors already counted in the metrics
        self.dropped = 0
        self.pin = pin
        self._output_drift: dict[int, Ewma] = {}
        self._output_rows: dict[int, int] = {}
        # the target calls of the last infer(): (version, request indices, start ns, end ns, ok), in
        # call order (time.perf_counter_ns): what tracing's target spans and the cost meter read
        self.calls: list[tuple[int, list[int], int, int, bool]] = []
        self._whole: dict[str, np.ndarray] | None = None
        self.tracer: Any = None  # a tritonguard.observe.tracing.Tracer when the guard traces (compare spans)
        self._input_drift: tuple[int, DriftMonitor | None] | None = None
        self._last_drift_score = 0.0
        self._drift_flagged: dict[int, bool] = {}  # per version: flagged at the last scoring
        self.alerts = AlertDispatcher(
            [load_callable(config.alert_callable)] if config.alert_callable else [], config.alert_webhook)
        self.state = self._initial_state()
        self._jobs: queue.Queue = queue.Queue(maxsize=config.compare_queue)
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._work, name=f"compare-{guard}", daemon=True)
        self._worker.start()
        self._reconciler = None
        if config.reconcile_interval_s > 0:
            self._reconciler = threading.Thread(target=self._reconcile, name=f"reconcile-{guard}", daemon=True)
            self._reconciler.start()

    # -- state -----------------------------------------------------------------------------
    def _versions_on_disk(self) -> list[int]:
        return repository.versions(self.repo / self.target)

    def _initial_state(self) -> RolloutState:
        """The stored state, or a new one pinning today's latest version as primary, so a
        version exported later gets no traffic until it is routed to on purpose."""
        state = self.store.load()
        if state is not None:
            return state
        on_disk = self._versions_on_disk()
        # a target outside this repository: Triton's latest (-1) unless pinned
        pinned = self.pin if self.pin > 0 else (on_disk[-1] if on_disk else -1)

        def create(current: RolloutState) -> RolloutState:
            if current.primary == -1:
                current.primary = pinned
            return current

        try:
            return self.store.update(create, by=f"guard:{self.guard}")
        except StateError as exc:
            log.warning("guard %s: cannot write the initial rollout state (%s); primary v%d in memory",
                        self.guard, exc, pinned)
            return RolloutState(model=self.guard, primary=pinned)

    def refresh(self, now: float, *, wait: bool = False) -> None:
        if now - self._last_poll < self.config.poll_interval_s:
            return
        # execute() never waits for the reconciler's read: it serves by the state in hand
        if not self._refresh_lock.acquire(blocking=wait):
            return
        try:
            if now - self._last_poll >= self.config.poll_interval_s:
                self._refresh(now)
        finally:
            self._refresh_lock.release()

    def _refresh(self, now: float) -> None:
        self._last_poll = now
        new = self.store.poll(self.state.revision)
        if (errs := getattr(self.store, "errors", 0)) > self._state_errors:
            # an unreadable / corrupt document or an unreachable Redis: the last good state
            # stays in force (the store logged it); the count goes to the metrics port
            self.metrics.inc("state_errors", errs - self._state_errors)
            self._state_errors = errs
        if new is not None and new.revision != self.state.revision:
            log.info("guard %s: rollout state r%d -> r%d", self.guard, self.state.revision, new.revision)
            # a breaker document that was shared and is now gone was removed on purpose
            # (`route --reset-breaker`, a fresh rollout or arm): this process forgets its trip too
            # (a trip of ours not yet stored was never in the old state, so it is kept)
            dropped = set(self.state.breakers) - set(new.breakers)
            self.state = new
            with self._lock:
                for key in dropped:
                    if key.isdigit() and int(key) in self._breakers:
                        log.info("guard %s: breaker of %s v%s reset by the rollout state", self.guard, self.target, key)
                        self._breakers[int(key)] = Breaker(self.breaker_config, name=f"{self.target}:{key}")
        with self._lock:
            for version, shared in self.state.breakers.items():
                try:
                    self.breaker(int(version)).adopt(shared)
                except (ValueError, KeyError):
                    log.exception("guard %s: bad breaker state for v%s", self.guard, version)

    def primary(self) -> int:
        if self.state.primary > 0:
            return self.state.primary
        on_disk = self._versions_on_disk()
        return on_disk[-1] if on_disk else -1

    def breaker(self, version: int) -> Breaker:
        b = self._breakers.get(version)
        if b is None:
            b = self._breakers[version] = Breaker(self.breaker_config, name=f"{self.target}:{version}")
        return b

    def target_for(self, version: int) -> Any:
        t = self._targets.get(version)
        if t is None:
            with self._target_lock:  # the serving thread, the worker and the reconciler
                t = self._targets.get(version)
                if t is None:
                    t = self._targets[version] = self.make_target(version)
        return t

    # -- goldens ---------------------------------------------------------------------------
    def golden_verdict(self, version: int) -> str:
        """PASS / MARGINAL / FAIL for ``version``, checking it on this server the first time."""
        if not self.config.golden_check:
            return PASS
        known = self.state.goldens.get(str(version))
        if known is not None:
            return known.get("verdict", FAIL)
        with self._golden_lock:  # the reconciler may be checking it right now: wait for its verdict
            known = self.state.goldens.get(str(version))
            if known is not None:
                return known.get("verdict", FAIL)
            last = self._unready.get(version)
            if last is not None and self.clock() - last < UNREADY_RETRY_S:
                return FAIL  # its target was unreachable a moment ago: not routable yet
            return self._check_and_record(version)

    def _check_and_record(self, version: int) -> str:
        result = self.check_goldens(version)
        if result.get("unready"):
            self._unready[version] = self.clock()
            return FAIL
        self._unready.pop(version, None)
        self.state.goldens[str(version)] = result

        def record(current: RolloutState) -> RolloutState:
            current.goldens.setdefault(str(version), result)
            return current

        try:
            self.state = self.store.update(record, by=f"guard:{self.guard}")
        except StateError as exc:
            log.warning("guard %s: golden result for v%d not stored: %s", self.guard, version, exc)
        self.metrics.inc("goldens", 1, target_version=str(version), verdict=result["verdict"])
        if result["verdict"] == FAIL:
            self.alert("golden_fail", version, result["metrics"])
        return result["verdict"]

    def check_goldens(self, version: int) -> dict[str, Any]:
        vdir = self.repo / self.target / str(version)
        now = self.clock()
        path = vdir / repository.GOLDENS
        if not path.exists():
            # nothing to check against (a model not exported by us, or a target outside this
            # repository): say so loudly, but do not refuse a version the user routed to
            log.warning("guard %s: %s v%d has no %s; golden check SKIPPED", self.guard, self.target, version,
                        repository.GOLDENS)
            return {"verdict": SKIPPED, "metrics": {"reason": f"no {repository.GOLDENS}"}, "checked_at": now}
        inputs, expected = repository.load_goldens(path)
        cfg = self._validator_for(vdir)
        worst, figures = PASS, {}
        # the whole set in one call, then a few rows alone and the set tiled to the largest batch
        # the target accepts: a version that fails only at batch 1 or only on big batches (which
        # live traffic makes and a 64-row golden call may not) fails here, before any traffic
        n = len(next(iter(inputs.values())))
        runs: list[tuple[str, np.ndarray]] = [("all", np.arange(n))]
        runs += [(f"batch 1 (row {k})", np.array([k])) for k in range(min(n, 3))]
        if self.max_batch > n:
            runs.append((f"batch {self.max_batch}", np.resize(np.arange(n), self.max_batch)))
        for label, rows in runs:
            try:
                got = self.target_for(version).infer({k: v[rows] for k, v in inputs.items()})
            except Exception as exc:  # noqa: BLE001 - a broken version fails its goldens, nothing more
                if isinstance(exc, TargetError) and (exc.code in UNREADY_CODES or "not ready" in str(exc)):
                    # the model is not there to judge (loading, or a version step not loaded yet):
                    # a stored FAIL would refuse it for good, even once it loads
                    log.warning("guard %s: goldens of %s v%d not run, target unavailable (again in %gs): %s",
                                self.guard, self.target, version, UNREADY_RETRY_S, exc)
                    return {"verdict": FAIL, "unready": True, "metrics": {"error": str(exc)}, "checked_at": now}
                figures["error"] = f"{label}: {type(exc).__name__}: {exc}"
                worst = FAIL
                break
            for name in self.output_names:
                if name not in expected:
                    continue
                v = self.registry.validate(got[name], expected[name][rows], cfg)
                if label == "all" or v.status != PASS:
                    figures[name if label == "all" else f"{name} at {label}"] = v.metrics
                if v.status == FAIL or (v.status != PASS and worst == PASS):
                    worst = v.status
            if worst == FAIL:
                break
        log.info("guard %s: goldens of %s v%d on this server: %s %s", self.guard, self.target, version, worst, figures)
        return {"verdict": worst, "metrics": figures, "checked_at": now}

    def validator_for(self, version: int) -> ValidatorConfig:
        """The validator settings ``version`` is judged with (its workload from its manifest's task)."""
        return self._validator_for(self.repo / self.target / str(version))

    def _validator_for(self, vdir: Path) -> ValidatorConfig:
        manifest = repository.read_manifest(vdir) or {}
        workload = TASK_TO_WORKLOAD.get(manifest.get("task", ""), "")
        if workload and not self.validator.custom and workload != self.validator.workload:
            from dataclasses import replace  # noqa: PLC0415

            return replace(self.validator, workload=workload)
        return self.validator

    def routable(self, version: int, now: float) -> bool:
        return self.golden_verdict(version) != FAIL and self.breaker(version).allow(now)

    # -- serving ---------------------------------------------------------------------------
    def infer(self, fused: dict[str, np.ndarray], sizes: list[int],
              pins: list[int | None] | None = None, traced: dict[int, Any] | None = None,
              draws: np.ndarray | None = None) -> Routed:
        """Route one batch. ``draws``: per request, its uniform draw in [0, 1) when an earlier
        stage drew it (the cache, which lets the candidate's band skip it); else drawn here.
        ``pins``: per request, the version it must be answered by (the ``version`` request
        parameter, e.g. reproducible batch scoring) or None: one the state names and that is
        routable, with no fallback to another version (UNAVAILABLE instead). ``traced``: request
        -> its guard span, for the requests being traced (their comparisons get spans too)."""
        now = self.clock()
        self.refresh(now)
        n = len(sizes)
        starts = offsets(sizes)
        state = self.state
        primary = self.primary()
        chain = [(step, primary if step == "primary" else v) for step, v in state.chain()]
        cand = state.candidate.version if state.candidate else None
        draws = self.rng.random(n) if draws is None else np.asarray(draws, dtype=np.float64)
        to_cand = state.candidate_mask(draws) if cand is not None and self.routable(cand, now) else np.zeros(n, bool)
        # A/B/n: each arm takes its band of the same draw; an unroutable arm's band goes home
        arm_of = state.arm_choice(draws) if state.arms else np.zeros(n, np.int64)
        for a in state.arms:
            if not self.routable(a.version, now):
                arm_of[arm_of == a.version] = 0

        served: list[str] = [""] * n
        self.calls = []
        self._whole = None  # the outputs of one call that answered the whole batch, if one did
        self._last_error: dict[int, TargetError] = {}  # request -> the last target error it met
        errors: list[TritonGuardError | None] = [None] * n
        out_rows: dict[int, dict[str, np.ndarray]] = {}
        pending = {i for i in range(n)}
        # first hop: candidate share, the rest to the primary; then down the chain
        # an open primary breaker sends its share down the chain (e.g. to the previous primary)
        home = primary if self.routable(primary, now) else self._next_in_chain(chain, set(), now)
        first = {i: (cand if to_cand[i] else int(arm_of[i]) or home) for i in range(n)}
        pinned = self._pin(pins, first, errors, pending, now) if pins is not None else set()
        tried: dict[int, set[int]] = {i: set() for i in range(n)}
        reasons: dict[int, str] = {}
        for hop in range(len(chain) + 1):
            if hop and pinned & pending:  # a pinned request is answered by its version or not at all
                for i in pinned & pending:
                    last = self._last_error.get(i)
                    what = f"version {first[i]} of '{self.target}' (pinned by the request)"
                    errors[i] = (TargetError(f"{what} failed: {last}", last.code) if last
                                 else TargetError(f"{what} could not answer", "UNAVAILABLE"))
                pending -= pinned
            groups: dict[int | None, list[int]] = {}
            for i in sorted(pending):
                version = first[i] if hop == 0 else self._next_in_chain(chain, tried[i], now)
                groups.setdefault(version, []).append(i)
            if not groups:
                break
            for version, idx in groups.items():
                if version is None:  # chain exhausted: default response or abstain
                    self._default(idx, reasons, served, errors, out_rows, sizes)
                    pending -= set(idx)
                    continue
                ok = self._call(version, idx, fused, starts, out_rows, served, reasons)
                for i in idx:
                    tried[i].add(version)
                pending -= set(ok)
            if not pending:
                break
        fallbacks = [i for i in range(n) if served[i] and first[i] is not None and served[i] != f"{self.target}:{first[i]}"]
        for i in fallbacks:
            self.metrics.inc("fallbacks", 1, reason=reasons.get(i, "unknown"))
        self._enqueue_comparisons(fused, starts, out_rows, served, first, cand, primary, draws, to_cand, traced)
        self.observe_inputs(fused, primary)
        good = [i for i in range(n) if errors[i] is None]
        if self._whole is not None and len(good) == n:
            # the usual batch: one version answered all of it in one call; its outputs are the
            # batch's as they came (no split and re-concatenation per request)
            outputs = {name: self._whole[name] for name in self.output_names}
        else:
            outputs = {name: concat([out_rows[i][name] for i in good]) if good else np.empty((0,))
                       for name in self.output_names}
        by_label: dict[str, int] = {}
        for i in good:
            by_label[served[i]] = by_label.get(served[i], 0) + 1
        for label, k in by_label.items():
            self.metrics.inc("served", k, served_by=label)
        return Routed(outputs, served, errors, frozenset(fallbacks))

    def _pin(self, pins: list[int | None], first: dict[int, int | None], errors: list[Any], pending: set[int],
             now: float) -> set[int]:
        """Requests pinned to a version: their first hop; a version not served here (or not a
        positive integer) fails the request alone."""
        named = set(self.named_versions())
        pinned = set()
        for i, pin in enumerate(pins):
            if pin is None:
                continue
            if pin <= 0:
                errors[i] = InvalidInput("version", "version", "request parameter 'version' must be a positive integer")
            elif pin not in named:
                errors[i] = TargetError(f"version {pin} of '{self.target}' is not routed here (served: "
                                        f"{', '.join(f'v{v}' for v in sorted(named))})", "UNAVAILABLE")
            elif not self.routable(pin, now):
                errors[i] = TargetError(f"version {pin} of '{self.target}' is not routable now (breaker open or "
                                        "goldens failed); retry later", "UNAVAILABLE")
            else:
                first[i] = pin
                pinned.add(i)
                continue
            pending.discard(i)
        return pinned

    def _next_in_chain(self, chain: list[tuple[str, int | None]], tried: set[int], now: float) -> int | None:
        primary = None
        for step, version in chain:
            if step == "primary":
                primary = version
            if step == "default":
                break
            if version is None or version in tried:
                continue
            if self.routable(version, now):
                return version
        # Nothing healthy left: an open breaker on the primary (a latency spike, say) should
        # degrade service, not end it, so the primary answers as the last resort unless it
        # failed its goldens (then its answers are known to be wrong).
        if primary is not None and primary not in tried and self.golden_verdict(primary) != FAIL:
            return primary
        return None

    def _call(self, version: int, idx: list[int], fused: dict[str, np.ndarray], starts: np.ndarray,
              out_rows: dict[int, dict[str, np.ndarray]], served: list[str], reasons: dict[int, str]) -> list[int]:
        """Run ``version`` on the requests ``idx``; returns those it answered well."""
        whole = len(idx) == len(starts) - 1  # idx is sorted: every request of the batch, in order
        if whole:
            sub, sub_sizes = fused, np.diff(starts).tolist()
        else:
            sub = {k: concat([v[starts[i]:starts[i + 1]] for i in idx]) for k, v in fused.items()}
            sub_sizes = [int(starts[i + 1] - starts[i]) for i in idx]
        t0_ns = time.perf_counter_ns()
        try:
            out = self.target_for(version).infer(sub)
        except TargetError as exc:
            self.calls.append((version, idx, t0_ns, time.perf_counter_ns(), False))
            if len(idx) > 1:  # isolate: one poisonous request must not fail its neighbours
                ok: list[int] = []
                for i in idx:
                    ok += self._call(version, [i], fused, starts, out_rows, served, reasons)
                if len(ok) == len(idx):
                    # every request succeeded alone: the version failed the batch, not an input.
                    # Users saw no error, but it is a hard fault of the version all the same
                    self._record(version, len(idx), fused=len(idx))
                    self.metrics.inc("fused_failures", len(idx), target_version=str(version))
                    log.warning("guard %s: %s v%d failed a fused call of %d requests that each succeeded "
                                "alone: %s", self.guard, self.target, version, len(idx), exc)
                return ok
            latency = (time.perf_counter_ns() - t0_ns) / 1e6
            self._record(version, 1, errors=1, latency_ms=latency)
            # one count per request this version failed (the rollout gates divide by requests)
            self.metrics.inc("target_errors", 1, code=exc.code, target_version=str(version))
            reasons[idx[0]] = "error"
            self._last_error[idx[0]] = exc
            log.warning("guard %s: %s v%d failed a request: %s", self.guard, self.target, version, exc)
            return []
        t1_ns = time.perf_counter_ns()
        self.calls.append((version, idx, t0_ns, t1_ns, True))
        latency = (t1_ns - t0_ns) / 1e6
        self.metrics.inc("target_calls", 1)
        self.metrics.observe("latency", latency / 1000, target_version=str(version))
        if self.latency is not None:
            self.latency.record(version, int(sum(sub_sizes)), latency / 1000, self.clock())
        sub_starts = offsets(sub_sizes)
        parts = {k: split(v, sub_starts) for k, v in out.items()}
        # NaN/Inf per request, over the whole fused output at once
        bad_rows = None
        for name in self.output_names:
            a = out[name]
            if np.issubdtype(a.dtype, np.floating):
                rows_bad = ~np.isfinite(a.reshape(len(a), -1)).all(axis=1)
                bad_rows = rows_bad if bad_rows is None else bad_rows | rows_bad
        bad_req = rows_any(bad_rows, sub_starts) if bad_rows is not None and bad_rows.any() else None
        ok, bad = [], 0
        label = f"{self.target}:{version}"
        for k, i in enumerate(idx):
            if bad_req is not None and bad_req[k]:
                reasons[i] = "non_finite"
                bad += 1
                continue
            out_rows[i] = {name: parts[name][k] for name in self.output_names}
            served[i] = label
            ok.append(i)
        self._record(version, len(idx), non_finite=bad, latency_ms=latency)
        self.metrics.inc("target_errors", bad, code="NON_FINITE", target_version=str(version))
        if whole and not bad:
            self._whole = out
        return ok

    def _default(self, idx, reasons, served, errors, out_rows, sizes) -> None:
        default = self.state.default_response
        for i in idx:
            if isinstance(default, dict):
                out_rows[i] = {name: np.repeat(np.asarray([default[name]], dtype=np.float32), sizes[i], axis=0)
                               for name in self.output_names}
                served[i] = "default"
            else:
                why = reasons.get(i, "unavailable")
                last = self._last_error.get(i)
                if why == "error" and last is not None:
                    # every version tried failed with its own error: the client gets the target's
                    # code (a 400 stays a 400, a 500 a 500), not a generic "unavailable"
                    errors[i] = TargetError(str(last), last.code)
                else:
                    errors[i] = TargetError(f"no healthy version of '{self.target}' could answer ({why}"
                                            f"{': ' + str(last) if last else ''}); retry later", "UNAVAILABLE")
            self.metrics.inc("fallbacks", 1, reason="default" if isinstance(default, dict) else "abstain")

    def _record(self, version: int, n: int, *, errors: int = 0, non_finite: int = 0, latency_ms: float | None = 0.0,
                verdicts: Any = (), fused: int = 0) -> None:
        now = self.clock()
        with self._lock:
            b = self.breaker(version)
            trip = b.record_batch(now, n, errors=errors, non_finite=non_finite,
                                  latency_ms=None if fused else latency_ms, verdicts=verdicts, fused=fused)
            if trip is None:
                trip = self._latency_vs_primary(version, b, now)
            shared = b.to_dict() if trip else None
        if trip is not None:
            self.metrics.inc("trips", 1, target_version=str(version), reason=trip.reason)
            self.alert("breaker_trip", version, {"reason": trip.reason, **trip.figures})
            self._submit(("breaker", version, shared))

    def alert(self, kind: str, version: int | None, figures: dict[str, Any]) -> None:
        if self.alerts.callables or self.alerts.webhook_url:
            self.alerts.fire({"event": kind, "guard": self.guard, "target": self.target, "version": version,
                              "figures": figures, "at": self.clock()})

    # -- input drift ------------------------------------------------------------------------
    def _drift_monitor(self, version: int) -> DriftMonitor | None:
        if self._input_drift is None or self._input_drift[0] != version:
            path = self.repo / self.target / str(version) / REFERENCE_FILE
            monitor = None
            if path.exists():
                try:
                    import json  # noqa: PLC0415

                    monitor = DriftMonitor(ReferenceSummary.from_dict(json.loads(path.read_text())))
                except (ValueError, KeyError, OSError):
                    log.exception("guard %s: unreadable drift reference %s", self.guard, path)
            self._input_drift = (version, monitor)
        return self._input_drift[1]

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
            self._submit(("drift", version))

    def _score_drift(self, version: int) -> None:
        monitor = self._drift_monitor(version)
        if monitor is None:
            return
        with self._drift_lock:  # its own lock: scoring takes ~20 ms and must not stall breakers
            report = monitor.check()
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

    def _latency_vs_primary(self, version: int, b: Breaker, now: float) -> Any:
        ratio = self.config.latency_ratio
        if ratio <= 0 or version not in self._experiments() or b.state != CLOSED or b.shielded(now):
            return None
        if self.call_share(version) < self.config.latency_min_share:
            return None  # cache-cold at this share: its latency would blame the version for its share
        need = max(self.breaker_config.min_requests, 50)  # p95 of fewer is one outlier
        primary = self.breaker(self.primary())
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

    # -- off the critical path -------------------------------------------------------------
    def named_versions(self) -> list[int]:
        """Versions the state may route to: primary, candidate, arms, the fallback chain."""
        st = self.state
        named = [self.primary()]
        if st.candidate is not None:
            named.append(st.candidate.version)
        named += [a.version for a in st.arms]
        named += st.route_versions()
        return [v for v in dict.fromkeys(named) if v > 0]

    def _reconcile(self) -> None:
        """Follow the store without waiting for traffic: an idle guard has the new state, its
        golden verdicts and its breaker gauges within ``reconcile_interval_s`` of a change."""
        while not self._stop.wait(self.config.reconcile_interval_s):
            try:
                self.refresh(self.clock(), wait=True)
                named = self.named_versions()
                for version in named:
                    if (self.config.golden_check and str(version) not in self.state.goldens
                            and self.ready(version)):
                        self.golden_verdict(version)
                with self._lock:
                    for version in named:  # a gauge for every routed version, served yet or not
                        self.breaker(version)
                self.publish()
                if self.latency is not None and not self.latency.flush():
                    self.metrics.inc("state_errors", 1)
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                log.exception("guard %s: reconcile pass failed", self.guard)

    def _submit(self, job: tuple) -> bool:
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            self.dropped += 1
            self.metrics.inc("compare_drops", 1)
            return False

    def call_share(self, version: int) -> float:
        """The share of calls ``version`` gets as now routed: its traffic share, plus the shadow
        share for a candidate (mirrored calls keep it as warm as served ones); 1 for the primary."""
        st = self.state
        if version == self.primary():
            return 1.0
        if st.candidate is not None and st.candidate.version == version:
            return st.candidate.share + (1 - st.candidate.share) * st.shadow_share
        return sum(a.weight for a in st.arms if a.version == version)

    def _experiments(self) -> dict[int, float]:
        """Versions under test (the candidate, or the A/B/n arms) and their shadow share."""
        st = self.state
        if st.candidate is not None:
            return {st.candidate.version: st.shadow_share}
        return {a.version: 0.0 for a in st.arms}

    def _enqueue_comparisons(self, fused, starts, out_rows, served, first, cand, primary, draws, to_cand,
                             traced=None) -> None:
        now = self.clock()
        for version, shadow in self._experiments().items():
            canary = ([i for i in out_rows if served[i] == f"{self.target}:{version}"]
                      if self.config.canary_compare else [])
            # shadow: a sample of primary-served requests is also run on the candidate; while its
            # breaker is half-open, mirrored traffic is what probes it (at least 10 %)
            b = self.breaker(version)
            rate = shadow if b.allow(now) else (max(shadow, 0.1) if b.wants_probe(now) else 0.0)
            shadow_idx = []
            if rate > 0:
                u = (draws * 7919.0) % 1.0  # a second draw, independent of the canary one
                shadow_idx = [i for i in out_rows if served[i] == f"{self.target}:{primary}" and u[i] < rate]
            for kind, idx, other, served_v in (("canary", canary, primary, version),
                                               ("shadow", shadow_idx, version, primary)):
                if not idx:
                    continue
                sub = {k: concat([v[starts[i]:starts[i + 1]] for i in idx]) for k, v in fused.items()}
                got = {name: concat([out_rows[i][name] for i in idx]) for name in self.output_names}
                spans = [traced[i] for i in idx if i in traced] if traced else None
                self._submit((kind, other, served_v, sub, got, spans) if spans else (kind, other, served_v, sub, got))

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                if job[0] == "breaker":
                    self._store_breaker(job[1], job[2])
                elif job[0] == "drift":
                    self._score_drift(job[1])
                elif len(job) > 5:  # traced requests among the compared: a span each
                    t0 = time.time_ns()
                    verdict = self._compare(*job[:5])
                    if self.tracer is not None:
                        cand = job[2] if job[0] == "canary" else job[1]
                        self.tracer.compared(job[5], job[0], cand, t0, time.time_ns(), verdict)
                else:
                    self._compare(*job)
            except Exception:  # noqa: BLE001 - comparisons must never take serving down
                log.exception("guard %s: comparison job failed", self.guard)

    def _compare(self, kind: str, other: int, served_v: int, inputs: dict[str, np.ndarray],
                 served_out: dict[str, np.ndarray]) -> str | None:
        """canary: ``served_out`` came from the candidate, ``other`` is the primary (the
        reference); shadow: ``served_out`` came from the primary, ``other`` is the candidate."""
        cand = served_v if kind == "canary" else other
        if cand not in self._experiments():
            # queued while ``cand`` was under test, and the rollout has moved on since (promoted,
            # rolled back): its judge is gone, and judged by the default validator a promoted
            # retrain would trip its own breaker as primary
            return None
        now = self.clock()
        t0 = time.perf_counter()
        try:
            if kind == "canary" and self.latency is not None:
                other_out = self._paired_run(cand, other, inputs)
            else:
                other_out = self.target_for(other).infer(inputs)
        except TargetError:
            if kind == "shadow":  # the candidate failed on mirrored traffic: count it
                self._record(cand, len(next(iter(inputs.values()))), errors=len(next(iter(inputs.values()))),
                             latency_ms=(time.perf_counter() - t0) * 1000)
            return "ERROR"
        cand_out, ref_out = (served_out, other_out) if kind == "canary" else (other_out, served_out)
        cfg = self._validator_for(self.repo / self.target / str(cand))
        name = cfg.output or self.output_names[0]
        judge = self.state.judge_of(cand)
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
        with self._lock:
            b = self.breaker(cand)
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
            if trip is None and rows and b.state == CLOSED:
                ewma = self._output_drift.setdefault(
                    cand, Ewma(self.config.output_drift_alpha, self.config.output_drift_threshold))
                ewma.update((verdict.per_row == FAIL).astype(np.float64))
                self.metrics.set("output_drift", float(ewma.value), target_version=str(cand))
                seen = self._output_rows[cand] = self._output_rows.get(cand, 0) + rows
                if ewma.exceeded and seen >= self.config.output_drift_min_rows:
                    trip = b.trip(now, "drift", {"fail_share_ewma": ewma.value,
                                                  "limit": self.config.output_drift_threshold, "kind": kind,
                                                  **verdict.metrics})
                    self._output_drift.pop(cand, None)
                    self._output_rows.pop(cand, None)
                    shared, changed = b.to_dict(), True
        self._after_comparison(cand, trip, shared, changed)
        return verdict.status

    def _paired_run(self, cand: int, primary: int, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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
        the rest) and the rollout's gates weigh the disagreement against what the two versions'
        offline disagreement predicts. Disagreement never trips the breaker: it is not a fault,
        and the gates decide on enough rows. Non-finite outputs still are a hard fault."""
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
        with self._lock:
            b = self.breaker(cand)
            if b.wants_probe(now):
                # a probe fails on a hard fault only; agreement neither closes nor reopens it
                per_row = np.where(~finite, FAIL, np.where(agree, PASS, "MARGINAL"))
                trip = b.record_probe(now, list(per_row))
                shared, changed = b.to_dict(), True
            else:
                trip = b.record_batch(now, rows if kind == "shadow" else 0,
                                      non_finite=non_finite if kind == "shadow" else 0)
                shared, changed = (b.to_dict() if trip else None), trip is not None
        self._after_comparison(cand, trip, shared, changed)

    def _after_comparison(self, cand: int, trip: Any, shared: dict[str, Any] | None, changed: bool) -> None:
        """What a comparison did to the candidate's breaker: count and alert a trip, share a change."""
        if trip is not None:
            self.metrics.inc("trips", 1, target_version=str(cand), reason=trip.reason)
            self.alert("breaker_trip", cand, {"reason": trip.reason, **trip.figures})
        if changed:
            self._store_breaker(cand, shared)

    def _store_breaker(self, version: int, shared: dict[str, Any]) -> None:
        try:
            # latest transition wins: a process that has not yet adopted another's newer change
            # (e.g. a trip while this one was still half-open) must not write over it
            def newer(old: dict[str, Any] | None) -> dict[str, Any]:
                if old and float(old.get("changed_at", 0.0)) > float(shared.get("changed_at", 0.0)):
                    return old
                return shared

            self.state = self.store.update_breaker(version, newer, by=f"guard:{self.guard}")
        except StateError as exc:
            log.warning("guard %s: breaker state of v%d not stored: %s", self.guard, version, exc)

    def publish(self) -> None:
        """Breaker states and the routed shares as gauges (cheap: local values, pushed by the
        metrics thread; the shares only when the state's revision changed)."""
        code = {"closed": 0, "half_open": 1, "open": 2}
        for version, b in list(self._breakers.items()):
            self.metrics.set("breaker_state", code.get(b.state, 2), target_version=str(version))
        if self.state.revision != self._published_revision:
            self._published_revision = self.state.revision
            shares = route_shares(self.state, self.primary())
            for key in self._published_shares - shares.keys():
                shares[key] = 0.0  # a role a version no longer has: 0, so a rule sees it end
            for (version, role), share in shares.items():
                self.metrics.set("route_share", share, target_version=str(version), role=role)
            self._published_shares = {k for k, v in shares.items() if v > 0}

    def close(self) -> None:
        self._stop.set()
        self._worker.join(timeout=2)
        if self._reconciler is not None:
            self._reconciler.join(timeout=2)
        if self.latency is not None:
            self.latency.flush()  # the last calls still count for a rollout being judged
        self.alerts.flush(timeout=1)


def route_shares(state: RolloutState, primary: int) -> dict[tuple[int, str], float]:
    """(version, role) -> share of live traffic the state routes there: ``primary``,
    ``candidate`` (its share), ``arm`` (A/B/n weights), ``shadow`` (mirrored, on top)."""
    out: dict[tuple[int, str], float] = {}
    rest = 1.0
    if state.candidate is not None and state.candidate.version > 0:
        out[(state.candidate.version, "candidate")] = state.candidate.share
        rest -= state.candidate.share
        if state.shadow_share > 0:
            out[(state.candidate.version, "shadow")] = state.shadow_share
    for arm in state.arms:
        out[(arm.version, "arm")] = arm.weight
        rest -= arm.weight
    if primary > 0:
        out[(primary, "primary")] = max(0.0, rest)
    return out


__all__ = ["Router", "RoutingConfig", "Routed", "route_shares"]
