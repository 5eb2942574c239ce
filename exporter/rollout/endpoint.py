"""What ``python -m exporter endpoint GUARD VERSION --url URL`` does (exporter/cli/endpoint_cmd.py):
declare that version VERSION of the guard's target is served by an OpenAI-compatible server at
URL (vLLM, TGI, ``transformers serve``), in ``<repository>/<target>/endpoints.json``
(:mod:`tritonguard.rollout.endpoints`), or withdraw that declaration.

The version is then a version like the others to ``exporter promote``, ``route`` and
``rollback``: the guard calls it at the URL (whatever its placement), canary and shadow traffic
reach it, ``served_by`` names it, and the live gates judge it on what the guards measure through
that server (there is nothing to run offline). The API key is never written: ``api_key_env`` /
``api_key_file`` say where each guard reads it.
"""

from __future__ import annotations

from pathlib import Path

from exporter.errors import ExporterError
from exporter.rollout.guards import guard_target
from tritonguard.rollout.endpoints import Endpoint, EndpointError, declare, withdraw


class EndpointRefused(ExporterError, ValueError):
    """The declaration cannot be written or withdrawn: a bad URL or number, a model that is not a
    guard, a version that is not declared. Nothing was changed."""


def declare_version(repository: Path, guard: str, version: int, *, url: str, model: str = "",
                    api_key_env: str = "", api_key_file: str = "", judge: str = "task") -> tuple[str, Endpoint]:
    """Declare ``version`` of ``guard``'s target served at ``url``: the target's name and the
    endpoint as written (its URL normalised).
    Raises :class:`~exporter.rollout.guards.NotAGuard` or :class:`EndpointRefused`."""
    target = guard_target(repository, guard)
    if not url:
        raise EndpointRefused("--url is required (or --remove)")
    try:
        endpoint = Endpoint(version=version, url=url, model=model, api_key_env=api_key_env,
                            api_key_file=api_key_file, judge=judge)
        declare(repository / target, endpoint)
    except EndpointError as exc:  # its messages never hold credentials (check_url)
        raise EndpointRefused(str(exc)) from None
    return target, endpoint


def withdraw_version(repository: Path, guard: str, version: int) -> str:
    """Withdraw ``version``'s declaration; the target's name. Raises ``NotAGuard`` or
    :class:`EndpointRefused` (not declared, or an unreadable ``endpoints.json``)."""
    target = guard_target(repository, guard)
    try:
        withdrawn = withdraw(repository / target, version)
    except EndpointError as exc:
        raise EndpointRefused(str(exc)) from None
    if not withdrawn:
        raise EndpointRefused(f"v{version} of '{target}' is not declared at a URL")
    return target
