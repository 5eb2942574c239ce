"""Goldens on the serving hardware, before a version gets traffic.

The first time a version is asked about, it runs on its stored golden inputs here (the whole
set, a few rows alone, and tiled to the target's largest batch) and is judged against the stored
outputs by its workload's validator; the verdict is written to the rollout state, so every
process and replica routes by the same one, and a version that FAILs is never routed to. A
target that cannot be reached yet (loading, unloaded) is no verdict: the version is not routable
meanwhile and is tried again after ``UNREADY_RETRY_S``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core import repository
from tritonguard.core.errors import TargetError
from tritonguard.guard.routing.config import (
    SKIPPED,
    TASK_TO_WORKLOAD,
    UNREADY_CODES,
    UNREADY_RETRY_S,
)
from tritonguard.guard.routing.view import RolloutView
from tritonguard.rollout.state import RolloutState
from tritonguard.rollout.validators import FAIL, PASS, ValidatorConfig, ValidatorRegistry

log = logging.getLogger(__name__)


class GoldensChecker:
    def __init__(self, *, guard: str, repo: Path, target: str, view: RolloutView, target_for: Callable[[int], Any],
                 output_names: list[str], validator: ValidatorConfig, registry: ValidatorRegistry, metrics: Any,
                 alert: Callable[[str, int | None, dict[str, Any]], None], clock: Callable[[], float],
                 enabled: bool = True, max_batch: int = 0):
        self.guard, self.repo, self.target, self.view = guard, repo, target, view
        self.target_for, self.output_names = target_for, output_names
        self.validator, self.registry, self.metrics, self.alert = validator, registry, metrics, alert
        self.clock, self.enabled = clock, enabled
        self.max_batch = max_batch  # goldens also run at this batch size (0: not known)
        self._lock = threading.Lock()  # one golden check at a time, never two of a version
        self._unready: dict[int, float] = {}  # version -> when its target last could not be reached
        # versions with no goldens to check (SKIPPED): the state stores verdicts only (PASS,
        # MARGINAL, FAIL), so a skip is kept here, checked and logged once per process; before,
        # each reconcile pass checked it again and logged "golden result ... not stored"
        self._skipped: set[int] = set()
        # whether a version is on this replica yet (the router sets it): one that is not is no
        # verdict, and is not checked (its goldens file, its artifact may be on their way)
        self.present: Callable[[int], bool] = lambda _v: True
        # runs a check (the guard sets its cost meter's: a check is nobody's request, even when a
        # batch's routing runs it on the serving thread)
        self.uncharged: Callable[[Callable[[], str]], str] = lambda work: work()

    def verdict(self, version: int) -> str:
        """PASS / MARGINAL / FAIL for ``version``, checking it on this server the first time."""
        if not self.enabled:
            return PASS
        known = self.view.state.goldens.get(str(version))
        if known is not None:
            return known.get("verdict", FAIL)
        if version in self._skipped:
            return SKIPPED
        if not self.present(version):
            return FAIL  # not routable yet; nothing stored
        with self._lock:  # the reconciler may be checking it right now: wait for its verdict
            known = self.view.state.goldens.get(str(version))
            if known is not None:
                return known.get("verdict", FAIL)
            last = self._unready.get(version)
            if last is not None and self.clock() - last < UNREADY_RETRY_S:
                return FAIL  # its target was unreachable a moment ago: not routable yet
            return self.uncharged(lambda: self._check_and_record(version))

    def _check_and_record(self, version: int) -> str:
        result = self.check(version)
        if result.get("unready"):
            self._unready[version] = self.clock()
            return FAIL
        self._unready.pop(version, None)
        if result["verdict"] == SKIPPED:  # nothing to store (see _skipped)
            self._skipped.add(version)
            self.metrics.inc("goldens", 1, target_version=str(version), verdict=SKIPPED)
            return SKIPPED
        self.view.state.goldens[str(version)] = result

        def record(current: RolloutState) -> RolloutState:
            current.goldens.setdefault(str(version), result)
            return current

        self.view.update(record, f"golden result for v{version}")
        self.metrics.inc("goldens", 1, target_version=str(version), verdict=result["verdict"])
        if result["verdict"] == FAIL:
            self.alert("golden_fail", version, result["metrics"])
        return result["verdict"]

    def check(self, version: int) -> dict[str, Any]:
        """Run ``version`` on its goldens here: ``{"verdict", "metrics", "checked_at"}`` (and
        ``"unready": True`` when its target could not be reached)."""
        vdir = self.repo / self.target / str(version)
        now = self.clock()
        path = vdir / repository.GOLDENS
        if not path.exists():
            # nothing to check against (a model not exported by us, or a target outside this
            # repository): say so loudly, but do not refuse a version the user routed to
            log.warning("guard %s: %s v%d has no %s; golden check SKIPPED", self.guard, self.target, version,
                        repository.GOLDENS)
            return {"verdict": SKIPPED, "metrics": {"reason": f"no {repository.GOLDENS}"}, "checked_at": now}
        inputs, expected = repository.load_goldens(path)
        cfg = self.validator_for(version)
        worst, figures = PASS, {}
        # the whole set in one call, then a few rows alone and the set tiled to the largest batch
        # the target accepts: a version that fails only at batch 1 or only on big batches (which
        # live traffic makes and a 64-row golden call may not) fails here, before any traffic
        n = len(next(iter(inputs.values())))
        runs: list[tuple[str, np.ndarray]] = [("all", np.arange(n))]
        runs += [(f"batch 1 (row {k})", np.array([k])) for k in range(min(n, 3))]
        if self.max_batch > n:
            runs.append((f"batch {self.max_batch}", np.resize(np.arange(n), self.max_batch)))
        for label, rows in runs:
            try:
                got = self.target_for(version).infer({k: v[rows] for k, v in inputs.items()})
            except Exception as exc:  # noqa: BLE001 - a broken version fails its goldens, nothing more
                if isinstance(exc, TargetError) and (exc.code in UNREADY_CODES or "not ready" in str(exc)):
                    # the model is not there to judge (loading, or a version step not loaded yet):
                    # a stored FAIL would refuse it for good, even once it loads
                    log.warning("guard %s: goldens of %s v%d not run, target unavailable (again in %gs): %s",
                                self.guard, self.target, version, UNREADY_RETRY_S, exc)
                    return {"verdict": FAIL, "unready": True, "metrics": {"error": str(exc)}, "checked_at": now}
                figures["error"] = f"{label}: {type(exc).__name__}: {exc}"
                worst = FAIL
                break
            for name in self.output_names:
                if name not in expected:
                    continue
                v = self.registry.validate(got[name], expected[name][rows], cfg)
                if label == "all" or v.status != PASS:
                    figures[name if label == "all" else f"{name} at {label}"] = v.metrics
                if v.status == FAIL or (v.status != PASS and worst == PASS):
                    worst = v.status
            if worst == FAIL:
                break
        log.info("guard %s: goldens of %s v%d on this server: %s %s", self.guard, self.target, version, worst, figures)
        return {"verdict": worst, "metrics": figures, "checked_at": now}

    def validator_for(self, version: int) -> ValidatorConfig:
        """The validator settings ``version`` is judged with (its workload from its manifest's task)."""
        manifest = repository.read_manifest(self.repo / self.target / str(version)) or {}
        workload = TASK_TO_WORKLOAD.get(manifest.get("task", ""), "")
        if workload and not self.validator.custom and workload != self.validator.workload:
            return replace(self.validator, workload=workload)
        return self.validator
