"""Where the rollout state lives, one interface, two stores:

- :class:`FileStateStore`: ``<repo>/<guard>/rollout_state.json``; writes are atomic replaces
  under an ``flock`` on a sidecar lock file, so writers in separate processes never lose an update;
  ``poll`` costs one ``stat`` while nothing changed.
- :class:`RedisStateStore`: one key per model; writes are WATCH/MULTI/EXEC compare-and-set.

Reads never raise into serving: a corrupt or missing document, or a Redis outage, leaves the
last good state in place (logged once, counted in ``errors``). Writes raise
:class:`~tritonguard.rollout.state.StateError` (:class:`~tritonguard.rollout.state.StateConflict`
when ``expected_revision`` no longer holds), for the caller to handle.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from tritonguard.core.files import atomic_write
from tritonguard.core.outage import Backoff
from tritonguard.core.store import (
    ENV_URL,
    file_lock,
    redacted,
    redis_client,
    redis_prefix,
    store_error,
)
from tritonguard.rollout.state import (
    STATE_FILE,
    RolloutState,
    StateConflict,
    StateError,
    StateUnavailable,
    log,
)

Updater = Callable[[RolloutState], "RolloutState | None"]
BreakerUpdater = Callable[["dict[str, Any] | None"], "dict[str, Any] | None"]


def _apply(fn: Updater, current: RolloutState, expected: int | None, by: str, now: float) -> RolloutState:
    if expected is not None and current.revision != expected:
        raise StateConflict(f"state of '{current.model}' is at revision {current.revision}, expected {expected}")
    work = RolloutState.from_dict(current.to_dict())  # fn may mutate its argument freely
    new = fn(work)
    new = work if new is None else new
    new.revision = current.revision + 1
    new.updated_at = now
    new.updated_by = by or new.updated_by
    # round trip: a buggy updater fails here instead of writing a document no reader accepts
    return RolloutState.from_dict(json.loads(json.dumps(new.to_dict())))


def _breaker_fn(version: int | str, fn: BreakerUpdater) -> Updater:
    key = str(version)

    def update(state: RolloutState) -> RolloutState:
        new = fn(copy.deepcopy(state.breakers.get(key)))
        if new is None:
            state.breakers.pop(key, None)
        else:
            state.breakers[key] = new
        return state

    return update


class FileStateStore:
    """The state document as a file; see the module docstring."""

    def __init__(self, path: str | os.PathLike, *, model: str = "", clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.model = model or self.path.parent.name
        self.clock = clock
        self.errors = 0
        self._last: RolloutState | None = None
        self._sig: tuple[int, int, int] | None = None
        self._failing = False

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        # the inode changes on every atomic replace, so equal signatures mean an unchanged file
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> RolloutState:
        with open(self.path, "rb") as f:
            return RolloutState.from_json(f.read())

    def _refresh(self, sig: tuple[int, int, int] | None) -> None:
        try:
            if sig is None:
                raise FileNotFoundError(f"{self.path} does not exist")
            state = self._read()
        except (OSError, StateError) as exc:
            self._sig = sig
            if self._last is None and isinstance(exc, FileNotFoundError):
                return  # never written yet: not an error
            self.errors += 1
            if not self._failing:
                log.error("rollout state %s unreadable, keeping revision %s: %s", self.path,
                          None if self._last is None else self._last.revision, exc)
            self._failing = True
            return
        if self._failing:
            log.info("rollout state %s readable again at revision %d", self.path, state.revision)
        self._failing = False
        self._last, self._sig = state, sig

    def load(self) -> RolloutState | None:
        """The current state, or the last good one; None before any state was written."""
        self._refresh(self._stat())
        return self._last

    def poll(self, last_revision: int | None = None) -> RolloutState | None:
        """The state if its revision differs from ``last_revision``, else None; one stat when unchanged."""
        sig = self._stat()
        if sig != self._sig:
            self._refresh(sig)
        if self._last is None or self._last.revision == last_revision:
            return None
        return self._last

    def _locked(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return file_lock(self.lock_path)

    def _write(self, state: RolloutState) -> None:
        # the rename itself must survive a crash too: the folder's entry is synced as well
        atomic_write(self.path, state.to_json(), sync_dir=True)

    def update(self, fn: Updater, expected_revision: int | None = None, *, by: str = "") -> RolloutState:
        """Read-modify-write under the lock; ``fn`` gets a private copy (a fresh state if none)."""
        with self._locked():
            try:
                current = self._read()
            except FileNotFoundError:
                current = RolloutState(model=self.model)
            except OSError as exc:
                raise StateError(f"cannot read {self.path}: {exc}") from None
            new = _apply(fn, current, expected_revision, by, self.clock())
            try:
                self._write(new)
            except OSError as exc:
                raise StateError(f"cannot write {self.path}: {exc}") from None
        self._last, self._sig, self._failing = new, self._stat(), False
        return new

    def update_breaker(self, version: int | str, fn: BreakerUpdater, *, by: str = "") -> RolloutState:
        """CAS on one version's breaker document only; routing fields are re-read, never clobbered."""
        return self.update(_breaker_fn(version, fn), by=by)


