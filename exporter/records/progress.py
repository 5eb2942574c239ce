"""Where a rollout controller keeps its progress, and who may drive the rollout.

Two backends, one interface (``read``, ``write`` inside ``lock()``, ``driver()``, ``where``):

- :class:`FileProgress`, when the rollout state is the file beside the guard:
  ``<repo>/<guard>/rollout_controller.json``, replaced atomically. ``lock()`` is an ``flock`` on
  ``<file>.lock``; ``driver()`` a non-blocking ``flock`` on ``<file>.run``, which the kernel
  drops the moment the driving process dies.
- :class:`RedisProgress`, whenever the state is in Redis (``TRITONGUARD_STATE_URL``): the
  progress document sits beside it (``tritonguard:rollout:<model>``, in the state's namespace:
  ``tritonguard:{<namespace>}:rollout:<model>``), so a rollout started on
  one host can be watched, paused, aborted or resumed from any other, and survives the loss of
  the host that drove it. Both locks are leases, redis-py's ``Lock`` (``SET key token NX PX
  lease``, released by compare-and-delete), renewed by a daemon thread every third of the lease.
  Writes are fenced: a Lua script stores the document only while the writer's lock token is
  still in place, so a writer whose lease lapsed (a stall longer than the lease) writes nothing
  and says so. A driver that dies stops renewing; its lease lapses within ``lease_s`` and
  ``rollout resume`` anywhere takes over at the same step.

Redis errors surface as :class:`ProgressUnavailable` (a :class:`StateError`), which the
controller treats like a state-store outage: hold, look again later, never pass a gate.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import Timeout

from exporter.errors import ExporterError
from tritonguard.core.files import atomic_write
from tritonguard.core.store import file_lock, redacted, redis_client, redis_prefix, store_error
from tritonguard.rollout.state import StateUnavailable
from tritonguard.rollout.stores import RedisStateStore

log = logging.getLogger(__name__)

PROGRESS_FILE = "rollout_controller.json"
LEASE_S = 15.0  # a dead driver's rollout can be resumed elsewhere this long after it stopped
LOCK_WAIT_S = 30.0  # longest wait for the short read-modify-write lock


class ControllerError(ExporterError):
    """A rollout that cannot start, resume or be driven (another one active, a busy driver)."""


class ProgressUnavailable(ControllerError, StateUnavailable):
    """The store holding the rollout progress cannot be reached."""


class _Held:
    """What ``driver()`` yields: ``lost`` turns true when a lease could not be kept."""

    lost = False


# -- file -------------------------------------------------------------------------------------
class FileProgress:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.where = str(self.path)

    def read(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    def write(self, text: str) -> None:
        atomic_write(self.path, text)

    @contextlib.contextmanager
    def _flock(self, suffix: str, blocking: bool, model: str) -> Iterator[_Held]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = file_lock(f"{self.path}{suffix}")
        try:
            lock.acquire(blocking=blocking)
        except Timeout:
            raise ControllerError(f"another process is driving the rollout of '{model}'") from None
        try:
            yield _Held()
        finally:
            lock.release()

    def lock(self):
        return self._flock(".lock", True, self.path.parent.name)

    def driver(self):
        return self._flock(".run", False, self.path.parent.name)


# -- redis ------------------------------------------------------------------------------------
_FENCED_SET = "if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('set', KEYS[2], ARGV[2]) return 1 end return 0"


class Lease(_Held):
    """A redis-py ``Lock`` whose token names its holder (for :meth:`RedisProgress.holder`),
    renewed in the background until released."""

    def __init__(self, progress: RedisProgress, key: str, ttl_s: float):
        self.progress, self.key = progress, key
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # not thread-local: the renewal thread renews with the token the caller's thread took
        self._lock = progress.client.lock(key, timeout=max(0.1, ttl_s), sleep=0.05, thread_local=False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, wait_s: float | None = None) -> bool:
        """Take the lease now, or (``wait_s``) retry for that long."""
        if not self.progress._call(self._lock.acquire, blocking=wait_s is not None, blocking_timeout=wait_s,
                                   token=self.token):
            return False
        self._thread = threading.Thread(target=self._renew, name=f"lease {self.key}", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        redis = self.progress._redis
        while not self._stop.wait(self._lock.timeout / 3):
            try:
                self._lock.reacquire()  # the TTL back to the full lease, if the token is still ours
            except redis.exceptions.LockNotOwnedError:
                self.lost = True
                log.error("lease %s lapsed (another holder took it, or renewal stalled past the lease)", self.key)
                return
            except redis.RedisError as exc:  # keep trying: the lease may still hold
                log.warning("lease %s: renewal failed: %s", self.key, store_error(exc, self.progress.url))

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(self.progress._redis.RedisError):  # not ours any more, or Redis away:
            self._lock.release()  # it lapses by itself within the lease


class RedisProgress:
    def __init__(self, url: str, model: str, *, key: str | None = None, lease_s: float = LEASE_S,
                 lock_wait_s: float = LOCK_WAIT_S, client: Any = None):
        import redis  # noqa: PLC0415

        self._redis = redis
        self.url, self.model, self.lease_s, self.lock_wait_s = url, model, lease_s, lock_wait_s
        self.key = key or f"{redis_prefix('rollout')}{model}"
        self.lock_key, self.driver_key = f"{self.key}:lock", f"{self.key}:driver"
        self.where = f"{redacted(url)} key {self.key}"
        # unlike the guards' reads (100 ms, then back off), the controller can afford to wait
        self.client = client or redis_client(url, timeout=5, retries=True)
        self._fenced_set = self.client.register_script(_FENCED_SET)
        self._lock: Lease | None = None

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._redis.RedisError as exc:
            raise ProgressUnavailable(f"rollout progress {self.where}: {store_error(exc, self.url)}") from None

    def holder(self, key: str) -> str:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        token, ttl = self._call(pipe.execute)
        if token is None:
            return "nobody"
        host, pid, _ = (token.decode() + "::").split(":", 2)
        return f"{host} pid {pid}, lease ends in {max(ttl, 0) / 1000:.1f} s unless renewed"

    def read(self) -> str | None:
        raw = self._call(self.client.get, self.key)
        return None if raw is None else raw.decode()

    def write(self, text: str) -> None:
        if self._lock is None:
            raise RuntimeError("RedisProgress.write outside lock()")
        if not self._call(self._fenced_set, keys=[self.lock_key, self.key], args=[self._lock.token, text]):
            raise ControllerError(f"rollout progress {self.where}: the lock lapsed before the write "
                                  "(a stall longer than the lease); nothing was written")

    @contextlib.contextmanager
    def lock(self) -> Iterator[Lease]:
        lease = Lease(self, self.lock_key, self.lease_s)
        if not lease.acquire(wait_s=self.lock_wait_s):
            raise ControllerError(f"the rollout progress of '{self.model}' stayed locked for "
                                  f"{self.lock_wait_s:g} s (held by {self.holder(self.lock_key)})")
        self._lock = lease
        try:
            yield lease
        finally:
            self._lock = None
            lease.release()

    @contextlib.contextmanager
    def driver(self) -> Iterator[Lease]:
        lease = Lease(self, self.driver_key, self.lease_s)
        if not lease.acquire():
            raise ControllerError(f"another process is driving the rollout of '{self.model}' "
                                  f"({self.holder(self.driver_key)})")
        try:
            yield lease
        finally:
            lease.release()


def open_progress(model: str, repo: str | os.PathLike, store: Any, *, lease_s: float = LEASE_S):
    """Redis beside a Redis state store (same server and namespace, ``tritonguard:rollout:<model>``),
    else the file beside the guard."""
    if isinstance(store, RedisStateStore):
        prefix = store.key[: -len(model)] if store.key.endswith(model) else f"{store.key}:"
        key = prefix.replace(":state:", ":rollout:", 1) + model if ":state:" in prefix else f"{store.key}:rollout"
        return RedisProgress(store.url, model, key=key, lease_s=lease_s)
    return FileProgress(Path(repo) / model / PROGRESS_FILE)
