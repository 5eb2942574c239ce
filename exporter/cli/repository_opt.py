"""``--repository/--model-repository/-r`` (the second is tritonserver's name for it): a folder or an object-store spec (``s3://bucket/prefix``, or Triton's
``s3://http://host:port/bucket/prefix``), ``$TRITONGUARD_REPOSITORY`` by default.

:func:`repository_command` wraps a command so that its body always gets a local folder: for an
``s3://`` spec, the working copy of :mod:`exporter.records.remote`, published when the command
succeeds (exit 0), left unpublished when it fails.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.markup import escape

from exporter.cli.consoles import WideConsole
from exporter.cli.exits import EXIT_BAD_INPUT
from exporter.records.remote import RemoteRepositoryError, working_copy
from tritonguard.core.objectstore import ENV_REPOSITORY, is_object_store
from tritonguard.core.store import ENV_URL

DEFAULT = "model_repository"

Repository = Annotated[str, typer.Option(
    "--repository", "--model-repository", "-r", envvar=ENV_REPOSITORY,
    help="Model repository: a folder, or s3://bucket/prefix (endpoint from $AWS_ENDPOINT_URL) or "
         "s3://http://host:port/bucket/prefix. --model-repository (tritonserver's flag) is the same.")]

_err = WideConsole(stderr=True, soft_wrap=True)


def repository_command(*, needs_state: bool = True, read_only: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``needs_state``: the command reads or writes the rollout state, which must then be in
    Redis (``$TRITONGUARD_STATE_URL``) when the repository is in an object store.
    ``read_only``: the command shows state and never publishes to an object store."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            spec = str(kwargs.get("repository") or DEFAULT)
            if kwargs.get("state_url"):
                # `--state-url` is this process's store (rollout_common.use_state_url); set it
                # before the object-store check below, which looks for $TRITONGUARD_STATE_URL
                os.environ[ENV_URL] = kwargs["state_url"]
            if not is_object_store(spec):
                kwargs["repository"] = Path(spec)
                return fn(*args, **kwargs)
            done: BaseException | None = None
            result = None
            try:
                with working_copy(spec, needs_state=needs_state, read_only=read_only,
                                  report=lambda line: _err.print(f"[green]✓[/] {escape(line)}")) as local:
                    kwargs["repository"] = local
                    try:
                        result = fn(*args, **kwargs)
                    except (typer.Exit, click.exceptions.Exit) as exc:
                        if getattr(exc, "exit_code", 1):
                            raise  # a failed command publishes nothing
                        done = exc
            except RemoteRepositoryError as exc:
                _err.print(f"[bold red]✗[/] {escape(str(exc))}")
                raise typer.Exit(EXIT_BAD_INPUT) from None
            if done is not None:
                raise done
            return result

        return wrapper

    return deco


__all__ = ["DEFAULT", "Repository", "repository_command"]
