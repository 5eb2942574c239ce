"""``python -m exporter compile MODEL --version N``: optimised variants, admitted on evidence.

Progress bars go to stderr, the summary table (or ``--json``) to stdout. Exit 0 whenever the
command ran, even if every variant was rejected; 2 on bad input (nothing is written then).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from exporter.build.compile import compile_model, environment
from exporter.build.variants import CompileError
from exporter.cli.consoles import console
from exporter.cli.exits import EXIT_BAD_INPUT
from exporter.cli.repository_opt import Repository
from exporter.records.registry import default_uri

# full-width lines when piped (a CI log, `| cat`); $COLUMNS respected
out = console()
err = console(stderr=True)

_STYLE = {"admitted": "green", "rejected": "red", "skipped": "dim"}
_LABELS = {"top1_agreement": "top1", "max_abs_prob_diff": "Δp", "min_cosine": "cos≥", "max_abs_diff": "Δ"}


def agreement(result) -> str:
    """Task-level figures of a result's golden report, short enough for a table cell."""
    rep = result.report
    if rep is None:
        return ""
    figs = [f"{_LABELS[k]} {v:.3g}" for k, v in rep.metrics.items() if k in _LABELS and isinstance(v, float)]
    if "error" in rep.metrics:
        figs = [str(rep.metrics["error"])]
    return " ".join([rep.verdict, *figs[:2]])


def summary_table(parent, results) -> Table:
    t = Table(title=f"{parent.model} v{parent.version} ({parent.art_model}/{parent.version}/{parent.artifact.name})",
              box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for col in ("variant", "speed ratio", "agreement", "verdict", "version / reason"):
        t.add_column(col, justify="right" if col == "speed ratio" else "left",
                     no_wrap=col in ("variant", "verdict"), overflow="fold")
    for r in results:
        ratio = "" if r.speed_ratio is None else f"{r.speed_ratio:.2f}x"
        t.add_row(r.variant, ratio, agreement(r), f"[{_STYLE[r.verdict]}]{r.verdict}[/]", r.reason)
    return t


def registry_lines(results) -> list[str]:
    lines = []
    for r in results:
        if r.verdict != "admitted" or r.registry == "off":
            continue
        style = "yellow" if r.registry.startswith("failed") else "dim"
        lines.append(f"[{style}]  v{r.version} ({r.variant}) registry: {r.registry}[/]")
    return lines


class _Bars:
    """One bar over the variants and one over the timing rounds of the current variant."""

    def __init__(self, console: Console):
        self.bars = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=console, transient=False)
        self.overall = self.rounds = None

    def __enter__(self):
        self.bars.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bars.__exit__(*exc)

    def start(self, variants):
        self.overall = self.bars.add_task("variants", total=len(variants))
        self.rounds = self.bars.add_task("timing", total=1, visible=False)

    def step(self, variant, label):
        self.bars.update(self.overall, description=f"{variant}: {label}")
        if label == "timing":
            self.bars.reset(self.rounds, total=1, visible=True, description=f"{variant}: timing rounds")

    def timing(self, variant, done, total):
        self.bars.update(self.rounds, completed=done, total=total)

    def done(self, result):
        self.bars.update(self.rounds, visible=False)
        self.bars.advance(self.overall)
        if self.bars.tasks[self.overall].finished:
            self.bars.update(self.overall, description="variants")
        style = _STYLE[result.verdict]
        self.bars.console.print(f"[{style}]{result.verdict:>8}[/] {result.variant}: {result.reason}")


def compile_command(
    model: Annotated[str, typer.Argument(help="Guard model name, e.g. digits (or its target, digits_raw).")],
    version: Annotated[int, typer.Option("--version", help="Exported version to compile (the parent).")],
    repository: Repository = "model_repository",
    variants: Annotated[str | None, typer.Option(help="Comma-separated: ort_opt,int8_dynamic,fp16,torch_compile,"
                                                 "tensorrt (default: all; inapplicable ones are reported as skipped).")] = None,
    min_speedup: Annotated[float | None, typer.Option(help="Speed-ratio floor for every variant (default per "
                                                      "variant: 0.90 ort_opt/torch_compile, 1.05 int8/fp16/tensorrt).")] = None,
    batch_size: Annotated[int, typer.Option(help="Rows per call when timing.")] = 8,
    rounds: Annotated[int, typer.Option(help="Timing rounds (parent and variant alternate).")] = 20,
    register: Annotated[bool, typer.Option("--register/--no-register",
                                           help="Register admitted versions in the MLflow registry (DRAFT).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")] = False,
) -> None:
    """Build optimised variants of MODEL's version N; admit the ones that pass its goldens and pay their way."""

    names = [v.strip() for v in variants.split(",") if v.strip()] if variants is not None else None
    # where admitted variants land, on stderr (stdout stays clean for --json)
    where = f"repository {Path(repository).resolve()}"
    if register:

        where += f"\nregistry   {default_uri(repository)}"
    err.print(f"[dim]{escape(where)}[/]", soft_wrap=True)
    try:
        if batch_size < 1 or rounds < 1:
            raise CompileError("--batch-size and --rounds must be >= 1")
        with _Bars(err) as bars:
            parent, results = compile_model(repository, model, version, names, min_speedup=min_speedup,
                                             batch_size=batch_size, rounds=rounds,
                                             registry="default" if register else None, progress=bars)
    except CompileError as exc:
        err.print(f"[bold red]✗ compile failed:[/] {escape(str(exc))}\n"
                  f"nothing was written to {escape(str(Path(repository).resolve()))}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    if as_json:
        typer.echo(json.dumps({"model": parent.model, "target": parent.target, "parent_version": parent.version,
                               "repository": str(repository), "environment": environment(),
                               "results": [r.as_dict() for r in results]}, indent=2))
        return
    out.print(summary_table(parent, results))
    for line in registry_lines(results):
        out.print(line)
