"""Replicas found, not listed: each server's guards register it in the shared store with a heartbeat.

One Redis key per replica (``tritonguard:replica:<host:http-port>``, with a namespace
``tritonguard:{<namespace>}:replica:<host:http-port>``: :func:`tritonguard.core.store.redis_prefix`), a hash written by every
guard instance on that replica (idempotent: the same fields, last writer wins) and given a TTL of
three heartbeat periods, so a replica that stops beating disappears by itself:

- ``info``: the replica's URLs (HTTP, gRPC, metrics), host and start time, as the launcher
  advertised them to the stubs (:func:`advertised`, ``TRITONGUARD_ADVERTISE_*``);
- ``heartbeat``: wall-clock time of the last beat;
- ``model:<guard>``: the versions that guard routes to (primary, candidate, arms, fallback chain)
  and when it said so; a guard unloaded long ago (older than the TTL) is not reported.

The guard cannot know Triton's ports by itself: without ``TRITONGUARD_ADVERTISE_HTTP`` (the
launcher sets it from ``--http-port``) or without a Redis state URL, nothing is registered.
Heartbeats run in a daemon thread per guard instance, never on the serving path; a Redis failure
is counted (:attr:`Heartbeat.errors`) and logged once, and the next beat tries again.
The exporter reads the live replicas with :meth:`ReplicaRegistry.live`: a SCAN of its own
namespace's prefix, so a staging fleet on the same Redis is not seen (nor routed, nor counted).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tritonguard.core.store import redacted, redis_client, redis_prefix, store_error, store_url

log = logging.getLogger("tritonguard.replicas")

ENV_HTTP = "TRITONGUARD_ADVERTISE_HTTP"
ENV_GRPC = "TRITONGUARD_ADVERTISE_GRPC"
ENV_METRICS = "TRITONGUARD_ADVERTISE_METRICS"
ENV_HOST = "TRITONGUARD_ADVERTISE_HOST"
ENV_STARTED = "TRITONGUARD_ADVERTISE_STARTED"
ENV_PERIOD = "TRITONGUARD_HEARTBEAT_S"
DEFAULT_PERIOD_S = 5.0
TTL_PERIODS = 3  # a key outlives its last beat by three periods
KEY_PREFIX = "tritonguard:replica:"  # without a namespace; see ReplicaRegistry


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


def advertised(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """What the launcher told this process about its server: URLs, host and start time; None
    without ``TRITONGUARD_ADVERTISE_HTTP`` (a server not started by the launcher)."""
    env = os.environ if environ is None else environ
    http = env.get(ENV_HTTP, "")
    if not http:
        return None
    try:
        started = float(env.get(ENV_STARTED, "") or 0.0)
    except ValueError:
        started = 0.0
    return {"http": http, "grpc": env.get(ENV_GRPC, ""), "metrics": env.get(ENV_METRICS, ""),
            "host": env.get(ENV_HOST, "") or socket.gethostname(), "started": started}


def replica_id(info: Mapping[str, Any]) -> str:
    """``host:port`` of the replica's HTTP URL: one key per replica, whatever guards it runs."""
    parts = urlsplit(info["http"] if "://" in info["http"] else f"http://{info['http']}")
    return f"{parts.hostname}:{parts.port or 80}"


def served_versions(state: Any) -> list[int]:
    """The target versions a rollout state routes to: its chain (candidate, primary, previous
    primary) and its A/B/n arms; -1 is "whatever Triton serves as latest"."""
    out = list(state.route_versions()) if state is not None else []
    out += [a.version for a in getattr(state, "arms", None) or []]
    return sorted(dict.fromkeys(out))


