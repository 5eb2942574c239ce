"""Model registry on MLflow: versions, stages, approvals and a tamper-evident record of who was live.

Every exported version is an MLflow model version (its ``source`` is the version folder in the
model repository, so MLflow copies no artifact and nothing lands in ``./mlruns``) tagged with
the artifact's SHA-256, the golden verdict and figures, and its lineage. MLflow deprecated its own
stages; its convention is registered-model aliases and tags, so the version PRODUCTION serves has
the alias ``champion`` and the version under test (STAGING) ``challenger``, and each version's tag
``tritonguard.role`` says ``draft``, ``challenger``, ``champion`` or ``archived``. During a
deprecation period the old vocabulary is written too, so existing queries keep working: the tag
``tritonguard.stage`` (DRAFT -> STAGING -> PRODUCTION -> ARCHIVED) and the aliases ``production``
and ``staging`` beside ``champion`` and ``challenger``; a registry written before ``champion``
existed is read through its ``production`` alias. Users may add aliases of their own
(:meth:`Registry.set_aliases`, ``promote --alias``).

MLflow has no compare-and-set, so :meth:`Registry.transition` adds one:

- embedded sqlite store (the default, :func:`default_uri`): an exclusive ``flock`` on
  ``<db>.lock`` around "re-read the stage, compare, write, append history". Two processes
  promoting at once are serialised; the second finds the stage moved and gets StageConflict.
- any other tracking URI (a team server) with a Redis to share (``lock_url``, default
  ``$TRITONGUARD_STATE_URL``, the store the guards already follow): the same section under a
  Redis lease ``tritonguard:registry:<model>:lock`` (token, renewed while held, lapsing 15 s
  after a holder dies; :mod:`exporter.records.progress`). Every client using that Redis is serialised.
- a team server without Redis: no lock can span clients, so a transition writes a unique token
  into the registered model's tag ``tritonguard.txn``, waits ``settle_s``, and proceeds only if
  its token is still there. This narrows the race window but is NOT linearisable (two clients
  whose write-then-read sequences do not overlap can both pass); set ``TRITONGUARD_STATE_URL``
  or run promotions from one place (a CI job).

Exactly one PRODUCTION per model: promoting archives the previous one in the same locked
section. The alias is authoritative: if a crash left a stale PRODUCTION tag, the next promotion
archives it. Every registration and transition is appended to a hash-chained JSON Lines file
(records carry ``seq``/``prev``/``hash`` as in :mod:`tritonguard.privacy.audit`, whose ``verify`` checks
it); it is only ever appended to (:mod:`exporter.records.history`). For an object-store
repository the history is kept in the store (:class:`exporter.records.history.StoreHistory`):
the sqlite registry then sits in this machine's working folder and is only this machine's
view, the history is the fleet's.
"""

from __future__ import annotations

import contextlib
import getpass
import importlib
import json
import logging
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from exporter.errors import ExporterError
from exporter.records.history import (
    HISTORY_FILE,
    FileHistory,
    HistoryError,
    StoreHistory,
    rollback_target,
)
from exporter.records.progress import ControllerError, ProgressUnavailable, RedisProgress
from exporter.records.remote import origin_of
from tritonguard.core.store import file_lock, redis_prefix
from tritonguard.privacy.audit.verify import VerifyResult

log = logging.getLogger(__name__)

STAGES = ("DRAFT", "STAGING", "PRODUCTION", "ARCHIVED")
CHAMPION, CHALLENGER = "champion", "challenger"
# the aliases a stage puts on its version: MLflow's convention first, then the deprecated
# stage-named alias, still written so that `models:/name@production` keeps working
ALIASES = {"PRODUCTION": (CHAMPION, "production"), "STAGING": (CHALLENGER, "staging")}
MANAGED_ALIASES = frozenset(a for names in ALIASES.values() for a in names)
# the tag ``tritonguard.role`` per stage (``tritonguard.stage`` keeps the stage itself)
ROLES = {"DRAFT": "draft", "STAGING": CHALLENGER, "PRODUCTION": CHAMPION, "ARCHIVED": "archived"}
# words accepted wherever a stage is named: the stage (old vocabulary) or its role
STAGE_WORDS = {**{s.lower(): s for s in STAGES}, **{r: s for s, r in ROLES.items()}}
T = "tritonguard."  # tag prefix
STAGE_TAG, ROLE_TAG = "tritonguard.stage", "tritonguard.role"  # deprecated vocabulary, current one
Approver = str | Callable[[dict[str, Any]], Any]
_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class RegistryError(ExporterError):
    """The registry refused an operation, or could not be read or written."""


