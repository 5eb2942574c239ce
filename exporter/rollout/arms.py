"""A/B/n rollouts: several candidate versions (arms) at once, each at a share of its weight.

:class:`AbnRollout` is the half of :class:`exporter.rollout.controller.RolloutController` that
drives a rollout in mode ``abn`` (a mixin: it works on the controller's store, progress and
hooks, under the controller's lock). Every arm is judged on its own window against the primary;
a failing arm is taken out alone while the others go on; the step advances when every live arm
passes; after the last step the arms stay at their full weights (``done``).
"""

from __future__ import annotations

import logging

from exporter.records.progress import ControllerError
from exporter.rollout.gates.verdict import FAIL, INCONCLUSIVE, PASS
from exporter.rollout.progress import (
    ABORTED,
    DONE,
    ROLLED_BACK,
    RUNNING,
    Progress,
    RolloutConfig,
    judge_doc,
    pin_primary,
)
from exporter.rollout.window import breaker_from_state, look
from tritonguard.rollout.state import Arm, RolloutState

log = logging.getLogger(__name__)


class AbnRollout:
    """The A/B/n transitions of :class:`~exporter.rollout.controller.RolloutController`: start,
    one look at every live arm, and taking arms out. Mixed into the controller, whose attributes
    (``model``, ``store``, ``by``, ``clock``, ``reader``, hooks) and helpers (``_save``,
    ``_hook``, ``_finish``, ``_timeout``, ``_latency``, ``_labels``) it uses."""

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
            pin_primary(s, primary)
            s.arms = [Arm(v, w * share) for v, w in cfg.arms.items()]
            for v in cfg.arms:
                s.breakers.pop(str(v), None)
                s.judges[str(v)] = judge_doc(cfg)
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
            breaker_from_state(readings[v], state, v)
            arm = p.arms[str(v)]
            # an arm's own share of traffic decides whether its latency is judged: a rarely called
            # arm runs cold even in paired timings (a same-speed arm at 15 % of ~90 req/s read 1.25x)
            report = look(arm, readings[v], cfg, "split", self._latency(p.primary, v),
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
