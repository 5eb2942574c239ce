"""``python -m exporter audit verify PATH``: check an audit log's hash chain.

Exit 0 when every record's hash, ``prev`` link and ``seq`` hold across the rotated files
(``PATH.N`` … ``PATH.1``, ``PATH``); 1 naming the first bad record when one was edited, inserted,
deleted or reordered; 2 when there is no audit log at PATH.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

EXIT_TAMPERED = 1
EXIT_NO_LOG = 2

audit_app = typer.Typer(help="Audit log tools.", no_args_is_help=True, add_completion=False)


@audit_app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="Audit log file (rotated PATH.1, PATH.2, … are read too).")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result on stdout.")] = False,
) -> None:
    """Verify the hash chain of an audit log; name the first bad record."""
    from tritonguard.audit import rotated_files
    from tritonguard.audit import verify as verify_chain

    files = rotated_files(path)
    result = verify_chain(path)
    if as_json:
        typer.echo(json.dumps({"path": str(path), "ok": result.ok, "records": result.records,
                               "first_bad": result.first_bad, "reason": result.reason,
                               "files": [str(f) for f in files]}))
    elif result.ok:
        typer.echo(f"ok: {result.records} records, chain intact ({len(files)} file{'s' if len(files) != 1 else ''})")
    elif not files:
        typer.echo(f"no audit log at {path}", err=True)
    else:
        typer.echo(f"TAMPERED: first bad record is #{result.first_bad} ({result.reason}); "
                   f"{result.records} records read", err=True)
    if not files:
        raise typer.Exit(EXIT_NO_LOG)
    if not result.ok:
        raise typer.Exit(EXIT_TAMPERED)
