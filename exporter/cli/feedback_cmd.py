"""``python -m exporter feedback MODEL --labels FILE``: labels that arrived after the answer.

Each guard keeps, for a while and in the state's store, what each version answered to the
requests that carried an id (:mod:`tritonguard.rollout.feedback`). This command joins a file of
``request_id,label`` rows (CSV with a header, JSON Lines, or Parquet; optional ``tenant`` and
``slice`` columns) to those answers and stores the joined labels, which the rollout's ``labels``
gate then weighs exactly like labels sent with the requests. A label whose request is unknown
(not sampled, expired, never answered here) or already joined is counted and skipped.

Exit codes (:mod:`exporter.cli.exits`): 0 labels joined, 1 none could be joined, 2 bad input (unreadable file, missing
columns, an unknown model, an unreachable store).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from exporter.cli.consoles import WideConsole
from exporter.cli.exits import EXIT_BAD_INPUT, EXIT_NEGATIVE
from exporter.errors import ExporterError
from tritonguard.core import repository as repo_mod
from tritonguard.rollout.feedback import FeedbackUnavailable, join, open_feedback_log

out = WideConsole(soft_wrap=True)
err = WideConsole(stderr=True, soft_wrap=True)
COLUMNS = ("request_id", "label")


class FeedbackError(ExporterError):
    """Labels cannot be joined: the store cannot be read or written, or the model is not a guard."""


class LabelFileError(FeedbackError, ValueError):
    """The label file cannot be read or lacks a column."""


def read_labels(path: Path) -> list[dict[str, Any]]:
    """Rows of ``path`` as dicts with at least ``request_id`` and ``label``."""
    path = Path(path)
    if not path.is_file():
        raise LabelFileError(f"{path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as fh:
                rows = list(csv.DictReader(fh))
        elif suffix in (".jsonl", ".ndjson"):
            rows = list(_jsonl(path))
        elif suffix == ".parquet":
            import pandas as pd  # noqa: PLC0415 - only for Parquet files

            rows = pd.read_parquet(path).to_dict("records")
        else:
            raise LabelFileError(f"{path}: expected .csv, .jsonl or .parquet")
    except (OSError, UnicodeDecodeError, csv.Error, ImportError, ValueError) as exc:
        if isinstance(exc, LabelFileError):
            raise
        raise LabelFileError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    for i, row in enumerate(rows, 1):
        missing = [c for c in COLUMNS if row.get(c) in (None, "")]
        if missing:
            raise LabelFileError(f"{path}: row {i} has no {', '.join(missing)} (columns: request_id, label, "
                                 "optional tenant and slice)")
    return rows


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise LabelFileError(f"{path}: line {i} is not JSON") from None
            if not isinstance(row, dict):
                raise LabelFileError(f"{path}: line {i} is not a JSON object")
            yield row


def feedback_command(
    model: Annotated[str, typer.Argument(help="Guard model name, e.g. digits.")],
    labels: Annotated[Path, typer.Option("--labels", help="CSV (with a header), JSON Lines or Parquet of "
                                         "request_id,label[,tenant][,slice].")],
    tenant: Annotated[str | None, typer.Option(help="Tenant of rows that name none. Default: the one tenant "
                                               "whose request carried the id (an id several tenants used is "
                                               "skipped as ambiguous).")] = None,
    repository: Annotated[Path, typer.Option("--repository", "--model-repository", "-r", help="Model repository folder.")] = Path("model_repository"),
    as_json: Annotated[bool, typer.Option("--json", help="The counts as JSON on stdout.")] = False,
) -> None:
    """Join LABELS to what each version of MODEL answered, for the rollout's labels gate."""

    try:
        if repo_mod.guard_dir(Path(repository), model) is None:
            raise FeedbackError(f"'{model}' is not a guarded model in {repository}")
        rows = read_labels(labels)
        try:
            res = join(open_feedback_log(model, repository), rows, tenant=tenant)
        except FeedbackUnavailable as exc:
            raise FeedbackError(str(exc)) from None
    except ExporterError as exc:
        err.print(f"[bold red]✗ feedback failed:[/] {exc}", markup=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    counts = {"labels": len(rows), "joined": len(res.joined), "unknown": res.unknown, "duplicate": res.duplicate,
              "ambiguous": res.ambiguous, "mismatched": res.mismatched,
              "by_version": {str(v): {"right": r, "labelled": n} for v, (r, n) in sorted(res.by_version.items())}}
    if as_json:
        typer.echo(json.dumps(counts, indent=2))
    else:
        per = ", ".join(f"v{v}: {d['right']}/{d['labelled']} right" for v, d in counts["by_version"].items())
        out.print(f"[bold]{model}[/]: joined {len(res.joined)} of {len(rows)} labels" + (f" ({per})" if per else ""))
        skipped = [f"{n} {what}" for n, what in ((res.unknown, "unknown request ids (not sampled, expired or never "
                                                             "answered here)"),
                                                 (res.duplicate, "already joined"),
                                                 (res.ambiguous, "ambiguous (several tenants used the id; "
                                                                 "give a tenant column or --tenant)"),
                                                 (res.mismatched, "not matching the answer (rows, or not a classifier)"))
                   if n]
        if skipped:
            err.print("skipped: " + "; ".join(skipped))
    if not res.joined:
        raise typer.Exit(EXIT_NEGATIVE)
