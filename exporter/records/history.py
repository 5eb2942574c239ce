"""The registry's stage history: an append-only JSON Lines chain of every registration and
transition, hash-chained as the audit log is (``seq``/``prev``/``hash``, checked by
:func:`tritonguard.privacy.audit.verify.verify`), and what it says about which version a
rollback should restore.

Where it lives: beside a folder repository, one file (:class:`FileHistory`); for an object-store
repository, in the store, one object per record beside the repository (:class:`StoreHistory`),
so that it outlives any machine's working copy and every machine sees the same chain.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exporter.errors import ExporterError
from tritonguard.core import objectstore
from tritonguard.core.files import atomic_write
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
        line = _line({"seq": seq, "ts": clock(), "prev": prev, **fields})
        with open(path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def _line(rec: dict[str, Any]) -> bytes:
    """The record as its chain line: its hash first, then the canonical body."""
    body = canonical(rec)
    return b'{"hash":"' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:] + b"\n"


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


def stages(records: list[dict[str, Any]]) -> dict[int, str]:
    """Each version's stage as the history tells it (registered DRAFT, then every move, the
    versions a promotion archived included): what a machine without the registry can show."""
    out: dict[int, str] = {}
    for rec in records:
        if rec.get("type") == "register":
            out.setdefault(int(rec["version"]), "DRAFT")
        elif rec.get("type") == "transition":
            out[int(rec["version"])] = str(rec["to"])
            for v in rec.get("archived") or []:
                out[int(v)] = "ARCHIVED"
    return out


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


class HistoryError(ExporterError):
    """The history cannot be read or written where it lives (an object store that is down)."""


class FileHistory:
    """The history as one local file: the fleet's own for a folder repository."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.where = str(self.path)

    def append(self, fields: dict[str, Any], clock: Callable[[], float]) -> None:
        append_record(self.path, fields, clock)

    def load(self, name: str | None = None) -> tuple[VerifyResult, list[dict[str, Any]]]:
        """(the chain's check, the records of ``name``); the records are read even when the check fails."""
        return check_history(self.path), read_records(self.path, name)


HISTORY_DIR = "history"  # under <repository prefix>.registry/ in the store
_KEY = re.compile(r"^(\d{12})\.json$")
APPEND_TRIES = 20  # another writer took the next seq this many times in a row: give up, say so


def history_prefix(spec: objectstore.StoreSpec) -> str:
    """The store prefix of a repository's history: ``<prefix>.registry/history/``, a sibling of
    the repository, so Triton (which treats every folder inside the repository as a model) never
    sees it. A repository at the bucket's root has no sibling: refused (every key of the bucket
    would be a model to ``--load-model=*``)."""
    if not spec.prefix:
        raise HistoryError(f"the repository {spec.url} is the root of its bucket, which leaves no place for the "
                           "registry history outside it (Triton would take it for a model): put the repository "
                           f"under a prefix, e.g. s3://{spec.bucket}/models")
    return f"{spec.prefix}.registry/{HISTORY_DIR}/"