class StageConflict(RegistryError):
    """The version is not in the stage the caller expected (someone else moved it)."""


class ApprovalRefused(RegistryError):
    """An approval callback or command refused the transition."""


class HistoryCorrupt(RegistryError):
    """The stage history's hash chain is broken: it was edited, truncated or reordered."""


@dataclass(kw_only=True)
class ModelVersionInfo:
    name: str
    version: int  # the model repository's version
    mlflow_version: str
    sha256: str
    stage: str
    tags: dict[str, str]


def default_uri(repository: str | os.PathLike) -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else a sqlite file beside the repository
    (``<parent>/<repository name>.registry/mlflow.db``: Triton treats every folder *inside* the
    repository as a model, so the registry must live outside it)."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    if env:
        return env
    repo = Path(repository).resolve()
    return f"sqlite:///{repo.parent / (repo.name + '.registry') / 'mlflow.db'}"


def open_registry(repository: str | os.PathLike, **kwargs: Any) -> Registry:
    """The registry the CLI uses for ``repository``: :func:`default_uri`; for a remote tracking
    server the history file is kept beside the repository (``<repository>.registry/``), the place
    the embedded store would use, since MLflow itself has no append-only record. For the working
    copy of an object-store repository, the history is the store's (:func:`open_history`)."""
    uri = default_uri(repository)
    if "history_path" not in kwargs and "history" not in kwargs:
        kwargs["history"] = open_history(repository, uri)
    return Registry(uri, **kwargs)


def open_history(repository: str | os.PathLike, uri: str | None = None) -> FileHistory | StoreHistory:
    """The stage history of ``repository`` (creates nothing): the file beside a folder
    repository's sqlite registry (``<repository>.registry/registry_history.jsonl`` by default,
    beside the repository for a tracking server); for the working copy of an
    object-store repository (:func:`exporter.records.remote.origin_of`) the records in the store,
    with that file as this machine's mirror of them. A repository at a bucket's root is refused
    (RegistryError): its history would have to sit inside the repository."""
    repo = Path(repository).resolve()
    path = repo.parent / (repo.name + ".registry") / HISTORY_FILE
    origin = origin_of(repo)
    if origin is None:
        db = sqlite_path(uri or default_uri(repo))
        return FileHistory(db.parent / HISTORY_FILE if db is not None else path)
    try:
        return StoreHistory(origin, path)
    except HistoryError as exc:
        raise RegistryError(str(exc)) from None


RECONCILE_TIMEOUT_S = 20.0


def registry_exists(repository: str | os.PathLike) -> bool:
    """Whether there is a registry to read for ``repository``: ``$MLFLOW_TRACKING_URI`` is set,
    or the embedded sqlite store beside the repository exists (reads never create one)."""
    uri = default_uri(repository)
    db = sqlite_path(uri)
    return db is None or db.exists()


def code_hash(cwd: str | os.PathLike | None = None) -> str | None:
    """``git rev-parse HEAD`` (suffixed ``-dirty`` with uncommitted changes), None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite URI as SQLAlchemy reads it: ``sqlite:///rel.db`` is
    relative, ``sqlite:////abs.db`` absolute; None for other URIs and in-memory databases."""
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///"):].split("?", 1)[0])
    return Path(path) if path and path != ":memory:" else None


def _who(approver: str | None) -> str:
    with contextlib.suppress(OSError, KeyError):
        return f"{approver or getpass.getuser()}@{socket.gethostname()}"
    return approver or "unknown"


