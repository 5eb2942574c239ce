"""``python -m exporter endpoint GUARD VERSION --url URL``: declare that version VERSION of the
guard's target is served by an OpenAI-compatible server at URL (vLLM, TGI, ``transformers
serve``), in ``<repository>/<target>/endpoints.json``; ``--remove`` withdraws it
(:mod:`exporter.rollout.endpoint`, docs/llm.md).

The version is then rolled out, routed and rolled back like any other (``promote``, ``route``,
``rollback``). The API key is never written: ``--api-key-env`` / ``--api-key-file`` say where each
guard reads it.
Exit codes (:mod:`exporter.cli.exits`): 0 done, 2 refused (one line on stderr; nothing changed).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from exporter.cli.consoles import WideConsole
from exporter.cli.exits import EXIT_BAD_INPUT
from exporter.cli.repository_opt import Repository
from exporter.errors import ExporterError
from exporter.rollout.endpoint import declare_version, withdraw_version

out = WideConsole(soft_wrap=True)
err = WideConsole(stderr=True, soft_wrap=True)

class EndpointJudge(str, Enum):
    """tritonguard.rollout.endpoints.JUDGES, as a choice (tests/unit/rollout/test_endpoints.py
    checks they are the same)."""

    task = "task"
    equivalence = "equivalence"


def endpoint_command(
    guard: Annotated[str, typer.Argument(help="The stream guard (its config.pbtxt names the target).")],
    version: Annotated[int, typer.Argument(help="The version number (not a version folder of the target).")],
    url: Annotated[str, typer.Option(help="The server's base URL, http(s)://host:port/v1.")] = "",
    model: Annotated[str, typer.Option(help="The model name the server serves (default: the target's name).")] = "",
    api_key_env: Annotated[str, typer.Option(help="Environment variable the guards read its API key from.")] = "",
    api_key_file: Annotated[str, typer.Option(help="File the guards read its API key from.")] = "",
    judge: Annotated[EndpointJudge, typer.Option(help="How a rollout compares it with the primary: on the "
                                                     "task (another runtime writes other text) or on "
                                                     "equivalence.")] = EndpointJudge.task,
    remove: Annotated[bool, typer.Option("--remove", help="Withdraw the declaration.")] = False,
    repository: Repository = "model_repository",
) -> None:
    """Declare (or --remove) a version of a stream guard's target served at the URL of an
    OpenAI-compatible server; then roll it out like any version."""
    repository = Path(repository)
    try:
        if remove:
            target = withdraw_version(repository, guard, version)
            out.print(escape(f"{guard}: v{version} of '{target}' is no longer served at a URL"))
            return
        target, endpoint = declare_version(repository, guard, version, url=url, model=model,
                                           api_key_env=api_key_env, api_key_file=api_key_file,
                                           judge=EndpointJudge(judge).value)
    except ExporterError as exc:  # NotAGuard, EndpointRefused: never a credential (check_url)
        err.print(f"[bold red]✗[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    out.print(escape(f"{guard}: v{version} of '{target}' is served at {endpoint.url} (model "
                     f"{endpoint.model or target!r}); roll it out with `python -m exporter promote {guard} "
                     f"--version {version} --server …`"))
