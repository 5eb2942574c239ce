"""Labels that arrive after the answer: what each version answered, kept a while, and the labels joined to it.

Most production labels come later than the answer (a review, a chargeback, a click). A rollout can
only judge a candidate on them if it remembers who answered what:

- **serving path** (:class:`tritonguard.guard.stages.feedback.FeedbackStage`, after the responses are
  built): for each answered request that carries a request id (KServe v2 ``id``), sampled at
  ``feedback.sample``, one *prediction*: ``(tenant, request id, when, version, source,
  answer)``. ``version`` is the version whose answer it was (a cache hit is the cached answer's
  version, a fallback the version that really answered), ``source`` says which path
  (``model`` / ``cache`` / ``fallback``), ``answer`` the predicted class ids (one per row) of a
  classifier, else a 16-byte digest of the output. Never the input, never the output itself: no
  PII lands here. A request that carries its label already (request parameter ``label``) gives a
  *label* record at once.
- **background**: records wait in a bounded buffer (more are dropped and counted, never waited
  for) and go out about once a second as one *segment* per writer (``host:pid``), with an expiry
  of ``feedback.ttl_s``: Redis ``tritonguard:feedback:<guard>:<kind>:<writer>:<seq>`` (``SET EX``)
  listed in the set ``tritonguard:feedback:<guard>:<kind>`` (``tritonguard:{<namespace>}:feedback:…``
  with ``$TRITONGUARD_NAMESPACE``); or files
  ``<repo>/<guard>/.feedback/<kind>/<writer>-<seq>.fb`` (written atomically; a reader removes
  expired ones). Tenant-scoped: a label joins only a prediction of the same tenant.
- ``exporter feedback MODEL --labels FILE`` (:func:`join`): reads every prediction segment,
  joins each ``(tenant, request_id, label[, slice])`` and writes the joined *label* records.
- the rollout's ``labels`` gate (:func:`tally`): per version, right / labelled, per true class
  and per named slice, over the label records of requests answered since the rollout began.

A segment: magic ``TGFB\\0\\0\\0\\1``, a msgpack list of records, a CRC-32 of both; a corrupt or
truncated one is skipped and counted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from tritonguard.core.errors import TritonGuardError
from tritonguard.core.files import atomic_write
from tritonguard.core.store import ENV_URL, redacted, redis_client, redis_prefix, store_error

log = logging.getLogger(__name__)

FEEDBACK_DIR = ".feedback"
KEY_PREFIX = "tritonguard:feedback:"  # without a namespace; see RedisFeedbackLog
PRED, LABEL = "pred", "label"
KINDS = (PRED, LABEL)
MAGIC = b"TGFB\x00\x00\x00\x01"
_CRC = struct.Struct("<I")
MODEL, CACHE, FALLBACK = "model", "cache", "fallback"


class FeedbackUnavailable(TritonGuardError):
    """The feedback log cannot be read or written (Redis down, folder unwritable)."""


@dataclass(kw_only=True)
class FeedbackConfig:
    """``feedback.*``: what a guard keeps so that late labels can be joined to its answers."""

    enabled: bool = True
    sample: float = 1.0  # share of requests with an id whose answer is kept
    ttl_s: float = 86400.0  # how long an answer waits for its label
    capacity: int = 100_000  # records buffered between flushes; more are dropped (counted)
    flush_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.sample <= 1:
            raise ValueError(f"feedback.sample must be in [0, 1], got {self.sample}")
        if self.ttl_s <= 0 or self.flush_interval_s <= 0:
            raise ValueError("feedback.ttl_s and feedback.flush_interval_s must be > 0")
        if self.capacity < 1:
            raise ValueError(f"feedback.capacity must be >= 1, got {self.capacity}")


# -- records ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    tenant: str
    request_id: str
    t: float  # when it was answered (wall clock)
    version: int
    source: str  # MODEL / CACHE / FALLBACK
    answer: tuple[int, ...] | bytes  # classes per row (classifier) or a digest

    def to_wire(self) -> list[Any]:
        answer = list(self.answer) if isinstance(self.answer, tuple) else self.answer
        return [self.tenant, self.request_id, self.t, self.version, self.source, answer]

    @classmethod
    def from_wire(cls, w: Sequence[Any]) -> Prediction:
        tenant, rid, t, version, source, answer = w
        return cls(str(tenant), str(rid), float(t), int(version), str(source),
                   tuple(int(x) for x in answer) if isinstance(answer, list) else bytes(answer))


@dataclass(frozen=True)
class Label:
    """A label joined to the answer it judges (or sent with the request)."""

    tenant: str
    request_id: str  # "" for a label sent with a request that had no id
    t: float  # when the labelled request was answered
    version: int
    source: str
    truth: tuple[int, ...]
    predicted: tuple[int, ...]
    slice: str = ""  # a slice the request or the label file named ("" = none)
    origin: str = "request"  # "request" (parameter) or "feedback" (joined later)

    def to_wire(self) -> list[Any]:
        return [self.tenant, self.request_id, self.t, self.version, self.source, list(self.truth),
                list(self.predicted), self.slice, self.origin]

    @classmethod
    def from_wire(cls, w: Sequence[Any]) -> Label:
        tenant, rid, t, version, source, truth, pred, sl, origin = w
        return cls(str(tenant), str(rid), float(t), int(version), str(source), tuple(int(x) for x in truth),
                   tuple(int(x) for x in pred), str(sl), str(origin))


def digest(arr: Any) -> bytes:
    """16 bytes naming an output without holding it."""
    import numpy as np  # noqa: PLC0415 - numpy is loaded wherever a guard runs

    a = np.ascontiguousarray(arr)
    return hashlib.blake2b(a.tobytes(), digest_size=16).digest()


def encode(records: Iterable[Prediction | Label]) -> bytes:
    body = MAGIC + msgpack.packb([r.to_wire() for r in records], use_bin_type=True)
    return body + _CRC.pack(zlib.crc32(body))


def decode(blob: bytes, kind: str) -> list[Any]:
    if len(blob) < len(MAGIC) + _CRC.size or not blob.startswith(MAGIC):
        raise ValueError("not a feedback segment (bad magic or too short)")
    (crc,) = _CRC.unpack_from(blob, len(blob) - _CRC.size)
    if zlib.crc32(memoryview(blob)[:-_CRC.size]) != crc:
        raise ValueError("checksum mismatch")
    rows = msgpack.unpackb(blob[len(MAGIC):-_CRC.size], raw=False)
    make = Prediction.from_wire if kind == PRED else Label.from_wire
    return [make(r) for r in rows]


# -- the log: files or Redis ----------------------------------------------------------------------
def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


class FileFeedbackLog:
    """Segments as files under ``root`` (``<repo>/<guard>/.feedback``)."""

    def __init__(self, root: str | os.PathLike, *, ttl_s: float = 86400.0, clock: Callable[[], float] = time.time):
        self.root, self.ttl_s, self.clock = Path(root), ttl_s, clock
        self.corrupt = 0
        self.where = str(self.root)

    def write(self, kind: str, writer: str, seq: int, records: Sequence[Prediction | Label]) -> None:
        try:
            atomic_write(self.root / kind / f"{_safe(writer)}-{seq:012d}.fb", encode(records))
        except OSError as exc:
            raise FeedbackUnavailable(f"feedback log {self.root}: {exc}") from None

    def read(self, kind: str) -> list[Any]:
        folder = self.root / kind
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise FeedbackUnavailable(f"feedback log {folder} unreadable: {exc}") from None
        stale = self.clock() - self.ttl_s
        out: list[Any] = []
        for e in entries:
            if not e.name.endswith(".fb"):
                continue
            try:
                if e.stat().st_mtime < stale:
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
                    continue
                with open(e.path, "rb") as fh:
                    out.extend(decode(fh.read(), kind))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, TypeError) as exc:
                self.corrupt += 1
                log.warning("feedback segment %s skipped: %s", e.path, exc)
        return out


class RedisFeedbackLog:
    """Segments as Redis strings with an expiry, listed in one set per guard and kind."""

    def __init__(self, url: str, guard: str, *, ttl_s: float = 86400.0, socket_timeout: float = 0.5,
                 key_prefix: str | None = None, client: Any = None):
        import redis  # noqa: PLC0415 - only with a Redis store

        self._redis = redis
        self.url, self.guard, self.ttl_s = url, guard, ttl_s
        self.prefix = f"{redis_prefix('feedback') if key_prefix is None else key_prefix}{guard}:"
        self.client = client or redis_client(url, timeout=socket_timeout)
        self.corrupt = 0
        self.where = f"{redacted(url)} ({self.prefix}*)"

    def write(self, kind: str, writer: str, seq: int, records: Sequence[Prediction | Label]) -> None:
        ttl = max(1, round(self.ttl_s))
        index, key = f"{self.prefix}{kind}", f"{self.prefix}{kind}:{writer}:{seq:012d}"
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.set(key, encode(records), ex=ttl)
                pipe.sadd(index, key)
                pipe.expire(index, ttl)
                pipe.execute()
        except self._redis.RedisError as exc:
            raise FeedbackUnavailable(f"feedback log {redacted(self.url)}: {store_error(exc, self.url)}") from None

    def read(self, kind: str) -> list[Any]:
        index = f"{self.prefix}{kind}"
        out: list[Any] = []
        try:
            keys = sorted(self.client.smembers(index))
            for start in range(0, len(keys), 500):
                chunk = keys[start:start + 500]
                blobs = self.client.mget(chunk)
                gone = [k for k, b in zip(chunk, blobs, strict=True) if b is None]
                if gone:
                    self.client.srem(index, *gone)
                for k, b in zip(chunk, blobs, strict=True):
                    if b is None:
                        continue
                    try:
                        out.extend(decode(b, kind))
                    except (ValueError, TypeError) as exc:
                        self.corrupt += 1
                        log.warning("feedback segment %s skipped: %s", k.decode(errors="replace"), exc)
        except self._redis.RedisError as exc:
            raise FeedbackUnavailable(f"feedback log {redacted(self.url)}: {store_error(exc, self.url)}") from None
        return out


def open_feedback_log(guard: str, repo_dir: str | os.PathLike, url: str | None = None,
                      **kwargs: Any) -> FileFeedbackLog | RedisFeedbackLog:
    """Redis when ``url`` (default ``$TRITONGUARD_STATE_URL``) is set, else files beside the guard."""
    url = os.environ.get(ENV_URL, "") if url is None else url
    if url:
        return RedisFeedbackLog(url, guard, **kwargs)
    return FileFeedbackLog(Path(repo_dir) / guard / FEEDBACK_DIR, **kwargs)


# -- the recorder (one per guard process) -----------------------------------------------------------
class FeedbackRecorder:
    """Buffers this process's records and publishes them as segments from a daemon thread."""

    def __init__(self, sink: Any, config: FeedbackConfig, *, writer_id: str | None = None):
        self.sink, self.config = sink, config
        self.writer_id = writer_id or f"{socket.gethostname()}:{os.getpid()}"
        self.dropped = 0  # records not kept: the buffer was full, or a flush failed for good
        self.flush_errors = 0
        self._pending: dict[str, list[Any]] = {PRED: [], LABEL: []}
        self._lock = threading.Lock()
        self._seq = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, kind: str, records: Sequence[Prediction | Label]) -> None:
        """Never blocks on I/O and never raises; a full buffer drops the records (counted)."""
        with self._lock:
            buf = self._pending[kind]
            room = self.config.capacity - len(self._pending[PRED]) - len(self._pending[LABEL])
            if room < len(records):
                self.dropped += len(records) - max(room, 0)
                records = records[:max(room, 0)]
            buf.extend(records)

    def flush(self) -> bool:
        with self._lock:
            batches = {k: v for k, v in self._pending.items() if v}
            self._pending = {PRED: [], LABEL: []}
        ok = True
        for kind, records in batches.items():
            self._seq += 1
            try:
                self.sink.write(kind, self.writer_id, self._seq, records)
            except Exception as exc:  # noqa: BLE001 - the store is optional for serving
                ok = False
                self.flush_errors += 1
                self.dropped += len(records)
                if not self._failing:
                    log.error("feedback log: %d %s records not published (%s: %s); dropping until it works",
                              len(records), kind, type(exc).__name__, exc)
                self._failing = True
        if ok and batches and self._failing:
            log.info("feedback log: publishing again")
            self._failing = False
        return ok

    def start(self) -> None:
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.config.flush_interval_s):
                self.flush()

        self._thread = threading.Thread(target=loop, name="tritonguard-feedback-flush", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.flush()


# -- joining and tallying -----------------------------------------------------------------------------
@dataclass
class JoinResult:
    joined: list[Label] = field(default_factory=list)
    unknown: int = 0  # no prediction with that (tenant, id): not sampled, expired, never answered
    ambiguous: int = 0  # a row naming no tenant, whose id several tenants' requests carried
    duplicate: int = 0  # already joined earlier (a label file fed twice)
    mismatched: int = 0  # a label whose row count differs from the answer's, or not a classifier's
    by_version: dict[int, tuple[int, int]] = field(default_factory=dict)  # version -> (right, labelled)


def parse_label(raw: Any) -> tuple[int, ...] | None:
    """A class id, or ids separated by commas / spaces for a request of several rows."""
    if raw is None or isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return (raw,)
    if isinstance(raw, float) and raw.is_integer():
        return (int(raw),)
    if isinstance(raw, (list, tuple)):
        try:
            return tuple(int(x) for x in raw)
        except (TypeError, ValueError):
            return None
    try:
        return tuple(int(x) for x in re.split(r"[,\s]+", str(raw).strip()) if x)
    except ValueError:
        return None


def join(log_: Any, labels: Iterable[Mapping[str, Any]], *, tenant: str | None = None) -> JoinResult:
    """Join ``labels`` (mappings with ``request_id``, ``label``, optional ``tenant`` and ``slice``)
    to the predictions in ``log_`` and write the joined label records. A label joins only an
    answer to the same tenant: a row's own ``tenant``, else ``tenant``, else (neither given) the
    one tenant whose request carried that id; an id several tenants used is then ambiguous and
    skipped, never guessed."""
    preds: dict[tuple[str, str], Prediction] = {}
    tenants_of: dict[str, set[str]] = {}
    for p in log_.read(PRED):
        preds[(p.tenant, p.request_id)] = p  # the latest answer to an id wins
        tenants_of.setdefault(p.request_id, set()).add(p.tenant)
    done = {(lab.tenant, lab.request_id) for lab in log_.read(LABEL) if lab.request_id}
    res = JoinResult()
    for row in labels:
        rid = str(row["request_id"])
        who = row.get("tenant") or tenant
        if who is None:
            found = tenants_of.get(rid, set())
            if len(found) > 1:
                res.ambiguous += 1
                continue
            who = next(iter(found), "")
        key = (str(who), rid)
        p = preds.get(key)
        if p is None:
            res.unknown += 1
            continue
        if key in done:
            res.duplicate += 1
            continue
        truth = parse_label(row.get("label"))
        if truth is None or not isinstance(p.answer, tuple) or len(truth) != len(p.answer):
            res.mismatched += 1
            continue
        done.add(key)
        lab = Label(p.tenant, p.request_id, p.t, p.version, p.source, truth, p.answer,
                    str(row.get("slice") or ""), "feedback")
        res.joined.append(lab)
        right, n = res.by_version.get(p.version, (0, 0))
        res.by_version[p.version] = (right + sum(a == b for a, b in zip(truth, p.answer, strict=True)), n + len(truth))
    if res.joined:
        log_.write(LABEL, f"feedback:{socket.gethostname()}:{os.getpid()}", time.time_ns(), res.joined)
    return res


@dataclass
class Tally:
    """Labelled rows per version: ``right`` / ``total``, and per true class / per slice."""

    right: dict[int, int] = field(default_factory=dict)
    total: dict[int, int] = field(default_factory=dict)
    by_class: dict[int, dict[str, list[int]]] = field(default_factory=dict)  # version -> class -> [right, n]
    by_slice: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    origins: dict[str, int] = field(default_factory=dict)  # rows by origin (request / feedback)

    def add(self, lab: Label) -> None:
        v = lab.version
        for truth, pred in zip(lab.truth, lab.predicted, strict=True):
            ok = int(truth == pred)
            self.right[v] = self.right.get(v, 0) + ok
            self.total[v] = self.total.get(v, 0) + 1
            cell = self.by_class.setdefault(v, {}).setdefault(str(truth), [0, 0])
            cell[0] += ok
            cell[1] += 1
            if lab.slice:
                cell = self.by_slice.setdefault(v, {}).setdefault(lab.slice, [0, 0])
                cell[0] += ok
                cell[1] += 1
            self.origins[lab.origin] = self.origins.get(lab.origin, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {"right": {str(k): v for k, v in self.right.items()},
                "total": {str(k): v for k, v in self.total.items()},
                "by_class": {str(k): v for k, v in self.by_class.items()},
                "by_slice": {str(k): v for k, v in self.by_slice.items()}, "origins": dict(self.origins)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tally:
        return cls(right={int(k): v for k, v in d.get("right", {}).items()},
                   total={int(k): v for k, v in d.get("total", {}).items()},
                   by_class={int(k): v for k, v in d.get("by_class", {}).items()},
                   by_slice={int(k): v for k, v in d.get("by_slice", {}).items()},
                   origins=dict(d.get("origins", {})))


def tally(labels: Iterable[Label], versions: Iterable[int], *, since: float = 0.0) -> Tally:
    """Labelled rows of ``versions`` answered at or after ``since``; a request labelled twice
    (sent with its label, then fed again) counts once."""
    want = set(versions)
    seen: set[tuple[str, str]] = set()
    out = Tally()
    for lab in labels:
        if lab.version not in want or lab.t < since:
            continue
        if lab.request_id:
            key = (lab.tenant, lab.request_id)
            if key in seen:
                continue
            seen.add(key)
        out.add(lab)
    return out


def recorder_for(guard: str, repo: str | os.PathLike, config: FeedbackConfig) -> FeedbackRecorder | None:
    """A started recorder for ``guard``; None (logged) when disabled or no log can be opened."""
    if not config.enabled:
        return None
    try:
        rec = FeedbackRecorder(open_feedback_log(guard, repo, ttl_s=config.ttl_s), config)
    except Exception as exc:  # noqa: BLE001 - e.g. a bad TRITONGUARD_STATE_URL: serve on without it
        log.warning("guard %s: answers not kept for late labels (%s)", guard,
                    store_error(exc, os.environ.get(ENV_URL, "")))
        return None
    rec.start()
    return rec


__all__ = ["CACHE", "FALLBACK", "FeedbackConfig", "FeedbackRecorder", "FeedbackUnavailable", "FileFeedbackLog",
           "JoinResult", "LABEL", "Label", "MODEL", "PRED", "Prediction", "RedisFeedbackLog", "Tally", "digest",
           "join", "open_feedback_log", "parse_label", "recorder_for", "tally"]