class Registry:
    """See the module docstring. ``approvers`` maps a target stage to callbacks that must all
    approve a move into it: a callable, ``"pkg.mod:fn"`` (called with the request dict; falsy or
    raising refuses) or a shell command (environment ``TRITONGUARD_*``; exit 0 approves)."""

    def __init__(self, tracking_uri: str, *, history_path: str | os.PathLike | None = None,
                 history: FileHistory | StoreHistory | None = None, lock_path: str | os.PathLike | None = None,
                 approvers: Mapping[str, Sequence[Approver]] | None = None,
                 settle_s: float = 0.2, clock: Callable[[], float] = time.time,
                 lock_url: str | None = None):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.uri = tracking_uri
        db = sqlite_path(tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        if history_path is None and history is None and db is None:
            raise RegistryError(f"registry {tracking_uri}: pass history_path (a file this host "
                                "keeps) for a registry that is not a local sqlite file")
        if history is None:
            history = FileHistory(Path(history_path) if history_path else db.parent / HISTORY_FILE)
        self.history_store = history
        self.history_path = history.path  # the file: the history itself, or this machine's mirror of it
        self.lock_path = Path(lock_path) if lock_path else (db.with_name(db.name + ".lock") if db else None)
        # a remote registry: a Redis lease when there is a Redis, else the optimistic tag token
        self.lock_url = (lock_url if lock_url is not None else os.environ.get("TRITONGUARD_STATE_URL", "")) or None
        self.approvers = {stage_of(k): list(v) for k, v in (approvers or {}).items()}
        self.settle_s, self.clock = settle_s, clock
        self.lock_wait_s = 30.0
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient  # noqa: PLC0415 - seconds to import: only when used

            self._client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        return self._client

    # -- reads ------------------------------------------------------------------------------
    def _find(self, name: str, version: int) -> Any | None:
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - defers a heavy import

        try:
            found = self.client.search_model_versions(
                f"name = '{_quote(name)}' and tags.`{T}version` = '{int(version)}'")
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")):
                return None
            raise RegistryError(f"registry {self.uri}: {exc}") from None
        return max(found, key=lambda mv: int(mv.version)) if found else None

    def _info(self, name: str, mv: Any) -> ModelVersionInfo:
        tags = dict(mv.tags)
        return ModelVersionInfo(name=name, version=int(tags[f"{T}version"]), mlflow_version=str(mv.version),
                                sha256=tags.get(f"{T}sha256", ""), stage=tags.get(STAGE_TAG, "DRAFT"),
                                tags=tags)

    def get(self, name: str, version: int) -> ModelVersionInfo:
        mv = self._find(name, version)
        if mv is None:
            raise RegistryError(f"'{name}' v{version} is not registered")
        return self._info(name, mv)

    def stage(self, name: str, version: int) -> str:
        return self.get(name, version).stage

    def versions(self, name: str) -> list[ModelVersionInfo]:
        mvs = self.client.search_model_versions(f"name = '{_quote(name)}'")
        return sorted((self._info(name, mv) for mv in mvs if f"{T}version" in mv.tags),
                      key=lambda i: i.version)

    def production(self, name: str) -> int | None:
        """The version behind the ``champion`` alias (in a registry written before it existed,
        the ``production`` alias), None if there is none."""
        for alias in ALIASES["PRODUCTION"]:
            found = self._alias(name, alias)
            if found is not None:
                return found
        return None

    def aliases(self, name: str) -> dict[str, int]:
        """Every alias of ``name`` and the repository version behind it (managed and the user's)."""
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - defers a heavy import

        try:
            held = {k: str(v) for k, v in self.client.get_registered_model(name).aliases.items()}
        except MlflowException:
            return {}
        by_mlflow = {i.mlflow_version: i.version for i in self.versions(name)}
        return {alias: by_mlflow[mlv] for alias, mlv in sorted(held.items()) if mlv in by_mlflow}

    def _alias(self, name: str, alias: str) -> int | None:
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - defers a heavy import

        try:
            mv = self.client.get_model_version_by_alias(name, alias)
        except MlflowException:
            return None
        return int(mv.tags[f"{T}version"]) if f"{T}version" in mv.tags else None

    # -- writes -----------------------------------------------------------------------------
    def register(self, name: str, version: int, manifest: Mapping[str, Any],
                 lineage: Mapping[str, Any] | None = None, *, source: str = "") -> ModelVersionInfo:
        """Register repository version ``version`` as DRAFT; a no-op for an already registered
        (name, version) with the same SHA-256, a RegistryError with another."""
        sha = manifest.get("sha256")
        if not isinstance(sha, str) or not sha:
            raise RegistryError(f"manifest of '{name}' v{version} has no sha256")
        with self._locked(name):
            existing = self._find(name, version)
            if existing is not None:
                info = self._info(name, existing)
                if info.sha256 != sha:
                    raise RegistryError(f"'{name}' v{version} is registered with sha256 {info.sha256[:12]}, "
                                        f"this artifact is {sha[:12]}: export a new version instead")
                return info
            self._ensure_model(name)
            lineage = dict(lineage or {})
            lineage.setdefault("code_hash", code_hash())
            lineage.setdefault("parent_version", self.production(name))
            golden = manifest.get("golden") or {}
            tags = {f"{T}version": str(int(version)), f"{T}sha256": sha, STAGE_TAG: "DRAFT",
                    ROLE_TAG: ROLES["DRAFT"],
                    f"{T}golden.verdict": str(golden.get("verdict", "")),
                    f"{T}golden.figures": json.dumps(golden.get("metrics", {}), sort_keys=True),
                    f"{T}golden.n": str(golden.get("n", "")),
                    f"{T}task": str(manifest.get("task", "")), f"{T}created": str(manifest.get("created", ""))}
            for key in ("data_version", "code_hash", "parent_version"):
                tags[f"lineage.{key}"] = "" if lineage.get(key) is None else str(lineage[key])
            for key in ("hyperparameters", "metrics"):
                tags[f"lineage.{key}"] = json.dumps(lineage.get(key) or {}, sort_keys=True, default=str)
            mv = self.client.create_model_version(name, source=self._source(source, name, version), tags=tags)
            self._append({"type": "register", "model": name, "version": int(version),
                          "mlflow_version": str(mv.version), "sha256": sha, "by": _who(None)})
        log.info("registered '%s' v%d as MLflow version %s (DRAFT)", name, version, mv.version)
        return self._info(name, mv)

    def _source(self, source: str, name: str, version: int) -> str:
        """Where the version's files are. A tracking server refuses local paths (they would name
        files on the server), so for a remote registry a local folder becomes
        ``tritonguard://<this host>/<absolute path>``: what it is, and where to find it."""
        source = source or f"{name}/{int(version)}"
        if sqlite_path(self.uri) is not None or "://" in source:
            return source
        return f"tritonguard://{socket.gethostname()}{Path(source).resolve().as_posix()}"

    def _ensure_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - defers a heavy import

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            self.client.create_registered_model(name, tags={f"{T}managed": "true"})

    def transition(self, name: str, version: int, to: str, expected_current: str,
                   approver: str | None = None, *, reason: str = "",
                   rollback: bool = False) -> ModelVersionInfo:
        """Move ``version`` to ``to`` if it is still in ``expected_current`` (else StageConflict).
        Stages may be named in either vocabulary (``PRODUCTION`` or ``champion``, :func:`stage_of`)."""
        to, expected_current = stage_of(to), stage_of(expected_current)
        if to == expected_current:
            raise StageConflict(f"'{name}' v{version}: already {to}")
        info = self.get(name, version)
        if info.stage != expected_current:  # cheap early answer; re-checked under the lock
            raise StageConflict(f"'{name}' v{version} is {info.stage}, not {expected_current}")
        if to in ("STAGING", "PRODUCTION") and info.tags.get(f"{T}golden.verdict") == "FAIL":
            raise RegistryError(f"'{name}' v{version} failed its golden check; it cannot become {to}")
        # approvals run outside the lock: a human-in-the-loop command must not block other models
        self._approve({"model": name, "version": int(version), "from": expected_current, "to": to,
                       "sha256": info.sha256, "approver": approver or "", "reason": reason})
        with self._locked(name):
            mv = self._find(name, version)
            current = self._info(name, mv).stage
            if current != expected_current:
                raise StageConflict(f"'{name}' v{version} is {current}, not {expected_current}")
            archived, live = self._apply(name, mv, to, current, rollback)
            self._append({"type": "transition", "model": name, "version": int(version),
                          "mlflow_version": str(mv.version), "sha256": info.sha256, "from": current,
                          "to": to, "archived": archived, "live": live,
                          "approver": approver or "", "by": _who(approver), "reason": reason,
                          "rollback": rollback})
        log.info("'%s' v%d: %s -> %s%s", name, version, current, to,
                 f" (archived {archived})" if archived else "")
        info.stage, info.tags[STAGE_TAG], info.tags[ROLE_TAG] = to, to, ROLES[to]
        return info

    def _apply(self, name: str, mv: Any, to: str, current: str, rollback: bool) -> tuple[list[int], int | None]:
        """Write the move; returns (versions archived, version live afterwards)."""
        c, mlv, archived = self.client, str(mv.version), []
        version = int(mv.tags[f"{T}version"])
        aliases = {k: str(v) for k, v in c.get_registered_model(name).aliases.items()}
        if to == "PRODUCTION":
            # the new version first, then the aliases, then the old ones: a crash in between leaves
            # the aliases on the new version and a stale tag that the next promotion archives
            # (an alias names one version: setting it takes it from the old champion)
            self._tag_stage(name, mlv, "PRODUCTION")
            for alias in ALIASES["PRODUCTION"]:
                c.set_registered_model_alias(name, alias, mlv)
            for alias in _split(mv.tags.get(f"{T}pending_aliases", "")):
                c.set_registered_model_alias(name, alias, mlv)
            if f"{T}pending_aliases" in mv.tags:
                c.delete_model_version_tag(name, mlv, f"{T}pending_aliases")
            for other in self.versions(name):
                if other.mlflow_version != mlv and other.stage == "PRODUCTION":
                    self._tag_stage(name, other.mlflow_version, "ARCHIVED")
                    if rollback:
                        c.set_model_version_tag(name, other.mlflow_version, f"{T}rolled_back", "true")
                    archived.append(other.version)
        else:
            self._tag_stage(name, mlv, to)
            if to == "STAGING":
                for alias in ALIASES["STAGING"]:
                    c.set_registered_model_alias(name, alias, mlv)
        for stage, names in ALIASES.items():
            for alias in names:
                if stage != to and aliases.get(alias) == mlv:
                    c.delete_registered_model_alias(name, alias)
        if to == "PRODUCTION":
            return archived, version
        return archived, None if current == "PRODUCTION" else self.production(name)

    def ensure_production(self, name: str, version: int, *, manifest: Mapping[str, Any] | None = None,
                          source: str = "", reason: str = "") -> tuple[ModelVersionInfo, bool]:
        """Make the registry say ``version`` is PRODUCTION because it *is* live (the routing's
        primary): registers it first if needed (from ``manifest``), moves it to PRODUCTION with
        the alias, archives every other PRODUCTION, and appends the move to the history
        (``"reconcile": true``). Idempotent: (info, False) when the registry already agrees,
        stale PRODUCTION tags and a misplaced alias included. Runs no approvers: it records
        where traffic already went; approval belongs to the command that moved it (promote)."""
        if self._find(name, version) is None:
            if manifest is None:
                raise RegistryError(f"'{name}' v{version} is not registered and has no manifest to register")
            self.register(name, version, manifest, {}, source=source)
        with self._locked(name):
            mv = self._find(name, version)
            info = self._info(name, mv)
            others = [o.version for o in self.versions(name)
                      if o.stage == "PRODUCTION" and o.mlflow_version != str(mv.version)]
            if info.stage == "PRODUCTION" and self.production(name) == version and not others:
                if info.tags.get(ROLE_TAG) != CHAMPION or \
                        any(self._alias(name, alias) != version for alias in ALIASES["PRODUCTION"]):
                    # written before the champion alias and the role tag: add them; nothing moved
                    self._apply(name, mv, "PRODUCTION", "PRODUCTION", False)
                return info, False
            if info.tags.get(f"{T}golden.verdict") == "FAIL":
                raise RegistryError(f"'{name}' v{version} failed its golden check; it cannot become PRODUCTION")
            archived, live = self._apply(name, mv, "PRODUCTION", info.stage, False)
            self._append({"type": "transition", "model": name, "version": int(version),
                          "mlflow_version": str(mv.version), "sha256": info.sha256, "from": info.stage,
                          "to": "PRODUCTION", "archived": archived, "live": live, "approver": "",
                          "by": _who(None), "reason": reason or "reconcile: the routing's primary",
                          "rollback": False, "reconcile": True})
        log.info("'%s' v%d: %s -> PRODUCTION (reconciled with the routing)%s", name, version, info.stage,
                 f" (archived {archived})" if archived else "")
        info.stage, info.tags[STAGE_TAG], info.tags[ROLE_TAG] = "PRODUCTION", "PRODUCTION", CHAMPION
        return info, True

    def _tag_stage(self, name: str, mlv: str, stage: str) -> None:
        """The stage in both vocabularies: ``tritonguard.role`` and the deprecated ``tritonguard.stage``."""
        self.client.set_model_version_tag(name, mlv, ROLE_TAG, ROLES[stage])
        self.client.set_model_version_tag(name, mlv, STAGE_TAG, stage)

    def set_aliases(self, name: str, version: int, aliases: Sequence[str], *, on_production: bool = False) -> None:
        """Point the user's ``aliases`` at ``version`` now, or with ``on_production`` when it
        becomes PRODUCTION (kept in its tag ``tritonguard.pending_aliases`` until then, so that
        the process that finishes the rollout, a ``rollout resume`` elsewhere, sets them).
        The managed aliases (champion, challenger and their deprecated synonyms) are refused."""
        names = [check_alias(a) for a in aliases]
        if not names:
            return
        with self._locked(name):
            mv = self._find(name, version)
            if mv is None:
                raise RegistryError(f"'{name}' v{version} is not registered")
            if on_production and self._info(name, mv).stage != "PRODUCTION":
                pending = [*_split(mv.tags.get(f"{T}pending_aliases", "")), *names]
                self.client.set_model_version_tag(name, str(mv.version), f"{T}pending_aliases",
                                                  ",".join(dict.fromkeys(pending)))
                return
            for alias in names:
                self.client.set_registered_model_alias(name, alias, str(mv.version))
        log.info("'%s' v%d: alias %s", name, version, ", ".join(names))

    def rollback(self, name: str, *, approver: str | None = None, reason: str = "") -> ModelVersionInfo:
        """Make :meth:`previous_production` PRODUCTION again; the current one is ARCHIVED."""
        target = self.previous_production(name)
        if target is None:
            raise RegistryError(f"'{name}' has no previous production version to roll back to")
        info = self.get(name, target)
        return self.transition(name, target, "PRODUCTION", info.stage, approver=approver,
                               reason=reason or "rollback", rollback=True)

    # -- approvals ---------------------------------------------------------------------------
    def _approve(self, request: dict[str, Any]) -> None:
        for spec in self.approvers.get(request["to"], []):
            label = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
            try:
                ok = _run_approver(spec, request)
            except Exception as exc:  # noqa: BLE001 - a failing approver is a refusal, named
                raise ApprovalRefused(f"approval '{label}' failed: {type(exc).__name__}: {exc}") from None
            if not ok:
                raise ApprovalRefused(f"approval '{label}' refused '{request['model']}' "
                                      f"v{request['version']} -> {request['to']}")

    # -- locking -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, name: str):
        if self.lock_path is not None:
            self.lock_path.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(self.lock_path):
                yield
            return
        if self.lock_url:

            locks = RedisProgress(self.lock_url, name, key=f"{redis_prefix('registry')}{name}",
                                  lock_wait_s=self.lock_wait_s)
            try:
                with locks.lock():
                    yield
            except ProgressUnavailable as exc:
                raise RegistryError(f"'{name}': the registry lock's Redis is unreachable: {exc}") from None
            except ControllerError as exc:  # waited lock_wait_s
                raise StageConflict(f"'{name}': another transition holds the registry lock ({exc})") from None
            return
        token = f"{uuid.uuid4().hex}:{self.clock() + 60:.0f}"
        self._ensure_model(name)
        held = self.client.get_registered_model(name).tags.get(f"{T}txn", "")
        if held and float(held.rsplit(":", 1)[-1]) > self.clock():
            raise StageConflict(f"'{name}': another transition is in progress ({held.split(':')[0][:8]})")
        self.client.set_registered_model_tag(name, f"{T}txn", token)
        time.sleep(self.settle_s)
        if self.client.get_registered_model(name).tags.get(f"{T}txn") != token:
            raise StageConflict(f"'{name}': another transition took the registry first")
        try:
            yield
        finally:
            if self.client.get_registered_model(name).tags.get(f"{T}txn") == token:
                self.client.delete_registered_model_tag(name, f"{T}txn")

    # -- history -----------------------------------------------------------------------------
    def _append(self, fields: dict[str, Any]) -> None:
        """One hash-chained record in the history (:mod:`exporter.records.history`)."""
        try:
            self.history_store.append(fields, self.clock)
        except HistoryError as exc:
            what = f"'{fields.get('model')}' v{fields.get('version')} {fields.get('type')}"
            raise RegistryError(f"{what}: written to the registry {self.uri}, but not to its history: {exc}") from None

    def verify_history(self) -> VerifyResult:
        return self._load_history(None)[0]

    def _load_history(self, name: str | None) -> tuple[VerifyResult, list[dict[str, Any]]]:
        try:
            return self.history_store.load(name)
        except HistoryError as exc:
            raise RegistryError(str(exc)) from None

    def history(self, name: str | None = None) -> list[dict[str, Any]]:
        """Records of ``name`` (all models if None), oldest first; HistoryCorrupt if tampered."""
        result, records = self._load_history(name)
        if not result.ok:
            raise HistoryCorrupt(f"registry history {self.history_store.where}: {result.reason}")
        return records

    def previous_production(self, name: str) -> int | None:
        """The latest version that was PRODUCTION before the current one and did not leave
        production through a rollback (the version a rollback should restore)."""
        current = self.production(name)
        return rollback_target(self.history(name), current)


def _run_approver(spec: Approver, request: dict[str, Any]) -> bool:
    if callable(spec):
        return bool(spec(dict(request)))
    if _CALLABLE.match(spec):
        mod, _, fn = spec.partition(":")
        return bool(getattr(importlib.import_module(mod), fn)(dict(request)))
    env = {**os.environ, **{f"TRITONGUARD_{k.upper()}": str(v) for k, v in request.items()}}
    proc = subprocess.run(spec, shell=True, env=env, capture_output=True, text=True, timeout=600)  # noqa: S602
    if proc.returncode != 0:
        log.warning("approval command %r exited %d: %s", spec, proc.returncode, proc.stderr.strip()[-500:])
    return proc.returncode == 0


def stage_of(word: str) -> str:
    """The stage a word names: a stage in either case (``PRODUCTION``, ``staging``: the deprecated
    vocabulary, still accepted) or a role (``champion``, ``challenger``, ``draft``, ``archived``)."""
    stage = STAGE_WORDS.get(str(word).strip().lower())
    if stage is None:
        raise RegistryError(f"unknown stage {word!r}; stages are {', '.join(STAGES)} "
                            f"(or {', '.join(ROLES[s] for s in STAGES)})")
    return stage


def check_alias(alias: str) -> str:
    """``alias`` if MLflow accepts it as a user's alias (letters, digits, ``_`` and ``-``; not
    ``latest``, not ``v<N>``) and it is not one this registry manages; else RegistryError."""
    if not re.fullmatch(r"[\w-]{1,255}", alias or "") or alias.lower() == "latest" \
            or re.fullmatch(r"[vV]\d+", alias):
        raise RegistryError(f"alias {alias!r}: letters, digits, '_' and '-' only, not 'latest' or v<N>")
    if alias.lower() in MANAGED_ALIASES:
        raise RegistryError(f"alias {alias!r} is managed by the registry (champion: PRODUCTION, "
                            "challenger: STAGING, and their old names production, staging)")
    return alias


def _split(aliases: str) -> list[str]:
    return [a for a in aliases.split(",") if a]


def _quote(name: str) -> str:
    if "'" in name or "`" in name:
        raise RegistryError(f"model name {name!r} may not contain quotes")
    return name
