"""Writing the chosen knobs into the user's repository (``--apply``): one backup per file,
atomic writes, only the knobs tune manages, nothing written over a file that changed since
tune read it or whose settings conflict with the change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.tune.knobs import KNOBS, PREFERRED, SHORT, Pipeline, configs_for, conflicts, fmt_value
from tritonguard.core import repository
from tritonguard.core.files import atomic_write


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
