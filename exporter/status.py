"""What a model repository holds: models, their versions, hashes and golden verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from tritonguard import repository as repo_mod

# the figures worth a column, per task, in the order shown
KEY_METRICS = {
    "classifier": ("top1_agreement", "max_abs_prob_diff"),
    "embedding": ("min_cosine",),
    "regression": ("max_abs_diff",),
}


def collect(repository: Path) -> list[dict[str, Any]]:
    """One entry per model folder with a config.pbtxt, sorted by name."""
    repository = Path(repository)
    if not repository.is_dir():
        return []
    models = []
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not (model_dir / repo_mod.CONFIG).exists():
            continue
        try:
            cfg = repo_mod.read_config(model_dir)
            kind = cfg.get("backend") or cfg.get("platform") or "?"
            params = {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
            error = None
        except Exception as exc:  # noqa: BLE001 - a broken config is itself worth reporting
            kind, params, error = "?", {}, f"unreadable config.pbtxt: {exc}"
        entry: dict[str, Any] = {"name": model_dir.name, "kind": kind, "versions": []}
        if error:
            entry["error"] = error
        if "target" in params:
            entry["target"] = params["target"]
        for v in repo_mod.versions(model_dir):
            man = repo_mod.read_manifest(model_dir / str(v)) or {}
            golden = man.get("golden") or {}
            entry["versions"].append({
                "version": v, "sha256": man.get("sha256"), "task": man.get("task"),
                "verdict": golden.get("verdict"), "metrics": golden.get("metrics", {}),
                "n": golden.get("n"), "created": man.get("created"), "part_of": man.get("part_of"),
            })
        models.append(entry)
    return models


# short labels: the table must stay readable in an 80-column terminal
_LABELS = {"top1_agreement": "top1", "max_abs_prob_diff": "Δp", "min_cosine": "cos≥", "max_abs_diff": "Δ"}


def _figures(task: str | None, metrics: dict[str, Any]) -> str:
    keys = KEY_METRICS.get(task or "", ())
    return "\n".join(f"{_LABELS.get(k, k)} {metrics[k]:.4g}" if isinstance(metrics[k], float)
                     else f"{_LABELS.get(k, k)} {metrics[k]}" for k in keys if k in metrics)


def _created(iso: str | None) -> str:
    return iso[:16].replace("T", " ") if iso else ""


_VERDICT_STYLE = {"PASS": "green", "MARGINAL": "yellow", "FAIL": "red"}


def table(models: list[dict[str, Any]], repository: Path) -> Table:
    t = Table(title=f"model repository {repository} (times UTC)", box=box.SIMPLE_HEAD, title_justify="left",
              pad_edge=False, collapse_padding=True)
    for col in ("model", "kind", "v", "sha256", "golden", "figures", "created"):
        t.add_column(col, no_wrap=col != "figures", min_width=10 if col == "figures" else None)
    for m in models:
        if "error" in m:
            t.add_row(m["name"], m["kind"], "", "", "[red]error[/]", m["error"], "")
            continue
        # a guard has no artifact of its own: show what it fronts instead
        target = f"→ {m['target']}" if "target" in m else ""
        if not m["versions"]:
            t.add_row(m["name"], m["kind"], "-", "", "", target, "")
        for i, v in enumerate(m["versions"]):
            verdict = v["verdict"] or ""
            style = _VERDICT_STYLE.get(verdict)
            golden = f"[{style}]{verdict}[/] {v['n']}" if style else ""
            if v["part_of"]:
                figures = f"in {v['part_of']}"
            else:
                figures = _figures(v["task"], v["metrics"]) or target
            t.add_row(m["name"] if i == 0 else "", m["kind"] if i == 0 else "", str(v["version"]),
                      (v["sha256"] or "")[:8], golden, figures, _created(v["created"]))
    return t
