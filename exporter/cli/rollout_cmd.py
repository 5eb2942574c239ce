"""``python -m exporter rollback | rollout status|abort|pause|resume|undo``: stop or steer a
progressive rollout, or restore the previous production version (``rollout undo``, kubectl's
word for it, is ``rollback``: the same function).

Exit codes (:mod:`exporter.cli.exits`): 0 done, 1 rolled back or aborted, 2 bad input, 3 still
running or paused. ``promote`` is :mod:`exporter.cli.promote_cmd`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from exporter.cli.consoles import where
from exporter.cli.exits import EXIT_BAD_INPUT
from exporter.cli.rollout_common import (
    Model,
    PrometheusSelector,
    PrometheusUrl,
    Repository,
    Servers,
    StateUrl,
    controller_for,
    err,
    exit_for,
    out,
    purge,
    reconcile,
    repository_command,
    servers_or_fleet,
    who_text,
)
from exporter.errors import ExporterError
from exporter.records.progress import ControllerError
from exporter.records.registry import RegistryError
from exporter.rollout.controller import RolloutController
from exporter.rollout.fleet import FleetReader
from exporter.rollout.guards import guard_target
from exporter.rollout.progress import ACTIVE, evidence
from exporter.rollout.route import RouteChange, apply
from exporter.rollout.serving import ensure_loaded
from exporter.rollout.window import metrics_reader, store_latency_reader

rollout_app = typer.Typer(help="Inspect or steer a progressive rollout.", no_args_is_help=True, add_completion=False)


def rollback(
    model: Model,
    repository: Repository = "model_repository",
    server: Servers = None,
    approver: Annotated[str | None, typer.Option(help="Who decided (recorded in the history).")] = None,
    reason: Annotated[str, typer.Option(help="Why (recorded in the history).")] = "manual rollback",
) -> None:
    """Abort MODEL's active rollout, or else restore the previous production version; purge the cache."""

    where(err, repository, registry=True)
    try:
        ctl, reg, _ = controller_for(model, repository, [], approver=approver)
        progress = ctl.status()
        if progress is not None and progress.status in ACTIVE:
            progress = ctl.abort(reason)
            purge(repository, model, "rollback")
            reconcile(repository, model, registry=reg)
            out.print(f"[bold]{model}[/]: rollout of {who_text(progress)} aborted, taken out of the routing")
            return
        target_version = reg.previous_production(model)
        if target_version is None:
            raise RegistryError(f"'{model}' has no previous production version to roll back to")
        ensure_loaded(list(server or []), repository, model, target_version)
        info = reg.rollback(model, approver=approver, reason=reason)
        apply(repository, model, RouteChange(primary=info.version, candidate=0), by="rollback",
              reason=f"rolled back to v{info.version} by `exporter rollback` ({reason})", rolled_back=True)
        purge(repository, model, "rollback")
    except ExporterError as exc:
        err.print(f"[bold red]✗ rollback failed:[/] {exc}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    reconcile(repository, model, registry=reg)
    out.print(f"[bold]{model}[/]: v{info.version} is primary and PRODUCTION again")


# kubectl's word: `rollout undo` beside `rollback`, one implementation
rollout_app.command("undo", help=f"{rollback.__doc__} The same as `exporter rollback` (kubectl's "
                    "`rollout undo`).")(repository_command()(rollback))


@rollout_app.command("status")
@repository_command(read_only=True)
def rollout_status(
    model: Model,
    server: Servers = None,
    metrics_url: Annotated[list[str] | None, typer.Option("--metrics-url", help="Metrics URL of each replica "
                           "(repeat; default: each --server's port + 2).")] = None,
    repository: Repository = "model_repository",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable progress on stdout.")] = False,
    state_url: StateUrl = None,
) -> None:
    """Show the rollout's step, dwell, status and last gate report; with --server (as for
    `rollout resume`), or the replicas live in a Redis store's registry, also the gates as the
    next look would judge them now (nothing is changed)."""

    try:
        fleet, _, urls = servers_or_fleet(list(server or []), metrics_url or [], state_url)
        progress = RolloutController(model, repository, reader=None).status()
    except ExporterError as exc:  # unreadable progress, or its Redis unreachable
        err.print(f"[bold red]✗ status failed:[/] {exc}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    live = None  # a read: the registry is reconciled where state changes, or by `exporter reconcile`
    if urls and progress is not None and progress.status in ("running", "paused"):
        live = _peek(model, repository, urls, fleet)
    if as_json:
        doc = progress.to_dict() if progress else None
        if doc is not None and urls:
            doc["live"] = live
        typer.echo(json.dumps(doc, indent=2))
        return
    if progress is None:
        out.print(f"{model}: no rollout")
        return
    out.print(f"[bold]{model}[/] {who_text(progress)} ({progress.mode}) {progress.status}, step "
              f"{progress.step_index + 1}/{len(progress.steps)} at {progress.steps[progress.step_index]:g} %, "
              f"look {progress.look}: {progress.reason}")
    if progress.status != "done":  # a finished rollout's reason already names its evidence
        out.print(f"  judged so far on: {evidence(progress)}")
    reports = {f"v{v}": a.get("last_report") for v, a in progress.arms.items()} or {"": progress.last_report}
    for who, report in reports.items():
        for g in (report or {}).get("gates", []):
            out.print(f"  {who:<4}{g['name']:<11} {g['verdict']:<12} n={g['samples']:<7} {g['reason']}")
    if urls and live is None:
        out.print(f"  live: the rollout is {progress.status}; no window to look at")
    elif live is not None and "error" in live:
        out.print(f"  live: [red]{live['error']}[/]")
    elif live is not None:
        for v, w in live["windows"].items():
            rep = w["report"]
            head = f"  live v{v}: " + (f"{rep['verdict']} now (not recorded; the driver decides)" if rep
                                       else w["reason"])
            out.print(head)
            for g in (rep or {}).get("gates", []):
                out.print(f"    {g['name']:<11} {g['verdict']:<12} n={g['samples']:<7} {g['reason']}")


def _peek(model: str, repository: Path, urls: list[str], fleet=None) -> dict | None:
    """The gates over the running window as of now, from the replicas' metrics (read only)."""

    try:
        target = guard_target(repository, model)
        try:
            latency = store_latency_reader(model, repository)
        except Exception:  # noqa: BLE001 - the buckets still judge
            latency = None
        reader = (FleetReader(fleet, model, target=target, count=len(urls), say=lambda m: err.print(f"[yellow]![/] {m}"))
                  if fleet is not None else metrics_reader(urls, model, target=target))
        ctl = RolloutController(model, repository, reader, latency_reader=latency)
        return ctl.peek()
    except ExporterError as exc:
        return {"error": str(exc)}


@rollout_app.command("abort")
@repository_command()
def rollout_abort(model: Model, repository: Repository = "model_repository",
                  reason: Annotated[str, typer.Option(help="Why.")] = "aborted by operator") -> None:
    """Stop MODEL's rollout and take the candidate out of the routing state."""

    try:
        ctl, _, _ = controller_for(model, repository, [])
        progress = ctl.abort(reason)
    except ControllerError as exc:
        err.print(f"[bold red]✗ abort failed:[/] {exc}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    out.print(f"[bold]{model}[/] {who_text(progress)}: aborted, taken out of the routing ({reason})")


@rollout_app.command("pause")
@repository_command()
def rollout_pause(model: Model, repository: Repository = "model_repository") -> None:
    """Hold the rollout at its current step (the candidate keeps its share)."""

    try:
        progress = RolloutController(model, repository, reader=None).pause()
    except ControllerError as exc:
        err.print(f"[bold red]✗ pause failed:[/] {exc}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    exit_for(progress)


@rollout_app.command("resume")
@repository_command()
def rollout_resume(model: Model, server: Servers = None,
                   metrics_url: Annotated[list[str] | None, typer.Option("--metrics-url", help="Metrics URL of "
                                          "each replica (repeat; default: each --server's port + 2).")] = None,
                   repository: Repository = "model_repository",
                   approver: Annotated[str | None, typer.Option(help="Who approves PRODUCTION.")] = None,
                   state_url: StateUrl = None, prometheus: PrometheusUrl = None,
                   prometheus_selector: PrometheusSelector = None) -> None:
    """Continue a paused or interrupted rollout where it stopped (step, dwell and baseline)."""

    try:
        fleet, _, urls = servers_or_fleet(list(server or []), metrics_url or [], state_url)
        if not urls and fleet is None and not prometheus:
            raise ControllerError("resume reads the guards' metrics: pass --server URL (or --metrics-url URL), "
                                  "or --state-url redis://… whose registry lists the replicas")
        ctl, _, _ = controller_for(model, repository, urls, approver=approver, fleet=fleet, prometheus=prometheus,
                                    prometheus_selector=prometheus_selector)
        progress = ctl.resume()
        if progress.status == "done":
            purge(repository, model, "promote")
    except ExporterError as exc:
        err.print(f"[bold red]✗ resume failed:[/] {exc}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    exit_for(progress)
