"""The store's primitives every plane shares: where the shared store is, and a file lock.

Everything several processes (Triton model instances, replicas, the exporter) must share goes
through one store: Redis when ``$TRITONGUARD_STATE_URL`` (or an explicit URL) names one, else
files beside the guard's model folder, serialised by :func:`file_lock`.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from filelock import FileLock

ENV_URL = "TRITONGUARD_STATE_URL"
ENV_NAMESPACE = "TRITONGUARD_NAMESPACE"
# a namespace is a name: no Redis glob characters (a replica scan must not match another
# fleet's keys), no ':' (it would read as a key part), no braces (they delimit it below); 127
# characters hold the chart's "<kubernetes namespace>.<release>" (63 + 1 + 53)
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,126}$")


class NamespaceError(ValueError):
    """``$TRITONGUARD_NAMESPACE`` is not a usable name."""


def namespace(environ: Mapping[str, str] | None = None) -> str:
    """``$TRITONGUARD_NAMESPACE``: the fleet this process belongs to in a shared Redis ("" for
    none). Every Redis key the project writes carries it (:func:`redis_prefix`), so a staging
    fleet and a production fleet on one Redis neither route, count nor lock each other."""
    ns = (os.environ if environ is None else environ).get(ENV_NAMESPACE, "").strip()
    if ns and not _NAMESPACE.match(ns):
        raise NamespaceError(f"{ENV_NAMESPACE}={ns!r} is not a namespace: use 1-127 letters, digits, '_', '.' "
                             "or '-', starting with a letter or digit")
    return ns


def redis_prefix(kind: str, environ: Mapping[str, str] | None = None) -> str:
    """The key prefix of one kind of Redis key (``state``, ``replica``, ``quota``, …):
    ``tritonguard:<kind>:`` without a namespace (the keys of earlier releases), else
    ``tritonguard:{<namespace>}:<kind>:``. The braces keep every key of one fleet in one Redis
    Cluster hash slot and can never match a glob of the unnamespaced form."""
    ns = namespace(environ)
    return f"tritonguard:{{{ns}}}:{kind}:" if ns else f"tritonguard:{kind}:"


# query parameters whose value is a secret (redis-py passes every one to the connection:
# ``?password=`` works as well as ``:password@``)
_SECRET_PARAM = re.compile(r"pass|secret|token|credential", re.I)


def redacted(url: str) -> str:
    """``url`` as an operator may read it: the password of ``user:password@`` and the value of
    every secret query parameter (``?password=``, ``ssl_password=``, …) become ``***``; scheme,
    user, host, port, path and the other parameters stay. For every form redis-py takes
    (``redis://``, ``rediss://``, ``unix://``); a URL that cannot be parsed is reduced to its
    scheme. Every log line and error message that names a store says it this way."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("://", 1)[0] + "://***" if "://" in url else "***"
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            query = urlencode([(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return url
    # by hand: urlunsplit would fold ``unix:///path`` (an empty host) into ``unix:/path``
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def secrets_of(url: str) -> list[str]:
    """The secrets ``url`` carries (its password, secret query values), as written and decoded."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = []
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if _SECRET_PARAM.search(k)]
    out = {s for raw in found for s in (raw, unquote(raw)) if s}
    return sorted(out, key=len, reverse=True)  # the longest first: a secret may contain another


def scrubbed(text: str, url: str) -> str:
    """``text`` (an exception's message, say) with every secret of ``url`` replaced by ``***`` and
    ``url`` itself by its :func:`redacted` form: what a store may log of an error it got."""
    if url:
        text = text.replace(url, redacted(url))
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text


def store_error(exc: BaseException, url: str) -> str:
    """``<type>: <message>`` of a store error, with no secret of ``url`` in it."""
    return f"{type(exc).__name__}: {scrubbed(str(exc), url)}"


_NOT_CLUSTER: set[tuple[Any, ...]] = set()  # servers this process found not to be cluster nodes


def _refuse_cluster(conn: Any) -> None:
    """redis-py's connect hook: the usual handshake (AUTH, SELECT), then ``INFO cluster``, once per
    server and process. A node of a Redis Cluster is refused: redis.Redis does not follow
    MOVED/ASK redirections, a SCAN sees one node's keys only, and the Lua scripts touch several
    keys. A server that does not answer INFO (a proxy that hides it) is taken as it is."""
    import redis  # noqa: PLC0415 - only with a Redis store

    conn.on_connect()
    server = (getattr(conn, "path", None), getattr(conn, "host", None), getattr(conn, "port", None))
    if server in _NOT_CLUSTER:
        return  # no round trip on every reconnect: the quota client's timeout is 50 ms
    try:
        conn.send_command("INFO", "cluster")
        info = conn.read_response()
    except redis.ResponseError:
        _NOT_CLUSTER.add(server)
        return
    if isinstance(info, bytes):
        info = info.decode(errors="replace")
    if isinstance(info, dict):
        enabled = str(info.get("cluster_enabled", "0"))
    else:
        enabled = next((ln.split(":", 1)[1].strip() for ln in str(info).splitlines()
                        if ln.startswith("cluster_enabled:")), "0")
    if enabled != "1":
        _NOT_CLUSTER.add(server)
    else:
        where = conn.path if getattr(conn, "path", None) else f"{conn.host}:{conn.port}"
        raise redis.ConnectionError(
            f"Redis at {where} is a Redis Cluster node (cluster_enabled:1): tritonguard needs one Redis "
            "server (a primary, with replicas or Sentinel for failover), not a cluster")


def redis_client(url: str, *, timeout: float, retries: bool = False, **kwargs: Any) -> Any:
    """A ``redis.Redis`` for ``url`` as every store opens one: connect and socket timeouts of
    ``timeout`` seconds; without ``retries`` no client-side retry and no health check (a retry
    loop would hold a serving thread through an outage: the stores back off instead); each new
    connection checks that the server is not a Redis Cluster node (:func:`_refuse_cluster`)."""
    import redis  # noqa: PLC0415 - only with a Redis store

    if not retries:
        from redis.backoff import NoBackoff  # noqa: PLC0415
        from redis.retry import Retry  # noqa: PLC0415

        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        kwargs.setdefault("health_check_interval", 0)
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                redis_connect_func=_refuse_cluster, **kwargs)


def store_url(url: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """``url`` when given, else ``$TRITONGUARD_STATE_URL``; "" means the file store."""
    if url is not None:
        return url
    return (os.environ if environ is None else environ).get(ENV_URL, "")


def home(environ: Mapping[str, str] | None = None) -> Path:
    """``$TRITONGUARD_HOME``, else ``<venv>/var/tritonguard``: this machine's own files (the
    launcher's backend dir, runtime files of the file store, object-store caches)."""
    base = (os.environ if environ is None else environ).get("TRITONGUARD_HOME")
    return Path(base) if base else Path(sys.prefix) / "var" / "tritonguard"


def file_lock(path: str | os.PathLike, mode: int = 0o644) -> FileLock:
    """An exclusive ``flock`` on ``path`` (created with ``mode``) for a ``with`` block; the kernel
    drops it when the holder dies. No soft-lock fallback where flock is missing (a marker file
    would outlive a dead holder); a waiter polls every 5 ms (filelock's default is 50). Not
    thread-local, so another thread may release it: make one per holder, never share one."""
    return FileLock(path, mode=mode, fallback_to_soft=False, poll_interval=0.005, thread_local=False)


__all__ = ["ENV_NAMESPACE", "ENV_URL", "NamespaceError", "file_lock", "home", "namespace", "redacted",
           "redis_client", "redis_prefix", "scrubbed", "secrets_of", "store_error", "store_url"]
