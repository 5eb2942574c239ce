"""What the examples' trainings (tinylm in :mod:`examples.generator`, the digits CNN in
:mod:`examples.digits`) share: a pinned thread count, and a folder of trained weights that
several processes share.

A training's result is deterministic for its recipe, its seed, torch's thread count and the
versions of torch and Python, so it is trained on :data:`THREADS` threads whatever the machine,
and a process that names a folder in ``$TRITONGUARD_TRAIN_CACHE`` (the test lanes share one per
run, :mod:`tests.lanes`) loads the weights another process already trained there instead of
training them again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from tritonguard.core.files import atomic_write

TRAIN_CACHE_ENV = "TRITONGUARD_TRAIN_CACHE"

# One thread: tinylm's 200 steps took 12.7 s of CPU for 12.7 s wall, against 21.1 s of CPU for
# 11.4 s wall on two; the digits CNN's 30 epochs 5.8 s of CPU against 7.8 s for 0.4 s less wall
# (2026-11-30). Where cores are shared (the test lanes, a CI runner, a build box), the second
# thread's waits and syncs cost more than it saves.
THREADS = 1

T = TypeVar("T")


@contextlib.contextmanager
def pinned_threads(threads: int = THREADS) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` for the block; the caller's is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cache_key(source: Path, *parts: object) -> str:
    """A key for a training's result: ``parts`` (seed, steps, data version...), the recipe's
    source file, :data:`THREADS` and the versions of torch and Python."""
    text = "/".join(str(p) for p in (*parts, THREADS, torch.__version__, sys.version))
    return hashlib.sha256(text.encode() + b"\n" + Path(source).read_bytes()).hexdigest()[:20]


def cache_folder() -> Path | None:
    cache = os.environ.get(TRAIN_CACHE_ENV)
    return Path(cache) if cache else None


def shared(folder: Path, name: str, key: str, train: Callable[[], T],
           save: Callable[[T], dict[str, Any]], load: Callable[[dict[str, Any]], T]) -> T:
    """``train()``, once for every process that names the same ``folder``: the first trains and
    writes ``save(result)`` (tensors and floats, through ``torch.save``) to ``<name>-<key>.pt``;
    the others wait on its lock and return ``load`` of what it wrote. ``state_dict`` round-trips
    tensors bit for bit, so a loaded model exports the same file a fresh training exports."""
    from filelock import FileLock  # noqa: PLC0415 - only where the cache is asked for

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{key}.pt"
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return load(torch.load(path, weights_only=True))
        result = train()
        buf = io.BytesIO()
        torch.save(save(result), buf)
        atomic_write(path, buf.getvalue())
    return result
