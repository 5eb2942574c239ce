"""Layout upgrades: a guard with a BYTES input that is still the public model itself (exported
before the intake existed) is moved behind an intake, its settings and rollout state kept.
Run by the next export into the repository, or alone (``exporter upgrade``).
"""

from __future__ import annotations

from pathlib import Path

from exporter.build import layout
from exporter.build.errors import ExportError
from tritonguard.core import repository as repo_mod


def upgrade_plan(repository: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """What :func:`upgrade_layout` would write: ``[(model, config)]`` and one line per guard moved."""
    repository = Path(repository)
    if not repository.is_dir():
        return [], []
    writes: list[tuple[str, dict]] = []
    moved = []
    for model_dir in sorted(p for p in repository.iterdir() if (p / repo_mod.CONFIG).exists()):
        try:
            cfg = repo_mod.read_config(model_dir)
        except Exception:  # noqa: BLE001, S112 - not ours to fix here; the export that needs it says so
            continue
        params = cfg.get("parameters") or {}
        if cfg.get("backend") != "guard" or "serves_as" in params or not layout.needs_intake(cfg):
            continue
        name = model_dir.name
        fronts = layout.front_names(name)
        for role in ("guard", "intake"):
            if (repository / fronts[role]).exists():
                raise ExportError(f"cannot move guard '{name}' behind its intake: {repository / fronts[role]} "
                                  "already exists (rename or remove it)")
        guard = {**cfg, "name": fronts["guard"], "parameters": {**params, "serves_as": {"string_value": name}}}
        plan = [(fronts["guard"], guard), (fronts["intake"], layout.intake_config(fronts["intake"], cfg)),
                (name, layout.front_config(name, cfg, fronts["intake"], fronts["guard"]))]
        for _model, config in plan:
            layout.render(config)
        writes += plan  # the steps first: the public name changes last
        moved.append(f"{name}: now the ensemble {fronts['intake']} -> {fronts['guard']} "
                     f"(the guard's settings and rollout state kept)")
    return writes, moved


def upgrade_layout(repository: Path) -> list[str]:
    """Move every guard with a BYTES input that is still the public model itself (exported
    before the intake existed) behind an intake: ``NAME`` becomes the ensemble ``NAME_intake`` ->
    ``NAME_guard``; the guard keeps every setting and, serving as ``NAME``, its rollout state,
    latency samples and audit anchors (they stay in ``NAME/``). No version is added. Returns one
    line per model moved. A running server serves the new layout once the models are loaded again
    (a restart does it)."""
    writes, moved = upgrade_plan(repository)
    apply_plan(Path(repository), writes)
    return moved


def apply_plan(repository: Path, writes: list[tuple[str, dict]]) -> None:
    for model, config in writes:
        layout.write(repository / model, config)
        repo_mod.write_placeholder(repository / model / "1", model)
