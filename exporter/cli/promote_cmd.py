"""``python -m exporter promote``: registry stages and progressive rollouts.

``promote`` registers the version in the MLflow registry (idempotent), stages it, and walks it
through the traffic steps with the statistical gates between them; PRODUCTION comes from the
rollout's last passing gate (through the approvers, if any), ARCHIVED from a failing one. In
MLflow's words (:mod:`exporter.records.registry`): the staged version is the ``challenger``, the
promoted one the ``champion``; ``--to`` takes either word or the old stage name.
Exit codes (:mod:`exporter.cli.exits`): 0 promoted/done, 1 rolled back or aborted, 2 bad input, 3 still
running or paused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from exporter.cli.consoles import where
from exporter.cli.exits import EXIT_BAD_INPUT, EXIT_NEGATIVE
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
    servers_or_fleet,
)
from exporter.errors import BadInput, ExporterError
from exporter.records.registry import RegistryError, check_alias
from exporter.rollout.gates.config import GateConfig, parse_increase
from exporter.rollout.generation import MAX_REGRESSION, judge_generation
from exporter.rollout.guards import guard_target, judge_limits
from exporter.rollout.judge import JudgeError, judge_offline, manifest_judge, parse_margin
from exporter.rollout.progress import RolloutConfig
from exporter.rollout.route import RouteChange, apply, parse_arms
from exporter.rollout.serving import ensure_loaded
from tritonguard.core.repository import read_manifest, versions
from tritonguard.rollout.endpoints import EndpointError, read_endpoints
from tritonguard.rollout.state import JUDGES
from tritonguard.rollout.stores import open_store


def promote(
    model: Model,
    version: Annotated[int | None, typer.Option("--version", help="Version of the guard's target to promote.")] = None,
    to: Annotated[str, typer.Option("--to", help="staging (registered, loaded, no traffic: MLflow alias "
                  "challenger) or production (served: alias champion); 'challenger' and 'champion' are "
                  "accepted as the same.")] = "production",
    rollout: Annotated[bool, typer.Option("--rollout/--no-rollout", help="production: walk the traffic steps "
                                          "with gates (default), or switch at once (goldens still apply).")] = True,
    server: Servers = None,
    metrics_url: Annotated[list[str] | None, typer.Option("--metrics-url", help="Triton metrics URL of each "
                           "replica (repeat; default: each --server's port + 2).")] = None,
    repository: Repository = "model_repository",
    primary: Annotated[int | None, typer.Option(help="Primary version (default: the state's).")] = None,
    mode: Annotated[str, typer.Option(help="split (A/B share) or shadow (mirrored traffic).")] = "split",
    arms: Annotated[str | None, typer.Option("--arms", help="A/B/n instead of --version: VERSION=WEIGHT,... "
                    "(e.g. 2=0.3,3=0.2); each arm walks the steps at that share of its weight, gated on "
                    "its own; a failing arm leaves alone; the rest stay at full weight.")] = None,
    steps: Annotated[str, typer.Option(help="Percent steps.")] = "1,5,10,25,50,100",
    dwell_s: Annotated[float, typer.Option(help="Minimum seconds at each step.")] = 300.0,
    interval_s: Annotated[float, typer.Option(help="Seconds between looks.")] = 30.0,
    max_step_s: Annotated[float | None, typer.Option(help="Roll back a step inconclusive this long.")] = None,
    min_requests: Annotated[int, typer.Option(help="Candidate requests before a gate may pass.")] = 200,
    max_error_rate: Annotated[float, typer.Option(help="Error rate that must fail (SPRT p1).")] = 0.01,
    min_compared: Annotated[int, typer.Option(help="Compared candidate rows before the agreement gate may pass.")] = 100,
    min_agreement: Annotated[float, typer.Option(help="Validator agreement the candidate needs on compared rows.")] = 0.98,
    min_latency_samples: Annotated[int, typer.Option(help="Target calls per version before the latency gate may pass.")] = 100,
    latency_tolerance: Annotated[float, typer.Option(help="Candidate may be this fraction slower than the "
                                                     "primary (per call, at the same batch size) before the "
                                                     "rank test may fail it.")] = 0.15,
    judge: Annotated[str | None, typer.Option("--judge", help="task (a new model: judged on the task, "
                     "non-inferiority) or equivalence (the same weights: numerical tolerances); default: what "
                     "the version's manifest says.")] = None,
    max_regression: Annotated[str | None, typer.Option("--max-regression", help="Task judge: accuracy the "
                              "candidate may lose against the primary, e.g. 0.5pp (default); for a generative "
                              "model, the relative bits per char it may add, e.g. 3% (default).")] = None,
    max_disagreement: Annotated[str | None, typer.Option("--max-disagreement", help="Task judge without labels: "
                                "the share of answers the candidate may change against the primary (top-1; for "
                                "embeddings, rows under --min-cosine), e.g. 2% (default: the guard's "
                                "judge.max_disagreement, else 2 %). Never the candidate's own difference.")] = None,
    min_cosine: Annotated[float | None, typer.Option("--min-cosine", help="Embeddings: a row whose cosine to the "
                          "primary's is below this disagrees (default: the guard's judge.min_cosine, else 0.90).")] = None,
    min_labels: Annotated[int, typer.Option("--min-labels", help="Judge on labels: every step waits until both "
                          "versions have this many labelled rows (the 'label' request parameter, or "
                          "`exporter feedback`) and the candidate is shown no worse than --max-regression; "
                          "the disagreement limit is then reported, not enforced. 0: labels may stop a "
                          "candidate, never hold one.")] = 0,
    max_slice_regression: Annotated[str | None, typer.Option("--max-slice-regression", help="With labels: the "
                                    "recall one class or named slice may lose, e.g. 5pp (default: the guard's "
                                    "judge.max_slice_regression, else 5 pp).")] = None,
    max_cost_increase: Annotated[str | None, typer.Option("--max-cost-increase", help="Cost gate: roll back a "
                                 "candidate that costs more than this per request than the primary (guards' cost "
                                 "meter), e.g. 10% or 0.1; judged from the 50 % step. Default: no cost gate.")] = None,
    alias: Annotated[list[str] | None, typer.Option("--alias", help="Also point this MLflow alias of the "
                     "registered model at VERSION (repeat): when it becomes the champion (with --to challenger: "
                     "now). champion, challenger, production and staging are the registry's own.")] = None,
    approver: Annotated[str | None, typer.Option(help="Who approves (recorded in the history).")] = None,
    approve_cmd: Annotated[list[str] | None, typer.Option(help="Shell command that must exit 0 before PRODUCTION (repeat).")] = None,
    detach: Annotated[bool, typer.Option(help="Start the rollout and return (drive it with `rollout resume`).")] = False,
    state_url: StateUrl = None,
    prometheus: PrometheusUrl = None,
    prometheus_selector: PrometheusSelector = None,
) -> None:
    """Register VERSION (or each --arms version), load it on the servers, and stage it or roll it out."""

    where(err, repository, registry=True)
    try:
        # the --server list, else every replica live in the store's registry (re-read at each look)
        fleet, servers, found_urls = servers_or_fleet(list(server or []), metrics_url or [], state_url)
        if to.strip().lower() not in _TO:
            raise BadInput(f"--to must be staging or production (MLflow's challenger or champion), got {to!r}")
        to = _TO[to.strip().lower()]
        if (version is None) == (arms is None):
            raise BadInput("pass --version N (one candidate) or --arms V=W,... (A/B/n), not both or neither")
        aliases = [check_alias(a) for a in alias or []]
        if aliases and arms is not None:
            raise BadInput("--alias names one version: use it with --version, not --arms")
        arm_weights = None
        if arms is not None:

            arm_weights = dict(parse_arms(arms))
            if not arm_weights or to != "production" or not rollout:
                raise BadInput("--arms needs at least one VERSION=WEIGHT and a gated rollout to production")
            mode = "abn"
        config = None
        if judge is not None and judge not in JUDGES:
            raise BadInput(f"--judge must be one of {', '.join(JUDGES)}, got {judge!r}")
        margin = parse_margin(max_regression or "0.5pp")
        cost_limit = None if max_cost_increase is None else parse_increase(max_cost_increase)
        limits = judge_limits(repository, model, max_disagreement=max_disagreement, min_cosine=min_cosine,
                              max_slice_regression=max_slice_regression)
        if min_labels < 0:
            raise BadInput(f"--min-labels must be >= 0, got {min_labels}")
        target = guard_target(repository, model)
        exported = sorted({*(v for v in versions(repository / target) if read_manifest(repository / target / str(v))),
                           *_served_at_url(repository, target)})  # and the versions served at a URL
        for v in (version, *(arm_weights or ())):
            if v is not None and v not in exported:
                there = "has a folder but no manifest (not an exported version)" \
                    if (repository / target / str(v)).is_dir() else "does not exist"
                raise BadInput(f"'{model}' has no version v{v}: {repository / target / str(v)} {there}; "
                               f"exported versions of '{model}' (its model '{target}'): "
                               f"{', '.join(f'v{x}' for x in exported) or 'none'}")

        if to == "production" and rollout:
            config = _rollout_config(steps=steps, mode=mode, arms=arm_weights, dwell_s=dwell_s,
                                     interval_s=interval_s, max_step_s=max_step_s,
                                     gates={"min_requests": min_requests, "max_error_rate": max_error_rate,
                                            "min_compared": min_compared, "min_agreement": min_agreement,
                                            "min_latency_samples": min_latency_samples,
                                            "latency_tolerance": latency_tolerance, "max_regression": margin,
                                            "max_cost_increase": cost_limit,
                                            "max_disagreement": limits.max_disagreement,
                                            "limit_source": limits.sources["max_disagreement"],
                                            "max_slice_regression": limits.max_slice_regression,
                                            "min_labels": min_labels})
            urls = found_urls
            if not urls and fleet is None and not prometheus:
                raise BadInput("a rollout reads the guards' metrics: pass --server URL (or --metrics-url URL), "
                               "or --state-url redis://… whose registry lists the replicas")
        else:
            urls = []
        ctl, reg, target = controller_for(model, repository, urls, approver=approver,
                                       approve_cmd=approve_cmd, config=config, fleet=fleet, prometheus=prometheus,
                                       prometheus_selector=prometheus_selector)

        def register(v: int):
            vdir = repository / target / str(v)
            manifest = read_manifest(vdir) or _served_at_url(repository, target).get(v)
            if manifest is None:
                raise RegistryError(f"'{model}' v{v} (in '{target}') has no manifest in {vdir}: not an exported version")
            return reg.register(model, v, manifest, {}, source=str(vdir.resolve()))

        # the version serving now is PRODUCTION (registered if it was not: a guard pins its
        # first version as primary without the registry), so that a later `rollback` has
        # somewhere to go back to; a registry that fails here is said, and register() below decides
        state = open_store(model, repository).load()
        serving = primary or (state.primary if state else -1)
        if serving > 0 and serving not in (version, *(arm_weights or ())):
            reconcile(repository, model, primary=serving, create=True, registry=reg)

        def stage_version(v: int):
            info = register(v)
            for item in ensure_loaded(servers, repository, model, v):
                err.print(f"[green]✓[/] loaded {item}")
            if info.stage in ("DRAFT", "ARCHIVED"):
                reason = "staged" if to == "staging" else "rollout started"
                info = reg.transition(model, v, "STAGING", info.stage, approver, reason=reason)
            return info

        if arm_weights is not None:
            for v in arm_weights:
                stage_version(v)
            progress = ctl.start(None, primary=primary)
            if not detach:
                progress = ctl.run()
            else:
                out.print(f"[bold]{model}[/]: A/B/n rollout of {arms} started at {progress.steps[0]:g} % of the "
                          f"weights; drive it with `exporter rollout resume {model} --server …`")
                return
            exit_for(progress)
            return
        info = stage_version(version)
        reg.set_aliases(model, version, aliases, on_production=to == "production")
        if to == "staging":
            out.print(f"[bold]{model}[/] v{version}: STAGING, alias challenger (no traffic; "
                      "`promote --to production` rolls it out)")
            return
        if not rollout:
            if info.stage != "PRODUCTION":
                reg.transition(model, version, "PRODUCTION", info.stage, approver, reason="promoted without rollout")
            apply(repository, model, RouteChange(primary=version, candidate=0), by="promote",
                  reason=f"v{version} made primary by promote --no-rollout")
            purge(repository, model, "promote")
            out.print(f"[bold]{model}[/] v{version}: PRODUCTION, alias champion, and primary (no gradual rollout)")
            return
        judged = _judge_before_traffic(repository, model, target, version, primary or serving, judge, config,
                                       None if max_regression is None else margin, limits)
        if judged is not None and judged.verdict == "FAIL":
            on_stop = reg.stage(model, version)
            if on_stop in ("DRAFT", "STAGING"):
                reg.transition(model, version, "ARCHIVED", on_stop, approver, reason=judged.summary())
            out.print(f"[bold]{model}[/] v{version}: [red]rolled_back[/] before any traffic: {judged.summary()}")
            raise typer.Exit(EXIT_NEGATIVE)
        progress = ctl.start(version, primary=primary)
        if detach:
            out.print(f"[bold]{model}[/] v{version}: rollout started at {progress.steps[0]:g} %; "
                      f"drive it with `exporter rollout resume {model} --server …`")
            return
        progress = ctl.run()
        if progress.status == "done":
            purge(repository, model, "promote")
    except ExporterError as exc:
        err.print(f"[bold red]✗ promote failed:[/] {exc}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    exit_for(progress)


def _served_at_url(repository: Path, target: str) -> dict[int, dict]:
    """Manifests of the target's versions served at a URL (``endpoints.json``, tritonguard.rollout.endpoints)."""
    try:
        return {v: e.manifest(target) for v, e in read_endpoints(repository / target).items()}
    except EndpointError as exc:
        raise BadInput(str(exc)) from None


