"""The registry follows the routing: the rollout state's primary, which serves the traffic, is
PRODUCTION (what the registry says is a record; what the state says is what serves)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exporter.records.registry import (
    RECONCILE_TIMEOUT_S,
    Registry,
    default_uri,
    open_registry,
    registry_exists,
)
from exporter.rollout.controller import RolloutController
from exporter.rollout.guards import guard_target
from exporter.rollout.progress import ACTIVE
from tritonguard.core.repository import read_manifest
from tritonguard.rollout.endpoints import read_endpoints
from tritonguard.rollout.stores import open_store

log = logging.getLogger(__name__)


def reconcile_registry(repository: str | os.PathLike, model: str, *, state: Any = None,
                       primary: int | None = None, create: bool = False, registry: Registry | None = None,
                       timeout: float = RECONCILE_TIMEOUT_S,
                       warn: Callable[[str], Any] | None = None) -> str | None:
    """Make the registry agree with the routing: the rollout state's primary (``primary``
    overrides it), which serves the traffic, is PRODUCTION (registered from its manifest if it
    was not), any other PRODUCTION becomes ARCHIVED (:meth:`Registry.ensure_production`).

    For every CLI command that reads or changes rollout state. Skipped while a rollout of
    ``model`` is active (its controller moves the stages; its promotion is not atomic with the
    routing change), for a primary of -1 (none pinned yet) and, unless ``create``, when there is
    no registry (:func:`registry_exists`). Never raises: a registry that fails or does not
    answer within ``timeout`` seconds (a daemon thread) is reported through ``warn`` (default:
    the log) and the command goes on. Returns a line saying what changed, or None."""
    say = warn or (lambda msg: log.warning("%s", msg))
    repo = Path(repository)
    try:

        if primary is None:
            if state is None:
                state = open_store(model, repo).load()
            primary = state.primary if state is not None else -1
        if primary is None or primary < 1 or (not create and registry is None and not registry_exists(repo)):
            return None
        progress = RolloutController(model, repo, reader=None).status()  # type: ignore[arg-type]
        if progress is not None and progress.status in ACTIVE:
            return None
        target = guard_target(repo, model)
        vdir = repo / target / str(primary)
        manifest, source = read_manifest(vdir), str(vdir.resolve())
        if manifest is None and (endpoint := read_endpoints(repo / target).get(primary)) is not None:
            # a version served at a URL has no folder: its declaration is its manifest, as promote reads it
            manifest, source = endpoint.manifest(target), endpoint.url
    except Exception as exc:  # noqa: BLE001 - a view must not fail on the registry's account
        say(f"registry not reconciled for '{model}': {type(exc).__name__}: {exc}")
        return None
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            reg = registry or open_registry(repo)
            info, changed = reg.ensure_production(
                model, primary, manifest=manifest, source=source,
                reason=f"reconcile: v{primary} is the primary of the rollout state (it serves the traffic)")
            box["changed"] = changed
        except Exception as exc:  # noqa: BLE001 - reported below
            lines = str(exc).strip().splitlines()
            box["error"] = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    worker = threading.Thread(target=work, name="tritonguard-reconcile", daemon=True)
    worker.start()
    worker.join(timeout)
    where = registry.uri if registry is not None else default_uri(repo)
    if worker.is_alive():
        say(f"registry {where} did not answer within {timeout:g} s: '{model}' v{primary} (the primary) "
            "not checked for PRODUCTION")
        return None
    if "error" in box:
        say(f"registry {where}: could not make '{model}' v{primary} (the primary) PRODUCTION: {box['error']}")
        return None
    if box.get("changed"):
        return f"registry: '{model}' v{primary} is the primary, now PRODUCTION (any other PRODUCTION ARCHIVED)"
    return None


