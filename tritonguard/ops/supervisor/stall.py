"""Stall: the frozen-stub check.

Triton's metrics page says, per model, how many requests wait and how many executions ran
(:func:`parse_progress`); :class:`StallWatch` turns successive readings into :class:`Stall` s
(requests waiting, no new execution for ``stall_s``) and judges the model's stubs by the CPU
they used meanwhile. :func:`called_models` names the models a frozen guard calls, which are
stuck behind it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from tritonguard.ops.supervisor.stubs import Stub, cpu_seconds

STALL_S = 60.0  # a model with requests waiting and no execution for this long is checked for frozen stubs


def parse_progress(text: str) -> dict[str, tuple[int, int]]:
    """Model -> (requests waiting, executions so far), summed over its versions, from Triton's
    metrics page (``nv_inference_pending_request_count``, ``nv_inference_exec_count``)."""
    out: dict[str, list[int]] = {}
    for line in text.splitlines():
        if line.startswith("nv_inference_pending_request_count{"):
            slot = 0
        elif line.startswith("nv_inference_exec_count{"):
            slot = 1
        else:
            continue
        labels, _, value = line.rpartition("} ")
        start = labels.find('model="')
        if start < 0:
            continue
        model = labels[start + 7:labels.find('"', start + 7)]
        try:
            n = int(float(value))
        except ValueError:
            continue
        out.setdefault(model, [0, 0])[slot] += n
    return {m: (v[0], v[1]) for m, v in out.items()}


def called_models(config: str | None, loaded: set[str]) -> list[str]:
    """The loaded models a guard calls, from its config (JSON, as Triton returns it): its
    ``target``, the models of ``target_per_version`` (``{version}`` standing for a number), and
    every ``*.model`` parameter (``similarity.model``, ``semantic_cache.model``)."""
    try:
        params = json.loads(config or "{}").get("parameters") or {}
    except (ValueError, AttributeError):
        return []
    out: set[str] = set()
    for key, value in params.items():
        v = value.get("string_value", "") if isinstance(value, dict) else ""
        if not v:
            continue
        if key == "target" or key.endswith(".model"):
            out.update({v} & loaded)
        elif key == "target_per_version" and "{version}" in v:
            pattern = re.compile(re.escape(v).replace(re.escape("{version}"), r"\d+"))
            out.update(m for m in loaded if pattern.fullmatch(m))
    return sorted(out)


@dataclass
class _Progress:
    executions: int
    since: float | None = None  # when requests were first seen waiting with no new execution
    cpu: dict[int, float] = field(default_factory=dict)  # stub pid -> its CPU seconds then


@dataclass(frozen=True)
class Stall:
    model: str
    waiting: int  # requests waiting now
    seconds: float  # without a new execution
    idle: list[Stub]  # the model's stubs that used (almost) no CPU meanwhile; empty: all busy
    busiest: float = 0.0  # the highest share of one CPU a stub of the model used meanwhile


class StallWatch:
    """Models whose instances took no new execution for ``stall_s`` while requests waited.

    Fed one metrics reading at a time (:meth:`observe`). A model's clock starts at the first
    reading with requests waiting and the same execution count as the reading before, and
    restarts whenever an execution happens or nothing waits. When it reaches ``stall_s`` the
    model's stubs are judged by the CPU they used since the clock started: below ``cpu_share``
    of one CPU, a stub is idle (a deadlock, a native wait that never returns); above, it is
    working (a long execution), and the model is left alone for another ``stall_s``. A frozen
    stub is not at 0 %: each of its threads waiting for the GIL wakes every 5 ms (the frozen
    BLS stream guard, 24 threads, used 3 % of one CPU, measured); an execution that works uses
    one CPU or more."""

    def __init__(self, stall_s: float, cpu_share: float = 0.25,
                 cpu: Callable[[int], float | None] = cpu_seconds):
        self.stall_s, self.cpu_share, self.cpu = stall_s, cpu_share, cpu
        self.models: dict[str, _Progress] = {}

    def reset(self) -> None:
        self.models.clear()

    def observe(self, now: float, progress: dict[str, tuple[int, int]], stubs: dict[int, Stub]) -> list[Stall]:
        by_model: dict[str, dict[int, Stub]] = {}
        for pid, stub in stubs.items():
            by_model.setdefault(stub.model, {})[pid] = stub
        out = []
        for model, (waiting, executions) in progress.items():
            mine = by_model.get(model)
            seen = self.models.get(model)
            if not mine or seen is None or waiting <= 0 or executions != seen.executions:
                self.models[model] = _Progress(executions)
                continue
            if seen.since is None:
                seen.since = now
                seen.cpu = {pid: c for pid in mine if (c := self.cpu(pid)) is not None}
                continue
            took = now - seen.since
            if took < self.stall_s:
                continue
            idle, busiest = [], 0.0
            for pid, stub in mine.items():
                used = self.cpu(pid)
                if pid not in seen.cpu or used is None:
                    continue  # started during the stall (a reload), or gone
                share = (used - seen.cpu[pid]) / took
                busiest = max(busiest, share)
                if share < self.cpu_share:
                    idle.append(stub)
            out.append(Stall(model, waiting, took, sorted(idle, key=lambda s: s.instance), busiest))
            self.models[model] = _Progress(executions)  # judged: a new clock
        return out


def stall_seconds(env: dict[str, str], log: Callable[[str], None]) -> float:
    """``TRITONGUARD_STALL_S`` (seconds, 0: off), or the default when unset or not a number."""
    raw = env.get("TRITONGUARD_STALL_S", "").strip()
    if not raw:
        return STALL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        log(f"TRITONGUARD_STALL_S={raw!r} is not a number of seconds >= 0: using {STALL_S:.0f}")
        return STALL_S
    return value


__all__ = ["STALL_S", "Stall", "StallWatch", "called_models", "parse_progress", "stall_seconds"]
