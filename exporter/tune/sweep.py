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

Everything here but :class:`Session` runs without a server (and is unit-tested that way).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.build import layout
from exporter.errors import ExporterError
from tritonguard.core import repository
from tritonguard.core.files import atomic_write
from tritonguard.ops.launcher import perf_analyzer_run
from tritonguard.ops.server import Server
from tritonguard.triton import http as triton_http

# -- knobs -----------------------------------------------------------------------------------
GUARD_INSTANCES = "guard.instances"
GUARD_DELAY = "guard.delay_us"
TARGET_INSTANCES = "target.instances"
TARGET_DELAY = "target.delay_us"
TARGET_THREADS = "target.threads"
PREFERRED = "preferred"  # preferred_batch_size of the model that forms the batches
KNOBS = (GUARD_INSTANCES, GUARD_DELAY, TARGET_INSTANCES, TARGET_DELAY, TARGET_THREADS, PREFERRED)
SHORT = {GUARD_INSTANCES: "g.inst", GUARD_DELAY: "g.delay", TARGET_INSTANCES: "t.inst",
         TARGET_DELAY: "t.delay", TARGET_THREADS: "t.threads", PREFERRED: "pref"}
# the order coordinate descent visits knobs: the ones that moved throughput most here first
ORDER = (GUARD_INSTANCES, TARGET_THREADS, TARGET_INSTANCES, TARGET_DELAY, GUARD_DELAY, PREFERRED)
DELAY_LADDER = (0, 100, 500, 1000, 2000, 5000)
PREFERRED_LADDER: tuple[tuple[int, ...], ...] = ((), (4,), (8,), (16,), (32,))
# at most this many busy threads per core across the instances of one model (pruning)
OVERSUBSCRIBE = 2


class TuneError(ExporterError):
    """Bad input or an environment that cannot be tuned: one line for the user."""


@dataclass(frozen=True)
class Pipeline:
    """The models of one public name that tune serves, and which of them it changes."""

    public: str
    guard: str
    target: str  # the runtime model the knobs target.* change
    placement: str  # bls | inprocess
    load_order: tuple[str, ...]  # leaves first, then the guard, then the ensembles over them
    ensembles: tuple[str, ...]
    text: bool  # a BYTES input (sentences) rather than tensors

    @property
    def batcher(self) -> str:
        """The model whose dynamic batcher forms the batches the artifact runs: in process the
        guard runs it itself, over BLS the target batches what the guard instances send."""
        return self.guard if self.placement == "inprocess" else self.target

    @property
    def managed(self) -> tuple[str, ...]:
        return (self.target, self.guard)


def _steps(cfg: dict[str, Any]) -> list[str]:
    return [s["model_name"] for s in (cfg.get("ensemble_scheduling") or {}).get("step") or [] if s.get("model_name")]


def _param(cfg: dict[str, Any], key: str, default: str | None = None) -> str | None:
    value = (cfg.get("parameters") or {}).get(key)
    return value.get("string_value", default) if isinstance(value, dict) else default


