"""The rollout state as one guard process sees it: read from the store at most every
``poll_interval_s`` (a file ``stat`` or one Redis GET), the last good one kept when the store
fails, and the questions the router asks of it (the primary, the versions under test, the share
of calls a version gets)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tritonguard.core import repository
from tritonguard.rollout.state import RolloutState, StateError
from tritonguard.rollout.stores import StateStore

log = logging.getLogger(__name__)


class RolloutView:
    def __init__(self, *, guard: str, repo: Path, target: str, store: StateStore, poll_interval_s: float,
                 metrics: Any, pin: int = -1, on_new: Callable[[RolloutState, RolloutState], None] | None = None):
        """``on_new(old, new)``: called under the refresh lock when a new revision is read (the
        breakers forget trips the state dropped, and adopt the shared ones)."""
        self.guard, self.repo, self.target, self.store = guard, repo, target, store
        self.poll_interval_s, self.metrics, self.pin = poll_interval_s, metrics, pin
        self.on_new = on_new
        self._refresh_lock = threading.Lock()  # execute() and the reconciler re-read the state
        self._last_poll = 0.0
        self._state_errors = 0  # store errors already counted in the metrics
        self.state = self._initial()

    def versions_on_disk(self) -> list[int]:
        # only versions with a manifest: one without is being uploaded, or never finished
        return repository.complete_versions(self.repo / self.target)

    def _initial(self) -> RolloutState:
        """The stored state, or a new one pinning today's latest version as primary, so a
        version exported later gets no traffic until it is routed to on purpose."""
        state = self.store.load()
        if state is not None:
            return state
        on_disk = self.versions_on_disk()
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
        if now - self._last_poll < self.poll_interval_s:
            return
        # execute() never waits for the reconciler's read: it serves by the state in hand
        if not self._refresh_lock.acquire(blocking=wait):
            return
        try:
            if now - self._last_poll >= self.poll_interval_s:
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
        old = self.state
        if new is not None and new.revision != old.revision:
            log.info("guard %s: rollout state r%d -> r%d", self.guard, old.revision, new.revision)
            self.state = new
        if self.on_new is not None:
            self.on_new(old, self.state)

    def update(self, fn: Callable[[RolloutState], RolloutState], what: str) -> None:
        """Write through the store (``fn`` on the current document) and keep what it returns;
        a store that fails is logged, and the state in hand stays."""
        try:
            self.state = self.store.update(fn, by=f"guard:{self.guard}")
        except StateError as exc:
            log.warning("guard %s: %s not stored: %s", self.guard, what, exc)

    def update_breaker(self, version: int, fn: Callable[[Any], Any], what: str) -> None:
        try:
            self.state = self.store.update_breaker(version, fn, by=f"guard:{self.guard}")
        except StateError as exc:
            log.warning("guard %s: %s not stored: %s", self.guard, what, exc)

    # -- questions --------------------------------------------------------------------------
    def primary(self) -> int:
        if self.state.primary > 0:
            return self.state.primary
        on_disk = self.versions_on_disk()
        return on_disk[-1] if on_disk else -1

    def experiments(self) -> dict[int, float]:
        """Versions under test (the candidate, or the A/B/n arms) and their shadow share."""
        st = self.state
        if st.candidate is not None:
            return {st.candidate.version: st.shadow_share}
        return {a.version: 0.0 for a in st.arms}

    def named_versions(self) -> list[int]:
        """Versions the state may route to: primary, candidate, arms, the fallback chain."""
        st = self.state
        named = [self.primary()]
        if st.candidate is not None:
            named.append(st.candidate.version)
        named += [a.version for a in st.arms]
        named += st.route_versions()
        return [v for v in dict.fromkeys(named) if v > 0]

    def primary_share(self) -> float:
        """The share of requests the primary answers as now routed: 0 at a 100 % step (the
        candidate takes every request) or when the A/B/n arms' weights add up to 1."""
        st = self.state
        taken = st.candidate.share if st.candidate is not None else sum(a.weight for a in st.arms)
        return max(1.0 - taken, 0.0)

    def call_share(self, version: int) -> float:
        """The share of calls ``version`` gets as now routed: its traffic share, plus the shadow
        share for a candidate (mirrored calls keep it as warm as served ones); 1 for the primary."""
        st = self.state
        if version == self.primary():
            return 1.0
        if st.candidate is not None and st.candidate.version == version:
            return st.candidate.share + (1 - st.candidate.share) * st.shadow_share
        return sum(a.weight for a in st.arms if a.version == version)

    def chain(self) -> list[tuple[str, int | None]]:
        """The fallback chain with the primary resolved."""
        primary = self.primary()
        return [(step, primary if step == "primary" else v) for step, v in self.state.chain()]


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
