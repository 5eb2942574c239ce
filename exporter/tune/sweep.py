"""``exporter tune``: serving knobs of a guarded pipeline, tuned jointly on a private server.

The guard, its runtime target (the model that runs the artifact: ``digits_raw``,
``minilm_encoder``) and the ensembles over them are served by one private tritonserver (explicit
model control, free loopback ports) over a copy of their folders. Each trial point is written
into the COPY and loaded through ``POST /v2/repository/models/<name>/load`` with the config as
an override (target first, then the guard, then the ensembles), then driven with perf_analyzer
at every requested concurrency on realistic, varied inputs. The search is a coordinate descent
from the current configs: one knob at a time, one ladder step at a time, a step kept only when
it beats the incumbent by ``min_gain``; bounded by a number of points and seconds. The user's
repository is written only by :func:`apply_configs` (``--apply``): one backup per file, atomic
writes, only the knobs tune manages, nothing written over a file that changed since tune read it.

This module runs a tune (:func:`run`) and reports it; the parts are :mod:`exporter.tune.knobs`
(the pipeline and its knobs), :mod:`exporter.tune.search` (space, objective, coordinate
descent), :mod:`exporter.tune.session` (the private server and perf_analyzer) and
:mod:`exporter.tune.apply` (``--apply``). Everything but the session runs without a server (and
is unit-tested that way).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.tune.apply import Applied
from exporter.tune.knobs import Pipeline, TuneError, configs_for, describe, discover, read_knobs
from exporter.tune.search import CoordinateDescent, Objective, Point, Space, Stat, build_space
from exporter.tune.session import Session, input_data, perf_analyzer
from tritonguard.core import repository


# -- the run ---------------------------------------------------------------------------------
@dataclass
class Settings:
    concurrency: tuple[int, ...] = (8, 16)
    objective: Objective = field(default_factory=Objective)
    budget_points: int = 12
    budget_s: float = 600.0
    window_ms: int = 2000
    trials: int = 3
    stability_pct: float = 30.0
    knobs: tuple[str, ...] | None = None
    max_instances: int | None = None
    max_threads: int | None = None
    confirm: bool = True


@dataclass
class Result:
    model: str
    pipe: Pipeline
    settings: Settings
    space: Space
    base: dict[str, Any]
    points: list[Point]
    baseline: Point | None
    chosen: Point | None
    confirm: dict[str, Point] = field(default_factory=dict)
    skipped: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    elapsed_s: float = 0.0
    stop_reason: str = ""
    aborted: bool = False  # the search stopped on an error (the server unusable)

    @property
    def lone_request(self) -> dict[str, Any] | None:
        """The confirmation's c=1 figures, chosen against the current config; None without them."""
        b, c = self.confirm.get("baseline"), self.confirm.get("chosen")
        if b is None or c is None:
            return None
        if b.lone is None or c.lone is None:
            why = b.lone_error or c.lone_error
            return {"error": why} if why else None
        return {"baseline": dataclasses.asdict(b.lone), "chosen": dataclasses.asdict(c.lone),
                "throughput_change_pct": round((c.lone.throughput / b.lone.throughput - 1) * 100, 1)
                if b.lone.throughput else None,
                "p50_change_ms": round(c.lone.p50_ms - b.lone.p50_ms, 3)}

    @property
    def confirmed(self) -> bool | None:
        """None without a confirmation; else whether the chosen point still beat the baseline."""
        if not self.confirm:
            return None
        b, c = self.confirm.get("baseline"), self.confirm.get("chosen")
        if b is None or c is None or not c.ok:
            return False
        obj = dataclasses.replace(self.settings.objective, min_gain_pct=0)
        return obj.feasible(c, [q for q in self.points if q.ok]) and (not b.ok or obj.better(c, b, [b, c]))


