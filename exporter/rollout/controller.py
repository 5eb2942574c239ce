"""Progressive rollout controller: walks a candidate through traffic steps with gates between them.

Each :meth:`RolloutController.tick` is one look: read the guards' metrics, judge the window since
the step began with :func:`exporter.rollout.gates.engine.evaluate`, then

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
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from exporter.records.progress import (
    LEASE_S,
    PROGRESS_FILE,
    ControllerError,
    ProgressUnavailable,
    open_progress,
)
from exporter.rollout.gates.config import GateConfig
from exporter.rollout.gates.evaluate import evaluate
from exporter.rollout.gates.readings import GuardReadings, scrape
from exporter.rollout.gates.reasons import golden_reason, trip_reason
from exporter.rollout.gates.verdict import FAIL, INCONCLUSIVE, PASS, GateReport
from exporter.rollout.guards import validator_limits
from exporter.rollout.judge import OfflineJudgement
from tritonguard.rollout.feedback import LABEL, open_feedback_log, tally
from tritonguard.rollout.latency import open_latency_log, paired_key
from tritonguard.rollout.state import Arm, Candidate, RolloutState, StateError, open_store

__all__ = ["PROGRESS_FILE", "ControllerError", "ProgressUnavailable", "RolloutConfig", "RolloutController",
           "Progress", "evidence", "metrics_reader", "settle_progress", "store_labels_reader"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
RUNNING, PAUSED, ABORTED, DONE, ROLLED_BACK = "running", "paused", "aborted", "done", "rolled_back"
# a finished rollout whose outcome was later replaced by hand (route --primary, --arms, promote
# --no-rollout): the record stays, saying it no longer describes what serves
SUPERSEDED = "superseded"
ACTIVE = (RUNNING, PAUSED)
BREAKER_CODES = {"closed": 0, "half_open": 1, "open": 2}
WINDOW = ("baseline", "look", "reference", "last_report", "reason")  # one gated window's fields
Reader = Callable[[int, int], GuardReadings]  # (primary, candidate) -> readings
# (version, since) -> that version's exact per-call latencies since a wall-clock time
LatencyReader = Callable[[int, float], Any]
# (versions, since) -> their labelled rows answered since then (tritonguard.rollout.feedback.Tally)
LabelsReader = Callable[[Sequence[int], float], Any]


@dataclass(kw_only=True)
class RolloutConfig:
    steps: tuple[float, ...] = (1, 5, 10, 25, 50, 100)  # percent of traffic (or mirrored traffic)
    mode: str = "split"  # "split", "shadow" or "abn"
    arms: dict[int, float] | None = None  # abn: version -> full traffic weight (fraction)
    dwell_s: float = 300.0  # minimum time at each step
    interval_s: float = 30.0  # time between looks
    max_step_s: float | None = None  # an inconclusive step this old rolls back; None: hold forever
    promote: bool = True  # after the last step: make the candidate primary; False: stop there
    gates: GateConfig = field(default_factory=GateConfig)
    offline: dict[str, Any] | None = None  # the judgement before traffic (exporter.rollout.judge), for the record

    def __post_init__(self) -> None:
        self.steps = tuple(float(s) for s in self.steps)
        if not self.steps or any(not 0 < s <= 100 for s in self.steps) or \
                list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"rollout.steps must be increasing percentages in (0, 100], got {self.steps}")
        if self.mode not in ("split", "shadow", "abn"):
            raise ValueError(f"rollout.mode must be 'split', 'shadow' or 'abn', got {self.mode!r}")
        if self.mode == "abn":
            arms = {int(v): float(w) for v, w in (self.arms or {}).items()}
            if not arms or any(not 0 < w < 1 for w in arms.values()) or sum(arms.values()) >= 1:
                raise ValueError(f"rollout.arms (abn) must give each version a weight in (0, 1), summing "
                                 f"below 1 (the primary answers the rest), got {self.arms}")
            self.arms = arms
        elif self.arms:
            raise ValueError(f"rollout.arms is for mode 'abn', not {self.mode!r}")
        if self.dwell_s < 0 or self.interval_s <= 0:
            raise ValueError("rollout.dwell_s must be >= 0 and rollout.interval_s > 0")
        if self.max_step_s is not None and self.max_step_s < self.dwell_s:
            raise ValueError(f"rollout.max_step_s ({self.max_step_s}) must be >= dwell_s ({self.dwell_s})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutConfig:
        gates = dict(d.get("gates", {}))
        if "agree_verdicts" in gates:
            gates["agree_verdicts"] = tuple(gates["agree_verdicts"])
        return cls(**{**d, "steps": tuple(d["steps"]), "gates": GateConfig(**gates),
                      "arms": {int(v): w for v, w in d["arms"].items()} if d.get("arms") else None})


@dataclass(kw_only=True)
class Progress:
    model: str
    candidate: int
    primary: int
    mode: str
    steps: list[float]
    config: dict[str, Any] = field(default_factory=dict)  # the RolloutConfig it was started with
    status: str = RUNNING
    step_index: int = 0
    step_started_at: float = 0.0
    started_at: float = 0.0
    look: int = 0
    baseline: dict[str, Any] | None = None  # GuardReadings at the start of the step's window
    reference: dict[str, float] | None = None  # primary latency buckets of an earlier window
    last_report: dict[str, Any] | None = None
    reason: str = ""
    updated_at: float = 0.0
    # abn: per arm ("<version>"): weight, status, and its own window (baseline, look, reference,
    # last_report, reason); the fields above then describe the rollout as a whole
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    # gate -> what its last PASS rested on (the evidence promote's last line names)
    judged: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def live_arms(self) -> list[int]:
        return [int(v) for v, a in self.arms.items() if a["status"] == RUNNING]

    @property
    def share(self) -> float:
        return self.steps[self.step_index] / 100

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pin_primary(s: RolloutState, primary: int) -> None:
    """Make ``primary`` the state's primary, remembering the one it replaces."""
    if s.primary != primary:
        if s.primary > 0:
            s.previous_primary = s.primary
        s.primary = primary


