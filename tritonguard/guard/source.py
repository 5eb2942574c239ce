"""Where a guard finds the repository it routes in (its target's config, manifests, goldens).

- ``$TRITONGUARD_REPOSITORY=s3://…``: Triton hands every model a private temporary copy of its
  own folder (``/tmp/folderXXXXXX``), so the rest of the repository is not on disk. The guard
  mirrors the models it needs into a local cache (:class:`tritonguard.core.objectstore.
  RepositoryCache`: versions with a manifest only, artifacts checked against its sha256) and works
  on that. The rollout state must then be in Redis (``$TRITONGUARD_STATE_URL``).
- ``$TRITONGUARD_REPOSITORY=/path``: that folder.
- neither: the folder Triton loaded the model from, when it is a repository folder (named after
  the model). A temporary copy is refused: its parent is the shared ``/tmp``, where anyone could
  plant ``/tmp/<target>/<v>/model.onnx`` for an in-process guard to load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tritonguard.core import objectstore, repository
from tritonguard.core.errors import ConfigError, TargetError
from tritonguard.core.store import ENV_URL

log = logging.getLogger(__name__)

FETCH_RETRY_S = 2.0  # a named version still missing after a fetch: fetched again after this long
FETCH_RETRY_MAX_S = 60.0


class RepositorySource:
    """The repository a guard routes in. An object-store one is mirrored into a local cache:
    :meth:`fetch` brings a model in (``initialize()`` only: it waits for the store), and
    :meth:`fetch_later` asks this process's one fetcher thread to (the serving path: it never
    waits). :meth:`present` says whether a version is in the local view, checked: a version
    the rollout state names is routed to on this replica only once it is."""

    def __init__(self, root: Path, cache: objectstore.RepositoryCache | None = None):
        self.root, self.cache = Path(root), cache
        # model -> its complete local versions, as of the last fetch (read per batch: no I/O)
        self._local: dict[str, frozenset[int]] = {}
        self._fetcher: Fetcher | None = None

    @property
    def remote(self) -> bool:
        return self.cache is not None

    def fetch(self, model: str, keep: Iterable[int] = (),
              prepare: Callable[[list[int]], None] | None = None) -> None:
        """Bring ``model`` into the local view (a no-op for a local repository); a store that
        fails is logged, and what the cache holds stays in use. ``keep``: versions not dropped
        from the cache even if the store no longer has them (the ones routed to). ``prepare(new
        versions)``: called before :meth:`present` says yes to them (an in-process guard loads
        them there, so the first request routed to one does not wait for its load)."""
        if self.cache is None:
            return
        try:
            self.cache.sync(model, keep=keep)
        except objectstore.ObjectStoreError as exc:
            if not (self.root / model / repository.CONFIG).exists():
                raise
            log.warning("%s; serving from the cached copy", exc)
        finally:
            local = frozenset(repository.complete_versions(self.root / model))
            new = sorted(local - self._local.get(model, frozenset()))
            try:
                if prepare is not None and new:
                    prepare(new)
            finally:
                self._local[model] = local

    def present(self, model: str, version: int) -> bool:
        """Whether ``version`` of ``model`` is in the local view, whole and checked. Always for
        a local repository, and for a model the store does not hold (a target outside the
        repository: Triton serves it, there is nothing to fetch)."""
        if self.cache is None:
            return True
        local = self._local.get(model)
        if local is None:
            local = self._local[model] = frozenset(repository.complete_versions(self.root / model))
        return version in local or not (self.root / model / repository.CONFIG).exists()

    def fetch_later(self, model: str, keep: Callable[[], Iterable[int]] = tuple,
                    prepare: Callable[[list[int]], None] | None = None,
                    done: Callable[[str], None] | None = None) -> bool:
        """Ask the fetcher thread to :meth:`fetch` ``model`` (``keep()`` read when it runs;
        ``done(model)`` called on that thread afterwards, failed or not); returns False when a
        fetch of it is already waiting or running. A no-op for a local repository."""
        if self.cache is None:
            return False
        if self._fetcher is None:
            self._fetcher = Fetcher(self)
        return self._fetcher.request(model, lambda: self.fetch(model, keep(), prepare), done)

    def idle(self, timeout: float) -> bool:
        """Wait until the fetcher has nothing waiting or running; False on timeout."""
        return self._fetcher is None or self._fetcher.idle(timeout)

    def close(self, timeout: float = 2.0) -> None:
        if self._fetcher is not None:
            self._fetcher.stop(timeout)


class Fetcher:
    """The one thread of a guard process that fetches from the object store, so that a download
    (seconds for a large artifact) never runs on ``execute()``'s thread. Bounded: one fetch at a
    time, at most one waiting or running per model (a request for a model already waiting or
    running is refused: the caller asks again later)."""

    def __init__(self, source: RepositorySource):
        self.source = source  # whose fetches it runs
        self._cv = threading.Condition()
        self._waiting: dict[str, tuple[Callable[[], None], Callable[[str], None] | None]] = {}
        self._busy: str | None = None  # the model being fetched
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tritonguard-fetch", daemon=True)
        self._thread.start()

    def request(self, model: str, work: Callable[[], None], done: Callable[[str], None] | None) -> bool:
        with self._cv:
            if self._stop or model in self._waiting or model == self._busy:
                return False
            self._waiting[model] = (work, done)
            self._cv.notify()
            return True

    def idle(self, timeout: float) -> bool:
        """Wait until nothing is waiting or running (tests, shutdown); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._waiting and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._waiting or self._stop)
                if self._stop:
                    return
                model = next(iter(self._waiting))
                work, done = self._waiting.pop(model)
                self._busy = model
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - the thread outlives a store that fails; retried later
                log.warning("fetch of %s from the object store failed: %s", model, exc)
            finally:
                try:
                    if done is not None:
                        done(model)
                except Exception:  # noqa: BLE001
                    log.exception("after the fetch of %s", model)
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()

    def stop(self, timeout: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)


