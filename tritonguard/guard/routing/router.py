"""Version routing inside the guard: which version answers each request, and the fallbacks.

Per ``execute()`` batch the router
1. re-reads the rollout state (rate-limited; :class:`~tritonguard.guard.routing.view.RolloutView`),
2. assigns each request to the candidate (its traffic share, if its breaker is closed and its
   goldens passed) or, in an A/B/n split, to the arm its draw falls in (same conditions), or to
   the primary,
3. calls each version once with its fused sub-batch,
4. sends requests whose route failed (error, NaN/Inf outputs, open breaker) down the fallback
   chain — candidate → primary → previous primary → default — and records who served each,
5. hands canary and shadow comparisons to the comparison worker.

It is handed its collaborators, one concern each: the state view, the breakers
(:mod:`~tritonguard.guard.routing.breakers`), the goldens checker
(:mod:`~tritonguard.guard.routing.goldens`), the signals recorder (breaker feeds, input drift,
alerts: :mod:`~tritonguard.guard.routing.signals`) and the comparison worker with its comparator
(:mod:`~tritonguard.guard.routing.comparison`). A reconciler thread follows the store without
waiting for traffic (goldens of newly named versions, breaker gauges, the latency log's flush).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.errors import InvalidInput, TargetError, TritonGuardError
from tritonguard.core.tensors import concat, offsets, rows_any, split
from tritonguard.guard.routing.breakers import Breakers
from tritonguard.guard.routing.comparison import BatchComparator, ComparisonWorker
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.routing.goldens import GoldensChecker
from tritonguard.guard.routing.signals import Alerts, Signals
from tritonguard.guard.routing.sticky import PRIMARY_PIN
from tritonguard.guard.routing.view import RolloutView, route_shares
from tritonguard.rollout.breaker import Breaker, BreakerConfig
from tritonguard.rollout.state import RolloutState
from tritonguard.rollout.stores import StateStore
from tritonguard.rollout.validators import FAIL, ValidatorConfig, ValidatorRegistry

log = logging.getLogger(__name__)


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
                 latency: Any = None, present: Callable[[int], bool] | None = None):
        """``present(version)``: whether the version is on this replica, whole and checked (an
        object-store repository fetches it in the background,
        :meth:`tritonguard.guard.source.RepositorySource.present`); None: always. Until it is,
        the requests the state routes to it are served as if it were not in the rollout (the
        primary, the fallback chain): not ready yet is no error of the version, counts nowhere,
        and its goldens are not run."""
        self.guard, self.repo, self.target = guard, repo, target
        self.make_target = make_target
        self.output_names = output_names
        self.store, self.config = store, config
        self.metrics = metrics
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        # exact per-call latencies, shared through the store for the rollout's latency gate
        # (a tritonguard.rollout.latency.LatencyRecorder; None: not kept)
        self.latency = latency
        self._targets: dict[int, Any] = {}
        self._target_lock = threading.Lock()
        # whether goldens of version N may run ahead of traffic (a BLS guard: once it has served)
        self.ready = ready or (lambda _v: True)
        self.present = present or (lambda _v: True)
        self._published_revision = -1  # the state revision whose shares the gauges show
        self._published_shares: set[tuple[int, str]] = set()
        # the target calls of the last infer(): (version, request indices, start ns, end ns, ok), in
        # call order (time.perf_counter_ns): what tracing's target spans and the cost meter read
        self.calls: list[tuple[int, list[int], int, int, bool]] = []
        # the calling thread's CPU inside this batch's target calls: what an in-process target
        # ran on the serving thread (the cost meter's guard time leaves it out; wall time would
        # also leave out the time the thread waited for a core, and read 0 under load)
        self.calls_cpu_ns = 0
        self._whole: dict[str, np.ndarray] | None = None
        # the collaborators (they read the router's clock, which tests and tools may replace)
        now = self.now
        self.alerts = Alerts(guard=guard, target=target, config=config, clock=now)
        self.view = RolloutView(guard=guard, repo=repo, target=target, store=store,
                                poll_interval_s=config.poll_interval_s, metrics=metrics, pin=pin)
        self.breakers = Breakers(guard=guard, target=target, config=breaker, view=self.view, metrics=metrics,
                                 alert=self.alerts)
        self.view.on_new = self.breakers.follow
        self.worker = ComparisonWorker(guard=guard, size=config.compare_queue, metrics=metrics)
        self.signals = Signals(guard=guard, repo=repo, target=target, config=config,
                               min_requests=breaker.min_requests, view=self.view, breakers=self.breakers,
                               metrics=metrics, alert=self.alerts, submit=self.worker.submit, clock=now)
        self.goldens = self._goldens(validator, registry, max_batch)
        self.goldens.present = self.present
        self.comparator = self._comparator(registry)
        self.worker.compare = self.comparator.compare
        self.worker.share_breaker = self.breakers.share
        self.worker.score_drift = self.signals.score_drift
        self.signals.prepare(self.primary())  # its reference read and scipy imported before traffic
        self.worker.start()
        self._stop = threading.Event()
        self._reconciler = None
        if config.reconcile_interval_s > 0:
            self._reconciler = threading.Thread(target=self._reconcile, name=f"reconcile-{guard}", daemon=True)
            self._reconciler.start()

    def _goldens(self, validator: ValidatorConfig, registry: ValidatorRegistry, max_batch: int) -> GoldensChecker:
        return GoldensChecker(guard=self.guard, repo=self.repo, target=self.target, view=self.view,
                              target_for=self.target_for, output_names=self.output_names, validator=validator,
                              registry=registry, metrics=self.metrics, alert=self.alerts, clock=self.now,
                              enabled=self.config.golden_check, max_batch=max_batch)

    def _comparator(self, registry: ValidatorRegistry) -> Any:
        return BatchComparator(guard=self.guard, target=self.target, config=self.config, view=self.view,
                               breakers=self.breakers, signals=self.signals, target_for=self.target_for,
                               validator_for=self.goldens.validator_for, registry=registry,
                               output_names=self.output_names, metrics=self.metrics, latency=self.latency,
                               clock=self.now)

    def now(self) -> float:
        return self.clock()

    # -- what the guard and the stages ask ----------------------------------------------------
    @property
    def state(self) -> RolloutState:
        return self.view.state

    @property
    def tracer(self) -> Any:
        return self.worker.tracer

    @tracer.setter
    def tracer(self, tracer: Any) -> None:  # a tritonguard.observe.tracing.Tracer: comparison spans
        self.worker.tracer = tracer

    @property
    def dropped(self) -> int:
        return self.worker.dropped

    def refresh(self, now: float, *, wait: bool = False) -> None:
        self.view.refresh(now, wait=wait)

    def primary(self) -> int:
        return self.view.primary()

    def named_versions(self) -> list[int]:
        return self.view.named_versions()

    def call_share(self, version: int) -> float:
        return self.view.call_share(version)

    def breaker(self, version: int) -> Breaker:
        return self.breakers.get(version)

    def golden_verdict(self, version: int) -> str:
        return self.goldens.verdict(version)

    def check_goldens(self, version: int) -> dict[str, Any]:
        return self.goldens.check(version)

    def validator_for(self, version: int) -> ValidatorConfig:
        return self.goldens.validator_for(version)

    def target_for(self, version: int) -> Any:
        t = self._targets.get(version)
        if t is None:
            with self._target_lock:  # the serving thread, the worker and the reconciler
                t = self._targets.get(version)
                if t is None:
                    try:
                        t = self.make_target(version)
                    except TargetError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - a version that cannot load (in process: a
                        # missing file, a bad artifact) fails its requests like a target error, so
                        # they fall back down the chain; the details (paths) stay in the log
                        log.exception("guard %s: %s v%d could not be loaded", self.guard, self.target, version)
                        raise TargetError(f"version {version} of '{self.target}' could not be loaded: "
                                          f"{type(exc).__name__}", "UNAVAILABLE") from None
                    self._targets[version] = t
        return t

    def routable(self, version: int, now: float) -> bool:
        """Present here, goldens not FAILed, breaker letting calls through (a version not
        fetched yet is not routable, and its goldens are not run)."""
        return self.present(version) and self.golden_verdict(version) != FAIL and self.breakers.get(version).allow(now)

    # -- serving ---------------------------------------------------------------------------
    def infer(self, fused: dict[str, np.ndarray], sizes: list[int],
              pins: list[int | None] | None = None, traced: dict[int, Any] | None = None,
              draws: np.ndarray | None = None) -> Routed:
        """Route one batch. ``draws``: per request, its uniform draw in [0, 1) when an earlier
        stage drew it (the cache, which lets the candidate's band skip it); else drawn here.
        ``pins``: per request, the version it must be answered by (the ``version`` request
        parameter, e.g. reproducible batch scoring; ``PRIMARY_PIN``: the primary) or None: one the state names and that is
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
        self.calls_cpu_ns = 0
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
        self.signals.observe_inputs(fused, primary)
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
        named = set(self.view.named_versions())
        pinned = set()
        for i, pin in enumerate(pins):
            if pin is None:
                continue
            if pin == PRIMARY_PIN:  # version=primary
                pin = self.primary()
            if pin <= 0:
                errors[i] = InvalidInput("version", "version", "request parameter 'version' must be a positive integer")
            elif pin not in named:
                errors[i] = TargetError(f"version {pin} of '{self.target}' is not routed here (served: "
                                        f"{', '.join(f'v{v}' for v in sorted(named))})", "UNAVAILABLE")
            elif not self.routable(pin, now):
                why = "breaker open or goldens failed" if self.present(pin) else "not fetched to this replica yet"
                errors[i] = TargetError(f"version {pin} of '{self.target}' is not routable now ({why}); retry later",
                                        "UNAVAILABLE")
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
        if (primary is not None and primary not in tried and self.present(primary)
                and self.golden_verdict(primary) != FAIL):
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
        t0_ns, c0_ns = time.perf_counter_ns(), 0
        try:
            target = self.target_for(version)  # the first call in process loads the version: not its latency
            t0_ns, c0_ns = time.perf_counter_ns(), time.thread_time_ns()
            out = target.infer(sub)
        except TargetError as exc:
            self.calls.append((version, idx, t0_ns, time.perf_counter_ns(), False))
            if c0_ns:
                self.calls_cpu_ns += time.thread_time_ns() - c0_ns
            if len(idx) > 1:  # isolate: one poisonous request must not fail its neighbours
                ok: list[int] = []
                for i in idx:
                    ok += self._call(version, [i], fused, starts, out_rows, served, reasons)
                if len(ok) == len(idx):
                    # every request succeeded alone: the version failed the batch, not an input.
                    # Users saw no error, but it is a hard fault of the version all the same
                    self.signals.record(version, len(idx), fused=len(idx))
                    self.metrics.inc("fused_failures", len(idx), target_version=str(version))
                    log.warning("guard %s: %s v%d failed a fused call of %d requests that each succeeded "
                                "alone: %s", self.guard, self.target, version, len(idx), exc)
                return ok
            latency = (time.perf_counter_ns() - t0_ns) / 1e6
            self.signals.record(version, 1, errors=1, latency_ms=latency)
            # one count per request this version failed (the rollout gates divide by requests)
            self.metrics.inc("target_errors", 1, code=exc.code, target_version=str(version))
            reasons[idx[0]] = "error"
            self._last_error[idx[0]] = exc
            log.warning("guard %s: %s v%d failed a request: %s", self.guard, self.target, version, exc)
            return []
        t1_ns = time.perf_counter_ns()
        self.calls_cpu_ns += time.thread_time_ns() - c0_ns
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
        self.signals.record(version, len(idx), non_finite=bad, latency_ms=latency)
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

    # -- off the critical path -------------------------------------------------------------
    def _reconcile(self) -> None:
        """Follow the store without waiting for traffic: an idle guard has the new state, its
        golden verdicts and its breaker gauges within ``reconcile_interval_s`` of a change."""
        while not self._stop.wait(self.config.reconcile_interval_s):
            try:
                self.refresh(self.clock(), wait=True)
                named = self.view.named_versions()
                for version in named:
                    if (self.config.golden_check and str(version) not in self.state.goldens
                            and self.present(version) and self.ready(version)):
                        self.golden_verdict(version)
                with self.breakers.lock:
                    for version in named:  # a gauge for every routed version, served yet or not
                        self.breakers.get(version)
                self.publish()
                if self.latency is not None and not self.latency.flush():
                    self.metrics.inc("state_errors", 1)
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                log.exception("guard %s: reconcile pass failed", self.guard)

    def _enqueue_comparisons(self, fused, starts, out_rows, served, first, cand, primary, draws, to_cand,
                             traced=None) -> None:
        now = self.clock()
        for version, shadow in self.view.experiments().items():
            if not self.present(version):  # not here yet: nothing to mirror to, and no error of its own
                continue
            canary = ([i for i in out_rows if served[i] == f"{self.target}:{version}"]
                      if self.config.canary_compare else [])
            # shadow: a sample of primary-served requests is also run on the candidate; while its
            # breaker is half-open, mirrored traffic is what probes it (at least 10 %)
            b = self.breakers.get(version)
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
                self.worker.submit((kind, other, served_v, sub, got, spans) if spans else (kind, other, served_v, sub, got))

    def publish(self) -> None:
        """Breaker states and the routed shares as gauges (cheap: local values, pushed by the
        metrics thread; the shares only when the state's revision changed)."""
        self.breakers.publish()
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
        self.worker.stop()
        if self._reconciler is not None:
            self._reconciler.join(timeout=2)
        if self.latency is not None:
            self.latency.flush()  # the last calls still count for a rollout being judged
        self.alerts.flush(timeout=1)


__all__ = ["Router", "RoutingConfig", "Routed", "route_shares"]
