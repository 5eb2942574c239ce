"""Append-only, hash-chained audit log in JSON Lines, anchored outside the log.

Each record is ``{"seq", "ts", "prev", "hash", "type", "tenant", "model", ...fields}``: ``hash``
is the SHA-256 of the record's canonical JSON without ``hash``, and ``prev`` is the hash of the
record before it (``"0" * 64`` for the first ever). Editing, inserting or deleting a line breaks
the chain at that line, and :func:`verify` names it. The chain runs on across rotated files
(``path.N`` … ``path.1``, ``path``) and across restarts (the writer resumes from the last line).

Serving must never wait on the disk: :meth:`AuditLog.record` only puts the record on a bounded
queue and counts it in ``dropped`` when the queue is full; a daemon thread batches, appends and
fsyncs. Records hold hashes and ids only (see :func:`digest`), never request contents.

**Anchors.** A chain cannot show a lost tail: without its last records (or emptied) it still
verifies. So the writer thread keeps the chain's latest *anchor* outside the log: ``{"name"
(host:path), "seq" (records written so far), "head" (hash of the last one), "ts", "dropped"}``,
HMAC-SHA-256-signed with ``$TRITONGUARD_AUDIT_KEY`` (``audit.key_env``) when set, else only
checksummed. It is replaced atomically in ``<path>.anchor`` and, for a guard, in its state store
(:class:`FileAnchors` beside the rollout state, or :class:`RedisAnchors` when
``$TRITONGUARD_STATE_URL`` is set) every ``anchor_records`` records or ``anchor_interval_ms``,
whichever comes first, at start and on close; always after the records it counts are fsynced, so
an anchor is never ahead of the disk. :func:`verify` reports a chain shorter than an anchor, or
one whose anchored head is not in it, as truncated.

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
import hmac
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from tritonguard.core.errors import ConfigError, TritonGuardError
from tritonguard.core.files import atomic_write
from tritonguard.core.outage import Backoff
from tritonguard.core.store import ENV_URL, file_lock

log = logging.getLogger(__name__)

GENESIS = "0" * 64
RESERVED = frozenset(("seq", "ts", "prev", "hash", "type", "tenant", "model"))
GAP, TRUNCATION = "gap", "truncation"  # record types only the writer itself writes
INTERNAL_TYPES = frozenset((GAP, TRUNCATION))
KEY_ENV = "TRITONGUARD_AUDIT_KEY"
ANCHOR_SUFFIX = ".anchor"  # the local anchor: <path>.anchor
ANCHOR_PREFIX = "audit_anchor."  # the file store's: <repo>/<guard>/audit_anchor.<log name>.<id>.json
ANCHOR_HASH = "tritonguard:audit:anchors"  # the Redis store's anchors: one hash, a field per log
ANCHOR_VERSION = 1
MIN_KEY_CHARS = 16
_TAIL_BYTES = 1 << 20  # a record is far smaller; enough to find the last complete line
_LOG_EVERY_S = 10.0  # repeated writer failures (disk full, store down) are logged at most this often


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


@dataclass
class VerifyResult:
    ok: bool
    records: int  # records read, all files together
    first_bad: int | None  # 0-based position of the first bad record in the whole chain (= its seq)
    reason: str
    # ok | unanchored (intact, but no anchor to check the tail against) | gaps | truncated |
    # tampered (a bad record, or a bad anchor) | missing (no log, no anchor)
    status: str = "ok"
    missing: int = 0  # records an anchor counts beyond the end of the log
    gaps: list[dict[str, Any]] = field(default_factory=list)  # the chain's gap records
    truncations: list[str] = field(default_factory=list)  # every truncation found, worded
    anchors: list[dict[str, Any]] = field(default_factory=list)  # anchors found (with "at": where)
    warnings: list[str] = field(default_factory=list)


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


def utc_iso(ts: Any) -> str:
    """A record's ``ts`` as ISO 8601 UTC (to the hundredth of a second)."""
    try:
        return datetime.fromtimestamp(float(ts), timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    except (TypeError, ValueError, OverflowError, OSError):
        return str(ts)


# -- anchors ------------------------------------------------------------------------------------
class AnchorError(TritonGuardError):
    """An anchor store could not be read or written."""


class AnchorStore(Protocol):
    """Where anchors live besides ``<path>.anchor``: small JSON blobs by name."""

    def put(self, name: str, blob: str) -> None: ...
    def get(self, name: str) -> str | None: ...


def anchor_name(path: str | os.PathLike[str], host: str | None = None) -> str:
    """The name an audit file's anchor is stored under: ``host:absolute path`` (replicas on
    several hosts may share one Redis and one path)."""
    return f"{host or socket.gethostname()}:{os.path.abspath(path)}"


def local_anchor_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p.with_name(p.name + ANCHOR_SUFFIX)


def load_audit_key(env_name: str = KEY_ENV, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The anchors' HMAC key: the UTF-8 bytes of ``$env_name`` (stripped), None when unset."""
    env = os.environ if environ is None else environ
    raw = (env.get(env_name) or "").strip()
    if not raw:
        return None
    if len(raw) < MIN_KEY_CHARS:
        raise ConfigError(f"${env_name}: an audit key needs at least {MIN_KEY_CHARS} characters "
                          "(e.g. `openssl rand -hex 32`)")
    return raw.encode("utf-8")


def key_id(key: bytes) -> str:
    """A short public id of a key, so that verify can tell 'another key' from 'forged'."""
    return hashlib.sha256(b"tritonguard-audit-key-id\0" + key).hexdigest()[:16]


def make_anchor(*, name: str, path: str | os.PathLike[str], seq: int, head: str, ts: float,
                dropped: int = 0, key: bytes | None = None) -> dict[str, Any]:
    """A signed (``key``) or checksummed anchor of a chain with ``seq`` records ending in ``head``."""
    doc: dict[str, Any] = {"v": ANCHOR_VERSION, "name": name, "path": str(path), "seq": int(seq), "head": head,
                           "ts": ts, "dropped": int(dropped)}
    if key is not None:
        doc.update(alg="hmac-sha256", key_id=key_id(key))
        doc["sig"] = hmac.new(key, canonical(doc), hashlib.sha256).hexdigest()
    else:
        doc["alg"] = "sha256"
        doc["sig"] = hashlib.sha256(canonical(doc)).hexdigest()
    return doc


def check_anchor(doc: Any, key: bytes | None, *, require_signature: bool = True) -> str:
    """'' when ``doc`` is a well-formed anchor whose signature (with ``key``) or checksum holds,
    else what is wrong. With a key, an anchor that is only checksummed is refused
    (``require_signature``): anyone could have written it. A signed anchor is taken unchecked
    when there is no key (the caller warns)."""
    if not isinstance(doc, dict):
        return "not an anchor"
    if doc.get("v") != ANCHOR_VERSION:
        return f"anchor format {doc.get('v')!r} is not supported"
    seq, head = doc.get("seq"), doc.get("head")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        return "not an anchor (bad seq)"
    if not isinstance(head, str) or not re.fullmatch(r"[0-9a-f]{64}", head):
        return "not an anchor (bad head)"
    if not isinstance(doc.get("sig"), str):
        return "not an anchor (no signature)"
    body = canonical({k: v for k, v in doc.items() if k != "sig"})
    alg = doc.get("alg")
    if alg == "hmac-sha256":
        if key is None:
            return ""
        if doc.get("key_id") != key_id(key):
            return f"signed with another key (key id {doc.get('key_id')}, this key's is {key_id(key)})"
        if not hmac.compare_digest(doc["sig"], hmac.new(key, body, hashlib.sha256).hexdigest()):
            return "signature does not match (altered or forged)"
        return ""
    if alg == "sha256":
        if doc["sig"] != hashlib.sha256(body).hexdigest():
            return "checksum does not match (altered)"
        if key is not None and require_signature:
            return "not signed, but a key was given: anyone could have written it"
        return ""
    return f"unknown signature algorithm {alg!r}"


class FileAnchors:
    """Anchors as one small file per audit log in ``directory`` (replaced atomically). A guard's
    are ``<repo>/<guard>/audit_anchor.*.json``, beside its rollout state (files, not a folder:
    Triton reads every sub-folder of a model's folder as a version)."""

    def __init__(self, directory: str | os.PathLike[str], *, prefix: str = ""):
        self.directory = Path(directory)
        self.prefix = prefix

    def __str__(self) -> str:
        return str(self.directory / f"{self.prefix}*.json")

    def file_for(self, name: str) -> Path:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", name.rsplit("/", 1)[-1])[:80]
        return self.directory / f"{self.prefix}{base}.{hashlib.sha256(name.encode()).hexdigest()[:16]}.json"

    def put(self, name: str, blob: str) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(self.file_for(name), blob.encode("utf-8"), mode=0o600)
        except OSError as exc:
            raise AnchorError(f"cannot write an anchor in {self.directory}: {exc}") from None

    def get(self, name: str) -> str | None:
        try:
            return self.file_for(name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise AnchorError(f"cannot read {self.file_for(name)}: {exc}") from None

    def where(self, name: str) -> str:
        return str(self.file_for(name))


class RedisAnchors:
    """Anchors as fields (one per audit log) of one Redis hash. Short timeouts, no client
    retries, and a growing pause after a failure: the audit writer must not stall on Redis."""

    BACKOFF_START_S = 5.0
    BACKOFF_MAX_S = 60.0

    def __init__(self, url: str, *, key: str = ANCHOR_HASH, socket_timeout: float = 0.5, client: Any = None,
                 monotonic: Any = time.monotonic):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        self.url, self.key, self.monotonic = url, key, monotonic
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._health = Backoff(monotonic, self.BACKOFF_START_S, self.BACKOFF_MAX_S)

    def __str__(self) -> str:
        u = urlsplit(self.url)
        return f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}{u.path} {self.key}"

    def where(self, name: str) -> str:
        return f"{self}[{name}]"

    def _call(self, fn: Any) -> Any:
        if not self._health.available():
            raise AnchorError(f"anchor store {self} is backing off after an error")
        try:
            out = fn()
        except self._redis.RedisError as exc:
            self._health.fail()
            raise AnchorError(f"anchor store {self}: {type(exc).__name__}: {exc}") from None
        self._health.recover()
        return out

    def put(self, name: str, blob: str) -> None:
        self._call(lambda: self.client.hset(self.key, name, blob))

    def get(self, name: str) -> str | None:
        raw = self._call(lambda: self.client.hget(self.key, name))
        return None if raw is None else raw.decode("utf-8", "replace")

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing must not fail a shutdown
            pass


def open_anchor_store(model: str, repo_dir: str | os.PathLike[str], url: str | None = None) -> AnchorStore:
    """A guard's anchor store, chosen like :func:`tritonguard.rollout.state.open_store`: Redis when
    ``url`` (default ``$TRITONGUARD_STATE_URL``) is set, else files beside the rollout state."""

    if url is None:
        url = os.environ.get(ENV_URL, "")
    if url:
        return RedisAnchors(url)
    return FileAnchors(Path(repo_dir) / model, prefix=ANCHOR_PREFIX)


def _where(store: Any, name: str) -> str:
    return store.where(name) if hasattr(store, "where") else f"{store}[{name}]"


def read_anchors(path: str | os.PathLike[str], stores: Sequence[Any] = (), *, name: str | None = None,
                 key: bytes | None = None, require_signature: bool = True, other_key_ok: bool = False,
                 ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The anchors of the audit log ``path``: ``<path>.anchor``, then ``name`` (default
    :func:`anchor_name`) in each store. Returns (good anchors, each with ``"at"`` naming where it
    was found; problems with bad ones; warnings). ``other_key_ok`` (the writer, after a key
    change): an anchor signed with another key is taken, unchecked, with a warning."""
    name = name or anchor_name(path)
    found: list[dict[str, Any]] = []
    bad: list[str] = []
    warnings: list[str] = []
    sources: list[tuple[str, Any]] = [(str(local_anchor_path(path)), None), *((_where(s, name), s) for s in stores)]
    for where, store in sources:
        try:
            if store is None:
                try:
                    blob: str | None = local_anchor_path(path).read_text(encoding="utf-8")
                except FileNotFoundError:
                    blob = None
            else:
                blob = store.get(name)
        except (OSError, UnicodeDecodeError, AnchorError) as exc:
            warnings.append(f"anchor {where} could not be read: {exc}")
            continue
        if blob is None:
            continue
        try:
            doc = json.loads(blob)
        except ValueError:
            doc = None
        problem = check_anchor(doc, key, require_signature=require_signature)
        if problem and other_key_ok and key is not None and check_anchor(doc, None) == "" \
                and doc.get("alg") == "hmac-sha256" and doc.get("key_id") != key_id(key):
            warnings.append(f"anchor {where}: {problem}; its counts were compared unchecked")
        elif problem:
            bad.append(f"anchor {where}: {problem}")
            continue
        if doc.get("alg") != "sha256" and key is None:
            warnings.append(f"anchor {where} is signed, but no key was given (${KEY_ENV}): its signature was "
                            "not checked")
        found.append({**doc, "at": where})
    return found, bad, warnings


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
                detail = (f"{_n(missing, 'record')} missing after seq {self._seq - 1}: the anchor counted "
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
            for line in lines:
                if self._size and self._size + len(line) > self.config.max_bytes:
                    os.fsync(self._fd)
                    self._rotate()
                    rotated = True
                _write_all(self._fd, line)
                self._size += len(line)
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


def verify(path: str | os.PathLike[str], *, anchors: AnchorStore | Sequence[AnchorStore] | None = None,
           key: bytes | None = None, name: str | None = None, allow_gaps: bool = False) -> VerifyResult:
    """Check every hash, ``prev`` link and ``seq`` of the chain, oldest rotated file first, then
    the chain against its anchors (``<path>.anchor`` and ``name`` in each of ``anchors``).

    ``status`` (and ``ok``): ``ok`` (True) intact and anchored; ``unanchored`` (True, with a
    warning) intact, but no anchor was found, so a lost tail cannot be seen; ``gaps`` (True only
    with ``allow_gaps``) intact, but gap records say records were lost; ``truncated`` (False)
    fewer records than an anchor counts, an anchored head not in the chain, or a truncation
    record; ``tampered`` (False) a bad record (``first_bad``) or a bad anchor; ``missing`` (False)
    no log and no anchor.
    """
    stores = [] if anchors is None else [anchors] if not isinstance(anchors, (list, tuple)) else list(anchors)
    files = rotated_files(path)
    found, bad_anchors, warnings = read_anchors(path, stores, name=name, key=key)
    if not files and not found and not bad_anchors:
        return VerifyResult(False, 0, None, f"{path}: no audit log files", status="missing", warnings=warnings)
    heads: dict[int, list[dict[str, Any]]] = {}
    for doc in found:
        if doc["seq"] > 0:
            heads.setdefault(doc["seq"] - 1, []).append(doc)
    expected_prev, pos, bad, reason = GENESIS, 0, None, ""
    gaps: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    replaced: list[dict[str, Any]] = []
    for p in files:
        with open(p, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if bad is None:
                    problem = _check(line, pos, expected_prev)
                    if problem:
                        bad, reason = pos, f"{p.name}:{lineno}: {problem}"
                    else:
                        rec = json.loads(line)
                        expected_prev = rec["hash"]
                        if rec.get("type") == GAP:
                            gaps.append(rec)
                        elif rec.get("type") == TRUNCATION:
                            notes.append(rec)
                        replaced += [d for d in heads.get(pos, ()) if d["head"] != expected_prev]
                pos += 1
    result = VerifyResult(True, pos, None, "ok", anchors=found, warnings=warnings,
                          gaps=[{k: g.get(k) for k in ("seq", "ts", "lost", "first_lost_ts", "last_lost_ts", "reasons")}
                                for g in gaps])
    truncations = result.truncations
    for doc in found:
        if doc["seq"] > pos:
            result.missing = max(result.missing, doc["seq"] - pos)
    best = max(found, key=lambda d: d["seq"], default=None)
    if result.missing and best is not None:
        where = (f"after seq {pos - 1}" if pos else "the log is empty" if files else "no log files left")
        sep = " " if pos else ", "
        truncations.append(f"{_n(result.missing, 'record')} missing{sep}{where} (anchor {best['at']}: "
                           f"{_n(best['seq'], 'record')}, head {best['head'][:12]}…, {utc_iso(best['ts'])})")
    for doc in replaced:
        truncations.append(f"the anchored record seq {doc['seq'] - 1} (hash {doc['head'][:12]}…) is not in the chain: "
                           f"records up to it were cut and rewritten (anchor {doc['at']}, {utc_iso(doc['ts'])})")
    for rec in notes:
        truncations.append(f"{rec.get('detail')} (found when writing resumed: truncation record seq {rec.get('seq')}, "
                           f"{utc_iso(rec.get('detected_ts', rec.get('ts')))})")
    gap_text = ""
    if gaps:
        lost = sum(int(g.get("lost") or 0) for g in gaps)
        listed = "; ".join(_gap_text(g) for g in result.gaps[:5]) + ("; …" if len(gaps) > 5 else "")
        gap_text = f"gaps: {_n(lost, 'record')} lost in {_n(len(gaps), 'gap')}: {listed}"
    if bad is not None:
        result.ok, result.first_bad, result.reason, result.status = False, bad, reason, "tampered"
        result.warnings += [f"also truncated: {t}" for t in truncations]
    elif bad_anchors:
        result.ok, result.status, result.reason = False, "tampered", "; ".join(bad_anchors)
    elif truncations:
        result.ok, result.status = False, "truncated"
        result.first_bad = pos if result.missing else None
        result.reason = "truncated: " + "; ".join(truncations)
        if gap_text:
            result.warnings.append(f"also {gap_text}")
    elif gaps:
        result.ok, result.status, result.reason = allow_gaps, "gaps", gap_text
    elif not found:
        result.status = "unanchored"
        looked = [str(local_anchor_path(path)), *(_where(s, name or anchor_name(path)) for s in stores)]
        result.warnings.append(f"unanchored: no anchor found ({', '.join(looked)}); a lost tail cannot be detected")
    return result


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _gap_text(g: dict[str, Any]) -> str:
    why = ", ".join(f"{k} {v}" for k, v in sorted((g.get("reasons") or {}).items()))
    return (f"seq {g.get('seq')}: {g.get('lost')} lost {utc_iso(g.get('first_lost_ts'))} – "
            f"{utc_iso(g.get('last_lost_ts'))}{f' ({why})' if why else ''}")


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
