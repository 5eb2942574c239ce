"""What ``promote`` and the rollout commands share: their consoles, exit codes and arguments,
the controller wired to the registry and the response cache (hooks: PRODUCTION on promotion,
ARCHIVED and a cache purge on rollback), the registry reconciled with the routing, and the
one-line report a command exits with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from exporter.cli.consoles import WideConsole
from exporter.cli.exits import EXIT_NEGATIVE, EXIT_NOT_FINISHED
from exporter.cli.exits import EXIT_NEGATIVE as EXIT_ROLLED_BACK  # noqa: F401 - the old names, still imported
from exporter.cli.exits import EXIT_NOT_FINISHED as EXIT_HOLDING  # noqa: F401 - (tests/deploy/test_scripts.py)
from exporter.cli.repository_opt import Repository, repository_command  # noqa: F401 - the rollout commands' option
from exporter.cli.server_opt import HTTP, help_text, servers
from exporter.records.registry import open_registry
from exporter.rollout.controller import RolloutController
from exporter.rollout.fleet import Fleet, FleetReader, discover
from exporter.rollout.guards import guard_target
from exporter.rollout.prometheus import PrometheusReader
from exporter.rollout.reconcile import reconcile_registry
from exporter.rollout.serving import metrics_urls, purge_cache
from exporter.rollout.window import metrics_reader, store_labels_reader, store_latency_reader
from tritonguard.core.store import ENV_URL

# no wraps at 80 columns when piped (tables included): a CI log keeps whole lines
out = WideConsole(soft_wrap=True)
err = WideConsole(stderr=True, soft_wrap=True)

Model = Annotated[str, typer.Argument(help="Guard model name, e.g. digits.")]


def registry_for(repository: Path, approve_cmd: list[str] | None = None):
    return open_registry(repository, approvers={"PRODUCTION": approve_cmd} if approve_cmd else None)


def purge(repository: Path, model: str, why: str) -> None:
    try:
        done = purge_cache(repository, model, by=why)
    except Exception as exc:  # noqa: BLE001 - keys carry the artifact hash: a failed purge is not fatal
        err.print(f"[yellow]![/] cache purge of {model} failed: {exc}")
        return
    tiers = ", ".join(f"{k} {v}" for k, v in done.items() if k != "epoch") or "no shared tiers"
    err.print(f"[green]✓[/] cache of {model} purged (epoch {done['epoch']}; {tiers})")


def controller_for(model: str, repository: Path, urls: list[str], *, approver: str | None = None,
                approve_cmd: list[str] | None = None, config=None, fleet: Fleet | None = None,
                prometheus: str | None = None, prometheus_selector: str | None = None):
    """The controller reading ``urls``, or with ``fleet`` the registry's live replicas, re-resolved
    at every look, or with ``prometheus`` PromQL over every replica that Prometheus scrapes (those
    matching ``prometheus_selector``)."""
    target = guard_target(repository, model)
    reg = registry_for(repository, approve_cmd)

    # hooks are idempotent: a resumed rollout may call them again
    def on_promote(v: int) -> None:
        stage = reg.stage(model, v)
        if stage != "PRODUCTION":
            reg.transition(model, v, "PRODUCTION", stage, approver, reason="rollout gates passed")

    def on_rollback(v: int, reason: str) -> None:
        stage = reg.stage(model, v)
        if stage in ("DRAFT", "STAGING"):
            reg.transition(model, v, "ARCHIVED", stage, approver, reason=reason)
        err.print(f"[bold red]↩[/] v{v} rolled back: {reason}")
        purge(repository, model, "rollback")

    def on_step(step: int, share: float, report) -> None:
        err.print(f"[green]→[/] step {step + 1}: {share:.0%}" + (f"  ({report.summary()})" if report else ""))

    try:  # exact per-call latencies from the store; without them the gate reads histogram buckets
        latency = store_latency_reader(model, repository)
    except Exception as exc:  # noqa: BLE001 - e.g. Redis unreachable at start: the buckets still judge
        err.print(f"[yellow]![/] latency samples unavailable ({type(exc).__name__}: {exc}); judging histograms")
        latency = None
    try:  # labelled rows (request labels and `exporter feedback`) from the store
        labels = store_labels_reader(model, repository)
    except Exception as exc:  # noqa: BLE001 - the labels gate then reads the metrics
        err.print(f"[yellow]![/] labels from the store unavailable ({type(exc).__name__}: {exc}); "
                  "judging request labels from the metrics")
        labels = None
    say = lambda m: err.print(f"[yellow]![/] {m}")  # noqa: E731
    if prometheus:
        reader = PrometheusReader(prometheus, model, target=target, say=say, scope=prometheus_selector)
    elif fleet is not None:
        reader = FleetReader(fleet, model, target=target, count=len(urls), say=say)
    else:
        reader = metrics_reader(urls, model, target=target)
    return RolloutController(model, repository, reader, config=config,
                             on_promote=on_promote, on_rollback=on_rollback, on_step=on_step,
                             latency_reader=latency, labels_reader=labels), reg, target


def reconcile(repository: Path, model: str, **kwargs) -> None:
    """The registry's PRODUCTION follows the routing's primary; problems are warnings."""

    done = reconcile_registry(repository, model, warn=lambda msg: err.print(f"[yellow]![/] {msg}"), **kwargs)
    if done:
        err.print(f"[green]✓[/] {done}")


def who_text(progress) -> str:
    """``v2``, or for an A/B/n rollout ``arms v2=0.3, v3 (rolled_back)``."""
    if progress.mode != "abn":
        return f"v{progress.candidate}"
    return "arms " + ", ".join(f"v{v}={a['weight']:g}" + ("" if a["status"] == "running" else f" ({a['status']})")
                               for v, a in progress.arms.items())


def exit_for(progress) -> None:
    style = {"done": "green", "running": "yellow", "paused": "yellow", "superseded": "yellow"}.get(progress.status, "red")
    out.print(f"[bold]{progress.model}[/] {who_text(progress)}: [{style}]{progress.status}[/] at step "
              f"{progress.step_index + 1}/{len(progress.steps)} ({progress.steps[progress.step_index]:g} %): "
              f"{progress.reason}")
    if progress.status in ("rolled_back", "aborted"):
        raise typer.Exit(EXIT_NEGATIVE)
    if progress.status in ("running", "paused"):
        raise typer.Exit(EXIT_NOT_FINISHED)


Servers = Annotated[list[str] | None, typer.Option("--server", callback=servers(HTTP), help=help_text(
    HTTP, "Triton server of each replica (repeat): the version is loaded there if needed."))]

StateUrl = Annotated[str | None, typer.Option("--state-url", help="The shared store (redis://…; default "
                     "$TRITONGUARD_STATE_URL). Without --server/--metrics-url, every replica live in its "
                     "registry is used (the guards register their server there).")]


def use_state_url(state_url: str | None) -> None:
    """``--state-url`` is this process's store for everything (state, progress, registry)."""
    if state_url:
        os.environ[ENV_URL] = state_url


