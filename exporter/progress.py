"""Where a rollout controller keeps its progress, and who may drive the rollout.

Two backends, one interface (``read``, ``write`` inside ``lock()``, ``driver()``, ``where``):

- :class:`FileProgress`, when the rollout state is the file beside the guard:
  ``<repo>/<guard>/rollout_controller.json``, replaced atomically. ``lock()`` is an ``flock`` on
  ``<file>.lock``; ``driver()`` a non-blocking ``flock`` on ``<file>.run``, which the kernel
  drops the moment the driving process dies.
- :class:`RedisProgress`, whenever the state is in Redis (``TRITONGUARD_STATE_URL``): the
  progress document sits beside it (``tritonguard:rollout:<model>``), so a rollout started on
  one host can be watched, paused, aborted or resumed from any other, and survives the loss of
  the host that drove it. Both locks are leases: ``SET key token NX PX lease``, renewed by a
  daemon thread every third of the lease, released by compare-and-delete. Writes are fenced: a
  Lua script stores the document only while the writer's lock token is still in place, so a
  writer whose lease lapsed (a stall longer than the lease) writes nothing and says so. A
  driver that dies stops renewing; its lease lapses within ``lease_s`` and ``rollout resume``
  anywhere takes over at the same step.

Redis errors surface as :class:`ProgressUnavailable` (a :class:`StateError`), which the
controller treats like a state-store outage: hold, look again later, never pass a gate.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tritonguard.errors import TritonGuardError
from tritonguard.repository import atomic_write
from tritonguard.state import RedisStateStore, StateUnavailable

log = logging.getLogger(__name__)

PROGRESS_FILE = "rollout_controller.json"
LEASE_S = 15.0  # a dead driver's rollout can be resumed elsewhere this long after it stopped
LOCK_WAIT_S = 30.0  # longest wait for the short read-modify-write lock


class ControllerError(TritonGuardError):
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
        fd = os.open(f"{self.path}{suffix}", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                raise ControllerError(f"another process is driving the rollout of '{model}'") from None
            yield _Held()
        finally:
            os.close(fd)

    def lock(self):
        return self._flock(".lock", True, self.path.parent.name)

    def driver(self):
        return self._flock(".run", False, self.path.parent.name)


# -- redis ------------------------------------------------------------------------------------
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_FENCED_SET = "if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('set', KEYS[2], ARGV[2]) return 1 end return 0"


def _safe_url(url: str) -> str:
    """The URL without its password (it goes into messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class Lease(_Held):
    """A Redis key held with a random token and renewed in the background until released."""

    def __init__(self, progress: RedisProgress, key: str, ttl_s: float):
        self.progress, self.key, self.ttl_ms = progress, key, max(100, int(ttl_s * 1000))
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        if not self.progress._call(self.progress.client.set, self.key, self.token, nx=True, px=self.ttl_ms):
            return False
        self._thread = threading.Thread(target=self._renew, name=f"lease {self.key}", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        period = self.ttl_ms / 3000
        while not self._stop.wait(period):
            try:
                if not self.progress._call(self.progress._renew, keys=[self.key], args=[self.token, self.ttl_ms]):
                    self.lost = True
                    log.error("lease %s lapsed (another holder took it, or renewal stalled past the lease)",
                              self.key)
                    return
            except ProgressUnavailable as exc:  # keep trying: the lease may still hold
                log.warning("lease %s: renewal failed: %s", self.key, exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(ProgressUnavailable):  # it lapses by itself within the lease
            self.progress._call(self.progress._release, keys=[self.key], args=[self.token])


class RedisProgress:
    def __init__(self, url: str, model: str, *, key: str | None = None, lease_s: float = LEASE_S,
                 lock_wait_s: float = LOCK_WAIT_S, client: Any = None):
        import redis  # noqa: PLC0415

        self._redis = redis
        self.model, self.lease_s, self.lock_wait_s = model, lease_s, lock_wait_s
        self.key = key or f"tritonguard:rollout:{model}"
        self.lock_key, self.driver_key = f"{self.key}:lock", f"{self.key}:driver"
        self.where = f"{_safe_url(url)} key {self.key}"
        # unlike the guards' reads (100 ms, then back off), the controller can afford to wait
        self.client = client or redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)
        self._fenced_set = self.client.register_script(_FENCED_SET)
        self._lock: Lease | None = None

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._redis.RedisError as exc:
            raise ProgressUnavailable(f"rollout progress {self.where}: {type(exc).__name__}: {exc}") from None

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
        deadline = time.monotonic() + self.lock_wait_s
        while not lease.acquire():
            if time.monotonic() > deadline:
                raise ControllerError(f"the rollout progress of '{self.model}' stayed locked for "
                                      f"{self.lock_wait_s:g} s (held by {self.holder(self.lock_key)})")
            time.sleep(0.05)
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
    """Redis beside a Redis state store (same server, ``tritonguard:rollout:<model>``), else the
    file beside the guard."""
    if isinstance(store, RedisStateStore):
        prefix = store.key[: -len(model)] if store.key.endswith(model) else f"{store.key}:"
        key = prefix.replace(":state:", ":rollout:", 1) + model if ":state:" in prefix else f"{store.key}:rollout"
        return RedisProgress(store.url, model, key=key, lease_s=lease_s)
    return FileProgress(Path(repo) / model / PROGRESS_FILE)