def discover(repo: Path, model: str) -> tuple[Pipeline, dict[str, dict[str, Any]]]:
    """The pipeline serving the public ``model`` and the configs of all its models."""
    repo = Path(repo)
    if not (repo / model / repository.CONFIG).exists():
        known = sorted(p.name for p in repo.iterdir() if (p / repository.CONFIG).exists()) if repo.is_dir() else []
        raise TuneError(f"unknown model '{model}' in {repo} (models: {', '.join(known) or 'none'})")
    try:
        found = repository.guard_dir(repo, model)
    except Exception as exc:  # noqa: BLE001 - an unreadable config: one line
        raise TuneError(f"cannot read the config of '{model}': {exc}") from None
    if found is None:
        raise TuneError(f"'{model}' is not a guarded model (no backend 'guard' serves it); tune the public name, e.g. digits")
    guard_path, guard_cfg = found
    guard = guard_path.name
    configs: dict[str, dict[str, Any]] = {}

    def read(name: str) -> dict[str, Any]:
        if name not in configs:
            if not (repo / name / repository.CONFIG).exists():
                raise TuneError(f"model '{name}' (part of '{model}') is not in {repo}")
            configs[name] = repository.read_config(repo / name)
        return configs[name]

    read(model)
    configs[guard] = guard_cfg
    placement = _param(guard_cfg, "placement", "bls") or "bls"
    target_name = _param(guard_cfg, "target")
    if not target_name:
        raise TuneError(f"guard '{guard}' has no 'target' parameter")
    roots = [target_name]
    per_version = _param(guard_cfg, "target_per_version")
    if per_version and "{version}" in per_version:
        pat = re.compile("^" + re.escape(per_version).replace(re.escape("{version}"), r"\d+") + "$")
        roots += sorted(p.name for p in repo.iterdir() if pat.match(p.name) and (p / repository.CONFIG).exists())
    # every model under the target (ensemble steps, recursively), leaves first
    leaves: list[str] = []
    ensembles: list[str] = []

    def walk(name: str) -> None:
        if name in leaves or name in ensembles:
            return
        cfg = read(name)
        if cfg.get("platform") == "ensemble":
            for step in _steps(cfg):
                walk(step)
            ensembles.append(name)
        else:
            leaves.append(name)

    for root in roots:
        walk(root)
    runtime = [n for n in leaves if configs[n].get("backend") == "runtime"]
    if not runtime:
        raise TuneError(f"no model served by backend 'runtime' under '{target_name}': nothing to tune")
    front = [s for s in _steps(configs[model]) if s != guard] if model != guard else []
    for s in front:
        read(s)
    outer = [model] if model != guard else []
    text = layout.needs_intake(guard_cfg)  # a BYTES input: drive it with sentences
    pipe = Pipeline(public=model, guard=guard, target=runtime[0], placement=placement,
                    load_order=(*leaves, *front, guard, *ensembles, *outer), ensembles=(*ensembles, *outer), text=text)
    return pipe, configs


# -- reading and writing knobs ---------------------------------------------------------------
def _count(cfg: dict[str, Any]) -> int:
    groups = cfg.get("instance_group") or [{}]
    return int(groups[0].get("count", 1) or 1)


def _delay(cfg: dict[str, Any]) -> int:
    return int((cfg.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0) or 0)


def _preferred(cfg: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(x) for x in (cfg.get("dynamic_batching") or {}).get("preferred_batch_size") or [])