class StoreHistory:
    """The history of an object-store repository, kept in the store itself so that every machine
    reads and appends to the same chain, and no local failure can lose it: one object per
    record, ``<prefix>.registry/history/<seq, 12 digits>.json`` holding the record's line, never
    rewritten or deleted.

    Two writers: a record is created with a conditional put (``If-None-Match: *``), so of two
    exporters appending the same ``seq`` one wins and the other re-reads the tail and chains on
    after it; the chain never forks. This needs a store that honours conditional writes
    atomically (AWS S3 since 2024-11, MinIO); on one that ignores the header, or checks it and
    writes in two steps (moto's threaded server: two puts of one key at once both succeeded, 4
    of 100 keys with a 1 µs switch interval), two simultaneous appends can leave one record, and
    :func:`verify` would not see the loss.

    ``mirror`` is this machine's copy of the chain (a JSON Lines file the audit ``verify``
    checks, and ``<mirror>.index.json``: the ETag of each object copied), brought up to date
    before every read and append; only objects not yet copied, or changed, are fetched. A local
    history file found there that the store does not hold yet (written before the history moved
    to the store) is uploaded once, record by record; one that disagrees with the store is kept
    aside (``<name>.local-<time>.jsonl``), never deleted."""

    def __init__(self, spec: objectstore.StoreSpec, mirror: str | os.PathLike, s3: Any = None):
        self.spec, self.path = spec, Path(mirror)
        self.prefix = history_prefix(spec)
        self.where = f"s3://{spec.bucket}/{self.prefix}"
        self._s3 = s3

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = objectstore.client(self.spec)
        return self._s3

    def _fail(self, what: str, exc: BaseException) -> HistoryError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return HistoryError(f"registry history {self.where}: {what}: {type(exc).__name__}: {text}")

    def key(self, seq: int) -> str:
        return f"{self.prefix}{seq:012d}.json"

    def _listing(self) -> list[tuple[str, str]]:
        """(key, ETag) of every record object, by seq."""
        out = []
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.spec.bucket, Prefix=self.prefix):
                for obj in page.get("Contents", []) or []:
                    if _KEY.match(obj["Key"][len(self.prefix):]):
                        out.append((obj["Key"], str(obj.get("ETag", "")).strip('"')))
                    else:
                        log.warning("registry history %s: %s is not a record object: ignored", self.where, obj["Key"])
        except Exception as exc:  # noqa: BLE001 - botocore's errors: one line
            raise self._fail("cannot list it", exc) from None
        return sorted(out)

    def _get(self, key: str) -> bytes:
        try:
            body = self.s3.get_object(Bucket=self.spec.bucket, Key=key)["Body"].read()
        except Exception as exc:  # noqa: BLE001
            raise self._fail(f"cannot read {key}", exc) from None
        return body if body.endswith(b"\n") else body + b"\n"

    def _index_path(self) -> Path:
        return self.path.with_name(self.path.name + ".index.json")

    def sync(self) -> None:
        """Make the mirror the store's chain (see the class docstring)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(f"{self.path}.lock"):
            self._sync()

    def _sync(self) -> list[tuple[str, str]]:
        listed = self._listing()
        index_path = self._index_path()
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = None  # no mirror yet, or a history file from before the store kept it
        old = self.path.read_bytes() if self.path.exists() else b""
        if index is None and old.strip() and not listed:
            self._migrate(old)
            listed = self._listing()
            index = {}
        lines = old.splitlines(keepends=True)
        kept: list[bytes] = []
        if index:
            for (key, etag), line in zip(listed, lines, strict=False):
                if index.get(key) != etag:
                    break
                kept.append(line)
        fresh = kept + [self._get(key) for key, _ in listed[len(kept):]]
        new = b"".join(fresh)
        if new != old:
            if old.strip() and not new.startswith(old):
                aside = self.path.with_name(f"{self.path.stem}.local-{time.strftime('%Y%m%dT%H%M%S')}.jsonl")
                os.replace(self.path, aside)
                log.warning("registry history: the local copy disagreed with %s; kept as %s", self.where, aside)
            atomic_write(self.path, new)
        atomic_write(index_path, json.dumps(dict(listed), sort_keys=True))
        return listed

    def _migrate(self, old: bytes) -> None:
        """Upload a history file kept locally before the store held the history, as it is."""
        lines = [ln for ln in old.splitlines(keepends=True) if ln.strip()]
        for seq, line in enumerate(lines):
            if not self._create(self.key(seq), line):
                raise HistoryError(f"registry history {self.where}: another writer appended while this "
                                   f"machine's local history ({len(lines)} records) was being uploaded; run again")
        log.warning("registry history: %d record(s) kept on this machine copied to %s", len(lines), self.where)

    def _create(self, key: str, body: bytes) -> bool:
        """Put ``key`` only if it does not exist; False when another writer has it."""
        try:
            self.s3.put_object(Bucket=self.spec.bucket, Key=key, Body=body, IfNoneMatch="*",
                               ContentType="application/json")
        except Exception as exc:  # noqa: BLE001
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return False
            raise self._fail(f"cannot write {key}", exc) from None
        return True

    def append(self, fields: dict[str, Any], clock: Callable[[], float]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(f"{self.path}.lock"):
            for _ in range(APPEND_TRIES):
                self._sync()
                seq, prev = tail(self.path)
                line = _line({"seq": seq, "ts": clock(), "prev": prev, **fields})
                if self._create(self.key(seq), line):
                    self._sync()
                    return
                log.info("registry history %s: seq %d was taken by another writer; chaining after it", self.where, seq)
        raise HistoryError(f"registry history {self.where}: other writers took the next record {APPEND_TRIES} "
                           "times in a row; nothing appended")

    def load(self, name: str | None = None) -> tuple[VerifyResult, list[dict[str, Any]]]:
        self.sync()
        return check_history(self.path), read_records(self.path, name)