def run(repo: Path, model: str, settings: Settings, workdir: Path, log_path: Path,
        progress: Callable[[str, Any], None] = lambda event, data: None,
        measure: Callable[..., Stat] = perf_analyzer) -> tuple[Result, dict[str, str]]:
    """Tune ``model``; returns the result and the config texts tune started from (for apply)."""
    t0 = time.monotonic()
    pipe, configs = discover(repo, model)
    start_texts = {n: (Path(repo) / n / repository.CONFIG).read_text() for n in pipe.managed}
    space = build_space(pipe, configs, max_instances=settings.max_instances, max_threads=settings.max_threads,
                        only=settings.knobs)
    base = read_knobs(pipe, configs)
    search = CoordinateDescent(space, base, settings.objective)
    data = input_data(pipe, configs, Path(workdir) / "input.json")
    points: list[Point] = []
    progress("space", space)

    def measure_point(knobs: dict[str, Any], phase: str, session: Session) -> Point:
        p = Point(id=len(points), knobs=dict(knobs), phase=phase)
        points.append(p)
        progress("point", p)
        t = time.monotonic()
        try:
            session.load(configs_for(pipe, configs, knobs))
            for c in settings.concurrency:
                p.stats[c] = measure(session.url, pipe.public, c, data, window_ms=settings.window_ms,
                                     trials=settings.trials, stability_pct=settings.stability_pct)
            p.status = "ok"
            if phase == "confirm" and 1 not in settings.concurrency:
                # what the layout does to a lone request, which the objective does not see
                # (minilm: 2 guard instances of 1 thread won 1.75x at c=16 and lost 19 % at c=1)
                try:
                    p.lone = measure(session.url, pipe.public, 1, data, window_ms=settings.window_ms,
                                     trials=settings.trials, stability_pct=settings.stability_pct)
                except TuneError as exc:  # reported, but not the point's failure: c=1 is no objective
                    p.lone_error = str(exc)
        except TuneError as exc:
            p.status, p.error = "failed", str(exc)
            p.stats.clear()
        p.elapsed_s = time.monotonic() - t
        progress("measured", p)
        return p

    result = Result(model, pipe, settings, space, base, points, None, None)
    with Session(repo, pipe, configs, workdir, log_path) as session:
        progress("starting", None)
        session.start()
        progress("started", session.url)
        baseline = measure_point(base, "baseline", session)
        result.baseline = baseline
        if not baseline.ok:
            raise TuneError(f"the current config could not be measured: {baseline.error}")
        search.record(baseline)
        stop = "search converged (no step of any knob was kept)"
        try:
            for cand in search.proposals():
                spent = time.monotonic() - t0
                per_point = spent / max(1, len(points))
                if len(points) >= settings.budget_points:
                    stop = f"budget: {settings.budget_points} points"
                    break
                if spent + per_point > settings.budget_s:
                    stop = f"budget: {settings.budget_s:g} s"
                    break
                p = measure_point(cand, "search", session)
                kept = search.record(p)
                progress("verdict", (p, kept))
                if not p.ok:
                    # back to the incumbent's configs, whatever the failed load left behind
                    try:
                        session.load(configs_for(pipe, configs, search.incumbent_knobs), force=True)
                    except TuneError as exc:
                        raise TuneError(f"cannot restore the incumbent after a failed point: {exc}") from None
        except TuneError as exc:
            # the server is no longer usable: what was measured so far is still reported
            stop, result.aborted = f"stopped: {exc}", True
        result.stop_reason = stop
        result.skipped = search.skipped
        result.chosen = settings.objective.choose(points, search.incumbent)
        if settings.confirm and not result.aborted and result.chosen is not None and result.chosen.knobs != base:
            # baseline and chosen back to back: the gain must survive the machine's drift
            result.confirm["baseline"] = measure_point(base, "confirm", session)
            result.confirm["chosen"] = measure_point(result.chosen.knobs, "confirm", session)
    result.elapsed_s = time.monotonic() - t0
    return result, start_texts


