"""An application's metrics from every replica: each publishes its counts to the rollout
state's store, and a metrics route answers their sum (issue 44 item 2).

Why: Ray's proxy sends ``GET <route_prefix>/metrics`` to any replica. Answering one replica's own
counts, successive looks of ``exporter promote`` read different replicas' counters, and a window
between two of them counted nothing real. So each replica publishes a snapshot of its registry
(every sample of the guard's families) beside the rollout state, and the route answers the sum
over the application's replicas.

- Where: the state's store. Files: ``runtime_dir(repo)/<guard>/metrics/<application>/<replica>.json``
  (:func:`tritonguard.rollout.latency.runtime_dir`, as the latency log), replaced atomically.
  Redis: ``tritonguard:metrics:<guard>:<application>:<replica>`` (``SET ... EX``), listed in the
  set ``tritonguard:metrics:<guard>:<application>`` (namespaced like every key:
  :func:`tritonguard.core.store.redis_prefix`).
- When: a daemon thread of the replica, every ``interval_s`` (never on the request path), and the
  answering replica's own snapshot just before it answers (so its own counts are current).
- Counters and histograms are summed over every snapshot younger than ``ttl_s`` (an hour), live
  or not: a replica that died or was replaced keeps its last counts in the sum, so the sum never
  goes down when a replica goes, which ``exporter promote`` would read as a counter reset (it then
  takes its window again). Each look reads every replica's latest *stored* snapshot, and a
  snapshot only moves forward, so the sum is monotone whichever replica answers. After ``ttl_s``
  a dead replica's counts leave the sum: promote sees one reset, as after a guard restart.
- Gauges (``tritonguard_breaker_state``, ``tritonguard_route_share``, validator figures) come from
  the replicas whose snapshot is fresh (younger than ``fresh_s``) and are combined by max: "a
  breaker is open" on any live replica is what a gate wants to see; route shares are the
  rollout state's, the same on every replica.
- A store that fails: the route answers this replica's own counts (what it did before), counts
  it in ``tritonguard_state_errors_total`` and logs once; the next publish tries again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from tritonguard.core.files import atomic_write
from tritonguard.core.store import redacted, redis_client, redis_prefix, store_error
from tritonguard.rollout.latency import runtime_dir

log = logging.getLogger(__name__)

TTL_S = 3600.0
FRESH_S = 10.0
INTERVAL_S = 0.5
METRICS_DIR = "metrics"

Snapshot = dict[str, Any]  # {"t": wall clock, "replica": id, "families": [[name, type, doc, [[s, labels, v]]]]}


class BoardUnavailable(Exception):
    """The store could not be read or written (the message never holds the URL's password)."""


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


class FileBoard:
    """Snapshots as files under ``root``; the reader removes those older than ``ttl_s``."""

    def __init__(self, root: str | os.PathLike, *, ttl_s: float = TTL_S, clock: Callable[[], float] = time.time):
        self.root, self.ttl_s, self.clock = Path(root), ttl_s, clock

    def write(self, replica: str, blob: bytes) -> None:
        try:
            atomic_write(self.root / f"{_safe(replica)}.json", blob, fsync=False)
        except OSError as exc:
            raise BoardUnavailable(f"metrics snapshots {self.root}: {exc}") from None

    def read(self) -> list[bytes]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise BoardUnavailable(f"metrics snapshots {self.root}: {exc}") from None
        stale_before = self.clock() - self.ttl_s
        out: list[bytes] = []
        for entry in entries:
            if not entry.name.endswith(".json"):
                continue
            try:
                if entry.stat().st_mtime < stale_before:
                    os.unlink(entry.path)  # a replica gone for longer than the TTL
                    continue
                with open(entry.path, "rb") as f:
                    out.append(f.read())
            except OSError:
                continue  # removed meanwhile, or a read-only mount
        return out


class RedisBoard:
    """Snapshots as Redis strings with an expiry, listed in a set (no SCAN of the keyspace)."""

    def __init__(self, url: str, guard: str, app: str, *, ttl_s: float = TTL_S, client: Any = None):
        import redis  # noqa: PLC0415 - only with a Redis store

        self._redis, self.url = redis, url
        self.index = f"{redis_prefix('metrics')}{guard}:{app}"
        self.ttl_s = ttl_s
        self.client = client or redis_client(url, timeout=0.5)

    def write(self, replica: str, blob: bytes) -> None:
        ttl = max(1, round(self.ttl_s))
        key = f"{self.index}:{replica}"
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.set(key, blob, ex=ttl)
                pipe.sadd(self.index, key)
                pipe.expire(self.index, ttl)
                pipe.execute()
        except self._redis.RedisError as exc:
            raise BoardUnavailable(f"metrics snapshots {redacted(self.url)}: {store_error(exc, self.url)}") from None

    def read(self) -> list[bytes]:
        try:
            keys = sorted(self.client.smembers(self.index))
            blobs = self.client.mget(keys) if keys else []
            gone = [k for k, b in zip(keys, blobs, strict=True) if b is None]
            if gone:
                self.client.srem(self.index, *gone)
        except self._redis.RedisError as exc:
            raise BoardUnavailable(f"metrics snapshots {redacted(self.url)}: {store_error(exc, self.url)}") from None
        return [b for b in blobs if b is not None]


def open_board(guard: str, app: str, repo_dir: str | os.PathLike, url: str | None) -> FileBoard | RedisBoard:
    """Where the rollout state of ``guard`` lives: Redis at ``url``, else files beside the latency log."""
    if url:
        return RedisBoard(url, guard, app)
    return FileBoard(runtime_dir(repo_dir) / guard / METRICS_DIR / _safe(app))


def snapshot(registry: CollectorRegistry, replica: str, now: float) -> Snapshot:
    families = [[m.name, m.type, m.documentation, [[s.name, s.labels, s.value] for s in m.samples]]
                for m in registry.collect()]
    return {"t": now, "replica": replica, "families": families}


def combine(snaps: list[Snapshot], now: float, fresh_s: float = FRESH_S) -> list[Metric]:
    """Counters and histograms summed over ``snaps`` (``_created``: the earliest), gauges the max
    over the fresh ones; see the module's docstring."""
    out: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple], float] = {}
    for snap in sorted(snaps, key=lambda s: s.get("replica", "")):
        fresh = now - float(snap.get("t", 0)) <= fresh_s
        for name, typ, doc, samples in snap.get("families", []):
            if typ == "gauge" and not fresh:
                continue
            fam = out.get(name)
            if fam is None:
                fam = out[name] = Metric(name, doc, typ)
            for sname, labels, value in samples:
                key = (name, sname, tuple(sorted(labels.items())))
                old = values.get(key)
                if old is None:
                    values[key] = float(value)
                elif typ == "gauge":
                    values[key] = max(old, float(value))
                elif sname.endswith("_created"):
                    values[key] = min(old, float(value))
                else:
                    values[key] = old + float(value)
    for (name, sname, labels), value in values.items():
        out[name].add_sample(sname, dict(labels), value)
    return list(out.values())


