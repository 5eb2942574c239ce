"""Progressive rollout controller: walks a candidate through traffic steps with gates between them.

Each :meth:`RolloutController.tick` is one look: read the guards' metrics, judge the window since
the step began with :func:`exporter.rollout.gates.evaluate.evaluate`, then

- FAIL at any look: roll back at once (candidate out of the rollout state, ``on_rollback``);
- PASS once the step has dwelt ``dwell_s``: next step (``on_step``), or after the last one
  promote (``on_promote`` first, so a refused approval keeps the candidate where it is and
  pauses; then the candidate becomes primary and the old primary ``previous_primary``);
- INCONCLUSIVE (too little traffic, missing metrics): hold; never advance. ``max_step_s``
  optionally turns a step that stays inconclusive that long into a rollback.

Modes: ``split`` (A/B: the steps are the candidate's share of live traffic), ``shadow``
(the steps are ``shadow_share``: the candidate runs on mirrored traffic, its answers are
discarded, its share stays 0) and ``abn`` (A/B/n: several versions with weights, ``arms``
{version: full weight}; at step s % each live arm gets s % of its weight, through the state's
``arms``). In ``abn`` every arm is judged on its own window against the primary; a failing arm
is taken out alone (``on_rollback`` for it) while the others go on; the step advances when every
live arm passes; after the last step the arms stay at their full weights (``done``): an A/B/n
experiment has no single winner to promote, an operator ends it (``route --arms none``, then
``promote`` the winner). Every arm failing is a rollback.

The routing change goes through :func:`tritonguard.rollout.state.open_store`, the store the guards poll.
Progress (step, step start, look, the step's baseline readings, status, the configuration) is a
JSON document in the same store as the state (:mod:`exporter.records.progress`): the file
``<repo>/<guard>/rollout_controller.json`` beside a file state, the key
``tritonguard:rollout:<model>`` beside a Redis state. It is rewritten after every change, so a
new controller object (another process, another host after a crash) :meth:`resume` s at the same
step, dwell and baseline, with the gates it started with. Every read-modify-write holds the
store's lock; :meth:`run` also holds the driver lock so that only one process drives a rollout,
while :meth:`abort` and :meth:`pause` work from anywhere. Hooks must be idempotent: a crash
between a hook and the state write repeats the hook on resume.

Around the controller: :mod:`exporter.rollout.progress` (the configuration, the progress
document, the statuses, the evidence), :mod:`exporter.rollout.window` (the readers, and one
look at a window) and :mod:`exporter.rollout.arms` (the A/B/n half of the controller).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from exporter.records.progress import LEASE_S, ControllerError, open_progress
from exporter.rollout.arms import AbnRollout
from exporter.rollout.gates.readings import GuardReadings
from exporter.rollout.gates.reasons import golden_reason
from exporter.rollout.gates.verdict import FAIL, PASS, GateReport
from exporter.rollout.guards import validator_limits
from exporter.rollout.progress import (
    ABORTED,
    ACTIVE,
    DONE,
    FORMAT_VERSION,
    PAUSED,
    ROLLED_BACK,
    RUNNING,
    SUPERSEDED,
    Progress,
    RolloutConfig,
    evidence,
    judge_doc,
    passed_on,
    pin_primary,
)
from exporter.rollout.window import (
    WINDOW,
    LabelsReader,
    LatencyReader,
    Reader,
    breaker_from_state,
    look,
)
from tritonguard.rollout.latency import paired_key
from tritonguard.rollout.state import Candidate, RolloutState, StateError
from tritonguard.rollout.stores import open_store

__all__ = ["RolloutController", "settle_progress"]

log = logging.getLogger(__name__)


def settle_progress(model: str, repo: str | os.PathLike, state: RolloutState, reason: str, *,
                    rolled_back: bool = False) -> Progress | None:
    """After the routing changed outside a rollout: a finished (``done``) rollout whose outcome
    no longer holds in ``state`` -- its candidate is no longer the primary, or (A/B/n) its arms
    left the split -- becomes ``rolled_back`` (``exporter rollback``) or ``superseded``, with
    ``reason``, so status views stop calling it promoted. Active rollouts are left to their
    driver (it notices changes at its next look). Never raises: logs and returns None."""
    try:
        return RolloutController(model, repo, reader=None, store=None).settle(state, reason,  # type: ignore[arg-type]
                                                                              rolled_back=rolled_back)
    except Exception as exc:  # noqa: BLE001 - the routing change stands; the record is only a view
        log.warning("rollout progress of '%s' not updated after a routing change: %s", model, exc)
        return None


class RolloutController(AbnRollout):
    def __init__(self, model: str, repo: str | os.PathLike, reader: Reader, *,
                 config: RolloutConfig | None = None, store: Any = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 on_promote: Callable[[int], Any] | None = None,
                 on_rollback: Callable[[int, str], Any] | None = None,
                 on_step: Callable[[int, float, GateReport | None], Any] | None = None,
                 by: str = "controller", lease_s: float = LEASE_S,
                 latency_reader: LatencyReader | None = None, labels_reader: LabelsReader | None = None):
        self.model, self.reader, self.repo = model, reader, repo
        self.latency_reader = latency_reader
        self.labels_reader = labels_reader
        self.config = config or RolloutConfig()
        self.store = store if store is not None else open_store(model, repo)
        self.progress = open_progress(model, repo, self.store, lease_s=lease_s)
        self.clock, self.sleep, self.by = clock, sleep, by
        self.on_promote, self.on_rollback, self.on_step = on_promote, on_rollback, on_step

    # -- progress ---------------------------------------------------------------------------
    def status(self) -> Progress | None:
        text = self.progress.read()
        if text is None:
            return None
        try:
            d = json.loads(text)
            if d.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format_version {d.get('format_version')} is not {FORMAT_VERSION}")
            return Progress(**d)
        except (ValueError, TypeError) as exc:
            raise ControllerError(f"rollout progress {self.progress.where} is unreadable: {exc}") from None

    def _save(self, p: Progress) -> Progress:
        p.updated_at = self.clock()
        self.progress.write(json.dumps(p.to_dict(), indent=1, sort_keys=True))
        return p

    def _lock(self):
        return self.progress.lock()

    def _status_or(self, last: Progress | None) -> Progress | None:
        try:
            return self.status() or last
        except StateError:
            return last

    # -- commands -----------------------------------------------------------------------------
    def start(self, candidate: int | None = None, primary: int | None = None) -> Progress:
        """Route the first step to ``candidate`` (``abn``: to the configured arms; no candidate)
        and persist the rollout as running."""
        cfg = self.config
        if (cfg.mode == "abn") != (candidate is None):
            raise ControllerError("an abn rollout takes its versions from rollout.arms, the others one candidate")
        with self._lock():
            old = self.status()
            if old is not None and old.status in ACTIVE:
                raise ControllerError(f"a rollout of '{self.model}' v{old.candidate} is {old.status}; "
                                      "abort it first")
            state = self.store.load() or RolloutState(model=self.model)
            primary = state.primary if primary is None else primary
            if primary < 1:
                raise ControllerError(f"'{self.model}' has no pinned primary version: pass primary=N "
                                      "(or route --primary N) before a rollout")
            if cfg.mode == "abn":
                return self._start_arms(cfg, state, primary)
            if candidate == primary:
                raise ControllerError(f"v{candidate} is already the primary of '{self.model}'")
            if state.arms:
                raise ControllerError(f"'{self.model}' runs an A/B/n split (arms "
                                      f"{', '.join(f'v{a.version}' for a in state.arms)}): end it first "
                                      f"(exporter route {self.model} --arms none)")
            share = cfg.steps[0] / 100

            def route(s: RolloutState) -> RolloutState:
                pin_primary(s, primary)
                split = cfg.mode == "split"
                s.candidate = Candidate(candidate, share if split else 0.0)
                s.shadow_share = 0.0 if split else share
                s.breakers.pop(str(candidate), None)  # a fresh rollout starts with a closed breaker
                s.judges[str(candidate)] = judge_doc(cfg)  # how the guards compare it
                return s

            self.store.update(route, by=self.by)
            now = self.clock()
            p = self._save(Progress(model=self.model, candidate=candidate, primary=primary, mode=cfg.mode,
                                    steps=list(cfg.steps), config=cfg.to_dict(), step_started_at=now,
                                    started_at=now))
        log.info("rollout of '%s' v%d started (%s, %g %%)", self.model, candidate, cfg.mode, cfg.steps[0])
        self._hook(self.on_step, 0, share, None)
        return p

    def tick(self) -> Progress:
        """One look: read, judge, act. Returns the progress (unchanged when not running)."""
        with self._lock():
            p = self.status()
            if p is None:
                raise ControllerError(f"no rollout of '{self.model}' to drive")
            if p.status != RUNNING:
                return p
            cfg = self._config(p)
            if p.mode == "abn":
                return self._tick_arms(p, cfg)
            state = self.store.load()
            if state is None or state.candidate is None or state.candidate.version != p.candidate:
                return self._finish(p, ABORTED, "the candidate was changed outside the controller",
                                    touch_state=False)
            try:
                readings = self.reader(p.primary, p.candidate)
            except Exception as exc:  # noqa: BLE001 - unreachable metrics: hold, never pass
                log.warning("rollout of '%s': metrics unavailable: %s", self.model, exc)
                p.reason = f"metrics unavailable: {type(exc).__name__}: {exc}"
                return self._timeout(p, cfg) or self._save(p)
            breaker_from_state(readings, state, p.candidate)
            golden = state.goldens.get(str(p.candidate), {})
            if golden.get("verdict") == FAIL:
                # the guards never route to it: no traffic would ever judge it, so it is done
                return self._finish(p, ROLLED_BACK, f"{self._golden_text(golden)} (on the server, at "
                                                    f"{p.share:.0%})")
            window = {k: getattr(p, k) for k in WINDOW}
            report = look(window, readings, cfg, p.mode, self._latency(p.primary, p.candidate), p.share,
                                trip=state.breakers.get(str(p.candidate)),
                                labels=self._labels(cfg, [p.primary, p.candidate], p.started_at))
            for k in WINDOW:
                setattr(p, k, window[k])
            if report is None:
                return self._save(p)
            if report.verdict == FAIL:
                return self._finish(p, ROLLED_BACK, f"gate failed at {p.share:.0%}: {report.summary()}")
            dwelt = self.clock() - p.step_started_at >= cfg.dwell_s
            if report.verdict != PASS or not dwelt:
                return self._timeout(p, cfg) or self._save(p)
            for g in report.to_dict()["gates"]:
                if g["verdict"] == PASS and (what := passed_on(g)):
                    p.judged[g["name"]] = what
            if p.step_index + 1 < len(p.steps):
                return self._advance(p, readings, report)
            return self._complete(p, cfg)

    def run(self, *, max_ticks: int | None = None) -> Progress:
        """Tick every ``interval_s`` until the rollout stops running (or ``max_ticks`` looks)."""
        with self.progress.driver() as lease:
            ticks, last = 0, None
            while True:
                try:
                    p = last = self.tick()
                except StateError as exc:  # e.g. Redis down: nothing was applied; look again later
                    log.warning("rollout of '%s': store unavailable, holding: %s", self.model, exc)
                    p = self._status_or(last)
                    if p is None:
                        raise
                ticks += 1
                if p.status != RUNNING or (max_ticks is not None and ticks >= max_ticks):
                    return p
                if lease.lost:
                    raise ControllerError(f"rollout of '{self.model}': lost the driver lease "
                                          f"({self.progress.where}); another process may drive it now")
                self.sleep(self._config(p).interval_s)

    def resume(self, *, max_ticks: int | None = None) -> Progress:
        """Continue a paused or interrupted rollout where its progress file left it."""
        with self._lock():
            p = self.status()
            if p is None or p.status not in ACTIVE:
                raise ControllerError(f"no paused or running rollout of '{self.model}' to resume")
            if p.status == PAUSED:
                p.status, p.reason = RUNNING, "resumed"
                self._save(p)
        log.info("rollout of '%s' v%d resumes at step %d (%g %%)", self.model, p.candidate,
                 p.step_index, p.steps[p.step_index])
        return self.run(max_ticks=max_ticks)

    def pause(self, reason: str = "paused by operator") -> Progress:
        with self._lock():
            p = self.status()
            if p is None or p.status != RUNNING:
                raise ControllerError(f"no running rollout of '{self.model}' to pause")
            p.status, p.reason = PAUSED, reason
            return self._save(p)

    def settle(self, state: RolloutState, reason: str, *, rolled_back: bool = False) -> Progress | None:
        """See :func:`settle_progress`."""
        with self._lock():
            p = self.status()
            if p is None or p.status != DONE or self._holds(p, state):
                return p
            p.status = ROLLED_BACK if rolled_back else SUPERSEDED
            p.reason = f"{p.reason}; then {reason}" if p.reason else reason
            log.info("rollout of '%s' %s: %s", self.model, p.status, reason)
            return self._save(p)

    def _holds(self, p: Progress, state: RolloutState) -> bool:
        """Whether what the finished rollout ``p`` left in the routing still stands in ``state``."""
        if p.mode == "abn":
            routed = {a.version for a in state.arms}
            return bool(p.live_arms()) and set(p.live_arms()) <= routed
        if self._config(p).promote:
            return state.primary == p.candidate
        return state.candidate is not None and state.candidate.version == p.candidate

    def peek(self) -> dict[str, Any] | None:
        """A look at the running window without acting on it: the gate reports the next look
        would judge (per arm for A/B/n), from the reader's current metrics. Nothing is written.
        None without a rollout; ``{"error": ...}`` when the metrics cannot be read."""
        p = self.status()
        if p is None:
            return None
        cfg = self._config(p)
        state = self.store.load()
        versions = p.live_arms() if p.mode == "abn" else [p.candidate]
        out: dict[str, Any] = {"status": p.status, "windows": {}}
        for v in versions:
            window = ({k: p.arms[str(v)].get(k) for k in WINDOW} if p.mode == "abn"
                      else {k: getattr(p, k) for k in WINDOW})
            window = json.loads(json.dumps(window))  # a copy: look() writes into it
            try:
                readings = self.reader(p.primary, v)
            except Exception as exc:  # noqa: BLE001 - unreachable replicas: said, not raised
                return {"status": p.status, "error": f"metrics unavailable: {type(exc).__name__}: {exc}"}
            if state is not None:
                breaker_from_state(readings, state, v)
            share = p.share * p.arms[str(v)]["weight"] if p.mode == "abn" else p.share
            mode = "split" if p.mode == "abn" else p.mode
            if window["baseline"] is None:
                out["windows"][str(v)] = {"report": None, "reason": "no baseline yet (the driver's first look "
                                                                    "takes it)", "readings": readings.to_dict()}
                continue
            report = look(window, readings, cfg, mode, self._latency(p.primary, v), share,
                                trip=state.breakers.get(str(v)) if state else None,
                                labels=self._labels(cfg, [p.primary, v], p.started_at))
            out["windows"][str(v)] = {"report": None if report is None else report.to_dict(),
                                      "reason": window["reason"], "readings": readings.to_dict()}
        return out

    def abort(self, reason: str = "aborted by operator") -> Progress:
        """Stop the rollout and take the candidate out of the routing state."""
        with self._lock():
            p = self.status()
            if p is None or p.status not in ACTIVE:
                raise ControllerError(f"no active rollout of '{self.model}' to abort")
            return self._finish(p, ABORTED, reason)

    # -- transitions --------------------------------------------------------------------------
    def _advance(self, p: Progress, readings: GuardReadings, report: GateReport) -> Progress:
        p.step_index += 1
        share, split = p.share, p.mode == "split"

        def route(s: RolloutState) -> RolloutState:
            if s.candidate is not None and s.candidate.version == p.candidate:
                s.candidate.share = share if split else 0.0
                s.shadow_share = 0.0 if split else share
            return s

        self.store.update(route, by=self.by)
        p.step_started_at, p.look, p.baseline = self.clock(), 0, readings.to_dict()
        self._save(p)
        log.info("rollout of '%s' v%d: step %d, %g %%", self.model, p.candidate, p.step_index, share * 100)
        self._hook(self.on_step, p.step_index, share, report)
        return p

    def _complete(self, p: Progress, cfg: RolloutConfig) -> Progress:
        if not cfg.promote:
            p.status, p.reason = DONE, "all steps passed; left at the last step (promote=False)"
            return self._save(p)
        if self.on_promote is not None:
            try:
                self.on_promote(p.candidate)
            except Exception as exc:  # noqa: BLE001 - e.g. ApprovalRefused: hold, an operator decides
                log.warning("rollout of '%s' v%d: promotion refused: %s", self.model, p.candidate, exc)
                p.status, p.reason = PAUSED, f"promotion refused: {type(exc).__name__}: {exc}"
                return self._save(p)

        def promote(s: RolloutState) -> RolloutState:
            if s.primary != p.candidate:
                s.previous_primary = s.primary if s.primary > 0 else s.previous_primary
                s.primary = p.candidate
            s.candidate, s.shadow_share = None, 0.0
            s.judges.pop(str(p.candidate), None)
            return s

        self.store.update(promote, by=self.by)
        p.status, p.reason = DONE, f"promoted; judged on: {evidence(p)}"
        log.info("rollout of '%s': v%d promoted to primary", self.model, p.candidate)
        return self._save(p)

    def _finish(self, p: Progress, status: str, reason: str, *, touch_state: bool = True) -> Progress:
        if p.mode == "abn":
            return self._finish_arms(p, status, reason, p.live_arms() if touch_state else [])
        if touch_state:
            def remove(s: RolloutState) -> RolloutState:
                if s.candidate is not None and s.candidate.version == p.candidate:
                    s.candidate, s.shadow_share = None, 0.0
                s.judges.pop(str(p.candidate), None)
                return s

            self.store.update(remove, by=self.by)
        p.status, p.reason = status, reason
        self._save(p)
        log.warning("rollout of '%s' v%d %s: %s", self.model, p.candidate, status, reason)
        self._hook(self.on_rollback, p.candidate, reason)
        return p

    def _latency(self, primary: int, candidate: int) -> Callable[[float], tuple[Any, Any]] | None:
        """(candidate, primary) latency samples of the same window, from the store; None without
        a latency reader. Only calls made at the same time are compared: the load differs between
        windows."""
        if self.latency_reader is None:
            return None

        read = self.latency_reader

        def samples(since: float) -> tuple[Any, Any]:
            # paired timings (same rows, back to back in the canary worker) where the guards make
            # them; serving-path calls only from guards that do not (canary comparison off)
            cand = read(paired_key(candidate, "candidate"), since)
            if len(cand):
                return cand, read(paired_key(candidate, "primary"), since)
            return read(candidate, since), read(primary, since)
        return samples

    def _labels(self, cfg: RolloutConfig, versions: list[int], since: float) -> Any:
        """Labelled rows of ``versions`` since the rollout began (a task judge only); None
        without a reader or when the store cannot be read (the gate then reads the metrics; with
        ``min_labels`` it holds)."""
        if self.labels_reader is None or cfg.gates.judge != "task":
            return None
        try:
            return self.labels_reader(versions, since)
        except Exception as exc:  # noqa: BLE001 - labels unavailable: the gate says so
            log.warning("rollout of '%s': labels unavailable (%s: %s)", self.model, type(exc).__name__, exc)
            return None

    def _golden_text(self, golden: dict[str, Any]) -> str:
        return golden_reason(golden, validator_limits(self.repo, self.model))

    def _timeout(self, p: Progress, cfg: RolloutConfig) -> Progress | None:
        limit = cfg.max_step_s
        if limit is not None and self.clock() - p.step_started_at > limit:
            return self._finish(p, ROLLED_BACK, f"no conclusive gate within max_step_s={limit:g} s "
                                                f"at {p.share:.0%} ({p.reason})")
        return None

    def _config(self, p: Progress) -> RolloutConfig:
        """The configuration the rollout was started with: a resumed one keeps its gates."""
        return RolloutConfig.from_dict(p.config) if p.config else self.config

    def _hook(self, fn: Callable[..., Any] | None, *args: Any) -> None:
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a hook must not wedge the rollout; it is logged
            log.exception("rollout of '%s': hook %s failed", self.model, getattr(fn, "__name__", fn))