def _judge_doc(cfg: RolloutConfig) -> dict[str, Any]:
    """The rollout state's ``judges`` entry for a version under test: how the guards compare it."""
    doc: dict[str, Any] = {"judge": cfg.gates.judge}
    if cfg.gates.judge == "task" and cfg.gates.cosine_floor is not None:
        doc["cosine"] = cfg.gates.cosine_floor
    return doc


def _name_the_trip(report: GateReport, breaker: dict[str, Any] | None) -> None:
    """A failing breaker gate says why the breaker tripped (the figure against its limit), from
    the breaker document the guards share in the rollout state."""

    last = (breaker or {}).get("last_trip")
    if not last:
        return
    for g in report.gates:
        if g.name == "breaker" and g.verdict == FAIL:
            g.reason = f"{g.reason}; last trip {trip_reason(last)}"


def _passed(g: dict[str, Any]) -> str | None:
    """A few words on what a passing gate rested on; None for gates every rollout passes."""
    f = g.get("figures") or {}
    name = g["name"]
    if name == "disagreement":
        return (f"disagreement limit {f.get('limit', 0):.2%} ({f.get('limit_source', '')}): "
                f"{f.get('disagree', 0):.0f}/{f.get('compared', 0):.0f} rows differ")
    if name == "labels":
        origins = ", ".join(f"{k} {v:.0f}" for k, v in sorted((f.get("origins") or {}).items()))
        return (f"live labels: accuracy {f.get('candidate_accuracy', 0):.2%} vs {f.get('primary_accuracy', 0):.2%} "
                f"on {f.get('candidate_labeled', 0):.0f} / {f.get('primary_labeled', 0):.0f} rows ({origins})")
    if name == "agreement":
        return f"validator agreement {f.get('agreement', 0):.2%} on {f.get('compared', 0):.0f} rows"
    if name == "latency":
        return "latency" + (f" (ratio {f['ratio']:.3f})" if isinstance(f.get("ratio"), (int, float)) else "")
    if name == "cost":
        return "cost"
    return None


def evidence(p: Progress) -> str:
    """What the rollout's decisions rested on: the offline judgement, then each live gate's
    last PASS, so that a promotion without labels reads as one on a disagreement limit."""

    parts = []
    offline = (p.config or {}).get("offline")
    if offline:
        try:
            parts.append(OfflineJudgement(**offline).evidence())
        except TypeError:  # a progress written by an older release
            parts.append(f"offline {offline.get('verdict', '?')}")
    else:
        parts.append("no offline judgement")
    parts.extend(p.judged.values())
    return "; ".join(parts)


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


