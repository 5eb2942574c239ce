"""The breakers of one guard process, one per target version, and their sharing.

Each process keeps its own sliding windows (:mod:`tritonguard.rollout.breaker`); what one process
decides (a trip, a probe's outcome) is written to the rollout state, and every process adopts the
shared states at its next read. The serving thread and the comparison worker both feed them, so
they sit behind one lock; a trip is counted, alerted, and stored off the serving path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from tritonguard.guard.routing.view import RolloutView
from tritonguard.rollout.breaker import Breaker, BreakerConfig
from tritonguard.rollout.state import RolloutState

log = logging.getLogger(__name__)

STATE_CODES = {"closed": 0, "half_open": 1, "open": 2}


class Breakers:
    def __init__(self, *, guard: str, target: str, config: BreakerConfig, view: RolloutView, metrics: Any,
                 alert: Callable[[str, int | None, dict[str, Any]], None]):
        self.guard, self.target, self.config, self.view, self.metrics = guard, target, config, view, metrics
        self.alert = alert
        self.lock = threading.Lock()  # hold it to feed a breaker: execute() and the worker both do
        self._by_version: dict[int, Breaker] = {}

    def get(self, version: int) -> Breaker:
        """``version``'s breaker (created closed); callers that feed it hold :attr:`lock`."""
        b = self._by_version.get(version)
        if b is None:
            b = self._by_version[version] = Breaker(self.config, name=f"{self.target}:{version}")
        return b

    def versions(self) -> list[int]:
        return list(self._by_version)

    def follow(self, old: RolloutState, new: RolloutState) -> None:
        """A new state was read: a breaker document that was shared and is now gone was removed
        on purpose (`route --reset-breaker`, a fresh rollout or arm), so this process forgets its
        trip too (a trip of ours not yet stored was never in the old state, so it is kept); the
        shared ones are adopted."""
        with self.lock:
            if new is not old:
                for key in set(old.breakers) - set(new.breakers):
                    if key.isdigit() and int(key) in self._by_version:
                        log.info("guard %s: breaker of %s v%s reset by the rollout state", self.guard, self.target, key)
                        self._by_version[int(key)] = Breaker(self.config, name=f"{self.target}:{key}")
            for version, shared in new.breakers.items():
                try:
                    self.get(int(version)).adopt(shared)
                except (ValueError, KeyError):
                    log.exception("guard %s: bad breaker state for v%s", self.guard, version)

    def tripped(self, version: int, trip: Any) -> None:
        """Count and alert a trip (the caller stores the breaker's new state)."""
        self.metrics.inc("trips", 1, target_version=str(version), reason=trip.reason)
        self.alert("breaker_trip", version, {"reason": trip.reason, **trip.figures})

    def share(self, version: int, shared: dict[str, Any]) -> None:
        """Write ``version``'s breaker state to the store (the worker does, off the serving
        path). The latest transition wins: a process that has not yet adopted another's newer
        change (e.g. a trip while this one was still half-open) must not write over it."""
        def newer(old: dict[str, Any] | None) -> dict[str, Any]:
            if old and float(old.get("changed_at", 0.0)) > float(shared.get("changed_at", 0.0)):
                return old
            return shared

        self.view.update_breaker(version, newer, f"breaker state of v{version}")

    def publish(self) -> None:
        """Each breaker's state as a gauge (a local value the metrics thread pushes)."""
        for version, b in list(self._by_version.items()):
            self.metrics.set("breaker_state", STATE_CODES.get(b.state, 2), target_version=str(version))
