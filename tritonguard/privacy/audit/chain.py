"""The audit chain's records: how one is hashed and linked, and which files hold the chain.

Each record is ``{"seq", "ts", "prev", "hash", "type", "tenant", "model", ...fields}``: ``hash``
is the SHA-256 of the record's canonical JSON without ``hash`` (:func:`canonical`,
:func:`record_hash`), and ``prev`` is the hash of the record before it (:data:`GENESIS`,
``"0" * 64``, for the first ever). Editing, inserting or deleting a line breaks the chain at that
line, and :func:`tritonguard.privacy.audit.verify.verify` names it. The chain runs on across
rotated files (``path.N`` … ``path.1``, ``path``: :func:`rotated_files`) and across restarts (the
writer resumes from the last line). Records hold hashes and ids only (see :func:`digest`), never
request contents; ``gap`` and ``truncation`` records are the writer's own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

GENESIS = "0" * 64
RESERVED = frozenset(("seq", "ts", "prev", "hash", "type", "tenant", "model"))
GAP, TRUNCATION = "gap", "truncation"  # record types only the writer itself writes
INTERNAL_TYPES = frozenset((GAP, TRUNCATION))


def digest(data: bytes | str, key: bytes | None = None) -> str:
    """SHA-256 hex of ``data`` (HMAC-SHA-256 with ``key``) for audit fields.

    Use a key for low-entropy values (tenant-chosen ids, short prompts): a plain hash of those
    can be reversed by guessing.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if key is not None:
        return hmac.new(key, raw, hashlib.sha256).hexdigest()
    return hashlib.sha256(raw).hexdigest()


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes that are hashed: sorted keys, no whitespace, non-JSON values as ``str``."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode("utf-8")


def record_hash(record: dict[str, Any]) -> str:
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != "hash"})).hexdigest()


def rotated_files(path: str | os.PathLike[str]) -> list[Path]:
    """The chain's files, oldest first: ``path.N`` … ``path.1``, then ``path``."""
    base = Path(path)
    numbered = []
    for p in base.parent.glob(base.name + ".*"):
        suffix = p.name[len(base.name) + 1:]
        if suffix.isdigit():
            numbered.append((int(suffix), p))
    files = [p for _, p in sorted(numbered, reverse=True)]
    if base.exists():
        files.append(base)
    return files


def utc_iso(ts: Any) -> str:
    """A record's ``ts`` as ISO 8601 UTC (to the hundredth of a second)."""
    try:
        return datetime.fromtimestamp(float(ts), timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    except (TypeError, ValueError, OverflowError, OSError):
        return str(ts)


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, plural unless ``n`` is 1 (for the texts of log and verify)."""
    return f"{n} {word}{'' if n == 1 else 's'}"
