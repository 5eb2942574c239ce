"""``python -m exporter batch MODEL --input PATH --output PATH``: score a table through a
guarded model on Ray Data, resumably (:mod:`exporter.batch.job`).

Progress and the summary go to stderr (``--json``: the summary as JSON on stdout). Progress
counts rows answered, committed or not (a block of text rows takes minutes to commit); where
stderr is not a terminal, a plain line every ``$TRITONGUARD_BATCH_PROGRESS_S`` seconds (10). Exit 0 when
every input row is in the output or the dead-letter folder, exactly once (rejected rows do not
fail a job); 4 when the job stopped (servers gone longer than ``--retry-timeout``, a worker
died): run the same command again to resume; 1 when every block committed but the output is not
exactly once; 2 on bad input (arguments, mapping, an output
folder that holds another job).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from exporter.batch import job as b
from exporter.batch.encode import read_block
from exporter.batch.eta import Eta, eta_text
from exporter.batch.run import run_job, summary
from exporter.batch.scorer import Scorer
from exporter.cli.consoles import console
from exporter.cli.exits import EXIT_BAD_INPUT, EXIT_NEGATIVE, EXIT_STOPPED
from exporter.cli.server_opt import GRPC, help_text, servers

out = console()
err = console(stderr=True)


class RowsPerSecond(ProgressColumn):
    def render(self, task: Any) -> Text:
        return Text(f"{task.speed:,.0f} rows/s" if task.speed else "… rows/s", style="cyan")


class EtaColumn(ProgressColumn):
    """The job's :class:`~exporter.batch.eta.Eta` (none until it rests on enough rows)."""

    def render(self, task: Any) -> Text:
        return Text(eta_text(task.fields.get("left")), style="cyan")


