"""The audit log's writer: :class:`AuditLog`, one anchored hash chain per file, never blocking.

Serving must never wait on the disk: :meth:`AuditLog.record` only puts the record on a bounded
queue and counts it in ``dropped`` when the queue is full; a daemon thread batches, appends and
fsyncs, and rotates the file beyond ``audit.max_bytes`` (what a record is and how the chain links:
:mod:`tritonguard.privacy.audit.chain`).

**Anchors** (:mod:`tritonguard.privacy.audit.anchors`) are written by the writer thread every
``anchor_records`` records or ``anchor_interval_ms``, whichever comes first, at start and on
close; always after the records they count are fsynced, so an anchor is never ahead of the disk.

**Gaps.** Records lost on the way (queue full, write failed, not serialisable) are counted; the
first record written once writing works again is a ``gap`` record: how many, their time range,
why. On start the writer compares the log with its anchors: when records are missing it writes a
``truncation`` record first, so the loss stays in the chain after newer anchors replace the old.

One writer per file. Two :class:`AuditLog` instances (or processes) appending to the same path
would interleave two chains, so the second one fails at construction (an advisory lock on
``path.lock``); give each guard instance its own file, e.g. suffixed with the process id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonguard.core.errors import ConfigError
from tritonguard.core.files import atomic_write
from tritonguard.core.store import file_lock
from tritonguard.privacy.audit.anchors import (
    KEY_ENV,
    AnchorStore,
    anchor_name,
    load_audit_key,
    local_anchor_path,
    make_anchor,
    read_anchors,
)
from tritonguard.privacy.audit.chain import (
    GAP,
    GENESIS,
    INTERNAL_TYPES,
    RESERVED,
    TRUNCATION,
    canonical,
    plural,
    rotated_files,
)

log = logging.getLogger(__name__)
_TAIL_BYTES = 1 << 20  # a record is far smaller; enough to find the last complete line
_LOG_EVERY_S = 10.0  # repeated writer failures (disk full, store down) are logged at most this often


@dataclass(kw_only=True)
class AuditConfig:
    """``audit.*`` parameters of a guard model."""

    path: str = ""  # JSON Lines file; empty = no audit log
    max_bytes: int = 64 * 1024 * 1024  # rotate to path.1, path.2, … beyond this size
    queue_size: int = 10000  # records waiting for the writer; more are dropped (and counted)
    flush_interval_ms: int = 200  # how long the writer lets a batch gather before one fsync
    anchor_records: int = 1000  # re-anchor at least every this many records …
    anchor_interval_ms: int = 1000  # … and within this long of the last record written
    key_env: str = KEY_ENV  # variable holding the anchors' HMAC key; unset: checksummed only

    def __post_init__(self) -> None:
        if self.max_bytes < 4096:
            raise ValueError("audit.max_bytes must be >= 4096")
        if self.queue_size <= 0:
            raise ValueError("audit.queue_size must be > 0")
        if self.flush_interval_ms < 0:
            raise ValueError("audit.flush_interval_ms must be >= 0")
        if self.anchor_records < 1:
            raise ValueError("audit.anchor_records must be >= 1")
        if self.anchor_interval_ms < 0:
            raise ValueError("audit.anchor_interval_ms must be >= 0")


def _last_line(path: Path) -> bytes | None:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_BYTES))
        lines = f.read().splitlines()
    return lines[-1] if lines else None


class AuditLog:
    """Non-blocking writer of one anchored hash chain (see the module docstring)."""

    def __init__(self, config: AuditConfig, *, anchors: AnchorStore | None = None,
                 environ: Mapping[str, str] | None = None, clock: Any = time.time):
        self.config = config
        self.anchors = anchors
        self.clock = clock
        self.dropped = 0  # records lost: refused (queue full), not serialisable, or failed to write
        self.written = 0  # records written to the chain by this writer (gap records included)
        self.write_errors = 0
        self.anchor_errors = 0
        self.anchored_seq: int | None = None  # the seq of the last anchor written
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        # records lost and not yet reported in a gap record; also touched by serving threads
        self._lost_lock = threading.Lock()
        self._lost = 0
        self._lost_span: tuple[float, float] | None = None
        self._lost_why: dict[str, int] = {}
        self._notes: list[dict[str, Any]] = []  # truncation records to write before anything else
        self._tended_at = time.monotonic()  # when the anchor / pending gap was last written or tried
        self._local_seq: int | None = None  # seq of the anchor in <path>.anchor / in the store
        self._store_seq: int | None = None
        self._logged_at: dict[str, float] = {}
        if not config.path:
            return
        self._key = load_audit_key(config.key_env, environ)
        self.path = Path(config.path)
        self.name = anchor_name(self.path)
        self.anchor_path = local_anchor_path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owner = file_lock(f"{self.path}.lock", 0o600)
        try:
            self._owner.acquire(blocking=False)
        except OSError:  # filelock.Timeout is one
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
        if type in INTERNAL_TYPES:
            raise ValueError(f"audit record type {type!r} is reserved for the writer")
        ts = time.time()
        try:
            self._queue.put_nowait((ts, type, tenant, model, fields))
        except queue.Full:
            self._lose(1, "queue_full", ts, ts)
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued so far is on disk and anchored (tests, shutdown)."""
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
        """Write what is queued, anchor, then stop the writer and release the file."""
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
        self._owner.release()
        closer = getattr(self.anchors, "close", None)
        if closer is not None:
            closer()

    # -- lost records ---------------------------------------------------------------------
    def _lose(self, n: int, why: str, first_ts: float, last_ts: float, *, count: bool = True) -> None:
        """Note ``n`` lost records for the next gap record (``count``: and in ``dropped``)."""
        if n <= 0:
            return
        with self._lost_lock:
            if count:
                self.dropped += n
            self._lost += n
            self._lost_why[why] = self._lost_why.get(why, 0) + n
            lo, hi = self._lost_span or (first_ts, last_ts)
            self._lost_span = (min(lo, first_ts), max(hi, last_ts))

    def _take_lost(self) -> dict[str, Any] | None:
        with self._lost_lock:
            if not self._lost:
                return None
            lo, hi = self._lost_span or (0.0, 0.0)
            gap = {"lost": self._lost, "first_lost_ts": lo, "last_lost_ts": hi, "reasons": dict(self._lost_why)}
            self._lost, self._lost_span, self._lost_why = 0, None, {}
        return gap

    def _give_back(self, gap: dict[str, Any]) -> None:
        """A gap record that did not reach the disk: its count goes back to the pending ones."""
        for why, n in gap["reasons"].items():
            self._lose(n, why, gap["first_lost_ts"], gap["last_lost_ts"], count=False)

    def _pending(self) -> bool:
        return bool(self._lost or self._notes)

    def _log_limited(self, what: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._logged_at.get(what, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged_at[what] = now
            log.error(msg, *args)

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

    def _hash_at(self, seq: int) -> str | None:
        """The hash of record ``seq`` of this chain on disk, None if it is not there."""
        if seq == self._seq - 1:
            return self._prev
        for p in reversed(rotated_files(self.path)):
            with open(p, "rb") as f:
                try:
                    first = int(json.loads(f.readline())["seq"])
                except (ValueError, KeyError, TypeError):
                    continue
                if first > seq:
                    continue
                f.seek(0)
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and rec.get("seq") == seq:
                        return str(rec.get("hash"))
            return None
        return None

    def _check_anchors(self) -> None:
        """At start: does the log still hold what its anchors counted? If not, the first records
        written are ``truncation`` records saying what is missing (the old anchors are replaced
        next, and the loss must not go with them)."""
        stores = [self.anchors] if self.anchors is not None else []
        found, bad, warnings = read_anchors(self.path, stores, name=self.name, key=self._key,
                                            require_signature=False, other_key_ok=True)
        for w in warnings:
            log.warning("audit log %s: %s", self.path, w)
        now = self.clock()
        for problem in bad:
            log.error("audit log %s: %s", self.path, problem)
            self._notes.append({"found": self._seq, "missing": None, "detail": problem, "detected_ts": now})
        for doc in sorted(found, key=lambda d: -d["seq"]):
            base = {"anchor_at": doc["at"], "anchor_seq": doc["seq"], "anchor_head": doc["head"],
                    "anchor_ts": doc["ts"], "found": self._seq, "detected_ts": now}
            if doc["seq"] > self._seq:
                missing = doc["seq"] - self._seq
                detail = (f"{plural(missing, 'record')} missing after seq {self._seq - 1}: the anchor counted "
                          f"{doc['seq']}, the log holds {self._seq}")
                self._notes.append({**base, "missing": missing, "detail": detail})
            elif doc["seq"] > 0 and self._hash_at(doc["seq"] - 1) != doc["head"]:
                detail = f"the anchored record seq {doc['seq'] - 1} is not in the chain: records up to it were replaced"
                self._notes.append({**base, "missing": None, "detail": detail})
            else:
                continue
            log.error("audit log %s: truncated: %s (anchor %s)", self.path, detail, doc["at"])
            break  # one record for the worst anchor is enough

    def _run(self) -> None:
        try:
            self._check_anchors()
        except Exception:  # noqa: BLE001 - the writer thread must survive anything
            log.exception("audit log %s: checking the anchors failed", self.path)
        self._housekeep(force=True)
        interval = self.config.flush_interval_ms / 1000
        stop = False
        while not stop:
            try:
                first = self._queue.get(timeout=self._idle_timeout())
            except queue.Empty:
                self._housekeep()  # un-anchored records, or a gap record still to write
                continue
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
            self._housekeep(force=stop or bool(waiters))
            for w in waiters:
                w.set()

    def _idle_timeout(self) -> float | None:
        """How long the writer may sleep: for ever while everything is anchored and reported."""
        if self.anchored_seq == self._seq and not self._pending():
            return None
        due = self._tended_at + self.config.anchor_interval_ms / 1000 - time.monotonic()
        return max(0.01, due)

    def _housekeep(self, force: bool = False) -> None:
        """Write a pending gap / truncation record and the anchor when due (``force``: now).
        What fails (disk full, store down) is tried again ``anchor_interval_ms`` later."""
        due = force or time.monotonic() - self._tended_at >= self.config.anchor_interval_ms / 1000
        try:
            if self._pending() and due:
                self._write_batch([])
            if self.anchored_seq != self._seq and (
                    due or self._seq - (self.anchored_seq or 0) >= self.config.anchor_records):
                self._write_anchor()
        except Exception:  # noqa: BLE001 - the writer thread must survive anything
            log.exception("audit log %s: anchoring failed", self.path)
        finally:
            if due:
                self._tended_at = time.monotonic()

    def _write_anchor(self) -> None:
        """The anchor of what is on disk now, to every place that does not hold it yet."""
        doc = make_anchor(name=self.name, path=os.path.abspath(self.path), seq=self._seq, head=self._prev,
                          ts=self.clock(), dropped=self.dropped, key=self._key)
        blob = json.dumps(doc, sort_keys=True)
        if self._local_seq != self._seq:
            try:
                atomic_write(self.anchor_path, blob.encode("utf-8"), mode=0o600)
                self._local_seq = self._seq
            except OSError as exc:
                self.anchor_errors += 1
                self._log_limited("anchor-local", "audit log %s: cannot write its anchor %s: %s",
                                  self.path, self.anchor_path, exc)
        if self.anchors is not None and self._store_seq != self._seq:
            try:
                self.anchors.put(self.name, blob)
                self._store_seq = self._seq
            except Exception as exc:  # noqa: BLE001 - any store: the writer must go on
                self.anchor_errors += 1
                self._log_limited("anchor-store", "audit log %s: %s", self.path, exc)
        self._tended_at = time.monotonic()  # a failed place is tried again after anchor_interval_ms
        if self._local_seq == self._seq and (self.anchors is None or self._store_seq == self._seq):
            self.anchored_seq = self._seq

    def _write_batch(self, batch: list[tuple[float, str, str, str, dict[str, Any]]]) -> None:
        seq, prev = self._seq, self._prev
        now = self.clock()
        notes = list(self._notes)
        gap = self._take_lost()
        internal: list[tuple[float, str, str, str, dict[str, Any]]] = [
            (now, TRUNCATION, "", "", n) for n in notes]
        if gap is not None:
            internal.append((now, GAP, "", "", gap))
        lines, unserialisable = [], []
        for ts, typ, tenant, model, fields in internal + list(batch):
            rec = {"seq": seq, "ts": ts, "prev": prev, "type": typ, "tenant": tenant, "model": model, **fields}
            try:
                body = canonical(rec)
            except (TypeError, ValueError):  # e.g. mixed-type dict keys in a field
                unserialisable.append(ts)
                log.error("audit log %s: record of type %r is not JSON-serialisable; dropped", self.path, typ)
                continue
            prev = hashlib.sha256(body).hexdigest()
            # the stored line is the hashed body with "hash" put in front: no second encoding
            lines.append(b'{"hash":"' + prev.encode() + b'",' + body[1:] + b"\n")
            seq += 1
        if unserialisable:  # reported by the next gap record
            self._lose(len(unserialisable), "unserialisable", min(unserialisable), max(unserialisable))
        start, rotated = self._size, False
        try:
            # one write per file of the batch, not one per record: at 2,000 records/s the writes
            # per line were most of the writer thread's time, taken from the serving thread's GIL
            pending: list[bytes] = []
            for line in lines:
                if self._size and self._size + len(line) > self.config.max_bytes:
                    if pending:
                        _write_all(self._fd, b"".join(pending))
                        pending.clear()
                    os.fsync(self._fd)
                    self._rotate()
                    rotated = True
                pending.append(line)
                self._size += len(line)
            if pending:
                _write_all(self._fd, b"".join(pending))
            os.fsync(self._fd)
        except OSError as exc:
            self.write_errors += 1
            if gap is not None:
                self._give_back(gap)
            n_lost = len(batch) - len(unserialisable)  # the rest of this batch is lost with it
            if batch:
                self._lose(n_lost, "write_error", min(b[0] for b in batch), max(b[0] for b in batch))
            self._log_limited("write", "audit log %s: write failed (%s); %d records lost, %d in all so far",
                              self.path, exc, n_lost, self.dropped)
            # Chain the next batch on from the last record known to be on disk, and cut off what
            # may be half-written, so verify() shows exactly where records went missing.
            if not rotated:
                try:
                    os.ftruncate(self._fd, start)
                    self._size = start
                except OSError:
                    self._size = os.fstat(self._fd).st_size
            return
        if notes:
            del self._notes[:len(notes)]
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
