"""Stub scan: the Python backend stubs of a server, read from ``/proc``.

A stub is found by its argv (``triton_python_backend_stub <repo>/<model>/<version>/model.py
<shm region> … <instance>``); its model is the ``name:`` of the config.pbtxt above its version
folder, else that folder's name (Triton requires a model's folder to bear its name; a model from an
object store is loaded from a temporary copy named ``folderXXXXXX``). Also what the other parts ask of a
process: whether it is alive, the CPU it used, and removing a dead stub's shared memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

STUB_NAME = "triton_python_backend_stub"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str  # the model's name (its config's ``name:``, else its folder's name)
    instance: str  # e.g. digits_0_0
    shm_region: str
    version_dir: str = ""  # <repository>/<model>/<version>, where Triton found its model.py


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from field 3 (state) on, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a process, or None when it is gone."""
    rest = _stat_fields(pid)
    return None if rest is None else (int(rest[1]), rest[0])


def unlink_shm(region: str) -> None:
    if region and "/" not in region:
        try:
            os.unlink(f"/dev/shm/{region}")
        except OSError:
            pass


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def parse_stub(pid: int, argv: Sequence[str]) -> Stub | None:
    """A Python backend stub from its argv, or None for any other process."""
    if not argv or Path(argv[0]).name != STUB_NAME or len(argv) < 9:
        return None
    model_py = Path(argv[1])
    return Stub(pid=pid, model=model_name(model_py.parent.parent), instance=argv[8], shm_region=argv[2],
                version_dir=str(model_py.parent))


_NAME = re.compile(r'^name\s*:\s*"([^"]+)"', re.M)


def model_name(model_dir: Path) -> str:
    """The ``name:`` in the folder's config.pbtxt, else the folder's name. From an object store,
    Triton loads each model from a temporary copy (``/tmp/folderXXXXXX``) whose name says nothing;
    the copy's config.pbtxt still names the model (the exporter always writes ``name``)."""
    try:
        text = (model_dir / "config.pbtxt").read_text(errors="replace")
    except OSError:
        return model_dir.name
    m = _NAME.search(text)
    return m.group(1) if m else model_dir.name


def read_stub(pid: int) -> Stub | None:
    if not alive(pid):
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return parse_stub(pid, [a.decode(errors="replace") for a in argv if a])


def scan_stubs(parents: set[int]) -> dict[int, Stub]:
    """Live (not zombie) stub processes whose parent is one of ``parents``."""
    found: dict[int, Stub] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        st = _stat(pid)
        if st is None or st[0] not in parents:
            continue
        stub = read_stub(pid)
        if stub is not None:
            found[pid] = stub
    return found


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process has used, or None when it is gone."""
    rest = _stat_fields(pid)  # rest[0] is field 3: utime and stime are fields 14 and 15
    return None if rest is None else (int(rest[11]) + int(rest[12])) / CLOCK_TICKS


__all__ = ["Stub", "alive", "cpu_seconds", "parse_stub", "read_stub", "scan_stubs", "unlink_shm"]
