"""Files that appear whole or not at all: the one atomic write of the project.

A file is written under a temporary name in its own folder and renamed over the target
(``os.replace``, atomic on POSIX), so a reader sees the old content or the new, never a part.
``fsync`` makes the content durable before the rename; ``sync_dir`` makes the rename itself
durable (the folder's entry), for documents whose loss in a crash would matter (rollout state).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = True, sync_dir: bool = False,
                mode: int | None = None) -> Iterator[Path]:
    """A temporary path beside ``path`` (not yet existing) for the block to write; on success
    it replaces ``path`` (made durable as asked, chmod ``mode``), on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes | str, *, fsync: bool = True, sync_dir: bool = False,
                 mode: int | None = None) -> None:
    """Write ``data`` (str: UTF-8) to ``path`` atomically; see :func:`atomic_path`."""
    with atomic_path(path, fsync=fsync, sync_dir=sync_dir, mode=mode) as tmp:
        # created as any new file (0666 less the umask) unless a mode is asked for
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)


def file_digest(path: str | os.PathLike, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in 1 MiB chunks (an artifact may be gigabytes).
    ``md5`` is for comparing with an object store's ETag, never for security."""
    h = hashlib.new(algorithm, usedforsecurity=algorithm != "md5")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


__all__ = ["atomic_path", "atomic_write", "file_digest"]
