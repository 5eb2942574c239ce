"""Append-only, hash-chained audit log in JSON Lines.

Each record is ``{"seq", "ts", "prev", "hash", "type", "tenant", "model", ...fields}``: ``hash``
is the SHA-256 of the record's canonical JSON without ``hash``, and ``prev`` is the hash of the
record before it (``"0" * 64`` for the first ever). Editing, inserting or deleting a line breaks
the chain at that line, and :func:`verify` names it. The chain runs on across rotated files
(``path.N`` … ``path.1``, ``path``) and across restarts (the writer resumes from the last line).

Serving must never wait on the disk: :meth:`AuditLog.record` only puts the record on a bounded
queue and counts it in ``dropped`` when the queue is full; a daemon thread batches, appends and
fsyncs. Records hold hashes and ids only (see :func:`digest`), never request contents.

One writer per file. Two :class:`AuditLog` instances (or processes) appending to the same path
would interleave two chains, so the second one fails at construction (an advisory lock on
``path.lock``); give each guard instance its own file, e.g. suffixed with the process id.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)

GENESIS = "0" * 64
RESERVED = frozenset(("seq", "ts", "prev", "hash", "type", "tenant", "model"))
_TAIL_BYTES = 1 << 20  # a record is far smaller; enough to find the last complete line


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


@dataclass(kw_only=True)
class AuditConfig:
    """``audit.*`` parameters of a guard model."""

    path: str = ""  # JSON Lines file; empty = no audit log
    max_bytes: int = 64 * 1024 * 1024  # rotate to path.1, path.2, … beyond this size
    queue_size: int = 10000  # records waiting for the writer; more are dropped (and counted)
    flush_interval_ms: int = 200  # how long the writer lets a batch gather before one fsync

    def __post_init__(self) -> None:
        if self.max_bytes < 4096:
            raise ValueError("audit.max_bytes must be >= 4096")
        if self.queue_size <= 0:
            raise ValueError("audit.queue_size must be > 0")
        if self.flush_interval_ms < 0:
            raise ValueError("audit.flush_interval_ms must be >= 0")


@dataclass
class VerifyResult:
    ok: bool
    records: int  # records read, all files together
    first_bad: int | None  # 0-based position of the first bad record in the whole chain (= its seq)
    reason: str


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


def _last_line(path: Path) -> bytes | None:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_BYTES))
        lines = f.read().splitlines()
    return lines[-1] if lines else None


class AuditLog:
    """Non-blocking writer of one hash chain (see the module docstring)."""

    def __init__(self, config: AuditConfig):
        self.config = config
        self.dropped = 0  # records refused because the queue was full
        self.written = 0
        self.write_errors = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if not config.path:
            return
        self.path = Path(config.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"audit.path '{self.path}' is being written by another audit log; "
                              "give each guard instance its own file (e.g. suffix it with the pid)") from None
        self._seq, self._prev = self._resume()
        self._fd = self._open()
        self._thread = threading.Thread(target=self._run, name=f"audit-{self.path.name}", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    # -- producer side (serving threads) ------------------------------------------------
    def record(self, type: str, /, *, tenant: str = "", model: str = "", **fields: Any) -> bool:
        """Queue one record; never blocks. False when disabled, closed, or dropped (queue full)."""
        if self._thread is None or self._closed:
            return False
        clash = RESERVED.intersection(fields)
        if clash:
            raise ValueError(f"audit fields {sorted(clash)} are reserved")
        try:
            self._queue.put_nowait((time.time(), type, tenant, model, fields))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far is on disk (tests, shutdown)."""
        if self._thread is None or not self._thread.is_alive():
            return False
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer and release the file."""
        if self._thread is None or self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.error("audit log %s: queue still full after %.0f s; closing without draining", self.path, timeout)
        self._wake.set()
        self._thread.join(timeout)
        os.close(self._fd)
        os.close(self._lock_fd)

    # -- writer thread --------------------------------------------------------------------
    def _resume(self) -> tuple[int, str]:
        """(next seq, last hash) from the newest non-empty file of the chain."""
        for p in reversed(rotated_files(self.path)):
            if p.stat().st_size == 0:
                continue
            self._drop_torn_tail(p)
            line = _last_line(p)
            if line is None:
                continue
            try:
                rec = json.loads(line)
                return int(rec["seq"]) + 1, str(rec["hash"])
            except (ValueError, KeyError, TypeError):
                # Chain on from the raw line so the break stays visible to verify() right there.
                log.error("audit log %s: last line is not a valid record; chaining on from its raw hash", p)
                return 0, hashlib.sha256(line).hexdigest()
        return 0, GENESIS

    @staticmethod
    def _drop_torn_tail(p: Path) -> None:
        # Batches are fsynced whole, so only a crash mid-write leaves a line without its newline:
        # cut it off, or every later record would be glued onto it.
        with open(p, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read()
            if data.endswith(b"\n"):
                return
            keep = size - len(data) + data.rfind(b"\n") + 1
            log.error("audit log %s: dropping %d bytes of a torn last line", p, size - keep)
            f.truncate(keep)

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(fd).st_size
        return fd

    def _run(self) -> None:
        interval = self.config.flush_interval_ms / 1000
        stop = False
        while not stop:
            first = self._queue.get()
            # let a burst gather so that it costs one write and one fsync, not one per record
            if first is not None and not isinstance(first, threading.Event):
                self._wake.wait(interval)
            self._wake.clear()
            batch, waiters = [], []
            item = first
            while True:
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    waiters.append(item)
                else:
                    batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self._write_batch(batch)
                except Exception:  # noqa: BLE001 - the writer thread must survive anything
                    log.exception("audit log %s: writer failed", self.path)
            for w in waiters:
                w.set()

    def _write_batch(self, batch: list[tuple[float, str, str, str, dict[str, Any]]]) -> None:
        seq, prev = self._seq, self._prev
        lines = []
        for ts, typ, tenant, model, fields in batch:
            rec = {"seq": seq, "ts": ts, "prev": prev, "type": typ, "tenant": tenant, "model": model, **fields}
            try:
                body = canonical(rec)
            except (TypeError, ValueError):  # e.g. mixed-type dict keys in a field
                self.dropped += 1
                log.error("audit log %s: record of type %r is not JSON-serialisable; dropped", self.path, typ)
                continue
            prev = hashlib.sha256(body).hexdigest()
            # the stored line is the hashed body with "hash" put in front: no second encoding
            lines.append(b'{"hash":"' + prev.encode() + b'",' + body[1:] + b"\n")
            seq += 1
        start, rotated = self._size, False
        try:
            for line in lines:
                if self._size and self._size + len(line) > self.config.max_bytes:
                    os.fsync(self._fd)
                    self._rotate()
                    rotated = True
                _write_all(self._fd, line)
                self._size += len(line)
            os.fsync(self._fd)
        except OSError:
            self.write_errors += 1
            self.dropped += len(lines)
            log.exception("audit log %s: write failed; %d records lost", self.path, len(lines))
            # Chain the next batch on from the last record known to be on disk, and cut off what
            # may be half-written, so verify() shows exactly where records went missing.
            if not rotated:
                try:
                    os.ftruncate(self._fd, start)
                    self._size = start
                except OSError:
                    self._size = os.fstat(self._fd).st_size
            return
        self._seq, self._prev = seq, prev
        self.written += len(lines)

    def _rotate(self) -> None:
        os.close(self._fd)
        for p in rotated_files(self.path)[:-1]:  # highest number first: no rename overwrites
            n = int(p.name.rsplit(".", 1)[1])
            os.rename(p, f"{self.path}.{n + 1}")
        os.rename(self.path, f"{self.path}.1")
        self._fd = self._open()
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the renames durable before records land in the new file
        finally:
            os.close(dir_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def verify(path: str | os.PathLike[str]) -> VerifyResult:
    """Check every hash, ``prev`` link and ``seq`` of the chain, oldest rotated file first."""
    files = rotated_files(path)
    if not files:
        return VerifyResult(False, 0, None, f"{path}: no audit log files")
    expected_prev, pos, bad, reason = GENESIS, 0, None, ""
    for p in files:
        with open(p, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if bad is None:
                    problem = _check(line, pos, expected_prev)
                    if problem:
                        bad, reason = pos, f"{p.name}:{lineno}: {problem}"
                    else:
                        expected_prev = json.loads(line)["hash"]
                pos += 1
    return VerifyResult(bad is None, pos, bad, reason or "ok")


def _check(line: bytes, pos: int, expected_prev: str) -> str:
    try:
        rec = json.loads(line)
    except ValueError:
        return "not valid JSON"
    if not isinstance(rec, dict) or not isinstance(rec.get("hash"), str):
        return "not an audit record"
    if rec["hash"] != record_hash(rec):
        return f"hash mismatch (record seq {rec.get('seq')} was altered)"
    if rec.get("prev") != expected_prev:
        return f"prev does not match the hash of the record before (seq {rec.get('seq')}; records missing or reordered)"
    if rec.get("seq") != pos:
        return f"seq {rec.get('seq')} where {pos} was expected"
    return ""
