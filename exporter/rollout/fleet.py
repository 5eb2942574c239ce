"""Replicas found, not listed: the servers a command works on, from the replica registry the
guards keep in the shared store (:mod:`tritonguard.rollout.replicas`), when no ``--server`` is given.

:class:`Fleet` lists the live replicas (one line says how many, and from where);
:class:`FleetReader` is a rollout reader that re-resolves them at every look, so that

- a replica that stops heartbeating (its key expired) or whose metrics cannot be read drops out
  at that look, with a line saying so; what it counted until its last reading stays in the
  window (counters never go back, so the gates do not see a reset). One that comes back is
  read again from where it was;
- a replica that joins mid-rollout is counted from its first reading: its counters up to then
  are an offset, not traffic of the window;
- each reading of a replica is compared with its previous one: a new start time in its record,
  or any of the model's counters that went down, is a restart (Triton's counters start again
  from zero; a reloaded guard model's too). What it had counted until its previous reading is
  kept and its counters since the restart are added to it, so a restart mid-step neither loses
  the step's evidence nor takes the counts since the restart for an offset. What it counted
  between its previous reading and the restart is lost with the process (read more often to
  lose less).

Only the model's own series are read (another model's reload on the same server is not a reset
of this one). Gauges (breaker state, drift) are taken from the live replicas only. The
bookkeeping lives in the reader, one process: a reader made later (``rollout status``, a resumed
driver) counts the replicas live at its first look in full, as a ``--server`` list would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from exporter.errors import ExporterError
from exporter.rollout.gates.readings import GuardReadings, Series, scrape
from tritonguard.core import catalogue
from tritonguard.core.store import store_error, store_url
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
            raise FleetError(f"replica registry {redacted(self.url)} unreadable: {store_error(exc, self.url)}") from None

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


class _Replica:
    """What the reader knows of one replica; kept after it drops out (its counts stay)."""

    def __init__(self, started: float, offset: Series):
        self.started = started
        self.offset = offset  # its counters at its first reading when it joined after the first look
        self.base: Series = {}  # what it had counted in its lives before each restart
        self.prev: Series = {}  # its counters at its last reading, as read
        self.contribution: Series = {}  # base + (counters - offset), and its gauges
        self.live = True

    def went_back(self, series: Series) -> bool:
        return any(series.get(k, 0.0) < v - 1e-9 for k, v in self.prev.items())

    def restarted(self) -> None:
        """Its counters start again from zero: what it had counted until its last reading is kept."""
        _add(self.base, _counters(_minus(self.prev, self.offset)))
        self.offset = {}

    def read(self, series: Series) -> Series:
        self.prev = _counters(series)
        mine = _minus(series, self.offset)
        _add(mine, self.base)
        self.contribution = mine
        return mine


class FleetReader:
    """A rollout reader (``(primary, candidate) -> GuardReadings``) over the registry's live replicas."""

    def __init__(self, fleet: Fleet, model: str, *, target: str | None = None, timeout: float = 5.0,
                 say: Callable[[str], None] | None = None,
                 scraper: Callable[[str, float], Series] = scrape, count: int | None = None):
        self.fleet, self.model, self.target, self.timeout = fleet, model, target, timeout
        self.say = say or (lambda msg: log.info("%s", msg))
        self.scraper = scraper
        self.first = True
        self.known: dict[str, _Replica] = {}  # every replica counted so far, live or dropped out
        self.count = count  # replicas read at the last look (the line is said when it changes)

    def _mine(self, series: Series) -> Series:
        return {k: v for k, v in series.items() if dict(k[1]).get("model") == self.model}

    def _drop(self, rid: str, why: str) -> None:
        self.known[rid].live = False
        self.known[rid].contribution = _counters(self.known[rid].contribution)
        self.say(f"replica {rid} dropped out ({why}); its counts until its last reading stay in the window")

    def __call__(self, primary: int, candidate: int) -> GuardReadings:
        live = self.fleet.replicas()
        scraped: dict[str, tuple[Replica, Series]] = {}
        for r in live:
            try:
                scraped[r.id] = (r, self._mine(self.scraper(r.metrics, self.timeout)))
            except triton_http.Unreachable as exc:
                if r.id in self.known and self.known[r.id].live:
                    self._drop(r.id, f"metrics {r.metrics} unreadable: {exc.reason}")
                elif r.id not in self.known:
                    self.say(f"replica {r.id} not counted: metrics {r.metrics} unreadable: {exc.reason}")
        for rid, rep in self.known.items():
            if rep.live and rid not in scraped:
                self._drop(rid, "no heartbeat within the registry's TTL")
        contributions = []
        for rid, (r, series) in scraped.items():
            rep = self.known.get(rid)
            if rep is None:
                rep = self.known[rid] = _Replica(r.started, {} if self.first else _counters(series))
                if not self.first:
                    self.say(f"replica {rid} joined: counted from this reading")
            else:
                why = ("a new start time" if r.started and rep.started and r.started != rep.started
                       else "its counters went back" if rep.went_back(series) else "")
                if why:
                    rep.restarted()
                    self.say(f"replica {rid} restarted ({why}): its counts until its last reading stay, "
                             "its counts since the restart are added")
                elif not rep.live:
                    self.say(f"replica {rid} is back: counted again from its last reading")
                rep.started, rep.live = r.started or rep.started, True
            contributions.append(rep.read(series))
        self.first = False
        frozen = [rep.contribution for rep in self.known.values() if not rep.live]
        readings = GuardReadings.from_scrapes([*contributions, *frozen], self.model, primary, candidate,
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
