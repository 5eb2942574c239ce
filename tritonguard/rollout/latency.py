"""Exact per-call latencies of each target version, shared by every guard process through the store.

Why not the Prometheus histogram: the rollout gate rebuilt samples from its buckets, and two
sub-millisecond versions fell into one bucket, so a 2x slower candidate showed a shift of 0 and
was promoted. The gate (``exporter.rollout.gates.latency``) needs the calls themselves.

Every Triton model instance is its own process and several tritonservers may share one Redis,
so each process keeps its own samples and publishes them; the controller gathers them all:

- serving path: :meth:`LatencyRecorder.record` appends ``(t, rows, seconds)`` of one fused
  target call to a ring per version. O(1), no I/O, never raises.
- background (about once a second): :meth:`LatencyRecorder.flush` writes each ring that changed
  as one blob per writer (``host:pid``) and version, replacing that writer's previous blob. A
  writer therefore holds at most ``capacity`` samples per version, in memory and in the store.
- controller: :meth:`FileLatencyLog.read` / :meth:`RedisLatencyLog.read` gather every writer's
  blob of a version and return the samples with ``since <= t < until``.

Store layout, chosen like :func:`tritonguard.rollout.state.open_store` (Redis when ``url`` or
``$TRITONGUARD_STATE_URL`` is set, else files beside the guard's model folder):

- files: ``$TRITONGUARD_HOME/run/<repo>-<hash>/<guard>/latency/v<version>/<writer>.lat``
  (:func:`runtime_dir`: outside the repository, which may be read-only or an object store), replaced atomically (temporary file
  + ``os.replace``); the reader removes blobs not rewritten for ``ttl_s``.
- Redis: ``tritonguard:latency:<guard>:<version>:<writer>`` holds the blob (``SET ... EX ttl_s``),
  and the set ``tritonguard:latency:<guard>:<version>`` lists the writers' keys, so a read costs
  SMEMBERS + MGET instead of a SCAN of the whole keyspace. With ``$TRITONGUARD_NAMESPACE`` the
  prefix is ``tritonguard:{<namespace>}:latency:`` (:func:`tritonguard.core.store.redis_prefix`):
  a staging fleet's samples never reach production's gate.

A blob: header ``<8s i I`` (magic, model version, sample count n), then ``t`` float64[n] (wall
clock, seconds since the epoch, when the call ended), ``rows`` int32[n], ``seconds`` float32[n],
all little-endian, in time order, then a CRC-32 of everything before it. A truncated or corrupt
blob is skipped (logged, counted in ``corrupt``); an unreachable store raises
:class:`LatencyUnavailable` from ``read``, which the controller treats as "metrics unavailable".
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tritonguard.core.errors import TritonGuardError
from tritonguard.core.files import atomic_write
from tritonguard.core.store import ENV_URL, home, redacted, redis_client, redis_prefix, store_error

log = logging.getLogger(__name__)

LATENCY_DIR = ".latency"
KEY_PREFIX = "tritonguard:latency:"  # without a namespace; see RedisLatencyLog
TTL_S = 3600.0
MAGIC = b"TGLAT\x00\x00\x01"
_HEADER = struct.Struct("<8siI")
_CRC = struct.Struct("<I")
SAMPLE_BYTES = 8 + 4 + 4
MAX_BLOB_SAMPLES = 1 << 20  # a count above this is corruption, not a writer's ring
MAX_ROWS = 2**31 - 1  # the int32 rows column


class LatencyUnavailable(TritonGuardError):
    """The latency log cannot be read (Redis down, directory unreadable): no latency data."""


class CorruptBlob(ValueError):
    """A blob failed its checks; the reader skips it."""


@dataclass(frozen=True)
class Samples:
    """Fused target calls: when each ended (``t``), its sub-batch rows, and its duration."""

    t: np.ndarray
    rows: np.ndarray
    seconds: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "t", np.asarray(self.t, dtype=np.float64).ravel())
        object.__setattr__(self, "rows", np.asarray(self.rows, dtype=np.int32).ravel())
        object.__setattr__(self, "seconds", np.asarray(self.seconds, dtype=np.float32).ravel())
        if not len(self.t) == len(self.rows) == len(self.seconds):
            raise ValueError(f"Samples: t, rows and seconds differ in length "
                             f"({len(self.t)}, {len(self.rows)}, {len(self.seconds)})")

    def __len__(self) -> int:
        return len(self.t)

    @classmethod
    def empty(cls) -> Samples:
        return cls(np.empty(0), np.empty(0), np.empty(0))

    @classmethod
    def concat(cls, parts: Iterable[Samples]) -> Samples:
        parts = list(parts)
        if not parts:
            return cls.empty()
        return cls(np.concatenate([p.t for p in parts]), np.concatenate([p.rows for p in parts]),
                   np.concatenate([p.seconds for p in parts]))

    def between(self, since: float = 0.0, until: float | None = None) -> Samples:
        """The samples with ``since <= t < until``, in time order."""
        keep = self.t >= since
        if until is not None:
            keep &= self.t < until
        order = np.argsort(self.t[keep], kind="stable")
        return Samples(self.t[keep][order], self.rows[keep][order], self.seconds[keep][order])


# -- blobs ------------------------------------------------------------------------------------
def encode(version: int, samples: Samples) -> bytes:
    n = len(samples)
    body = b"".join((_HEADER.pack(MAGIC, version, n), samples.t.astype("<f8").tobytes(),
                     samples.rows.astype("<i4").tobytes(), samples.seconds.astype("<f4").tobytes()))
    return body + _CRC.pack(zlib.crc32(body))


def decode(blob: bytes, version: int) -> Samples:
    """Samples of a blob written for ``version``; :class:`CorruptBlob` if any check fails."""
    if len(blob) < _HEADER.size + _CRC.size:
        raise CorruptBlob(f"{len(blob)} bytes is shorter than a header")
    magic, v, n = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptBlob(f"bad magic {magic!r}")
    if n > MAX_BLOB_SAMPLES or len(blob) != _HEADER.size + n * SAMPLE_BYTES + _CRC.size:
        raise CorruptBlob(f"{len(blob)} bytes do not hold the {n} samples the header says (truncated?)")
    (crc,) = _CRC.unpack_from(blob, len(blob) - _CRC.size)
    if zlib.crc32(memoryview(blob)[:-_CRC.size]) != crc:
        raise CorruptBlob("checksum mismatch")
    if v != version:
        raise CorruptBlob(f"written for version {v}, found under version {version}")
    o = _HEADER.size
    t = np.frombuffer(blob, "<f8", n, o)
    rows = np.frombuffer(blob, "<i4", n, o + 8 * n)
    seconds = np.frombuffer(blob, "<f4", n, o + 12 * n)
    return Samples(t, rows, seconds)


# -- sinks ------------------------------------------------------------------------------------
class LatencyLog(Protocol):
    corrupt: int

    def write(self, version: int, writer: str, samples: Samples) -> None: ...

    def read(self, version: int, since: float = 0.0, until: float | None = None) -> Samples: ...


class FileLatencyLog:
    """Blobs as files under ``root`` (``runtime_dir(repo)/<guard>/latency``); see the module docstring."""

    def __init__(self, root: str | os.PathLike, *, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.ttl_s = ttl_s
        self.clock = clock
        self.corrupt = 0
        self._reported: set[str] = set()

    def path(self, version: int, writer: str) -> Path:
        # host names may hold characters a file name must not; ids stay distinct in practice
        return self.root / f"v{int(version)}" / (re.sub(r"[^A-Za-z0-9._-]", "_", writer) + ".lat")

    def write(self, version: int, writer: str, samples: Samples) -> None:
        # no fsync: a blob lost in a crash is rewritten a second later, or was the crashed
        # process's and stale anyway; serving-side disk flushes are not worth it
        atomic_write(self.path(version, writer), encode(version, samples), fsync=False)

    def read(self, version: int, since: float = 0.0, until: float | None = None) -> Samples:
        folder = self.root / f"v{int(version)}"
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return Samples.empty()  # nothing flushed yet
        except OSError as exc:
            raise LatencyUnavailable(f"latency log {folder} unreadable: {exc}") from None
        stale_before = self.clock() - self.ttl_s
        parts = []
        for entry in entries:
            if not entry.name.endswith((".lat", ".tmp")):
                continue
            try:
                if entry.stat().st_mtime < stale_before:
                    with contextlib.suppress(OSError):  # a read-only mount: just leave it
                        os.unlink(entry.path)  # a writer that stopped (its process ended)
                    continue
                if entry.name.endswith(".tmp"):
                    continue
                with open(entry.path, "rb") as f:
                    blob = f.read()
            except FileNotFoundError:
                continue  # removed by another reader meanwhile
            except OSError as exc:
                self._skip(entry.path, exc)
                continue
            try:
                parts.append(decode(blob, version))
            except CorruptBlob as exc:
                self._skip(entry.path, exc)
        return Samples.concat(parts).between(since, until)

    def _skip(self, where: str, exc: Exception) -> None:
        self.corrupt += 1
        if where not in self._reported:  # once per blob: a reader looks every few seconds
            self._reported.add(where)
            log.warning("latency blob %s skipped: %s", where, exc)


class RedisLatencyLog:
    """Blobs as Redis strings with an expiry, indexed by a set per version; see the module docstring."""

    def __init__(self, url: str, guard: str, *, key_prefix: str | None = None, ttl_s: float = TTL_S,
                 socket_timeout: float = 0.5, client: Any = None):
        import redis

        self._redis = redis
        self.url, self.guard = url, guard
        self.where = redacted(url)
        self.prefix = f"{redis_prefix('latency') if key_prefix is None else key_prefix}{guard}:"
        self.ttl_s = ttl_s
        # bytes in, bytes out (no decode_responses); no retries: an outage fails the flush fast
        self.client = client or redis_client(url, timeout=socket_timeout)
        self.corrupt = 0
        self._reported: set[bytes] = set()

    def index(self, version: int) -> str:
        return f"{self.prefix}{int(version)}"

    def key(self, version: int, writer: str) -> str:
        return f"{self.prefix}{int(version)}:{writer}"

    def write(self, version: int, writer: str, samples: Samples) -> None:
        ttl = max(1, round(self.ttl_s))
        index, key = self.index(version), self.key(version, writer)
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.set(key, encode(version, samples), ex=ttl)
                pipe.sadd(index, key)
                pipe.expire(index, ttl)  # refreshed after every blob: the index outlives them all
                pipe.execute()
        except self._redis.RedisError as exc:  # said by the recorder: without the URL's password
            raise LatencyUnavailable(f"latency log {self.where}: {store_error(exc, self.url)}") from None

    def read(self, version: int, since: float = 0.0, until: float | None = None) -> Samples:
        index = self.index(version)
        try:
            keys = sorted(self.client.smembers(index))
            blobs = self.client.mget(keys) if keys else []
            expired = [k for k, b in zip(keys, blobs, strict=True) if b is None]
            if expired:
                self.client.srem(index, *expired)
        except self._redis.RedisError as exc:
            raise LatencyUnavailable(f"latency log {self.where}: {store_error(exc, self.url)}") from None
        parts = []
        for key, blob in zip(keys, blobs, strict=True):
            if blob is None:
                continue
            try:
                parts.append(decode(blob, version))
            except CorruptBlob as exc:
                self.corrupt += 1
                if key not in self._reported:
                    self._reported.add(key)
                    log.warning("latency blob %s skipped: %s", key.decode(errors="replace"), exc)
        return Samples.concat(parts).between(since, until)


def open_latency_log(guard: str, repo_dir: str | os.PathLike, url: str | None = None,
                     **kwargs: Any) -> FileLatencyLog | RedisLatencyLog:
    """Redis when ``url`` (default ``$TRITONGUARD_STATE_URL``) is set, else files beside the guard."""
    if url is None:
        url = os.environ.get(ENV_URL, "")
    if url:
        return RedisLatencyLog(url, guard, **kwargs)
    return FileLatencyLog(runtime_dir(repo_dir) / guard / LATENCY_DIR.lstrip("."), **kwargs)


def runtime_dir(repo_dir: str | os.PathLike, environ: Any = None) -> Path:
    """Where the file store keeps what guards write at run time for the repository ``repo_dir``:
    ``$TRITONGUARD_HOME/run/<hash of its real path>``, outside the repository (never published,
    never part of a model's folder). The server and the exporter must share ``TRITONGUARD_HOME``
    (or both use Redis, ``$TRITONGUARD_STATE_URL``)."""
    import hashlib  # noqa: PLC0415

    real = os.path.realpath(os.fspath(repo_dir))
    key = hashlib.sha256(real.encode()).hexdigest()[:16]
    return home(environ) / "run" / f"{Path(real).name}-{key}"


# -- the recorder -------------------------------------------------------------------------------
class _Ring:
    __slots__ = ("t", "rows", "seconds", "count", "flushed")

    def __init__(self, capacity: int):
        self.t = np.empty(capacity, np.float64)
        self.rows = np.empty(capacity, np.int32)
        self.seconds = np.empty(capacity, np.float32)
        self.count = 0  # appends ever; the next slot is count % capacity
        self.flushed = 0  # count at the last successful flush

    def snapshot(self) -> Samples:
        cap = len(self.t)
        if self.count <= cap:
            sl = slice(0, self.count)
            return Samples(self.t[sl].copy(), self.rows[sl].copy(), self.seconds[sl].copy())
        start = self.count % cap  # the oldest sample: time order is the ring unrolled from here
        return Samples(np.roll(self.t, -start), np.roll(self.rows, -start), np.roll(self.seconds, -start))


def paired_key(version: int, role: str) -> int:
    """Store key of *paired* timings of ``version`` under test: the guard's canary worker runs
    the candidate and the primary on the same rows, back to back and in alternating order, and
    times both ("candidate" and "primary" roles). Unlike serving-path calls, a pair shares its
    load, its contention and its warmth (a version the worker re-runs on every canary batch is
    warmer than a rarely called one), so only the versions' own speed differs. Negative keys, so
    they never meet a real version number."""
    if role not in ("candidate", "primary"):
        raise ValueError(f"role must be 'candidate' or 'primary', got {role!r}")
    return -(2 * int(version) + (role == "primary"))


class LatencyRecorder:
    """This process's latest ``capacity`` calls per version, published through ``sink``."""

    def __init__(self, sink: LatencyLog, *, capacity: int = 4096, writer_id: str | None = None,
                 max_versions: int = 16):
        if capacity < 1 or max_versions < 1:
            raise ValueError(f"capacity and max_versions must be >= 1, got {capacity}, {max_versions}")
        self.sink = sink
        self.capacity = capacity
        self.max_versions = max_versions
        self.writer_id = writer_id or f"{socket.gethostname()}:{os.getpid()}"
        self.flush_errors = 0
        self.dropped = 0  # calls not recorded: invalid figures, or an unexpected error
        self._rings: dict[int, _Ring] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, version: int, rows: int, seconds: float, t: float) -> None:
        """One fused target call of ``version``: ``rows`` in its sub-batch, ``seconds`` it took,
        ``t`` when it ended (``time.time()``). Never raises: serving must not depend on it."""
        try:
            if not (0.0 <= seconds < float("inf") and 1 <= rows <= MAX_ROWS):
                self.dropped += 1
                return
            with self._lock:
                ring = self._rings.get(version)
                if ring is None:
                    ring = self._add(version)
                i = ring.count % self.capacity
                ring.t[i] = t
                ring.rows[i] = rows
                ring.seconds[i] = seconds
                ring.count += 1
        except Exception:  # noqa: BLE001 - a bad figure costs one sample, never a request
            self.dropped += 1

    def _add(self, version: int) -> _Ring:
        if len(self._rings) >= self.max_versions:
            # a guard serves a handful of versions; past that, forget the one idle longest
            # (its published blob stays until the store's TTL)
            idle = min(self._rings, key=lambda v: self._rings[v].t[(self._rings[v].count - 1) % self.capacity])
            del self._rings[idle]
        ring = self._rings[version] = _Ring(self.capacity)
        return ring

    def flush(self) -> bool:
        """Publish every ring that changed since its last flush. False (and ``flush_errors``
        counted) if any write failed; the ring stays pending for the next flush."""
        ok = True
        with self._flush_lock:
            with self._lock:
                pending = [v for v, r in self._rings.items() if r.count != r.flushed]
            for version in pending:
                with self._lock:  # a copy of <= capacity samples: microseconds
                    ring = self._rings.get(version)
                    if ring is None:
                        continue
                    count, snap = ring.count, ring.snapshot()
                try:
                    self.sink.write(version, self.writer_id, snap)
                except Exception as exc:  # noqa: BLE001 - any sink failure: try again next time
                    ok = False
                    self.flush_errors += 1
                    if not self._failing:
                        log.error("latency log: cannot publish v%d samples (%s: %s); retrying each flush",
                                  version, type(exc).__name__, exc)
                    self._failing = True
                    continue
                ring.flushed = count
            if ok and self._failing:
                log.info("latency log: publishing again")
                self._failing = False
        return ok

    def start(self, interval_s: float = 1.0) -> None:
        """Flush every ``interval_s`` from a daemon thread until :meth:`close`."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.flush()

        self._thread = threading.Thread(target=loop, name="tritonguard-latency-flush", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the flush thread and publish what is left (model ``finalize``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.flush()


def recorder_for(guard: str, repo: str | os.PathLike) -> LatencyRecorder | None:
    """Exact per-call latencies of each target version of ``guard``, flushed by its router's
    reconciler to the state's store for the rollout's latency gate. None (logged) when no log
    can be opened: serving never depends on it."""
    try:
        return LatencyRecorder(open_latency_log(guard, repo))
    except Exception as exc:  # noqa: BLE001 - e.g. a bad TRITONGUARD_STATE_URL: say so, serve on
        log.warning("guard %s: latency samples not kept (%s)", guard,
                    store_error(exc, os.environ.get(ENV_URL, "")))
        return None