# --to in MLflow's words (the aliases) or the deprecated stage names
_TO = {"challenger": "staging", "staging": "staging", "champion": "production", "production": "production"}


def _rollout_config(**kwargs):
    """A RolloutConfig from promote's flags; a value out of range is bad input (exit 2)."""
    gates, steps = kwargs.pop("gates"), kwargs.pop("steps")
    try:
        return RolloutConfig(**kwargs, steps=tuple(float(s) for s in steps.split(",")), gates=GateConfig(**gates))
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def _judge_before_traffic(repository: Path, model: str, target: str, version: int, primary: int,
                          judge: str | None, config, margin: float | None = None, limits=None):
    """Decide how the rollout compares ``version`` with ``primary`` and run both on the
    evaluation data (:mod:`exporter.rollout.judge`); sets the gates in ``config``. None when there is no
    gated rollout or nothing to compare against (then the live gates alone decide, said loudly)."""

    if config is None:
        return None
    name = judge or manifest_judge(repository, target, version)
    config.gates.judge = name
    manifest = read_manifest(repository / target / str(version)) or _served_at_url(repository, target).get(version, {})
    if manifest.get("task") == "generation":
        return _judge_generation(repository, model, target, version, primary, name, config, margin)
    outputs = manifest.get("outputs") or [{}]
    if primary is None or primary < 1 or not outputs[0].get("name"):
        err.print(f"[yellow]![/] {model} v{version}: no offline judgement (no primary or no manifest outputs); "
                  f"judged live ({name})")
        return None
    if manifest.get("task") == "embedding" and name == "task":
        config.gates.cosine_floor = limits.min_cosine  # the guards count rows under it as disagreeing
    try:
        judged = judge_offline(repository, target, primary, version, judge=name, task=manifest.get("task", ""),
                               output=outputs[0]["name"], max_regression=config.gates.max_regression,
                               min_agreement=config.gates.min_agreement or 0.99,
                               max_disagreement=limits.max_disagreement, limit_source=limits.sources["max_disagreement"],
                               min_cosine=limits.min_cosine, max_slice_regression=limits.max_slice_regression,
                               labels_live=config.gates.min_labels > 0)
    except JudgeError as exc:
        err.print(f"[yellow]![/] {model} v{version}: no offline judgement ({exc}); judged live ({name}, "
                  f"disagreement limit {config.gates.max_disagreement:.2%}: {config.gates.limit_source})")
        return None
    config.gates.expected_disagreement = judged.expected_disagreement
    if judged.limit is not None:
        config.gates.disagreement_limit, config.gates.limit_source = judged.limit, judged.limit_source
    config.offline = judged.to_dict()
    err.print(f"[bold]judge[/] {model} v{version} vs v{primary}: {judged.summary()}")
    return judged


def _judge_generation(repository: Path, model: str, target: str, version: int, primary: int, name: str,
                      config, margin: float | None):
    """A generative version (``task: generation``): greedy texts and bits per char of both
    versions on the evaluation texts (:mod:`exporter.rollout.generation`)."""

    if primary is None or primary < 1:
        err.print(f"[yellow]![/] {model} v{version}: no offline judgement (no primary); judged live ({name})")
        return None
    try:
        judged = judge_generation(repository, target, primary, version, judge=name,
                                  max_regression=MAX_REGRESSION if margin is None else margin,
                                  min_agreement=config.gates.min_agreement or 0.99)
    except JudgeError as exc:
        err.print(f"[yellow]![/] {model} v{version}: no offline judgement ({exc}); judged live ({name})")
        return None
    # live, the canary compares greedy texts: equal for a re-export (the agreement gate judges
    # them); for another training run they differ by nature, and bits per char on the eval texts,
    # this judge's task metric, has decided: live disagreement is then reported, not judged
    config.gates.expected_disagreement = judged.expected_disagreement
    if name == "task":
        config.gates.judge_disagreement = False
    config.offline = judged.to_dict()
    err.print(f"[bold]judge[/] {model} v{version} vs v{primary}: {judged.summary()}")
    return judged
