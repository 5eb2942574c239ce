"""Where tune looks and how it decides: the search space (a ladder of values per knob, pruned
where a knob cannot matter or would oversubscribe the cores), the measured points, the
objective (throughput or latency, with a p99 budget and a minimum gain) and the coordinate
descent that proposes the next point.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from exporter.tune.knobs import (
    GUARD_DELAY,
    GUARD_INSTANCES,
    KNOBS,
    PREFERRED,
    TARGET_DELAY,
    TARGET_INSTANCES,
    TARGET_THREADS,
    Pipeline,
    TuneError,
    conflicts,
    param,
    point_key,
    read_knobs,
)

# the order coordinate descent visits knobs: the ones that moved throughput most here first
ORDER = (GUARD_INSTANCES, TARGET_THREADS, TARGET_INSTANCES, TARGET_DELAY, GUARD_DELAY, PREFERRED)
DELAY_LADDER = (0, 100, 500, 1000, 2000, 5000)
PREFERRED_LADDER: tuple[tuple[int, ...], ...] = ((), (4,), (8,), (16,), (32,))
# at most this many busy threads per core across the instances of one model (pruning)
OVERSUBSCRIBE = 2


# -- search space ----------------------------------------------------------------------------
@dataclass
class Space:
    ladders: dict[str, list[Any]]  # the knobs searched, each with its candidate values
    pruned: dict[str, str]  # knob -> why it is not searched
    cpus: int
    max_batch: int
    placement: str

    def invalid(self, point: dict[str, Any]) -> str | None:
        """Why ``point`` is not worth measuring (None: it is)."""
        cap = OVERSUBSCRIBE * self.cpus
        threads = point[TARGET_THREADS]
        if point[TARGET_INSTANCES] * threads > cap and self.placement == "bls":
            return f"target {point[TARGET_INSTANCES]} instances x {threads} threads > {cap} (2 x {self.cpus} cores)"
        if self.placement == "inprocess" and point[GUARD_INSTANCES] * threads > cap:
            return f"guard {point[GUARD_INSTANCES]} instances x {threads} threads > {cap} (2 x {self.cpus} cores)"
        if any(p > self.max_batch for p in point[PREFERRED]):
            return f"preferred batch size above max_batch_size {self.max_batch}"
        return None


def build_space(pipe: Pipeline, configs: dict[str, dict[str, Any]], *, cpus: int | None = None,
                max_instances: int | None = None, max_threads: int | None = None,
                only: tuple[str, ...] | None = None) -> Space:
    cpus = max(1, cpus or os.cpu_count() or 1)
    max_instances = max_instances or min(4, max(2, cpus))
    max_threads = max_threads or min(4, cpus)
    base = read_knobs(pipe, configs)
    g, t = configs[pipe.guard], configs[pipe.target]
    max_batch = int(t.get("max_batch_size", 0) or 0)
    pruned: dict[str, str] = {}
    if only is not None:
        for k in KNOBS:
            if k not in only:
                pruned[k] = "not in --knobs"
    if pipe.placement == "inprocess":
        for k in (TARGET_INSTANCES, TARGET_DELAY):
            pruned.setdefault(k, "the guard runs the artifact in process: the target's batcher is not on the path")
    if max_batch <= 1:
        for k in (GUARD_DELAY, TARGET_DELAY, PREFERRED):
            pruned.setdefault(k, "no batching (max_batch_size <= 1)")
    for role, cfg in (("guard", g), ("target", t)):
        for k in (f"{role}.instances", f"{role}.delay_us"):
            reasons = conflicts(cfg, (k,), role)
            if reasons:
                pruned.setdefault(k, "; ".join(reasons))
    for reason in conflicts(configs[pipe.batcher], (PREFERRED,), "guard" if pipe.batcher == pipe.guard else "target"):
        pruned.setdefault(PREFERRED, reason)
    if pipe.placement == "inprocess" and param(g, "runtime.intra_op_threads") is not None:
        pruned.setdefault(TARGET_THREADS, "the guard's runtime.intra_op_threads overrides it")
    ladders: dict[str, list[Any]] = {
        GUARD_INSTANCES: list(range(1, max_instances + 1)),
        TARGET_INSTANCES: list(range(1, max_instances + 1)),
        GUARD_DELAY: list(DELAY_LADDER),
        TARGET_DELAY: list(DELAY_LADDER),
        TARGET_THREADS: list(range(1, max_threads + 1)),
        PREFERRED: [p for p in PREFERRED_LADDER if all(x <= max_batch for x in p)],
    }
    for k, values in ladders.items():
        if base[k] not in values:  # the current value is always a rung
            values.append(base[k])
            values.sort(key=lambda v: (len(v), v) if isinstance(v, tuple) else v)
    searched = {k: v for k, v in ladders.items() if k not in pruned}
    for k, v in list(searched.items()):
        if len(v) < 2:
            pruned[k] = "a single value"
            del searched[k]
    return Space(ladders=searched, pruned=pruned, cpus=cpus, max_batch=max_batch, placement=pipe.placement)


# -- objective -------------------------------------------------------------------------------
@dataclass
class Stat:
    throughput: float
    p50_ms: float
    p99_ms: float


@dataclass
class Point:
    id: int
    knobs: dict[str, Any]
    status: str = "pending"  # ok | failed | pruned
    error: str = ""
    stats: dict[int, Stat] = field(default_factory=dict)  # concurrency -> figures
    elapsed_s: float = 0.0
    phase: str = "search"  # baseline | search | confirm
    # a confirmation's figures for one request at a time (c=1), when the tuned concurrencies
    # leave it out: reported beside the objective, never part of it
    lone: Stat | None = None
    lone_error: str = ""  # why it could not be measured (the point itself still counts)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.stats)

    @property
    def mean_throughput(self) -> float:
        return sum(s.throughput for s in self.stats.values()) / len(self.stats) if self.stats else 0.0

    @property
    def worst_p99(self) -> float:
        return max((s.p99_ms for s in self.stats.values()), default=float("inf"))


@dataclass
class Objective:
    """``throughput``: the highest mean throughput over the concurrencies, with p99 within
    ``p99_ms`` at every one (when given). ``latency``: the lowest worst-p99, with mean throughput
    at least ``min_throughput_pct`` % of the best measured (0: simply the lowest p99)."""

    kind: str = "throughput"
    p99_ms: float | None = None
    min_throughput_pct: float = 90.0
    min_gain_pct: float = 3.0  # what a step must win by to be kept (noise on a shared box)

    def __post_init__(self) -> None:
        if self.kind not in ("throughput", "latency"):
            raise TuneError(f"objective must be throughput or latency, got {self.kind!r}")
        if self.p99_ms is not None and self.p99_ms <= 0:
            raise TuneError("--p99-ms must be > 0")
        if not 0 <= self.min_throughput_pct <= 100:
            raise TuneError("--min-throughput-pct must lie in 0..100")
        if not -100 <= self.min_gain_pct <= 100:
            raise TuneError("--min-gain must lie in -100..100")

    def describe(self) -> str:
        if self.kind == "throughput":
            return "max throughput" + (f" with p99 ≤ {self.p99_ms:g} ms at every concurrency" if self.p99_ms else "")
        text = "min p99"
        if self.min_throughput_pct:
            text += f" with throughput ≥ {self.min_throughput_pct:g} % of the best"
        if self.p99_ms:
            text += f" and p99 ≤ {self.p99_ms:g} ms"
        return text

    def feasible(self, p: Point, points: list[Point] = ()) -> bool:
        if not p.ok:
            return False
        if self.p99_ms is not None and p.worst_p99 > self.p99_ms:
            return False
        if self.kind == "latency" and self.min_throughput_pct:
            best = max((q.mean_throughput for q in points if q.ok), default=p.mean_throughput)
            return p.mean_throughput >= best * self.min_throughput_pct / 100
        return True

    def score(self, p: Point) -> float:
        """Larger is better (among feasible points)."""
        return p.mean_throughput if self.kind == "throughput" else -p.worst_p99

    def better(self, cand: Point, inc: Point, points: list[Point] = ()) -> bool:
        """``cand`` beats the incumbent by the margin (a feasible point beats an infeasible one;
        of two infeasible ones, the lower p99 — the way back into the budget)."""
        if not cand.ok:
            return False
        if not inc.ok:
            return True
        fc, fi = self.feasible(cand, points), self.feasible(inc, points)
        if fc != fi:
            return fc
        gain = self.min_gain_pct / 100
        if not fc:
            return cand.worst_p99 < inc.worst_p99 * (1 - gain)
        if self.kind == "throughput":
            return cand.mean_throughput > inc.mean_throughput * (1 + gain)
        return cand.worst_p99 < inc.worst_p99 * (1 - gain)

    def choose(self, points: list[Point], incumbent: Point | None) -> Point | None:
        """The incumbent when it is feasible, else the best feasible point, else None."""
        ok = [p for p in points if p.ok and p.phase != "confirm"]
        if incumbent is not None and self.feasible(incumbent, ok):
            return incumbent
        feasible = [p for p in ok if self.feasible(p, ok)]
        return max(feasible, key=self.score) if feasible else None


# -- search ----------------------------------------------------------------------------------
class CoordinateDescent:
    """Proposes points one knob and one ladder step at a time from the incumbent, walking on in
    a direction while steps are kept; sweeps the knobs again until a sweep keeps nothing.
    :meth:`record` tells it the outcome of the last proposal."""

    def __init__(self, space: Space, start: dict[str, Any], objective: Objective):
        self.space, self.objective = space, objective
        self.incumbent_knobs = dict(start)
        self.incumbent: Point | None = None
        self.points: list[Point] = []
        self.seen: set[tuple] = {point_key(start)}
        self.skipped: list[tuple[dict[str, Any], str]] = []
        self._kept = False

    def record(self, p: Point) -> bool:
        """Add a measured point; True when it became the incumbent."""
        self.points.append(p)
        if self.incumbent is None and p.ok and p.knobs == self.incumbent_knobs:
            self.incumbent = p
            return True
        ok = [q for q in self.points if q.ok]
        self._kept = self.incumbent is not None and self.objective.better(p, self.incumbent, ok) or \
            (self.incumbent is None and p.ok)
        if self._kept:
            self.incumbent, self.incumbent_knobs = p, dict(p.knobs)
        return self._kept

    def _step(self, knob: str, direction: int) -> dict[str, Any] | None:
        ladder = self.space.ladders[knob]
        i = ladder.index(self.incumbent_knobs[knob]) + direction
        if not 0 <= i < len(ladder):
            return None
        return {**self.incumbent_knobs, knob: ladder[i]}

    def proposals(self) -> Iterator[dict[str, Any]]:
        order = [k for k in ORDER if k in self.space.ladders]
        while True:
            moved = False
            for knob in order:
                for direction in (+1, -1):
                    walked = False
                    while True:
                        cand = self._step(knob, direction)
                        if cand is None:
                            break
                        key = point_key(cand)
                        if key in self.seen:
                            break
                        self.seen.add(key)
                        why = self.space.invalid(cand)
                        if why:
                            self.skipped.append((cand, why))
                            break
                        self._kept = False
                        yield cand
                        if not self._kept:
                            break
                        walked = moved = True
                    if walked:  # kept a step up: no need to look down
                        break
            if not moved:
                return