def report(result: Result, applied: list[Applied] | None = None) -> dict[str, Any]:
    def stats(p: Point) -> dict[str, Any]:
        return {str(c): dataclasses.asdict(s) for c, s in p.stats.items()}

    def point(p: Point) -> dict[str, Any]:
        ok = [q for q in result.points if q.ok and q.phase != "confirm"]
        return {"id": p.id, "phase": p.phase, "knobs": _json_knobs(p.knobs), "changed": describe(p.knobs, result.base),
                "status": p.status, "error": p.error or None, "results": stats(p),
                "mean_throughput": round(p.mean_throughput, 2) if p.ok else None,
                "worst_p99_ms": round(p.worst_p99, 3) if p.ok else None,
                "feasible": result.settings.objective.feasible(p, ok),
                "baseline": p is result.baseline, "chosen": p is result.chosen, "elapsed_s": round(p.elapsed_s, 2)}

    s = result.settings
    pipe = result.pipe
    return {
        "model": result.model,
        "pipeline": {"guard": pipe.guard, "target": pipe.target, "placement": pipe.placement,
                     "batcher": pipe.batcher, "models": list(pipe.load_order)},
        "objective": {"kind": s.objective.kind, "p99_ms": s.objective.p99_ms,
                      "min_throughput_pct": s.objective.min_throughput_pct if s.objective.kind == "latency" else None,
                      "min_gain_pct": s.objective.min_gain_pct, "text": s.objective.describe()},
        "settings": {"concurrency": list(s.concurrency), "budget_points": s.budget_points, "budget_s": s.budget_s,
                     "window_ms": s.window_ms, "trials": s.trials, "stability_pct": s.stability_pct,
                     "cpus": result.space.cpus, "protocol": "http"},
        "search_space": {"ladders": {k: [_json(v) for v in vs] for k, vs in result.space.ladders.items()},
                         "pruned": result.space.pruned,
                         "skipped_points": [{"knobs": _json_knobs(k), "reason": r} for k, r in result.skipped]},
        "points": [point(p) for p in result.points],
        "baseline": point(result.baseline) if result.baseline else None,
        "chosen": point(result.chosen) if result.chosen else None,
        "confirm": {k: point(p) for k, p in result.confirm.items()} or None,
        "confirmed": result.confirmed,
        "lone_request": result.lone_request,
        "stop_reason": result.stop_reason,
        "aborted": result.aborted,
        "elapsed_s": round(result.elapsed_s, 1),
        "applied": [dataclasses.asdict(a) for a in applied] if applied is not None else None,
    }


def _json(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _json_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    return {k: _json(v) for k, v in knobs.items()}


def plot(result: Result, path: Path) -> None:
    """Throughput vs p99 per point and concurrency; baseline and chosen marked."""
    import matplotlib  # noqa: PLC0415 - defers a heavy import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - defers a heavy import

    fig, ax = plt.subplots(figsize=(7, 5))
    markers = "os^Dvp*"
    for i, c in enumerate(result.settings.concurrency):
        pts = [p for p in result.points if p.ok and p.phase != "confirm" and c in p.stats]
        ax.scatter([p.stats[c].p99_ms for p in pts], [p.stats[c].throughput for p in pts], marker=markers[i % 7],
                   alpha=0.6, label=f"c={c}")
        for p in pts:
            ax.annotate(str(p.id), (p.stats[c].p99_ms, p.stats[c].throughput), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        for p, style, label in ((result.baseline, dict(facecolors="none", edgecolors="black", s=160), "baseline"),
                                (result.chosen, dict(color="red", marker="*", s=220), "chosen")):
            if p is not None and p.ok and c in p.stats:
                ax.scatter([p.stats[c].p99_ms], [p.stats[c].throughput], label=f"{label} c={c}", zorder=3, **style)
    if result.settings.objective.p99_ms:
        ax.axvline(result.settings.objective.p99_ms, color="grey", linestyle="--", label="p99 budget")
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("inferences / s")
    ax.set_title(f"tune {result.model}: {result.settings.objective.describe()}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
