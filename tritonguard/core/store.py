"""The store's primitives every plane shares: where the shared store is, and a file lock.

Everything several processes (Triton model instances, replicas, the exporter) must share goes
through one store: Redis when ``$TRITONGUARD_STATE_URL`` (or an explicit URL) names one, else
files beside the guard's model folder, serialised by :func:`file_lock`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from filelock import FileLock

ENV_URL = "TRITONGUARD_STATE_URL"


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


__all__ = ["ENV_URL", "file_lock", "home", "store_url"]