def read_knobs(pipe: Pipeline, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    g, t = configs[pipe.guard], configs[pipe.target]
    return {GUARD_INSTANCES: _count(g), GUARD_DELAY: _delay(g), TARGET_INSTANCES: _count(t),
            TARGET_DELAY: _delay(t), TARGET_THREADS: int(_param(t, "intra_op_threads", "1") or 1),
            PREFERRED: _preferred(configs[pipe.batcher])}


def conflicts(cfg: dict[str, Any], knobs: set[str] | tuple[str, ...], role: str) -> list[str]:
    """Settings of ``cfg`` (a ``role`` = guard | target config) that tune does not manage and
    that conflict with changing ``knobs`` there: tune would write a value the model ignores or
    overwrite something it cannot represent."""
    out = []
    groups = cfg.get("instance_group") or []
    if f"{role}.instances" in knobs:
        if len(groups) > 1:
            out.append(f"{len(groups)} instance_group entries (tune sets one count)")
        elif groups and groups[0].get("kind", "KIND_CPU") not in ("KIND_CPU", "KIND_AUTO"):
            out.append(f"instance_group kind {groups[0].get('kind')} (tune sizes CPU instances)")
        elif groups and (groups[0].get("gpus") or groups[0].get("rate_limiter")):
            out.append("instance_group with gpus/rate_limiter (tune sets one plain count)")
    batching = {f"{role}.delay_us", PREFERRED} & set(knobs)
    if batching and "sequence_batching" in cfg:
        out.append("sequence_batching (tune changes dynamic_batching)")
    if batching and "dynamic_batching" not in cfg:
        out.append("no dynamic_batching (tune never adds one)")
    if role == "guard" and _param(cfg, "runtime.intra_op_threads") is not None and TARGET_THREADS in knobs:
        out.append("parameter runtime.intra_op_threads (overrides the target's threads in process)")
    return out


def with_knobs(cfg: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the knob ``values`` (keys ``instances``, ``delay_us``, ``threads``,
    ``preferred``) set; everything else kept. Never adds a dynamic_batching."""
    new = copy.deepcopy(cfg)
    if "instances" in values:
        groups = new.get("instance_group") or [{"kind": "KIND_CPU"}]
        groups[0] = {**groups[0], "count": int(values["instances"])}
        new["instance_group"] = groups
    if "dynamic_batching" in new:
        db = dict(new.get("dynamic_batching") or {})
        if "delay_us" in values:
            if values["delay_us"]:
                db["max_queue_delay_microseconds"] = str(int(values["delay_us"]))
            else:
                db.pop("max_queue_delay_microseconds", None)
        if "preferred" in values:
            if values["preferred"]:
                db["preferred_batch_size"] = [int(x) for x in values["preferred"]]
            else:
                db.pop("preferred_batch_size", None)
        new["dynamic_batching"] = db
    if "threads" in values:
        params = dict(new.get("parameters") or {})
        params["intra_op_threads"] = {"string_value": str(int(values["threads"]))}
        new["parameters"] = params
    return new


def configs_for(pipe: Pipeline, base: dict[str, dict[str, Any]], point: dict[str, Any],
                knobs: tuple[str, ...] = KNOBS) -> dict[str, dict[str, Any]]:
    """The configs of the managed models at ``point`` (only ``knobs`` applied), from ``base``."""
    g: dict[str, Any] = {}
    t: dict[str, Any] = {}
    if GUARD_INSTANCES in knobs:
        g["instances"] = point[GUARD_INSTANCES]
    if GUARD_DELAY in knobs:
        g["delay_us"] = point[GUARD_DELAY]
    if TARGET_INSTANCES in knobs:
        t["instances"] = point[TARGET_INSTANCES]
    if TARGET_DELAY in knobs:
        t["delay_us"] = point[TARGET_DELAY]
    if TARGET_THREADS in knobs:
        t["threads"] = point[TARGET_THREADS]
    if PREFERRED in knobs:
        (g if pipe.batcher == pipe.guard else t)["preferred"] = point[PREFERRED]
    return {pipe.target: with_knobs(base[pipe.target], t), pipe.guard: with_knobs(base[pipe.guard], g)}


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
    if pipe.placement == "inprocess" and _param(g, "runtime.intra_op_threads") is not None:
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


def point_key(point: dict[str, Any]) -> tuple:
    return tuple(point[k] for k in KNOBS)


def describe(point: dict[str, Any], base: dict[str, Any] | None = None) -> str:
    """``g.inst=2 t.threads=1``: the knobs of ``point`` that differ from ``base`` (all without)."""
    parts = []
    for k in KNOBS:
        if base is not None and point[k] == base[k]:
            continue
        v = point[k]
        parts.append(f"{SHORT[k]}={','.join(map(str, v)) or 'none' if isinstance(v, tuple) else v}")
    return " ".join(parts) or "(current config)"


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


# -- measuring -------------------------------------------------------------------------------
def input_data(pipe: Pipeline, configs: dict[str, dict[str, Any]], path: Path) -> Path:
    """perf_analyzer ``--input-data``: varied realistic requests (load_digits images, sentences)."""
    inputs = configs[pipe.guard].get("input") or []
    if pipe.text:
        name = inputs[0]["name"] if inputs else "TEXT"
        from examples.texts import stdlib_sentences  # noqa: PLC0415

        data = [{name: {"content": [s], "shape": [1]}} for s in stdlib_sentences(48)]
    else:
        import numpy as np  # noqa: PLC0415
        from sklearn.datasets import load_digits  # noqa: PLC0415

        if len(inputs) != 1:
            raise TuneError(f"tune drives tensor models with one input; '{pipe.public}' has {len(inputs)}")
        dims = [int(d) for d in inputs[0].get("dims") or []]
        images = load_digits().images[:64].astype(np.float32)
        if int(np.prod(dims)) != 64:
            raise TuneError(f"no realistic inputs for '{pipe.public}' (input dims {dims}); tune knows digits-shaped images and text")
        data = [{inputs[0]["name"]: {"content": img.ravel().tolist(), "shape": dims}} for img in images]
    path.write_text(json.dumps({"data": data}))
    return path


def perf_analyzer(url: str, model: str, concurrency: int, data: Path, *, window_ms: int, trials: int,
                  stability_pct: float) -> Stat:
    """One perf_analyzer run; a window that never settles within ``stability_pct`` is measured
    again with no stability bound (the machine is noisy, not the point broken)."""

    out = ""
    for stability in (stability_pct, 1000):
        try:
            row, out = perf_analyzer_run(url, model, concurrency, data, window_ms=window_ms, trials=trials,
                                         stability_pct=stability, timeout=60 + window_ms * trials * 3 / 1000)
        except subprocess.TimeoutExpired:
            raise TuneError(f"perf_analyzer timed out on {model} c={concurrency}") from None
        if row is not None:
            return Stat(float(row["Inferences/Second"]), float(row["p50 latency"]) / 1000,
                        float(row["p99 latency"]) / 1000)
        if "stable" not in out.lower():
            break
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    raise TuneError(f"perf_analyzer failed on {model} c={concurrency}: {(errors or lines or ['no output'])[-1][:300]}")


class Session:
    """One private tritonserver over a copy of the pipeline's folders; trial configs go into
    the copy and are loaded with a config override. Use as a context manager: the server is
    stopped by PID on every way out."""

    def __init__(self, repo: Path, pipe: Pipeline, configs: dict[str, dict[str, Any]], workdir: Path,
                 log_path: Path):
        self.src, self.pipe, self.workdir, self.log_path = Path(repo), pipe, Path(workdir), log_path
        self.loaded = {name: configs[name] for name in pipe.managed}
        self.server = None
        self.copy = self.workdir / "repository"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def prepare(self) -> Path:
        """The copy: mirror (guard folders copied, others linked), the public model's rollout
        state kept (a canaried version keeps its share), each managed model a real folder whose
        config.pbtxt is its own and whose versions link to the user's."""
        repository.mirror(self.src, self.copy)
        for name in {self.pipe.public, self.pipe.guard}:
            state = self.src / name / "rollout_state.json"
            if state.exists():
                shutil.copy2(state, self.copy / name / "rollout_state.json")
        for name in self.pipe.managed:
            dest = self.copy / name
            if dest.is_symlink():
                dest.unlink()
                dest.mkdir()
                for entry in (self.src / name).iterdir():
                    if entry.name == repository.CONFIG:
                        shutil.copy2(entry, dest / entry.name)
                    elif not entry.name.startswith(("rollout_state", ".rollout_state")):
                        (dest / entry.name).symlink_to(entry.resolve())
        return self.copy

    def start(self, timeout: float = 240.0) -> None:

        self.prepare()
        args = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in self.pipe.load_order)]
        # unsupervised: the supervisor takes the stubs a reload retires for dead ones and
        # reloads the model again, in the middle of the next measurement
        env = {**os.environ, "TRITONGUARD_SUPERVISE": "0"}
        self.server = Server(repository=self.copy, log_path=self.log_path, extra_args=args, env=env)
        try:
            self.server.start(wait_models=[self.pipe.public], timeout=timeout)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "\\n" in first:  # a load error's python traceback, escaped inside the reason
                first = first.split("\\n")[0] + "…"
            raise TuneError(f"tritonserver could not start: {first}") from None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.http_url

    def _post_load(self, name: str, config: dict[str, Any] | None, timeout: float = 180.0) -> None:
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        try:
            status, raw = triton_http.request(f"http://{self.url}/v2/repository/models/{name}/load", "POST",
                                              json.dumps(body).encode(), timeout=timeout)
        except triton_http.Unreachable as exc:
            raise TuneError(f"load of {name} failed: {exc.reason}") from None
        if status != 200:
            try:
                msg = json.loads(raw).get("error", "") or f"HTTP {status}"
            except ValueError:
                msg = f"HTTP {status}"
            raise TuneError(f"load of {name} failed: {msg.splitlines()[0]}")

    def load(self, new: dict[str, dict[str, Any]], *, force: bool = False) -> list[str]:
        """Write the changed managed configs into the copy and reload them (target first, then
        the guard, then the ensembles over them); returns the models reloaded."""
        changed = [n for n in self.pipe.load_order if n in new and (force or new[n] != self.loaded.get(n))]
        if not changed:
            return []
        if self.pipe.placement == "inprocess" and self.pipe.target in changed and self.pipe.guard not in changed:
            changed.append(self.pipe.guard)  # the guard reads the target's runtime settings at load
        for name in changed:
            repository.write_config(self.copy / name, new[name])
            self._post_load(name, new[name])
            self.loaded[name] = new[name]
        for name in self.pipe.ensembles:
            self._post_load(name, None)
        deadline = time.monotonic() + 60
        assert self.server is not None
        while not self.server._ok(f"/v2/models/{self.pipe.public}/ready"):
            if time.monotonic() > deadline:
                raise TuneError(f"{self.pipe.public} not ready after reloading {', '.join(changed)}")
            time.sleep(0.3)
        return changed