def batch_command(
    model: Annotated[str, typer.Argument(help="Guarded model, e.g. digits or minilm.")],
    input_path: Annotated[Path, typer.Option("--input", help="A Parquet, JSONL or CSV file, or a folder of one format.")],
    output: Annotated[Path, typer.Option("--output", help="Output folder: part-NNNNNN.parquet per input block.")],
    server: Annotated[list[str] | None, typer.Option("--server", callback=servers(GRPC), help=help_text(
        GRPC, "Triton server to score on (repeat: round-robin; default 127.0.0.1:8001)."))] = None,
    mapping: Annotated[list[str] | None, typer.Option("--map", help="INPUT=COLUMN (repeat); an unmapped input "
                                                       "reads the column of its own name.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Tenant the rows are scored as (request parameter 'tenant').")] = None,
    version: Annotated[int | None, typer.Option("--version", help="Accept answers of this version only, for "
                                                "reproducible scoring; the job stops if the guard does not serve it.")] = None,
    header: Annotated[list[str] | None, typer.Option("--header", help="NAME=VALUE gRPC metadata on every request "
                                                     "(repeat), e.g. x-tritonguard-api-key=$KEY.")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight per server and worker.")] = 4,
    workers: Annotated[int, typer.Option(min=1, help="Ray actors scoring blocks.")] = 1,
    batch_rows: Annotated[int | None, typer.Option(min=1, help="Rows per request (default: the model's max_batch_size).")] = None,
    block_rows: Annotated[int, typer.Option(min=1, help="Rows per block, the unit of checkpointing: a Parquet row "
                                            "group, sliced when it holds more.")] = 65536,
    dead_letter: Annotated[Path | None, typer.Option(help="Rejected rows' folder (default: OUTPUT/_dead_letter).")] = None,
    ray_address: Annotated[str | None, typer.Option(help="Ray cluster to run on (default: a local one).")] = None,
    retry_timeout: Annotated[float, typer.Option(help="Seconds a request may keep failing transiently "
                                                 "(UNAVAILABLE, quota) before the job stops.")] = 300.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the mapping on the first rows, write nothing.")] = False,
    restart: Annotated[bool, typer.Option("--restart", help="Score from scratch when OUTPUT holds another job.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="The summary as JSON on stdout.")] = False,
) -> None:
    """Score every row of INPUT through the guarded MODEL over gRPC and write Parquet: the
    outputs, served_by, version and row_id per row; rejected rows go to the dead-letter folder
    with the reason. Killed at any point, the same command resumes: committed blocks are kept."""

    servers = tuple(server or ["127.0.0.1:8001"])
    try:
        files = b.input_files(input_path)
        mapped = b.parse_mapping(mapping or [])
        specs, outputs, max_batch = b.model_specs(servers[0], model, mapped)
        header_line = b.csv_header(files[0]) if b.FORMATS[files[0].suffix.lower()] == "csv" else ""
        specs = b.resolve_columns(files, specs, header_line, mapped)
        dead = dead_letter or output / b.DEAD_LETTER
        job = b.Job(model=model, inputs=specs, outputs=outputs, servers=servers, output=str(output.resolve()),
                    dead_letter=str(dead.resolve()), batch_rows=batch_rows or max_batch, block_rows=block_rows,
                    concurrency=concurrency, tenant=tenant, version=version,
                    headers=b.parse_headers(header or []), retry_timeout_s=retry_timeout, csv_header=header_line)
        t0 = time.perf_counter()
        blocks = b.plan_blocks(files, block_rows)
        if dry_run:
            _dry_run(b, job, blocks)
            return
        b.open_output(output, dead, b.fingerprint(files, job, blocks), restart)
    except b.BatchError as exc:
        err.print(f"[bold red]✗ batch failed:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    total = sum(x.rows for x in blocks)
    done = b.committed(output)
    pending = [x for x in blocks if x.id not in done]
    err.print(f"[dim]{escape(model)}: {total:,} rows in {len(blocks)} blocks from {len(files)} file(s); "
              f"{len(done)} blocks already committed, {len(pending)} to score on {len(servers)} server(s)[/]",
              soft_wrap=True)
    failed = None
    results: list[b.BlockResult] = []
    if pending:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), RowsPerSecond(),
                   TextColumn("ETA"), EtaColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err, transient=False) as progress:
            base = total - sum(x.rows for x in pending)
            task = progress.add_task(escape(model), total=total, completed=base)
            shown = {"committed": 0, "answered": 0, "line": time.monotonic()}
            eta = Eta(total - base)
            every = float(os.environ.get("TRITONGUARD_BATCH_PROGRESS_S", "10"))

            def show() -> None:  # rows answered (committed or not); never behind the commits
                done_now = max(shown["committed"], shown["answered"])
                left = eta.update(done_now)
                progress.update(task, completed=base + done_now, left=left)
                now = time.monotonic()
                if not err.is_terminal and now - shown["line"] >= every:
                    # no live bar in a log file or a pipe: a plain line every `every` seconds
                    shown["line"] = now
                    rate = "…" if eta.rate is None else f"{eta.rate:,.0f}"
                    err.print(f"{escape(model)}: {base + done_now:,}/{total:,} rows answered "
                              f"({base + shown['committed']:,} committed), {rate} rows/s, ETA "
                              f"{'-' if left is None else time.strftime('%H:%M:%S', time.gmtime(left))}",
                              soft_wrap=True, highlight=False)

            def on_block(r: b.BlockResult) -> None:
                results.append(r)
                shown["committed"] += r.rows
                show()

            def on_rows(n: int) -> None:
                shown["answered"] = n
                show()

            try:
                run_job(job, pending, workers=workers, ray_address=ray_address, on_block=on_block, on_rows=on_rows)
            except Exception as exc:  # noqa: BLE001 - Ray wraps a worker's error; name its cause
                failed = _cause(exc)
    wall = time.perf_counter() - t0
    result = summary(output, dead, total)
    result.update(wall_s=round(wall, 1), output=str(output), dead_letter=str(dead), complete=failed is None)
    if results:  # this run's scoring, from the first block's start to the last commit (Ray's start-up excluded)
        span = max(r.finished for r in results) - min(r.started for r in results)
        result.update(scoring_s=round(span, 1), scoring_rows_s=round(sum(r.rows for r in results) / span) if span else None)
    if failed is not None:
        err.print(f"[bold red]✗ batch stopped:[/] {escape(failed)}\n"
                  f"  {result['scored'] + result['rejected']:,} of {total:,} rows committed; "
                  "run the same command again to resume", soft_wrap=True)
    _print_summary(result, as_json)
    if failed is not None:
        raise typer.Exit(EXIT_STOPPED)
    if not result["exactly_once"]:
        raise typer.Exit(EXIT_NEGATIVE)


def _cause(exc: BaseException) -> str:
    """The worker's own error out of Ray's wrappers (RayTaskError keeps it as ``cause``)."""
    seen = exc
    while getattr(seen, "cause", None) is not None:
        seen = seen.cause
    if seen is exc and exc.__cause__ is not None:
        seen = exc.__cause__
    text = str(seen).strip().splitlines()
    return f"{type(seen).__name__}: {text[-1] if text else ''}"


def _dry_run(b: Any, job: Any, blocks: list[Any]) -> None:
    """Encode the first block's first rows and send one request; print what would be written."""
    if not blocks:
        raise b.BatchError("the input holds no rows")
    first = blocks[0]
    enc = read_block(first, job)
    sample = {k: v[: job.batch_rows] for k, v in enc.tensors.items()}
    scorer = Scorer(job)
    try:
        outs, served, rejected = scorer.score(sample) if enc.rows.size else ({}, [], {})
    finally:
        scorer.close()
    served = [x.decode() for x in served]
    t = Table(title=f"{job.model}: mapping", title_justify="left")
    for col in ("input", "column", "datatype", "shape per row"):
        t.add_column(col)
    for s in job.inputs:
        t.add_row(s.name, s.column, s.datatype, str(list(s.dims)))
    out.print(t)
    n = len(next(iter(sample.values()))) if sample else 0
    out.print(f"first block: {first.rows} rows, {len(enc.rows)} readable, {len(enc.bad)} not "
              f"({', '.join(sorted({r for r, _ in enc.bad.values()})) or 'none'})")
    out.print(f"sent {n} rows: {len(served)} served ({', '.join(sorted(set(served))) or 'none'}), "
              f"{len(rejected)} rejected")
    for i, (rule, message) in list({**enc.bad, **{int(enc.rows[k]): v for k, v in rejected.items()}}.items())[:5]:
        out.print(f"  row {first.first_row + i}: {rule}: {escape(message)}", soft_wrap=True)
    for o, v in outs.items():
        out.print(f"output {o}: {v.dtype} {list(v.shape)}")
    if n and not served:
        raise b.BatchError("no row of the sample was served: check the mapping")


def _print_summary(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    rate = (result["scored"] + result["rejected"]) / result["wall_s"] if result["wall_s"] else 0.0
    check = "[green]exactly once[/]" if result["exactly_once"] else (
        f"[red]{result['missing_rows']:,} missing, {result['duplicate_rows']:,} duplicated[/]")
    scoring = (f", scoring {result['scoring_rows_s']:,} rows/s over {result['scoring_s']} s"
               if result.get("scoring_rows_s") else "")
    err.print(f"[bold]{result['rows']:,} rows[/]: {result['scored']:,} scored, {result['rejected']:,} rejected; "
              f"{check}; {result['wall_s']:.1f} s wall ({rate:,.0f} rows/s overall{scoring})")
    if result["rejects_by_reason"]:
        err.print("  rejects  " + ", ".join(f"{k} {v:,}" for k, v in sorted(result["rejects_by_reason"].items())))
    err.print("  served   " + (", ".join(f"{k} {v:,}" for k, v in sorted(result["served_by"].items())) or "none"))
    err.print(f"  output   {escape(result['output'])}  (dead letters: {escape(result['dead_letter'])})", soft_wrap=True)
