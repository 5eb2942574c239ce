"""The pipeline ``exporter tune`` serves and the knobs it turns: the models of one public name
(guard, runtime target, ensembles) found in the repository, and each knob read from and
written into their configs (instances, queue delay, threads, preferred batch sizes), refusing
settings tune cannot represent.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.build import layout
from exporter.errors import ExporterError
from tritonguard.core import repository

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


def param(cfg: dict[str, Any], key: str, default: str | None = None) -> str | None:
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
    placement = param(guard_cfg, "placement", "bls") or "bls"
    target_name = param(guard_cfg, "target")
    if not target_name:
        raise TuneError(f"guard '{guard}' has no 'target' parameter")
    roots = [target_name]
    per_version = param(guard_cfg, "target_per_version")
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
            TARGET_DELAY: _delay(t), TARGET_THREADS: int(param(t, "intra_op_threads", "1") or 1),
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
    if role == "guard" and param(cfg, "runtime.intra_op_threads") is not None and TARGET_THREADS in knobs:
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


def fmt_value(v: Any) -> str:
    return (",".join(map(str, v)) or "none") if isinstance(v, tuple) else str(v)
