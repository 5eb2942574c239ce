"""``python -m exporter audit verify PATH``: check an audit log's hash chain and its anchors.

The chain (every record's hash, ``prev`` link and ``seq``, across the rotated files ``PATH.N`` …
``PATH.1``, ``PATH``) is checked against the chain's anchors: ``PATH.anchor``, and the guard's
state store when given (``--state-url`` / ``$TRITONGUARD_STATE_URL`` for Redis, ``--repository``
for the file store). Exit codes (:mod:`exporter.cli.exits`, one table for every command):

- 0: intact and anchored (also: unanchored without ``--require-anchor``, gaps with ``--allow-gaps``)
- 1: a finding, named by the first word on stderr (``status`` in ``--json``): TAMPERED (a record
  was edited, inserted, deleted or reordered, the first bad one named; or an anchor is forged,
  altered or signed with another key), TRUNCATED (fewer records than an anchor counts, or the
  anchored head is not in the chain), GAPS (the writer lost records and said so in gap records),
  UNANCHORED (with ``--require-anchor``: no anchor found, a lost tail cannot be detected)
- 2: no audit log at PATH (and no anchor for it), or the anchors' key cannot be read

The findings share 1 rather than a number each: every one says the log cannot be trusted as
complete, the flags above choose which of them fail, and 3 and 4 mean "not finished" and
"stopped part way" in every other command.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from exporter.cli.exits import EXIT_BAD_INPUT, EXIT_NEGATIVE, EXIT_OK
from tritonguard.core.errors import ConfigError
from tritonguard.privacy.audit.anchors import (
    ANCHOR_PREFIX,
    FileAnchors,
    RedisAnchors,
    load_audit_key,
)
from tritonguard.privacy.audit.anchors import anchor_name as default_name
from tritonguard.privacy.audit.chain import rotated_files, utc_iso
from tritonguard.privacy.audit.verify import verify as verify_chain

audit_app = typer.Typer(help="Audit log tools.", no_args_is_help=True, add_completion=False)


def _file_stores(repository: Path, model: str | None) -> list[Any]:
    """File-store anchors (``audit_anchor.*.json`` in a guard's folder): the guard's (``--model``),
    else ``repository`` itself (one guard's folder) and each of its model folders."""

    if model:
        return [FileAnchors(repository / model, prefix=ANCHOR_PREFIX)]
    folders = [repository, *sorted(d for d in repository.iterdir() if d.is_dir())] if repository.is_dir() else []
    return [FileAnchors(d, prefix=ANCHOR_PREFIX) for d in folders]


@audit_app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="Audit log file (rotated PATH.1, PATH.2, … are read too).")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result on stdout.")] = False,
    allow_gaps: Annotated[bool, typer.Option("--allow-gaps", help="Exit 0 when the only findings are gap "
                                             "records (records the writer lost and reported).")] = False,
    require_anchor: Annotated[bool, typer.Option("--require-anchor", help="Exit 1 when no anchor is found "
                                                 "(default: a warning, exit 0).")] = False,
    state_url: Annotated[str, typer.Option("--state-url", envvar="TRITONGUARD_STATE_URL",
                                           help="Redis holding the guards' anchors.")] = "",
    repository: Annotated[Path | None, typer.Option("--repository", "--model-repository", "-r", help="Model repository (or one guard's "
                                                    "folder) holding the file store's anchors.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="The guard whose file-store anchors to read "
                                              "(default: any guard of --repository).")] = None,
    anchor_name: Annotated[str | None, typer.Option("--anchor-name", help="Name the anchor is stored under "
                                                    "in the state store (default: HOST:absolute PATH).")] = None,
    host: Annotated[str | None, typer.Option("--host", help="Host that wrote the log (default: this one).")] = None,
    key_env: Annotated[str, typer.Option("--key-env", help="Variable holding the anchors' HMAC key.")]
    = "TRITONGUARD_AUDIT_KEY",
) -> None:
    """Verify the hash chain of an audit log against its anchors; name the first bad record,
    the records missing at the end, and the gaps."""

    try:
        key = load_audit_key(key_env, os.environ)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    stores: list[Any] = []
    if state_url:
        stores.append(RedisAnchors(state_url))
    if repository is not None:
        stores += _file_stores(repository, model)
    name = anchor_name or default_name(path, host)
    files = rotated_files(path)
    result = verify_chain(path, anchors=stores, key=key, name=name, allow_gaps=allow_gaps)
    for s in stores:
        if hasattr(s, "close"):
            s.close()
    code = {"tampered": EXIT_NEGATIVE, "missing": EXIT_BAD_INPUT, "truncated": EXIT_NEGATIVE,
            "gaps": EXIT_OK if allow_gaps else EXIT_NEGATIVE,
            "unanchored": EXIT_NEGATIVE if require_anchor else EXIT_OK}.get(result.status, EXIT_OK)
    if as_json:
        typer.echo(json.dumps({"path": str(path), "ok": result.ok and code == 0, "status": result.status,
                               "exit_code": code, "records": result.records, "first_bad": result.first_bad,
                               "missing": result.missing, "reason": result.reason, "gaps": result.gaps,
                               "truncations": result.truncations, "anchors": result.anchors,
                               "warnings": result.warnings, "files": [str(f) for f in files]}))
        raise typer.Exit(code)
    n_files = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    if result.status == "missing":
        typer.echo(f"no audit log at {path}", err=True)
    elif result.status == "tampered":
        if result.first_bad is not None:
            typer.echo(f"TAMPERED: first bad record is #{result.first_bad} ({result.reason}); "
                       f"{result.records} records read", err=True)
        else:
            typer.echo(f"TAMPERED: {result.reason}; {result.records} records read", err=True)
    elif result.status == "truncated":
        for t in result.truncations:
            typer.echo(f"TRUNCATED: {t}", err=True)
        typer.echo(f"{result.records} records read ({n_files}), chain intact up to there", err=True)
    elif result.status == "gaps" and not allow_gaps:
        typer.echo(f"GAPS: {result.reason.removeprefix('gaps: ')}", err=True)
        typer.echo(f"{result.records} records read ({n_files}), chain intact otherwise; "
                   "--allow-gaps accepts them", err=True)
    elif result.status == "unanchored" and require_anchor:
        typer.echo(f"UNANCHORED: {result.records} records, chain intact ({n_files}), but no anchor was found: "
                   "a lost tail cannot be detected", err=True)
        result.warnings = [w for w in result.warnings if not w.startswith("unanchored")]
    else:
        typer.echo(f"ok: {result.records} records, chain intact ({n_files})")
        best = max(result.anchors, key=lambda d: d["seq"], default=None)
        if best is not None:
            signed = "signed" if best.get("alg") == "hmac-sha256" else "unsigned"
            typer.echo(f"anchored: {best['seq']} records at {utc_iso(best['ts'])} ({signed}; "
                       f"{', '.join(a['at'] for a in result.anchors)})")
        if result.status == "gaps":
            typer.echo(f"warning: {result.reason}", err=True)
    for w in result.warnings:
        typer.echo(f"warning: {w}", err=True)
    raise typer.Exit(code)