@dataclass
class Replica:
    """One live replica as the registry holds it."""

    id: str
    http: str
    grpc: str = ""
    metrics: str = ""
    host: str = ""
    started: float = 0.0
    heartbeat: float = 0.0
    models: dict[str, list[int]] = field(default_factory=dict)  # guard -> versions it routes to

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReplicaRegistry:
    """The live replicas in Redis; see the module docstring. ``period_s`` sets the TTL;
    ``key_prefix`` defaults to this process's namespace (``redis_prefix("replica")``)."""

    def __init__(self, url: str, *, period_s: float = DEFAULT_PERIOD_S, key_prefix: str | None = None,
                 socket_timeout: float = 1.0, clock: Callable[[], float] = time.time, client: Any = None):
        import redis  # noqa: PLC0415 - only with a Redis store

        self._redis = redis
        self.url, self.clock = url, clock
        self.prefix = redis_prefix("replica") if key_prefix is None else key_prefix
        self.period_s = float(period_s)
        self.ttl_s = max(1, int(round(TTL_PERIODS * self.period_s)))
        self.client = client or redis_client(url, timeout=socket_timeout)
        self.errors = redis.RedisError

    def key(self, rid: str) -> str:
        return f"{self.prefix}{rid}"

    def beat(self, info: Mapping[str, Any], model: str = "", versions: list[int] | None = None,
             now: float | None = None) -> str:
        """One heartbeat: refresh the replica's fields and TTL (and ``model``'s versions); returns its id."""
        now = self.clock() if now is None else now
        rid = replica_id(info)
        key = self.key(rid)
        fields: dict[str, Any] = {"info": json.dumps(dict(info), sort_keys=True), "heartbeat": repr(now)}
        if model:
            fields[f"model:{model}"] = json.dumps({"versions": list(versions or []), "at": now})
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.ttl_s)
        pipe.execute()
        return rid

    def remove(self, rid: str) -> None:
        self.client.delete(self.key(rid))

    def live(self, now: float | None = None) -> list[Replica]:
        """Every replica whose key has not expired, sorted by id (raises the client's errors)."""
        now = self.clock() if now is None else now
        keys = sorted(k.decode() if isinstance(k, bytes) else k
                      for k in self.client.scan_iter(match=f"{self.prefix}*", count=500))
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        out = []
        for k, raw in zip(keys, pipe.execute(), strict=True):
            doc = {(a.decode() if isinstance(a, bytes) else a): (b.decode() if isinstance(b, bytes) else b)
                   for a, b in (raw or {}).items()}
            try:
                info = json.loads(doc["info"])
                rep = Replica(id=k[len(self.prefix):], http=info["http"], grpc=info.get("grpc", ""),
                              metrics=info.get("metrics", ""), host=info.get("host", ""),
                              started=float(info.get("started") or 0.0), heartbeat=float(doc.get("heartbeat", 0)))
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("replica key %s unreadable, skipped: %s", k, exc)
                continue
            for f, v in doc.items():
                if not f.startswith("model:"):
                    continue
                try:
                    m = json.loads(v)
                except ValueError:
                    continue
                if now - float(m.get("at", 0)) <= self.ttl_s:  # a guard unloaded since: not served
                    rep.models[f[len("model:"):]] = [int(x) for x in m.get("versions", [])]
            out.append(rep)
        return out

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing never matters
            pass


class Heartbeat:
    """A daemon thread beating every ``period_s`` for one guard instance; never raises."""

    def __init__(self, registry: ReplicaRegistry, info: Mapping[str, Any], model: str,
                 versions: Callable[[], list[int]]):
        self.registry, self.info, self.model, self.versions = registry, dict(info), model, versions
        self.errors = 0
        self.beats = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{model}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def beat_once(self) -> bool:
        try:
            versions = list(self.versions())
        except Exception as exc:  # noqa: BLE001 - a beat without versions is still a beat
            log.debug("heartbeat %s: versions unavailable: %s", self.model, exc)
            versions = []
        try:
            self.registry.beat(self.info, self.model, versions)
        except Exception as exc:  # noqa: BLE001 - Redis down: count, say once, try next period
            self.errors += 1
            if not self._failing:
                log.error("replica heartbeat of %s to %s failed (%s); retrying every %g s",
                          self.model, redacted(self.registry.url), store_error(exc, self.registry.url),
                          self.registry.period_s)
            self._failing = True
            return False
        if self._failing:
            log.info("replica heartbeat of %s to %s works again", self.model, redacted(self.registry.url))
        self._failing = False
        self.beats += 1
        return True

    def _run(self) -> None:
        while True:
            self.beat_once()
            if self._stop.wait(self.registry.period_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self.registry.close()


def period(environ: Mapping[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    try:
        value = float(env.get(ENV_PERIOD, "") or DEFAULT_PERIOD_S)
    except ValueError:
        value = DEFAULT_PERIOD_S
    return value if value > 0 else DEFAULT_PERIOD_S


def start_heartbeat(model: str, versions: Callable[[], list[int]], *, url: str | None = None,
                    environ: Mapping[str, str] | None = None) -> Heartbeat | None:
    """Register this replica for ``model``'s guard instance, or None (said once in the log) when
    there is no Redis store or no advertised URL. Never raises."""
    url = store_url(url, environ)
    if not is_redis(url):
        return None
    info = advertised(environ)
    if info is None:
        log.info("guard %s: replica not registered in %s: no %s (start the server with the launcher, "
                 "or set TRITONGUARD_ADVERTISE_HTTP/_GRPC/_METRICS)", model, redacted(url), ENV_HTTP)
        return None
    try:
        registry = ReplicaRegistry(url, period_s=period(environ))
    except Exception as exc:  # noqa: BLE001 - e.g. no redis package: serve anyway
        log.error("guard %s: replica registry unavailable (%s)", model, store_error(exc, url))
        return None
    return Heartbeat(registry, info, model, versions).start()


__all__ = ["ENV_GRPC", "ENV_HOST", "ENV_HTTP", "ENV_METRICS", "ENV_PERIOD", "ENV_STARTED", "Heartbeat",
           "Replica", "ReplicaRegistry", "advertised", "is_redis", "redacted", "replica_id", "served_versions",
           "start_heartbeat"]