class RolloutController:
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
                _pin_primary(s, primary)
                split = cfg.mode == "split"
                s.candidate = Candidate(candidate, share if split else 0.0)
                s.shadow_share = 0.0 if split else share
                s.breakers.pop(str(candidate), None)  # a fresh rollout starts with a closed breaker
                s.judges[str(candidate)] = _judge_doc(cfg)  # how the guards compare it
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
            self._breaker_from_state(readings, state, p.candidate)
            golden = state.goldens.get(str(p.candidate), {})
            if golden.get("verdict") == FAIL:
                # the guards never route to it: no traffic would ever judge it, so it is done
                return self._finish(p, ROLLED_BACK, f"{self._golden_text(golden)} (on the server, at "
                                                    f"{p.share:.0%})")
            window = {k: getattr(p, k) for k in WINDOW}
            report = self._look(window, readings, cfg, p.mode, self._latency(p.primary, p.candidate), p.share,
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
                if g["verdict"] == PASS and (what := _passed(g)):
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
            window = json.loads(json.dumps(window))  # a copy: _look writes into it
            try:
                readings = self.reader(p.primary, v)
            except Exception as exc:  # noqa: BLE001 - unreachable replicas: said, not raised
                return {"status": p.status, "error": f"metrics unavailable: {type(exc).__name__}: {exc}"}
            if state is not None:
                self._breaker_from_state(readings, state, v)
            share = p.share * p.arms[str(v)]["weight"] if p.mode == "abn" else p.share
            mode = "split" if p.mode == "abn" else p.mode
            if window["baseline"] is None:
                out["windows"][str(v)] = {"report": None, "reason": "no baseline yet (the driver's first look "
                                                                    "takes it)", "readings": readings.to_dict()}
                continue
            report = self._look(window, readings, cfg, mode, self._latency(p.primary, v), share,
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

    # -- A/B/n ----------------------------------------------------------------------------------
    def _start_arms(self, cfg: RolloutConfig, state: RolloutState, primary: int) -> Progress:
        """Under the lock: route the first step's weights to every arm."""
        assert cfg.arms is not None
        if primary in cfg.arms:
            raise ControllerError(f"v{primary} is the primary of '{self.model}': it cannot be an arm")
        if state.candidate is not None:
            raise ControllerError(f"'{self.model}' has a candidate (v{state.candidate.version}): an A/B/n "
                                  "rollout needs none")
        share = cfg.steps[0] / 100

        def route(s: RolloutState) -> RolloutState:
            _pin_primary(s, primary)
            s.arms = [Arm(v, w * share) for v, w in cfg.arms.items()]
            for v in cfg.arms:
                s.breakers.pop(str(v), None)
                s.judges[str(v)] = _judge_doc(cfg)
            return s

        self.store.update(route, by=self.by)
        now = self.clock()
        arms = {str(v): {"weight": w, "status": RUNNING, "baseline": None, "look": 0, "reference": None,
                         "last_report": None, "reason": ""} for v, w in cfg.arms.items()}
        p = self._save(Progress(model=self.model, candidate=min(cfg.arms), primary=primary, mode="abn",
                                steps=list(cfg.steps), config=cfg.to_dict(), step_started_at=now,
                                started_at=now, arms=arms))
        log.info("A/B/n rollout of '%s' started: %s at %g %% of their weights", self.model,
                 ", ".join(f"v{v}={w:g}" for v, w in cfg.arms.items()), cfg.steps[0])
        self._hook(self.on_step, 0, share, None)
        return p

    def _route_arms(self, p: Progress, share: float) -> None:
        live = {v: p.arms[str(v)]["weight"] * share for v in p.live_arms()}

        def route(s: RolloutState) -> RolloutState:
            s.arms = [Arm(a.version, live[a.version]) for a in s.arms if a.version in live]
            return s

        self.store.update(route, by=self.by)

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

    @staticmethod
    def _look(window: dict[str, Any], readings: GuardReadings, cfg: RolloutConfig, mode: str,
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

    def _tick_arms(self, p: Progress, cfg: RolloutConfig) -> Progress:
        state = self.store.load()
        live = p.live_arms()
        routed = {a.version for a in state.arms} if state is not None else set()
        if not set(live) <= routed:
            return self._finish_arms(p, ABORTED, "the arms were changed outside the controller", [])
        try:
            readings = {v: self.reader(p.primary, v) for v in live}
        except Exception as exc:  # noqa: BLE001 - unreachable metrics: hold, never pass
            log.warning("rollout of '%s': metrics unavailable: %s", self.model, exc)
            p.reason = f"metrics unavailable: {type(exc).__name__}: {exc}"
            return self._timeout(p, cfg) or self._save(p)
        p.look += 1
        verdicts: dict[int, str] = {}
        failed: list[int] = []
        for v in live:
            self._breaker_from_state(readings[v], state, v)
            arm = p.arms[str(v)]
            # an arm's own share of traffic decides whether its latency is judged: a rarely called
            # arm runs cold even in paired timings (a same-speed arm at 15 % of ~90 req/s read 1.25x)
            report = self._look(arm, readings[v], cfg, "split", self._latency(p.primary, v),
                                p.share * arm["weight"], trip=state.breakers.get(str(v)) if state else None,
                                labels=self._labels(cfg, [p.primary, v], p.started_at))
            if report is None:
                continue
            verdicts[v] = report.verdict
            if report.verdict == FAIL:
                arm["status"], arm["reason"] = ROLLED_BACK, f"gate failed at {p.share:.0%}: {report.summary()}"
                failed.append(v)
        if failed:
            self._route_arms(p, p.share)  # the failed arms leave; the others keep their weights
            for v in failed:
                log.warning("rollout of '%s': arm v%d rolled back: %s", self.model, v, p.arms[str(v)]["reason"])
                self._hook(self.on_rollback, v, p.arms[str(v)]["reason"])
        live = p.live_arms()
        overall = FAIL if not live else PASS if all(verdicts.get(v) == PASS for v in live) else INCONCLUSIVE
        p.last_report = {"verdict": overall, "arms": {v: a["last_report"] for v, a in p.arms.items()}}
        p.reason = "; ".join(f"v{v}: {a['reason']}" for v, a in p.arms.items())
        if not live:
            p.status = ROLLED_BACK
            return self._save(p)
        dwelt = self.clock() - p.step_started_at >= cfg.dwell_s
        if not dwelt or any(verdicts.get(v) != PASS for v in live):
            return self._timeout(p, cfg) or self._save(p)
        if p.step_index + 1 < len(p.steps):
            p.step_index += 1
            self._route_arms(p, p.share)
            p.step_started_at = self.clock()
            for v in live:
                p.arms[str(v)].update(baseline=readings[v].to_dict(), look=0)
            self._save(p)
            log.info("A/B/n rollout of '%s': step %d, %g %% of the arms' weights", self.model, p.step_index,
                     p.share * 100)
            self._hook(self.on_step, p.step_index, p.share, None)
            return p
        p.status, p.reason = DONE, (f"every step passed: {', '.join(f'v{v}' for v in live)} at full weight; "
                                    "end the split with route --arms none, promote the winner")
        return self._save(p)

    def _finish_arms(self, p: Progress, status: str, reason: str, remove: list[int]) -> Progress:
        for v in remove:
            p.arms[str(v)].update(status=status, reason=reason)
        if remove:
            self._route_arms(p, p.share)
        p.status, p.reason = status, reason
        self._save(p)
        log.warning("A/B/n rollout of '%s' %s: %s", self.model, status, reason)
        for v in remove:
            self._hook(self.on_rollback, v, reason)
        return p

    def _timeout(self, p: Progress, cfg: RolloutConfig) -> Progress | None:
        limit = cfg.max_step_s
        if limit is not None and self.clock() - p.step_started_at > limit:
            return self._finish(p, ROLLED_BACK, f"no conclusive gate within max_step_s={limit:g} s "
                                                f"at {p.share:.0%} ({p.reason})")
        return None

    def _config(self, p: Progress) -> RolloutConfig:
        """The configuration the rollout was started with: a resumed one keeps its gates."""
        return RolloutConfig.from_dict(p.config) if p.config else self.config

    @staticmethod
    def _breaker_from_state(readings: GuardReadings, state: RolloutState, candidate: int) -> None:
        # guards share tripped breakers through the state document: count them even when the
        # breaker gauge is missing or was scraped from a replica that has not seen the trip
        doc = state.breakers.get(str(candidate))
        if doc is not None:
            code = BREAKER_CODES.get(doc.get("state", "closed"), 2)
            readings.breaker_state = max(code, readings.breaker_state or 0)

    def _hook(self, fn: Callable[..., Any] | None, *args: Any) -> None:
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a hook must not wedge the rollout; it is logged
            log.exception("rollout of '%s': hook %s failed", self.model, getattr(fn, "__name__", fn))
