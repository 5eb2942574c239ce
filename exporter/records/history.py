"""The registry's stage history: an append-only JSON Lines file of every registration and
transition, hash-chained as the audit log is (``seq``/``prev``/``hash``, checked by
:func:`tritonguard.privacy.audit.verify.verify`), and what it says about which version a
rollback should restore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tritonguard.core.store import file_lock
from tritonguard.privacy.audit.chain import GENESIS, canonical
from tritonguard.privacy.audit.verify import VerifyResult, verify

log = logging.getLogger(__name__)

HISTORY_FILE = "registry_history.jsonl"


def append_record(path: Path, fields: dict[str, Any], clock: Callable[[], float]) -> None:
    """One hash-chained record; the caller holds the registry lock, this file lock covers
    remote registries whose lock is only optimistic."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(f"{path}.lock"):
        seq, prev = tail(path)
        rec = {"seq": seq, "ts": clock(), "prev": prev, **fields}
        body = canonical(rec)
        line = b'{"hash":"' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:] + b"\n"
        with open(path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def check_history(path: Path) -> VerifyResult:
    if not path.exists():
        return VerifyResult(True, 0, None, "no history yet")
    return verify(path)


def read_records(path: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Records of ``name`` (all models if None), oldest first, unchecked (see :func:`check_history`)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if name is None or r.get("model") == name]


def rollback_target(records: list[dict[str, Any]], current: int | None) -> int | None:
    """The latest version that was PRODUCTION in ``records`` before ``current`` and did not
    leave production through a rollback (the version a rollback should restore)."""
    rolled_back: set[int] = set()
    for rec in records:
        if rec["type"] == "transition" and rec.get("rollback"):
            rolled_back.update(rec.get("archived", []))
        elif rec["type"] == "transition" and rec["to"] == "PRODUCTION":
            rolled_back.discard(rec["version"])  # promoted again on purpose
    for rec in reversed(records):
        v = rec.get("version")
        if rec["type"] == "transition" and rec["to"] == "PRODUCTION" and v != current \
                and v not in rolled_back:
            return v
    return None


def tail(path: Path) -> tuple[int, str]:
    """(next seq, hash of the last record) of the history file."""
    if not path.exists() or path.stat().st_size == 0:
        return 0, GENESIS
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - (1 << 16)))
        last = f.read().splitlines()[-1]
    try:
        rec = json.loads(last)
        return int(rec["seq"]) + 1, str(rec["hash"])
    except (ValueError, KeyError, TypeError):
        # chain on from the raw line so verify() still points at the damage, not past it
        log.error("registry history %s: last line is not a record", path)
        return 0, hashlib.sha256(last).hexdigest()
