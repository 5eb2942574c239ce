"""The ``python -m exporter`` command group. Each command is a thin call into the library;
new commands (compile, promote, rollback, route) are added as further ``@app.command()``s."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from exporter.build.errors import ExportError, GoldenCheckFailed
from exporter.build.export import export_source
from exporter.build.upgrade import upgrade_layout
from exporter.cli.consoles import console, log_handler, where
from exporter.cli.exits import EXIT_BAD_INPUT, EXIT_BUG, EXIT_NEGATIVE
from exporter.cli.repository_opt import Repository, repository_command
from exporter.cli.rollout_common import StateUrl, servers_or_fleet
from exporter.cli.server_opt import HTTP, help_text, servers
from exporter.cli.status import collect, live, print_live, table, unreachable
from exporter.cli.watch import watch as watch_view
from exporter.errors import ExporterError
from exporter.rollout.reconcile import reconcile_registry
from exporter.rollout.route import RouteChange, apply, parse_arms, show, state_summary
from tritonguard.privacy.tenancy.auth import new_api_key
from tritonguard.privacy.tenancy.config import TenancyConfig

app = typer.Typer(
    help="Export models into a Triton model repository, behind a tritonguard guard.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals hold tensors and weights: unreadable
    epilog="Exit codes, the same in every command: 0 done, 1 done and the answer is no (rolled back, a "
           "check failed), 2 refused (bad input), 3 not finished (run it again later), 4 stopped part way "
           "(run it again to resume), 70 a bug. The table: docs/reference/exit-codes.md.",
)
# results to stdout, progress and logs to stderr, so `status --json | jq` stays clean; full-width
# lines when piped (a CI log, `| cat`), $COLUMNS respected (exporter.cli.consoles)
out = console()
err = console(stderr=True)



class Format(str, Enum):
    onnx = "onnx"
    torchscript = "torchscript"


class Task(str, Enum):
    classifier = "classifier"
    embedding = "embedding"
    regression = "regression"


class Judge(str, Enum):
    task = "task"
    equivalence = "equivalence"


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        handlers=[log_handler(err)], force=True)


def _where(repository: Path, registry: bool = False) -> None:
    where(err, repository, registry)


@contextmanager
def _step(label: str):
    t0 = time.perf_counter()
    with err.status(f"{label}…"):
        yield
    err.print(f"[green]✓[/] {label} [dim]({time.perf_counter() - t0:.2f} s)[/]")


@app.command()
@repository_command(needs_state=False)
def export(
    source: Annotated[str, typer.Option(help="package.module:function, a .onnx/.pt file, a Hugging Face "
                                        "model folder, or models:/name@alias, models:/name/version, runs:/…")],
    name: Annotated[str, typer.Option(help="Public model name (the guard); targets get suffixes.")],
    repository: Repository = "model_repository",
    fmt: Annotated[Format | None, typer.Option("--format", help="Artifact format (default: onnx; a .pt source stays torchscript).")] = None,
    opset: Annotated[int, typer.Option(help="ONNX opset.")] = 17,
    inputs: Annotated[Path | None, typer.Option(help="Golden inputs .npz (file and MLflow sources); for a "
                                                "Hugging Face folder .txt (one sentence a line) or .npz.")] = None,
    task: Annotated[Task | None, typer.Option(help="Task (file and MLflow sources; inferred for Hugging Face).")] = None,
    input_name: Annotated[list[str] | None, typer.Option(help="Artifact input names, in order (repeat).")] = None,
    output_name: Annotated[list[str] | None, typer.Option(help="Artifact output names, in order (repeat).")] = None,
    native: Annotated[bool, typer.Option(help="Serve the artifact with Triton's onnxruntime backend "
                                          "(platform onnxruntime_onnx; NGC image) instead of `runtime`.")] = False,
    mlflow_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI that models:/ and runs:/ sources "
                                                   "are read from (default: $MLFLOW_TRACKING_URI).")] = None,
    register: Annotated[bool, typer.Option(help="Register the version in the MLflow registry beside the "
                                           "repository (or $MLFLOW_TRACKING_URI) as DRAFT.")] = True,
    register_timeout: Annotated[float, typer.Option(help="Seconds to wait for the registry; the export "
                                                    "stands either way.")] = 60.0,
    judge: Annotated[Judge | None, typer.Option(help="How a rollout judges this version: on the task (a new "
                                                "model) or on equivalence (the same weights). Default: the "
                                                "source's choice, else equivalence when an earlier version has "
                                                "the same artifact hash, else task.")] = None,
    eval_file: Annotated[Path | None, typer.Option("--eval", help="Evaluation set a rollout judges this version on: "
                         ".npz (the inputs, optional 'labels' and 'slices'); for a text model also .txt (texts, "
                         "unlabelled), .tsv (query<TAB>positive: recall@k) or .jsonl ({text, positive?, slice?}).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Export even when an existing version has the very same "
                                        "artifact (same SHA-256); it becomes a new version judged by "
                                        "equivalence. Without it such an export is refused (exit 2).")] = False,
) -> None:
    """Export SOURCE as a new version, check it against its goldens, write it behind a guard,
    and register it in the MLflow model registry. Settings in existing config.pbtxt files
    (guard parameters, instance groups, batching) are kept. An export whose artifact is identical
    to an existing version's is refused unless --force is given."""

    _quiet_onnxruntime()
    _where(repository, registry=register)
    try:
        result = export_source(
            source, name=name, repository=repository, fmt=fmt.value if fmt else None, opset=opset,
            inputs=inputs, task=task.value if task else None, input_names=input_name or (),
            output_names=output_name or (), step=_step, native=native, mlflow_uri=mlflow_uri,
            register=register, register_timeout=register_timeout, judge=judge.value if judge else None,
            force=force, eval_path=eval_file)
    except GoldenCheckFailed as exc:
        # soft_wrap: one line however long (an engine's message), markup escaped ("[ONNXRuntimeError]")
        err.print(f"[bold red]✗ {escape(str(exc))}[/]", soft_wrap=True)
        raise typer.Exit(EXIT_NEGATIVE) from None
    except ExporterError as exc:
        err.print(f"[bold red]✗ export failed:[/] {escape(str(exc))}", soft_wrap=True)
        err.print(f"nothing was written to {escape(str(Path(repository).resolve()))}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    for notice in result.notices:
        err.print(f"[yellow]![/] {escape(notice)}", soft_wrap=True)
    rep = result.report
    style = "green" if rep.verdict == "PASS" else "yellow"
    figures = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in rep.metrics.items())
    out.print(f"[bold]{result.name}[/] version [bold]{result.version}[/]: golden [{style}]{rep.verdict}[/] "
              f"on {rep.n} samples ({figures})")
    out.print(f"  artifact {result.artifact}  sha256 {result.sha256[:16]}…")
    out.print(f"  models   {', '.join(result.models)}  (total {sum(result.timings.values()):.1f} s)")
    same = f" (same weights as v{result.same_weights_as})" if result.same_weights_as is not None else ""
    out.print(f"  judge    {result.judge}{same}")
    if result.evaluation is not None:
        ev = result.evaluation
        if ev.get("metric"):
            out.print(f"  eval     {ev['metric']} {ev['value']:.4g} on {ev['n']} labelled rows")
        else:
            out.print(f"  eval     {ev['n']} unlabelled rows (compared with the primary at promote, not scored)")
    if result.registration is not None:
        reg = result.registration
        out.print(f"  registry {reg.name} v{reg.version} = MLflow version {reg.mlflow_version}, "
                  f"stage [bold]{reg.stage}[/]  ({result.registry_uri})")
    elif result.registration_error:
        err.print(f"[bold yellow]! not registered:[/] {result.registration_error}\n"
                  "  the export stands; `exporter promote` registers the version when it is promoted")
    else:
        out.print("  registry skipped (--no-register)")