class RedisStateStore:
    """The state document in a Redis hash (``doc``, ``revision``) under
    ``redis_prefix("state")`` (``tritonguard:{<namespace>}:state:<model>``); see the module
    docstring. Messages name the store by :func:`~tritonguard.core.store.redacted` URL only."""

    BACKOFF_START_S = 5.0
    BACKOFF_MAX_S = 60.0
    MAX_CAS_ATTEMPTS = 200

    def __init__(self, url: str, model: str, *, key_prefix: str | None = None,
                 socket_timeout: float = 0.1, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, client: Any = None):
        import redis

        self._redis = redis
        self.url, self.model = url, model
        self.where = redacted(url)
        self.key = f"{redis_prefix('state') if key_prefix is None else key_prefix}{model}"
        self.clock, self.monotonic = clock, monotonic
        # no client-side retries: a retry loop would hold the serving thread during an outage
        self.client = client or redis_client(url, timeout=socket_timeout)
        self.errors = 0
        self._last: RolloutState | None = None
        self._health = Backoff(monotonic, self.BACKOFF_START_S, self.BACKOFF_MAX_S)

    # -- outage handling ------------------------------------------------------------------
    def _available(self) -> bool:
        return self._health.available()

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        log.error("rollout state store %s unreachable (%s); retrying in %.0f s", self.where,
                  store_error(exc, self.url), self._health.fail())

    def _ok(self) -> None:
        if self._health.recover():
            log.info("rollout state store %s reachable again", self.where)

    # -- reads ----------------------------------------------------------------------------
    def _parse(self, raw: bytes | None) -> RolloutState | None:
        if raw is None:
            return None
        try:
            return RolloutState.from_json(raw)
        except StateError as exc:
            self.errors += 1
            log.error("rollout state %s invalid, keeping the last good one: %s", self.key, exc)
            return None

    def load(self) -> RolloutState | None:
        if not self._available():
            return self._last
        try:
            raw = self.client.hget(self.key, "doc")
        except self._redis.RedisError as exc:
            self._failed(exc)
            return self._last
        self._ok()
        state = self._parse(raw)
        if state is not None:
            self._last = state
        return self._last

    def poll(self, last_revision: int | None = None) -> RolloutState | None:
        """Like :meth:`FileStateStore.poll`; one small HGET while the revision is unchanged."""
        if self._available():
            try:
                rev = self.client.hget(self.key, "revision")
                self._ok()
                if rev is not None and (self._last is None or int(rev) != self._last.revision):
                    self.load()
            except self._redis.RedisError as exc:
                self._failed(exc)
            except ValueError as exc:
                self.errors += 1
                log.error("rollout state %s: bad revision field: %s", self.key, exc)
        if self._last is None or self._last.revision == last_revision:
            return None
        return self._last

    # -- writes ---------------------------------------------------------------------------
    def update(self, fn: Updater, expected_revision: int | None = None, *, by: str = "") -> RolloutState:
        if not self._available():
            raise StateUnavailable(f"state store {self.where} is backing off after an error")
        redis = self._redis
        try:
            with self.client.pipeline() as pipe:
                for _ in range(self.MAX_CAS_ATTEMPTS):
                    try:
                        pipe.watch(self.key)
                        raw = pipe.hget(self.key, "doc")
                        current = (RolloutState.from_json(raw) if raw is not None
                                   else RolloutState(model=self.model))
                        new = _apply(fn, current, expected_revision, by, self.clock())
                        pipe.multi()
                        pipe.hset(self.key, mapping={"doc": new.to_json(), "revision": new.revision})
                        pipe.execute()
                    except redis.WatchError:
                        # another writer won the race: re-read and re-apply, after a short jitter
                        time.sleep(random.uniform(0, 0.002))
                        continue
                    self._ok()
                    self._last = new
                    return new
        except redis.RedisError as exc:
            self._failed(exc)
            raise StateUnavailable(f"state store {self.where}: {store_error(exc, self.url)}") from None
        raise StateConflict(f"state of '{self.model}': gave up after {self.MAX_CAS_ATTEMPTS} contended attempts")

    def update_breaker(self, version: int | str, fn: BreakerUpdater, *, by: str = "") -> RolloutState:
        return self.update(_breaker_fn(version, fn), by=by)


StateStore = FileStateStore | RedisStateStore


def open_store(model: str, repo_dir: str | os.PathLike, url: str | None = None, **kwargs: Any) -> StateStore:
    """Redis when ``url`` (default ``$TRITONGUARD_STATE_URL``) is set, else the file beside the guard."""
    if url is None:
        url = os.environ.get(ENV_URL, "")
    if url:
        return RedisStateStore(url, model, **kwargs)
    return FileStateStore(Path(repo_dir) / model / STATE_FILE, model=model, **kwargs)
