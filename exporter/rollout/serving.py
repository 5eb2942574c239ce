"""What ``promote`` / ``rollback`` need from the serving side: versions loaded on every replica,
and the guard's cache purged.

Loading goes through Triton's HTTP repository API (``POST /v2/repository/models/<name>/load``),
only for names checked to be model folders of the repository: an unknown name given to
``pb_utils.load_model`` aborts a Triton server, so the guards never load anything themselves.
A guard with the ``inprocess`` placement runs the target's versions itself (from the version
folders): nothing needs loading. With ``bls``, the version (or its pinned ensemble,
``target_per_version``) must be ready on each replica; a server that does not run with
``--model-control-mode=explicit`` (or ``poll``) cannot load it, and the error says so.

Purging: the rollout state's ``cache_epoch`` is bumped, so every guard instance drops its own
in-process L1 entries at its next batch, and the shared tiers (L2 SQLite, L3 Redis) lose the
model's rows here, once. The tiers come from the guard's resolved parameters (config.pbtxt,
``TRITONGUARD_*`` of this process, ``[tool.tritonguard]``): run the command with the server's
environment. No encryption key is needed to delete rows.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exporter.errors import ExporterError
from tritonguard.core import repository
from tritonguard.core.config import from_params, layered_parameters, split_parameters
from tritonguard.guard.config import GuardConfig
from tritonguard.privacy.cache.config import CacheConfig, PrivacyMode
from tritonguard.privacy.cache.tiers import RedisTier as _Redis
from tritonguard.privacy.cache.tiers import SqliteTier as _Sqlite
from tritonguard.rollout.endpoints import endpoint_of
from tritonguard.rollout.stores import open_store
from tritonguard.triton import http as triton_http

log = logging.getLogger(__name__)

ADMIN_HEADER = os.environ.get("TRITONGUARD_ADMIN_HEADER", "x-tritonguard-admin-key")


class ServingError(ExporterError):
    """A version cannot be made ready on a server."""


def _guard_config(repo: Path, model: str) -> dict[str, Any]:
    if not (Path(repo) / model / repository.CONFIG).exists():
        raise ServingError(f"no model '{model}' in {repo}")
    found = repository.guard_dir(repo, model)
    if found is None:
        raise ServingError(f"'{model}' is not a guard model")
    return found[1]


def _params(cfg: dict[str, Any]) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}


def models_to_load(repo: Path, model: str, version: int) -> list[tuple[str, int]]:
    """``(model name, version)`` pairs Triton must have ready for the guard to route to ``version``;
    empty for the in-process placement."""
    repo = Path(repo)
    params = _params(_guard_config(repo, model))
    if params.get("placement", "inprocess") == "inprocess":
        return []
    target = params["target"]
    if endpoint_of(repo / target, version) is not None:
        return []  # served at a URL (endpoints.json): nothing of it runs in Triton
    per_version = params.get("target_per_version", "")
    if per_version:
        name = per_version.format(version=version)
        if not (repo / name / repository.CONFIG).exists():
            raise ServingError(f"'{name}' (the pinned ensemble of {target} v{version}) is not in {repo}: "
                               f"export the version with `exporter export` first")
        return [(name, 1)]
    if version not in repository.versions(repo / target):
        raise ServingError(f"v{version} is not a version of '{target}' in {repo}")
    return [(target, version)]


def _request(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 10.0) -> tuple[int, str]:
    key = os.environ.get("TRITONGUARD_ADMIN_KEY", "")
    try:
        status, raw = triton_http.request(url, method, body, headers={ADMIN_HEADER: key} if key else None,
                                          timeout=timeout)
    except triton_http.Unreachable as exc:
        raise ServingError(f"server {url.split('/v2')[0]} unreachable: {exc.reason}") from None
    return status, raw.decode("utf-8", "replace")


def server_url(server: str) -> str:
    """``server`` as a URL: ``host:port`` gets ``http://``."""
    return server if server.startswith(("http://", "https://")) else f"http://{server}"


def ready(server: str, name: str, version: int) -> bool:
    code, _ = _request(f"{server_url(server)}/v2/models/{name}/versions/{version}/ready")
    return code == 200


def ensure_loaded(servers: Sequence[str], repo: Path, model: str, version: int, *, timeout_s: float = 120.0) -> list[str]:
    """Make ``version`` routable by ``model``'s guard on every server; returns what was loaded."""
    loaded: list[str] = []
    for name, v in models_to_load(repo, model, version):
        for server in servers:
            if ready(server, name, v):
                continue
            code, body = _request(f"{server_url(server)}/v2/repository/models/{name}/load", "POST", b"{}",
                                  timeout=timeout_s)
            if code != 200:
                try:
                    detail = json.loads(body).get("error", body)
                except ValueError:
                    detail = body
                hint = ""
                if "explicit" in detail or "polling" in detail or code in (400, 403):
                    hint = (" (start tritonserver with --model-control-mode=explicit --load-model='*' so new "
                            "versions can be loaded, or restart it; with TRITONGUARD_ADMIN_KEY set, this "
                            "process needs the same key)")
                raise ServingError(f"{server}: loading '{name}' failed: HTTP {code}: {detail.strip()}{hint}")
            deadline = time.monotonic() + timeout_s
            while not ready(server, name, v):
                if time.monotonic() > deadline:
                    raise ServingError(f"{server}: '{name}' v{v} not ready after {timeout_s:.0f} s")
                time.sleep(0.5)
            loaded.append(f"{server}:{name}/{v}")
            log.info("loaded %s v%d on %s", name, v, server)
    return loaded


def metrics_urls(servers: Sequence[str], explicit: Sequence[str]) -> list[str]:
    """``--metrics-url`` as given, else each ``--server``'s host with HTTP port + 2 (Triton's
    8000/8002 convention)."""
    if explicit:
        return list(explicit)
    out = []
    for server in servers:
        base = server_url(server)
        scheme, _, rest = base.partition("://")
        host, _, port = rest.rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ServingError(f"cannot derive a metrics URL from --server {server}: pass --metrics-url")
        out.append(f"{scheme}://{host}:{int(port) + 2}/metrics")
    return out


def purge_cache(repo: Path, model: str, *, by: str = "cli") -> dict[str, int | str]:
    """Bump ``cache_epoch`` (every instance drops its L1) and delete the model's L2/L3 rows."""

    repo = Path(repo)
    cfg = _guard_config(repo, model)
    params = layered_parameters(_params(cfg), repo)
    groups = split_parameters(params, GuardConfig.SECTIONS, model=model)
    cache = from_params(CacheConfig, groups["cache"], section="cache", model=model)
    done: dict[str, int | str] = {}

    def bump(s):
        s.cache_epoch += 1
        return s

    state = open_store(model, repo).update(bump, by=by)
    done["epoch"] = state.cache_epoch
    if cache.enabled and cache.mode is PrivacyMode.PERSISTED_ENCRYPTED:
        if cache.l2_path and Path(cache.l2_path).exists():
            db = _Sqlite(cache.l2_path, cache.l2_max_rows)
            try:
                done["l2"] = db.purge(model)
            finally:
                db.close()
        if cache.l3_url:
            r = _Redis(cache.l3_url, cache.l3_ttl_s, cache.l3_key_prefix(), max(cache.l3_timeout_ms / 1000, 2.0))
            try:
                done["l3"] = r.purge(model)
            except r.errors as exc:
                done["l3"] = f"failed: {type(exc).__name__}"  # entries expire by TTL; keys changed anyway
                log.warning("purging L3 of %s failed: %s", model, exc)
            finally:
                r.close()
    return done