class _Combined:
    def __init__(self, metrics: list[Metric]):
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


class ReplicaMetrics:
    """One replica's side: publishes its registry every ``interval_s`` and answers the
    application's sum (:meth:`page`). ``on_error`` is called once per failed store operation."""

    def __init__(self, registry: CollectorRegistry, board: FileBoard | RedisBoard, replica: str, *,
                 on_error: Callable[[], None], interval_s: float = INTERVAL_S, fresh_s: float = FRESH_S,
                 clock: Callable[[], float] = time.time):
        self.registry, self.board, self.replica = registry, board, replica
        self.on_error, self.interval_s, self.fresh_s, self.clock = on_error, interval_s, fresh_s, clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._warned = False

    def publish(self) -> bool:
        """This replica's snapshot to the store; False (counted, logged once) when it failed."""
        blob = json.dumps(snapshot(self.registry, self.replica, self.clock())).encode()
        try:
            with self._lock:  # the thread and the route: one writer of this replica's key at a time
                self.board.write(self.replica, blob)
        except BoardUnavailable as exc:
            self._failed(exc)
            return False
        return True

    def page(self) -> bytes:
        """The application's metrics page: every replica's counts summed; this replica's own
        when the store failed."""
        if self.publish():
            try:
                blobs = self.board.read()
            except BoardUnavailable as exc:
                self._failed(exc)
            else:
                snaps = []
                for blob in blobs:
                    try:
                        snaps.append(json.loads(blob))
                    except ValueError:
                        continue  # a torn write of a crashed replica: its counts wait for its next
                registry = CollectorRegistry()
                registry.register(_Combined(combine(snaps, self.clock(), self.fresh_s)))  # type: ignore[arg-type]
                return generate_latest(registry)
        return generate_latest(self.registry)

    def _failed(self, exc: Exception) -> None:
        self.on_error()
        if not self._warned:
            self._warned = True
            log.warning("replica %s: metrics not shared, the route answers this replica's own (%s)", self.replica, exc)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.publish()

        self._thread = threading.Thread(target=loop, name=f"metrics-{self.replica}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the thread and publishes a last time: the counts stay in the sum until the TTL."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.publish()


__all__ = ["BoardUnavailable", "FileBoard", "RedisBoard", "ReplicaMetrics", "combine", "open_board", "snapshot"]