# -- applying --------------------------------------------------------------------------------
@dataclass
class Applied:
    model: str
    status: str  # written | unchanged | skipped
    detail: str = ""
    backup: str = ""


def managed_changes(pipe: Pipeline, base: dict[str, Any], chosen: dict[str, Any]) -> dict[str, set[str]]:
    """Per managed model, the knobs that differ between ``base`` and ``chosen``."""
    out: dict[str, set[str]] = {pipe.guard: set(), pipe.target: set()}
    for k in KNOBS:
        if base[k] == chosen[k]:
            continue
        if k == PREFERRED:
            out[pipe.batcher].add(k)
        else:
            out[pipe.guard if k.startswith("guard.") else pipe.target].add(k)
    return out


def apply_configs(repo: Path, pipe: Pipeline, start_texts: dict[str, str], base: dict[str, Any],
                  chosen: dict[str, Any], stamp: str) -> list[Applied]:
    """Write the chosen knobs into the user's configs: per file a backup
    ``config.pbtxt.bak-<stamp>`` beside it, then an atomic write of the user's CURRENT config
    with only tune's knobs changed. A file that changed since tune read it, or whose config has
    settings that conflict with the change, is reported and left alone."""
    repo = Path(repo)
    results = []
    for name, knobs in managed_changes(pipe, base, chosen).items():
        if not knobs:
            results.append(Applied(name, "unchanged", "no managed knob changed"))
            continue
        path = repo / name / repository.CONFIG
        try:
            text = path.read_text()
        except OSError as exc:
            results.append(Applied(name, "skipped", f"cannot read {path}: {exc.strerror}"))
            continue
        if text != start_texts.get(name):
            results.append(Applied(name, "skipped", f"{path} changed since tune read it (a hand edit?); not overwritten"))
            continue
        current = repository.read_config(repo / name)
        role = "guard" if name == pipe.guard else "target"
        reasons = conflicts(current, knobs, role)
        if reasons:
            results.append(Applied(name, "skipped", f"{path}: {'; '.join(reasons)}; not overwritten"))
            continue
        new = configs_for(pipe, {pipe.guard: current, pipe.target: current}, chosen,
                          knobs=tuple(knobs))[name]
        backup = path.with_name(f"{repository.CONFIG}.bak-{stamp}")
        atomic_write(backup, text)
        repository.write_config(repo / name, new)
        results.append(Applied(name, "written", ", ".join(sorted(f"{SHORT[k]}={fmt_value(chosen[k])}" for k in knobs)),
                               str(backup)))
    return results


def fmt_value(v: Any) -> str:
    return (",".join(map(str, v)) or "none") if isinstance(v, tuple) else str(v)


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
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

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
