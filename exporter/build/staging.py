"""Writing versions into a model repository: the next free version number, staged version
folders moved in whole (all or none, never over an existing version), and the timestamp a
manifest records. Shared by ``export`` and ``compile``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from exporter.build.errors import ExportError
from tritonguard.core import repository as repo_mod


def next_version(repository: Path, models: Sequence[str]) -> int:
    return 1 + max((max(repo_mod.versions(repository / m), default=0) for m in models), default=0)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def place_versions(moves: list[tuple[Path, Path]]) -> None:
    """Move staged version folders into the repository, all or none."""
    for _, dest in moves:
        if dest.exists():
            raise ExportError(f"{dest} already exists; versions are never overwritten")
    placed: list[Path] = []
    try:
        for src, dest in moves:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _move_dir(src, dest)
            placed.append(dest)
    except BaseException:
        for d in placed:
            shutil.rmtree(d, ignore_errors=True)
        raise


def _move_dir(src: Path, dest: Path) -> None:
    try:
        os.rename(src, dest)
        return
    except OSError:
        pass  # another filesystem (EXDEV): copy beside the target, then rename in one step
    # a hidden, non-numeric name: Triton never takes it for a version while it fills up
    partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(src, partial)
        os.rename(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