def _quiet_onnxruntime() -> None:
    """onnxruntime logs a failing kernel to stderr itself, in red, before raising; the export
    reports the same error as its one line, so its logger only speaks of fatal errors here."""
    try:
        import onnxruntime  # noqa: PLC0415 - defers a heavy import
    except ImportError:
        return
    onnxruntime.set_default_logger_severity(4)


@app.command()
@repository_command(read_only=True)
def status(
    repository: Repository = "model_repository",
    server: Annotated[list[str] | None, typer.Option("--server", callback=servers(HTTP), help=help_text(
        HTTP, "Triton server of a replica (repeat): live breaker states, drift and answers per version from "
        "its metrics port (HTTP + 2)."))] = None,
    metrics_url: Annotated[list[str] | None, typer.Option("--metrics-url", help="Metrics URL of a replica (repeat).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="A live view of every guard (routing, rollout gates, "
                     "breakers, traffic rates), redrawn every 2 s from the --server metrics; Ctrl-C stops.")] = False,
    state_url: StateUrl = None,
) -> None:
    """Models with versions, hashes and goldens; per guard: routing, rollout step and gates,
    registry stages, and (with --server) live breaker states and drift. A --server or
    --metrics-url that cannot be reached is an error (exit 2), named on stderr; under --watch
    only at the start (a replica lost later is shown in the view). Without --server, a Redis store
    (--state-url or $TRITONGUARD_STATE_URL) gives every live replica of its registry, re-read at each
    --watch reading."""

    if watch and as_json:
        err.print("[bold red]✗ status failed:[/] --watch draws a live view; use --json without it")
        raise typer.Exit(EXIT_BAD_INPUT)
    try:
        fleet, servers, urls = servers_or_fleet(list(server or []), metrics_url or [], state_url,
                                                say=lambda line: err.print(escape(line), soft_wrap=True))
    except ExporterError as exc:
        err.print(f"[bold red]✗ status failed:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    # a listed replica that cannot be reached is an error; a found one is only shown as unreachable
    if fleet is None and (problems := unreachable(servers, urls, explicit_metrics=bool(metrics_url))):
        for problem in problems:
            err.print(f"[bold red]✗ status failed:[/] {escape(problem)}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    if watch:

        watch_view(out, repository, servers, urls, fleet=fleet)
        return
    models = collect(repository)
    guards = live(repository, urls, servers=servers)
    if as_json:
        doc = {"repository": str(repository), "models": models, "guards": guards}
        if fleet is not None:  # URLs, host, start, last heartbeat and versions served, per replica
            doc["replicas"] = [r.to_dict() for r in fleet.last]
        typer.echo(json.dumps(doc, indent=2))
        return
    if not models:
        out.print(f"no models in {repository}")
        return
    out.print(table(models, repository))
    print_live(out, guards)


@app.command()
@repository_command()
def route(
    model: Annotated[str, typer.Argument(help="Guard model name, e.g. digits.")],
    repository: Repository = "model_repository",
    primary: Annotated[int | None, typer.Option(help="Primary version.")] = None,
    candidate: Annotated[int | None, typer.Option(help="Candidate version (0 removes it).")] = None,
    share: Annotated[float | None, typer.Option(help="Candidate's share of live traffic, 0..1.")] = None,
    shadow: Annotated[float | None, typer.Option(help="Share of primary traffic mirrored to the candidate.")] = None,
    fallback: Annotated[str | None, typer.Option(help="Chain, e.g. candidate,primary,previous_primary,default.")] = None,
    default: Annotated[str | None, typer.Option(help="End of the chain: abstain (503) or none.")] = None,
    reset_breaker: Annotated[int | None, typer.Option(help="Close this version's breaker now.")] = None,
    arms: Annotated[str | None, typer.Option(
        help="A/B/n split: VERSION=WEIGHT,... (e.g. 2=0.3,3=0.2); the primary answers the rest. "
             "'none' ends it.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the state as JSON.")] = False,
) -> None:
    """Show or set a guarded model's rollout state (guards pick it up within a second)."""

    try:
        change = RouteChange(primary=primary, candidate=candidate, share=share, shadow=shadow,
                             fallback=fallback.split(",") if fallback else None, default=default,
                             reset_breaker=reset_breaker, arms=None if arms is None else parse_arms(arms))
        changing = any(v is not None for v in vars(change).values())
        if changing:
            _where(repository)
            apply(repository, model, change)
        state = show(repository, model, reconcile=changing)  # showing alone writes nothing
    except ExporterError as exc:  # RouteError; NotAGuard (a model that is not a guard): one line, no traceback
        err.print(f"[bold red]✗ route failed:[/] {exc}")
        raise typer.Exit(exc.exit_code) from None
    if as_json:
        typer.echo(json.dumps(state, indent=2))
        return
    if state.get("state", "") is None:
        out.print(f"{model}: no rollout state yet (the guard writes one when it first loads)")
        return
    head, *rest = state_summary(state, goldens=True)
    out.print(f"[bold]{model}[/] {head}")
    for line in rest:
        out.print(f"  {line}")


@app.command("reconcile")
@repository_command()
def reconcile_command(
    model: Annotated[str | None, typer.Argument(help="Guard model name (default: every guard).")] = None,
    repository: Repository = "model_repository",
) -> None:
    """Make the registry say what serves: each guard's primary (its rollout state) becomes
    PRODUCTION, registered from its manifest if it was not, any other PRODUCTION ARCHIVED.
    `export`, `route` with a change, `promote` and `rollback` do this themselves; `status` only
    says when the two disagree."""

    names = [model] if model else [m.get("serves_as") or m["name"] for m in collect(repository)
                                   if m.get("kind") == "guard"]
    if not names:
        out.print(f"no guarded models in {escape(str(repository))}")
        return
    for name in names:
        try:
            changed = reconcile_registry(repository, name, create=True,
                                         warn=lambda msg: err.print(f"[yellow]![/] {escape(msg)}", soft_wrap=True))
        except ExporterError as exc:
            err.print(f"[bold red]✗ reconcile failed:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None
        out.print(f"[green]✓[/] {escape(changed)}" if changed else f"{escape(name)}: registry already agrees",
                  soft_wrap=True)


@app.command()
@repository_command(needs_state=False)
def upgrade(repository: Repository = "model_repository") -> None:
    """Move the repository to the current layout, adding no version: a guard with a text (BYTES)
    input becomes the ensemble NAME = NAME_intake -> NAME_guard, so one malformed request cannot
    fail the batch it lands in. Settings and rollout state are kept. `export` does this too."""

    if not (repository.is_dir()):
        err.print(f"[bold red]✗[/] no model repository at {escape(str(repository.resolve()))}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    _where(repository)
    try:
        moved = upgrade_layout(repository)
    except ExportError as exc:
        err.print(f"[bold red]✗ upgrade failed:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    for line in moved:
        out.print(f"[green]✓[/] {escape(line)}", soft_wrap=True)
    if not moved:
        out.print(f"{escape(str(repository.resolve()))}: already up to date", soft_wrap=True)


@app.command("tenant-key")
def tenant_key(tenant: Annotated[str, typer.Argument(help="Tenant id the key is for.")]) -> None:
    """A fresh random API key for TENANT on stdout (hand it over; it is stored nowhere) and, on
    stderr, its SHA-256 digest as the line to add to tenancy.keys_file."""

    if not TenancyConfig().pattern.match(tenant):
        err.print(f"[bold red]✗[/] tenant id must match {escape(TenancyConfig.tenant_pattern)}")
        raise typer.Exit(EXIT_BAD_INPUT)
    key, digest = new_api_key()
    typer.echo(key)
    err.print(f'add to tenancy.keys_file (TOML):  "{tenant}" = ["{digest}"]\n'
              f'                        (JSON):  "{tenant}": ["{digest}"]', markup=False, highlight=False, soft_wrap=True)


def main() -> None:
    from tritonguard.core.store import NamespaceError, namespace  # noqa: PLC0415

    try:  # every Redis key carries it: a bad one is one line, before any command runs
        namespace()
    except NamespaceError as exc:
        err.print(f"[bold red]✗[/] {escape(str(exc))}", soft_wrap=True)
        raise SystemExit(EXIT_BAD_INPUT) from None
    try:
        app()
    except Exception as exc:  # noqa: BLE001 - the CLI's entry: a bug is one line and EXIT_BUG, not a traceback and 1
        crashed(exc)
        raise SystemExit(EXIT_BUG) from None


_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s/:@]*:)[^\s/@]+@", re.I)


def crashed(exc: BaseException) -> None:
    """Write ``exc``'s traceback to a file, say in one line on stderr what it was and where the
    file is (the caller exits :data:`~exporter.cli.exits.EXIT_BUG`): a script sees a bug as a code
    of its own (1 is a negative answer), a user sees one line and not a screen of frames. The file is
    ``$TRITONGUARD_HOME/crash/exporter-<UTC time>-<pid>.txt`` (the system's temporary folder when
    that cannot be written), readable by its owner only; the line masks URL passwords."""

    from tritonguard.core.store import ENV_URL, home, scrubbed  # noqa: PLC0415

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"exporter-{stamp}-{os.getpid()}.txt"
    path = None
    for folder in (home() / "crash", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(f"python -m exporter {' '.join(sys.argv[1:])}\n\n{text}")
            path = folder / name
            break
        except OSError:
            continue
    message = _URL_PASSWORD.sub(r"\1***@", scrubbed(str(exc), os.environ.get(ENV_URL, "")))
    what = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    where_ = f"the traceback is in {path}" if path else f"the traceback could not be written:\n{text}"
    err.print(f"[bold red]✗ unexpected error (a bug, exit {EXIT_BUG}):[/] {escape(what)}; {escape(where_)}; "
              "please report both", soft_wrap=True)


# `python -m exporter audit verify PATH` (exit 0 intact, 1 a finding, 2 no log)
from exporter.cli.audit_cmd import audit_app  # noqa: E402

app.add_typer(audit_app, name="audit")

# registry stages and progressive rollouts
from exporter.cli.promote_cmd import promote  # noqa: E402
from exporter.cli.rollout_cmd import rollback, rollout_app  # noqa: E402

app.command()(repository_command()(promote))
app.command()(repository_command()(rollback))
app.add_typer(rollout_app, name="rollout")

# labels that arrive after the answer, joined to what each version answered
from exporter.cli.feedback_cmd import feedback_command  # noqa: E402

app.command("feedback")(feedback_command)

# optimised variants of an exported version, admitted on goldens and measured speed
from exporter.cli.compile_cmd import compile_command  # noqa: E402

app.command("compile")(repository_command(needs_state=False)(compile_command))

# the profiling level for a guarded pipeline: sweep guard + target serving knobs together
from exporter.cli.tune_cmd import tune_command  # noqa: E402

app.command("tune")(tune_command)

# offline scoring of whole tables through a guard, on Ray Data: resumable, exactly once
from exporter.cli.batch_cmd import batch_command  # noqa: E402

app.command("batch")(batch_command)

# events from a Kafka topic scored through a guard, results to a topic: at-least-once
from exporter.cli.stream_cmd import stream_command  # noqa: E402

app.command("stream")(stream_command)

# `python -m exporter openai --server HOST:PORT --model GUARD`: the OpenAI-compatible front (issue 42)
from exporter.cli.openai_cmd import openai_command  # noqa: E402

app.command("openai")(openai_command)

# `python -m exporter endpoint GUARD VERSION --url URL`: a version served outside Triton (issue 42)
from exporter.cli.endpoint_cmd import endpoint_command  # noqa: E402

app.command("endpoint")(repository_command(needs_state=False)(endpoint_command))
