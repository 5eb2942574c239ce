"""Replicas found, not listed: the servers a command works on, from the replica registry the
guards keep in the shared store (:mod:`tritonguard.rollout.replicas`), when no ``--server`` is given.

:class:`Fleet` lists the live replicas (one line says how many, and from where);
:class:`FleetReader` is a rollout reader that re-resolves them at every look, so that

- a replica that stops heartbeating (its key expired) or whose metrics cannot be read drops out
  at that look, with a line saying so; what it counted until its last reading stays in the
  window (counters never go back, so the gates do not see a reset);
- a replica that joins mid-rollout is counted from its first reading: its counters up to then
  are an offset, not traffic of the window.

Gauges (breaker state, drift) are taken from the live replicas only. The bookkeeping lives in
the reader, one process: a reader made later (``rollout status``, a resumed driver) counts the
replicas live at its first look in full, as a ``--server`` list would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from exporter.errors import ExporterError
from exporter.rollout.gates.readings import GuardReadings, Series, scrape
from tritonguard.core import catalogue
from tritonguard.core.store import store_url
from tritonguard.rollout.replicas import Replica, ReplicaRegistry, is_redis, period, redacted
from tritonguard.triton import http as triton_http

log = logging.getLogger(__name__)
_GAUGES = {name for name, kind in catalogue.families().items() if kind == "gauge"}


class FleetError(ExporterError):
    """The replica registry cannot be read."""


class Fleet:
    """The live replicas of the registry at ``url``."""

    def __init__(self, url: str, registry: ReplicaRegistry | None = None):
        self.url = url
        self.registry = registry or ReplicaRegistry(url, period_s=period())
        self.last: list[Replica] = []  # as of the last successful read

    def replicas(self) -> list[Replica]:
        try:
            self.last = self.registry.live()
            return self.last
        except Exception as exc:  # noqa: BLE001 - redis errors, whatever the client raises
            raise FleetError(f"replica registry {redacted(self.url)} unreadable: {type(exc).__name__}: {exc}") from None

    def line(self, replicas: list[Replica]) -> str:
        n = len(replicas)
        return f"{n} replica{'s' if n != 1 else ''} live (from {redacted(self.url)})"


def discover(url: str | None = None) -> Fleet | None:
    """A :class:`Fleet` when the state URL (``url``, else ``$TRITONGUARD_STATE_URL``) is Redis."""
    url = store_url(url)
    return Fleet(url) if is_redis(url) else None


def _counter(name: str) -> bool:
    return name.startswith("tritonguard_") and name not in _GAUGES


def _counters(series: Series) -> Series:
    return {k: v for k, v in series.items() if _counter(k[0])}


def _minus(series: Series, offset: Series) -> Series:
    return {k: (v - offset.get(k, 0.0)) if _counter(k[0]) else v for k, v in series.items()}


def _add(into: Series, series: Series) -> None:
    for k, v in series.items():
        into[k] = into.get(k, 0.0) + v


class FleetReader:
    """A rollout reader (``(primary, candidate) -> GuardReadings``) over the registry's live replicas."""

    def __init__(self, fleet: Fleet, model: str, *, target: str | None = None, timeout: float = 5.0,
                 say: Callable[[str], None] | None = None,
                 scraper: Callable[[str, float], Series] = scrape, count: int | None = None):
        self.fleet, self.model, self.target, self.timeout = fleet, model, target, timeout
        self.say = say or (lambda msg: log.info("%s", msg))
        self.scraper = scraper
        self.first = True
        self.offsets: dict[str, Series] = {}  # replica -> counters at its first reading (joined later)
        self.last: dict[str, Series] = {}  # replica -> its contribution at the last reading
        self.started: dict[str, float] = {}
        self.frozen: Series = {}  # counters of replicas that dropped out, as of their last reading
        self.count = count  # replicas read at the last look (the line is said when it changes)

    def _drop(self, rid: str, why: str) -> None:
        _add(self.frozen, _counters(self.last.pop(rid, {})))
        self.offsets.pop(rid, None)
        self.started.pop(rid, None)
        self.say(f"replica {rid} dropped out ({why}); its counts until its last reading stay in the window")

    def __call__(self, primary: int, candidate: int) -> GuardReadings:
        live = self.fleet.replicas()
        scraped: dict[str, tuple[Replica, Series]] = {}
        for r in live:
            try:
                scraped[r.id] = (r, self.scraper(r.metrics, self.timeout))
            except triton_http.Unreachable as exc:
                if r.id in self.last:
                    self._drop(r.id, f"metrics {r.metrics} unreadable: {exc.reason}")
                else:
                    self.say(f"replica {r.id} not counted: metrics {r.metrics} unreadable: {exc.reason}")
        for rid in [rid for rid in self.last if rid not in scraped]:
            self._drop(rid, "no heartbeat within the registry's TTL")
        for rid, (r, series) in scraped.items():
            restarted = rid in self.started and r.started and r.started != self.started[rid]
            if rid in self.last and not restarted:
                continue
            if restarted:
                self._drop(rid, "restarted")
            if not self.first or restarted:
                self.offsets[rid] = _counters(series)
                self.say(f"replica {rid} joined: counted from this reading")
            self.started[rid] = r.started
        contributions = []
        for rid, (_, series) in scraped.items():
            mine = _minus(series, self.offsets.get(rid, {}))
            if any(v < -1e-9 for k, v in mine.items() if _counter(k[0])):  # reset unseen by `started`
                self._drop(rid, "its counters went back: restarted")
                self.offsets[rid] = _counters(series)
                self.say(f"replica {rid} joined: counted from this reading")
                mine = _minus(series, self.offsets[rid])
            self.last[rid] = mine
            contributions.append(mine)
        self.first = False
        readings = GuardReadings.from_scrapes([*contributions, self.frozen], self.model, primary, candidate,
                                              target=self.target)
        readings.replicas = GuardReadings.from_scrapes(contributions, self.model, primary, candidate,
                                                       target=self.target).replicas
        if not contributions:
            readings.problems.append(f"no live replica readable ({self.fleet.line(live)})")
        if self.count != len(contributions):
            self.say(self.fleet.line(live) + (f", {len(contributions)} read" if len(contributions) != len(live) else ""))
            self.count = len(contributions)
        readings.taken_at = time.time()
        return readings


def resolve(fleet: Fleet) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(HTTP URLs, metrics URLs, ``to_dict()`` of each replica) of the live replicas."""
    live = fleet.replicas()
    return [r.http for r in live], [r.metrics for r in live], [r.to_dict() for r in live]
