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

from filelock import FileLock

ENV_URL = "TRITONGUARD_STATE_URL"
ENV_NAMESPACE = "TRITONGUARD_NAMESPACE"
# a namespace is a name: no Redis glob characters (a replica scan must not match another
# fleet's keys), no ':' (it would read as a key part), no braces (they delimit it below)
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class NamespaceError(ValueError):
    """``$TRITONGUARD_NAMESPACE`` is not a usable name."""


def namespace(environ: Mapping[str, str] | None = None) -> str:
    """``$TRITONGUARD_NAMESPACE``: the fleet this process belongs to in a shared Redis ("" for
    none). Every Redis key the project writes carries it (:func:`redis_prefix`), so a staging
    fleet and a production fleet on one Redis neither route, count nor lock each other."""
    ns = (os.environ if environ is None else environ).get(ENV_NAMESPACE, "").strip()
    if ns and not _NAMESPACE.match(ns):
        raise NamespaceError(f"{ENV_NAMESPACE}={ns!r} is not a namespace: use 1-63 letters, digits, '_', '.' "
                             "or '-', starting with a letter or digit")
    return ns


def redis_prefix(kind: str, environ: Mapping[str, str] | None = None) -> str:
    """The key prefix of one kind of Redis key (``state``, ``replica``, ``quota``, …):
    ``tritonguard:<kind>:`` without a namespace (the keys of earlier releases), else
    ``tritonguard:{<namespace>}:<kind>:``. The braces keep every key of one fleet in one Redis
    Cluster hash slot and can never match a glob of the unnamespaced form."""
    ns = namespace(environ)
    return f"tritonguard:{{{ns}}}:{kind}:" if ns else f"tritonguard:{kind}:"


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


__all__ = ["ENV_NAMESPACE", "ENV_URL", "NamespaceError", "file_lock", "home", "namespace", "redis_prefix",
           "store_url"]
