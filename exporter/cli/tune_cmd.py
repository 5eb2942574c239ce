"""``python -m exporter tune MODEL``: the serving knobs of a guarded pipeline, tuned jointly.

Progress goes to stderr, the table of points to stdout; ``tune_report.json`` and ``tune.png``
go to ``--out``. Exit 0 when the run completed (whether or not a point beat the current config),
1 when ``--apply`` left a file alone (changed meanwhile or conflicting), 2 on bad input, 4 when
the server or the baseline measurement failed (:mod:`exporter.cli.exits`). The user's repository is written only with
``--apply``.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from exporter.cli.consoles import console
from exporter.cli.exits import EXIT_BAD_INPUT, EXIT_NEGATIVE, EXIT_OK, EXIT_STOPPED
from exporter.tune import sweep as tune
from exporter.tune.apply import apply_configs
from exporter.tune.knobs import KNOBS, TuneError, describe, discover, fmt_value
from exporter.tune.search import Objective

out = console()
err = console(stderr=True)
LONE_REQUEST_WARN_PCT = 5.0  # c=1 throughput lost by the chosen layout that the summary warns about


class ObjectiveKind(str, Enum):
    throughput = "throughput"
    latency = "latency"


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise typer.BadParameter(f"{what}: comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{what}: at least one integer >= 1, got {text!r}")
    return values


def points_table(result) -> Table:
    obj = result.settings.objective
    ok = [p for p in result.points if p.ok and p.phase != "confirm"]
    t = Table(title=f"tune {result.model}: {obj.describe()}", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("#", justify="right")
    t.add_column("phase")
    t.add_column("knobs (vs current config)", overflow="fold")
    for c in result.settings.concurrency:
        t.add_column(f"c={c} inf/s", justify="right")
        t.add_column(f"c={c} p99 ms", justify="right")
    t.add_column("verdict")
    for p in result.points:
        knobs = describe(p.knobs, result.base)
        cells: list[str] = []
        for c in result.settings.concurrency:
            s = p.stats.get(c)
            cells += [f"{s.throughput:.1f}" if s else "", f"{s.p99_ms:.2f}" if s else ""]
        if not p.ok:
            verdict = f"[red]failed[/]: {escape(p.error)}"
        elif p.phase == "confirm":
            verdict = "[dim]confirm[/]"
        else:
            verdict = "" if obj.feasible(p, ok) else "[yellow]over budget[/]"
        mark = "[bold green]★ chosen[/]" if p is result.chosen else ("baseline" if p is result.baseline else "")
        style = "bold" if p is result.chosen else ("dim" if p.phase == "confirm" else None)
        t.add_row(str(p.id), p.phase, escape(knobs), *cells, " ".join(x for x in (mark, verdict) if x), style=style)
    return t


def _summary(result) -> list[str]:
    lines = []
    b, c = result.baseline, result.chosen
    if c is None:
        lines.append("[yellow]no point met the objective[/] (the current config neither): nothing to apply")
    elif c.knobs == result.base:
        lines.append("[green]the current config is the best point found[/]: nothing to change")
    else:
        gain = (c.mean_throughput / b.mean_throughput - 1) * 100 if b and b.ok and b.mean_throughput else 0.0
        lines.append(f"chosen #{c.id}: {escape(describe(c.knobs, result.base))}  —  mean throughput "
                     f"{c.mean_throughput:.1f} vs {b.mean_throughput:.1f} inf/s ({gain:+.1f} %), worst p99 "
                     f"{c.worst_p99:.2f} vs {b.worst_p99:.2f} ms")
        if result.confirmed is not None:
            cb, cc = result.confirm.get("baseline"), result.confirm.get("chosen")
            figs = ""
            if cb and cc and cb.ok and cc.ok:
                figs = (f" (back to back: {cc.mean_throughput:.1f} vs {cb.mean_throughput:.1f} inf/s, "
                        f"p99 {cc.worst_p99:.2f} vs {cb.worst_p99:.2f} ms)")
            lines.append(("[green]confirmed[/]" if result.confirmed else "[yellow]not confirmed[/]: the gain did "
                          "not reproduce against the baseline") + figs)
        lone = result.lone_request
        if lone is not None and "error" in lone:
            lines.append(f"[yellow]one request at a time (c=1, not tuned): not measured[/]: {escape(lone['error'])}")
        elif lone is not None:
            change = lone["throughput_change_pct"]
            figs = f"{lone['chosen']['throughput']:.1f} vs {lone['baseline']['throughput']:.1f} inf/s"
            if change is not None:
                figs += f" ({change:+.1f} %)"
            line = f"one request at a time (c=1, not tuned): {figs}, p50 {lone['p50_change_ms']:+.2f} ms"
            if change is not None and change < -LONE_REQUEST_WARN_PCT:
                line = f"[yellow]{line}[/]: the chosen layout is slower for a lone request; weigh that before --apply"
            lines.append(line)
    style = "red" if result.aborted else "dim"
    lines.append(f"[{style}]{escape(result.stop_reason)}; {len(result.points)} points in {result.elapsed_s:.0f} s[/]")
    return lines


class _Progress:
    """A bar over the point budget and one status line per point, on stderr."""

    def __init__(self, budget: int):
        from rich.progress import (  # noqa: PLC0415
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bars = Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=err, transient=True)
        self.task = self.bars.add_task("starting tritonserver", total=budget)
        self.base: dict[str, Any] | None = None

    def __enter__(self):
        self.bars.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bars.__exit__(*exc)

    def __call__(self, event: str, data: Any) -> None:
        con = self.bars.console
        if event == "space":
            for knob, reason in data.pruned.items():
                con.print(f"[dim]  not tuned: {knob}: {escape(reason)}[/]")
            ladders = ", ".join(f"{k} [{' '.join(fmt_value(x) for x in v)}]" for k, v in data.ladders.items())
            con.print(f"[dim]  searching: {escape(ladders) or 'nothing'}[/]")
        elif event == "started":
            con.print(f"[dim]  private tritonserver on {data}[/]")
        elif event == "point":
            if self.base is None:
                self.base = dict(data.knobs)
            self.bars.update(self.task, description=f"#{data.id} {data.phase}: {describe(data.knobs, self.base)}"[:40])
        elif event == "measured":
            if data.phase != "confirm":
                self.bars.advance(self.task)
            if data.ok:
                figs = ", ".join(f"c={c} {s.throughput:.0f}/s p99 {s.p99_ms:.1f} ms" for c, s in data.stats.items())
                con.print(f"  #{data.id:<3d}{data.phase:<9s}{escape(describe(data.knobs, self.base))}: {figs}")
            else:
                con.print(f"  [red]#{data.id:<3d}failed[/] {escape(describe(data.knobs, self.base))}: {escape(data.error)}")
        elif event == "verdict":
            p, kept = data
            if p.ok and kept:
                con.print(f"  [green]    kept #{p.id}[/]")


def tune_command(
    model: Annotated[str, typer.Argument(help="Public name of a guarded model, e.g. digits or minilm.")],
    repository: Annotated[Path, typer.Option("--repository", "--model-repository", "-r", help="Model repository folder.")] = Path("model_repository"),
    concurrency: Annotated[str, typer.Option(help="perf_analyzer concurrencies, comma-separated.")] = "8,16",
    objective: Annotated[ObjectiveKind, typer.Option(help="throughput: max mean throughput within --p99-ms; "
                                                     "latency: min worst p99 within --min-throughput-pct of the best.")] = ObjectiveKind.throughput,
    p99_ms: Annotated[float | None, typer.Option("--p99-ms", help="p99 budget at every concurrency (ms).")] = None,
    min_throughput_pct: Annotated[float, typer.Option(help="latency objective: throughput floor, % of the best point's.")] = 90.0,
    budget_points: Annotated[int, typer.Option(help="Points measured, the current config included.")] = 12,
    budget_s: Annotated[float, typer.Option(help="Stop the search before a point that would end past this many seconds.")] = 600.0,
    window_ms: Annotated[int, typer.Option(help="perf_analyzer measurement window (ms).")] = 2000,
    trials: Annotated[int, typer.Option(help="perf_analyzer --max-trials per concurrency.")] = 3,
    stability_pct: Annotated[float, typer.Option(help="perf_analyzer stability bound (%); unstable -> measured again without one.")] = 30.0,
    min_gain: Annotated[float, typer.Option(help="% a step must beat the incumbent by to be kept (noise guard).")] = 3.0,
    knobs: Annotated[str | None, typer.Option(help="Only these knobs, comma-separated: guard.instances, guard.delay_us, "
                                              "target.instances, target.delay_us, target.threads, preferred.")] = None,
    max_instances: Annotated[int | None, typer.Option(help="Largest instance count tried (default: cores, 2..4).")] = None,
    max_threads: Annotated[int | None, typer.Option(help="Largest intra_op_threads tried (default: cores, at most 4).")] = None,
    confirm: Annotated[bool, typer.Option("--confirm/--no-confirm", help="Measure baseline and chosen once more, "
                                          "back to back (and at c=1, reported only, when --concurrency leaves it "
                                          "out); --apply needs the gain confirmed.")] = True,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Report folder (default ./tune-<model>-<timestamp>).")] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Write the chosen knobs into the repository's configs "
                                        "(backup config.pbtxt.bak-<timestamp> beside each).")] = False,
) -> None:
    """Tune the guard, its target and the steps between them jointly on a private tritonserver."""

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    try:
        conc = _ints(concurrency, "--concurrency")
        only = None
        if knobs is not None:
            only = tuple(k.strip() for k in knobs.split(",") if k.strip())
            unknown = [k for k in only if k not in KNOBS]
            if unknown or not only:
                raise TuneError(f"unknown knob(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(KNOBS)}")
        if budget_points < 1 or budget_s <= 0 or window_ms < 100 or trials < 1:
            raise TuneError("--budget-points >= 1, --budget-s > 0, --window-ms >= 100 and --trials >= 1")
        if (max_instances is not None and max_instances < 1) or (max_threads is not None and max_threads < 1):
            raise TuneError("--max-instances and --max-threads must be >= 1")
        obj = Objective(objective.value, p99_ms, min_throughput_pct, min_gain)
        settings = tune.Settings(concurrency=conc, objective=obj, budget_points=budget_points, budget_s=budget_s,
                                 window_ms=window_ms, trials=trials, stability_pct=stability_pct, knobs=only,
                                 max_instances=max_instances, max_threads=max_threads, confirm=confirm)
        discover(repository, model)  # bad input fails here, before a server starts
    except (TuneError, typer.BadParameter) as exc:
        err.print(f"[bold red]✗ tune:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None

    folder = (out_dir or Path(f"tune-{model}-{stamp}")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    err.print(f"[dim]repository {escape(str(Path(repository).resolve()))} (read only{', --apply writes' if apply else ''})\n"
              f"report     {escape(str(folder))}[/]", soft_wrap=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"tritonguard-tune-{model}-"))
    t0 = time.monotonic()
    try:
        with _Progress(budget_points) as bar:
            result, start_texts = tune.run(repository, model, settings, workdir, folder / "tritonserver.log", progress=bar)
    except TuneError as exc:
        err.print(f"[bold red]✗ tune {escape(model)}:[/] {escape(str(exc))} [dim](after {time.monotonic() - t0:.0f} s; "
                  f"server log {escape(str(folder / 'tritonserver.log'))})[/]", soft_wrap=True)
        raise typer.Exit(EXIT_STOPPED) from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    out.print(points_table(result))
    for line in _summary(result):
        out.print(line, soft_wrap=True)

    applied = None
    code = EXIT_STOPPED if result.aborted else EXIT_OK
    if apply:
        chosen = result.chosen
        if result.aborted:
            err.print("[yellow]--apply: not written: the search stopped on an error[/]")
            applied = []
        elif chosen is None or chosen.knobs == result.base:
            err.print("--apply: nothing to write (the current config stays)")
            applied = []
        elif result.confirmed is False:
            err.print("[yellow]--apply: not written: the chosen point's gain was not confirmed[/] "
                      "(run again, or with --no-confirm to trust the search)", soft_wrap=True)
            applied = []
            code = EXIT_NEGATIVE
        else:
            applied = apply_configs(repository, result.pipe, start_texts, result.base, chosen.knobs, stamp)
            for a in applied:
                if a.status == "written":
                    err.print(f"[green]✓ wrote[/] {escape(a.model)}: {escape(a.detail)} [dim](backup {escape(a.backup)})[/]",
                              soft_wrap=True)
                elif a.status == "skipped":
                    err.print(f"[yellow]✗ not written[/] {escape(a.model)}: {escape(a.detail)}", soft_wrap=True)
                    code = EXIT_NEGATIVE
            written = sorted((a.model for a in applied if a.status == "written"), key=lambda n: n != result.pipe.target)
            if written:
                err.print(f"[dim]a running server picks them up on a reload: POST /v2/repository/models/<name>/load "
                          f"for {', '.join(written)}, in this order{'' if model in written else f', then {escape(model)}'}[/]", soft_wrap=True)
    report = tune.report(result, applied)
    (folder / "tune_report.json").write_text(json.dumps(report, indent=2))
    try:
        tune.plot(result, folder / "tune.png")
    except Exception as exc:  # noqa: BLE001 - a missing matplotlib must not lose the report
        err.print(f"[yellow]no PNG: {escape(str(exc))}[/]")
    err.print(f"[dim]report {escape(str(folder / 'tune_report.json'))} and tune.png[/]", soft_wrap=True)
    if code:
        raise typer.Exit(code)