def resolve(name: str, model_dir: Path, environ: Mapping[str, str]) -> RepositorySource:
    spec = environ.get(objectstore.ENV_REPOSITORY, "")
    if objectstore.is_object_store(spec):
        if not environ.get(ENV_URL):
            raise ConfigError(f"model '{name}': the repository is in an object store ({objectstore.ENV_REPOSITORY}); "
                              f"set {ENV_URL}=redis://… for the rollout state")
        cache = objectstore.RepositoryCache(spec, environ=environ, child_min_bytes=objectstore.CHILD_MIN_BYTES)
        return RepositorySource(cache.root, cache)
    if spec:
        return RepositorySource(Path(spec))
    model_dir = Path(model_dir)
    if model_dir.name != name:
        raise ConfigError(f"model '{name}' was loaded from a temporary copy, not a repository folder "
                          f"(an object-store repository?): set {objectstore.ENV_REPOSITORY} to the repository")
    return RepositorySource(model_dir.parent)


def follow_rollout(src: RepositorySource, view: Any, target: str, present: Callable[[int], bool], *,
                   guard: str, prepare: Callable[[list[int]], None] | None = None) -> None:
    """An object-store repository: a version the rollout state names that this replica lacks
    (exported or declared at a URL after this guard loaded) is fetched by the source's fetcher
    thread, never on the serving path (a large artifact takes seconds); the router routes to it
    once ``present(version)`` says so, and serves its share by the rest of the rollout until
    then. ``prepare(new versions)`` runs on that thread before they count as present (an
    in-process guard loads them there). A fetch that leaves a named version missing (the store
    failed) is tried again on a later poll, at most every ``FETCH_RETRY_S`` (doubling, up to
    ``FETCH_RETRY_MAX_S``). Chains itself into ``view.on_new`` (called at every state poll)."""
    chained = view.on_new
    retry = {"at": 0.0, "wait": FETCH_RETRY_S, "revision": -1}
    reported: set[int] = set()

    def done(_model: str) -> None:
        missing = [v for v in view.named_versions() if not present(v)]
        if missing and view.state.revision != retry["revision"]:
            retry["at"] = 0.0  # the state moved on while this fetch ran: its news are fetched at once
            return
        if missing:  # the store failed, or does not have it (yet): later, less and less often
            retry["wait"] = min(retry["wait"] * 2, FETCH_RETRY_MAX_S)
            retry["at"] = time.monotonic() + retry["wait"]
            return
        retry["wait"] = FETCH_RETRY_S
        for version in sorted(reported):
            log.info("guard %s: %s v%d fetched and checked: routed to as the rollout state says",
                     guard, target, version)
        reported.clear()

    def on_new(old: Any, new: Any) -> None:
        missing = [v for v in view.named_versions() if not present(v)]
        now = time.monotonic()
        if missing and (new.revision != old.revision or now >= retry["at"]):
            if src.fetch_later(target, keep=view.named_versions, prepare=prepare, done=done):
                retry["at"], retry["revision"] = now + retry["wait"], new.revision
            for version in set(missing) - reported:
                reported.add(version)
                log.info("guard %s: %s v%d is named by the rollout state and not on this replica yet: "
                         "fetching it in the background; its share is served by the rest of the rollout "
                         "until then", guard, target, version)
        if chained is not None:
            chained(old, new)

    view.on_new = on_new


def check_complete(repo: Path, target: str, version: int) -> None:
    """Refuse a version of a target in this repository that has no manifest."""
    model_dir = Path(repo) / target
    if version > 0 and (model_dir / repository.CONFIG).exists() \
            and version not in repository.complete_versions(model_dir):
        raise TargetError(f"version {version} of '{target}' has no manifest: not served")


__all__ = ["FETCH_RETRY_MAX_S", "FETCH_RETRY_S", "Fetcher", "RepositorySource", "check_complete",
           "follow_rollout", "resolve"]