def servers_or_fleet(servers: list[str], metrics: list[str], state_url: str | None = None,
                     say=None) -> tuple[Fleet | None, list[str], list[str]]:
    """(fleet, HTTP URLs, metrics URLs): the given ``--server``/``--metrics-url``, else the replicas
    live in the registry of a Redis store (``fleet`` then set; its line said through ``say``, on
    stderr by default), else nothing. Raises ExporterError when the registry cannot be read."""
    use_state_url(state_url)
    if servers or metrics:
        return None, servers, metrics_urls(servers, metrics)
    fleet = discover()
    if fleet is None:
        return None, [], []
    live = fleet.replicas()
    (say or (lambda line: err.print(line)))(fleet.line(live))
    return fleet, [r.http for r in live], [r.metrics for r in live]

PrometheusUrl = Annotated[str | None, typer.Option("--prometheus", help="Prometheus base URL (e.g. "
                          "http://prometheus:9090): the gates read every replica's guards with PromQL (the "
                          "recording rules' expressions, as counts since the first look) instead of scraping "
                          "each replica's metrics port.")]
PrometheusSelector = Annotated[str | None, typer.Option(
    "--prometheus-selector", envvar="TRITONGUARD_PROMETHEUS_SELECTOR", help="Label matchers added to every "
    "query of --prometheus, e.g. 'namespace=\"prod\",job=\"triton\"' (a Prometheus shared by several fleets).")]
