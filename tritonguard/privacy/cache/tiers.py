"""The cache's tiers: L1 in-process LRU, L2 SQLite on the host, L3 Redis shared by hosts.

:class:`LruTier`, :class:`SqliteTier` and :class:`RedisTier` store what
:class:`~tritonguard.privacy.cache.tiered.TieredCache` hands them (L2 and L3: encrypted rows). A
tier that fails (Redis down, disk full) is skipped for a backoff of 5 s doubling to 60 s
(:class:`TierHealth`): serving never waits on a broken cache. A damaged L2 file (not a database,
malformed, another schema: :func:`is_corruption`) is not a failure to wait out: it is moved aside
(quarantined, never deleted on the spot) and the tier starts again empty (:meth:`SqliteTier.heal`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tritonguard.core.outage import Backoff
from tritonguard.core.store import file_lock
from tritonguard.privacy.cache.keys import DIGEST, Value

log = logging.getLogger(__name__)

BACKOFF_S, MAX_BACKOFF_S = 5.0, 60.0
_SQL_CHUNK = 500  # stays below SQLite's bound-parameter limit
HEAL_EVERY_S = 60.0  # at most one runtime quarantine per process per minute: a flapping disk backs off
KEEP_QUARANTINED = 3  # quarantined L2 files kept beside it; older ones go, so a bad disk cannot fill up
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26  # primary result codes of a damaged file
_COLUMNS = ["key", "model", "nonce", "ct", "expires"]


class TierHealth(Backoff):
    """Backoff of one tier: after an error it is skipped (not retried) until ``until``."""

    def __init__(self, name: str, clock: Any):
        super().__init__(clock, BACKOFF_S, MAX_BACKOFF_S)
        self.name, self.errors = name, 0

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        if not self.backoff:  # log once per outage, not once per request
            log.warning("cache %s failed (%s: %s); skipping it for %.0f s, then retrying with backoff",
                        self.name, type(exc).__name__, exc, BACKOFF_S)
        self.fail()

    def ok(self) -> None:
        if self.recover():
            log.info("cache %s is back", self.name)


# Kept hand-written (issue 16): an entry expires at its own time (an L2/L3 promotion keeps the
# row's earlier expiry), which cachetools.TTLCache (one ttl for all) cannot express; TLRUCache
# can, but is slower on the hot path. timeit, 100k mixed ops (30% put) of small numpy entries,
# 4096 keys over 1024 entries, under a lock as here, cachetools 7.3.3, 2 shared cores, best of
# 5 in two runs: this class 102-147 ms, TLRUCache 373-636 ms, TTLCache 323-570 ms
# (loop overhead 12 ms): about 3.5-4x slower.
class LruTier:
    def __init__(self, capacity: int, ttl: float):
        self.capacity, self.ttl = capacity, ttl
        self._d: OrderedDict[bytes, tuple[float, Value]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes, now: float) -> Value | None:
        with self._lock:
            e = self._d.get(key)
            if e is None:
                return None
            if e[0] <= now:
                del self._d[key]
                return None
            self._d.move_to_end(key)
            return e[1]

    def put(self, key: bytes, value: Value, expires: float) -> None:
        with self._lock:
            self._d[key] = (expires, value)
            self._d.move_to_end(key)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def purge(self, model: str | None) -> int:
        with self._lock:
            if model is None:
                n = len(self._d)
                self._d.clear()
                return n
            tail = model.encode()
            drop = [k for k in self._d if k[DIGEST:] == tail]
            for k in drop:
                del self._d[k]
            return len(drop)

    def __len__(self) -> int:
        return len(self._d)


def is_corruption(exc: BaseException) -> bool:
    """Whether a SQLite error says the file is damaged (quarantine it), as opposed to a transient
    condition (locked, busy, disk full, I/O) that the backoff waits out."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    msg = str(exc).lower()
    return any(w in msg for w in ("malformed", "not a database", "disk image"))


class _Damaged(Exception):
    """The L2 file at ``ident`` (device, inode) failed its checks."""

    def __init__(self, ident: tuple[int, int], reason: str):
        super().__init__(reason)
        self.ident, self.reason = ident, reason


def _ident(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class SqliteTier:
    """Encrypted rows in one WAL-mode SQLite file; safe for several processes of one host.

    A damaged file is moved aside to ``<file>.corrupt-<UTC time>-<pid>`` (with its -wal/-shm) and
    replaced by an empty one: at open, and at runtime through :meth:`heal`. Every guard process
    of the host may find the same damage at once, so opening and moving hold an flock on
    ``<file>.lock``, and a move only moves the file that was found damaged (same inode): one
    process quarantines, the others open the fresh file. Serving never takes that lock.
    """

    def __init__(self, path: str, max_rows: int, busy_ms: int = 250, clock: Any = time.monotonic):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lockfile = self.path.with_name(self.path.name + ".lock")
        self.busy_ms, self.clock = busy_ms, clock
        self.max_rows = max_rows
        # trimming counts the table: do it every ~5% of the cap, not on every write
        self.trim_every = max(16, max_rows // 20)
        self._since_trim = 0
        self.quarantined = 0  # files this process moved aside
        self._healed_at = -math.inf
        self._lock = threading.Lock()
        self._db, self._ident = self._open()

    # -- opening and quarantine: never on the hot path ------------------------------------
    def _open(self) -> tuple[sqlite3.Connection, tuple[int, int]]:
        """A checked connection; a damaged file is quarantined and an empty one opened.

        One opener at a time: the file cannot move between its stat and its check, and processes
        creating a fresh file together would otherwise get "database is locked" (switching it to
        WAL needs an exclusive SQLite lock, and SQLite refuses rather than waits on that race)."""
        with file_lock(self._lockfile, 0o600):
            try:
                return self._connect()
            except _Damaged as exc:
                self._move_aside(exc)
            try:
                return self._connect()
            except _Damaged as exc:
                raise sqlite3.DatabaseError(f"{self.path} is damaged right after its quarantine: {exc.reason}") from None

    def _connect(self) -> tuple[sqlite3.Connection, tuple[int, int]]:
        if not self.path.exists():
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))  # ciphertext, but still owner-only
        ident = _ident(self.path)
        db = sqlite3.connect(str(self.path), timeout=self.busy_ms / 1000, isolation_level=None,
                             check_same_thread=False)
        try:
            self._prepare(db, ident)
        except sqlite3.DatabaseError as exc:
            db.close()
            if is_corruption(exc):
                raise _Damaged(ident, str(exc)) from None
            raise
        except _Damaged:
            db.close()
            raise
        return db, ident

    def _prepare(self, db: sqlite3.Connection, ident: tuple[int, int]) -> None:
        db.execute(f"PRAGMA busy_timeout={self.busy_ms}")
        db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the one writer
        db.execute("PRAGMA synchronous=NORMAL")  # a cache may lose its last writes on power loss
        db.execute("CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, model TEXT NOT NULL, "
                   "nonce BLOB NOT NULL, ct BLOB NOT NULL, expires REAL NOT NULL) WITHOUT ROWID")
        columns = [row[1] for row in db.execute("PRAGMA table_info(entries)")]
        if columns != _COLUMNS:  # not ours, or another version's: its rows cannot be read anyway
            raise _Damaged(ident, f"unexpected schema: entries has columns {columns}")
        db.execute("CREATE INDEX IF NOT EXISTS entries_expires ON entries(expires)")
        db.execute("CREATE INDEX IF NOT EXISTS entries_model ON entries(model)")
        # damage below the first page only shows when a page is read: find it now, not mid-traffic
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise _Damaged(ident, "quick_check: " + "; ".join(problems[:3]))

    def _move_aside(self, damaged: _Damaged) -> None:
        """Move the damaged file and its -wal/-shm aside, unless another process already has.
        Holds the flock."""
        try:
            if _ident(self.path) != damaged.ident:
                return  # moved by another process; this path is already the fresh file
        except FileNotFoundError:
            return
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() // 1000 % 1_000_000:06d}Z"
        dest = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        os.rename(self.path, dest)
        for suffix in ("-wal", "-shm"):  # a stale WAL must never be replayed into the fresh file
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{self.path}{suffix}", f"{dest}{suffix}")
        self._prune()
        self.quarantined += 1  # published by the guard as tritonguard_cache_quarantined_total
        log.warning("cache L2 (SQLite): %s is damaged (%s); quarantined it as %s and started an empty cache",
                    self.path, damaged.reason, dest.name)

    def _prune(self) -> None:
        """Keep the newest KEEP_QUARANTINED quarantined files (their names sort by time)."""
        prefix = self.path.name + ".corrupt-"
        kept = sorted(p for p in self.path.parent.iterdir()
                      if p.name.startswith(prefix) and not p.name.endswith(("-wal", "-shm")))
        for old in kept[:-KEEP_QUARANTINED]:
            for p in (old, Path(f"{old}-wal"), Path(f"{old}-shm")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            log.warning("cache L2 (SQLite): deleted the oldest quarantined file %s (keeping %d)",
                        old.name, KEEP_QUARANTINED)

    def _reopen(self) -> None:
        old = self._db
        self._db, self._ident = self._open()
        self._since_trim = 0
        # closed after the move: SQLite sees its file renamed and leaves the new -wal/-shm alone
        with contextlib.suppress(sqlite3.Error):
            old.close()

    def heal(self, exc: BaseException) -> bool:
        """After a corruption error: quarantine the file (unless another process already has) and
        reopen an empty one. At most once per HEAL_EVERY_S; False when not done now."""
        with self._lock:
            now = self.clock()
            if now - self._healed_at < HEAL_EVERY_S:
                return False
            self._healed_at = now
            with file_lock(self._lockfile, 0o600):
                self._move_aside(_Damaged(self._ident, str(exc)))
            self._reopen()
            return True

    def _follow(self) -> None:
        """Reopen if another process quarantined our file: rows written there are lost to the rest."""
        try:
            current = _ident(self.path)
        except FileNotFoundError:
            current = None
        if current != self._ident:
            log.info("cache L2 (SQLite): %s was replaced by another process; reopening it", self.path)
            self._reopen()

    # -- serving ----------------------------------------------------------------------------
    def get_many(self, ids: Sequence[bytes], now: float) -> dict[bytes, tuple[bytes, bytes, float]]:
        found = {}
        with self._lock:
            for i in range(0, len(ids), _SQL_CHUNK):
                chunk = ids[i:i + _SQL_CHUNK]
                sql = (f"SELECT key, nonce, ct, expires FROM entries WHERE key IN ({','.join('?' * len(chunk))})"
                       " AND expires > ?")
                for key, nonce, ct, expires in self._db.execute(sql, (*chunk, now)):
                    found[key] = (nonce, ct, expires)
        return found

    def put_many(self, rows: Sequence[tuple[bytes, str, bytes, bytes, float]], now: float) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._since_trim += len(rows)
            if self._since_trim >= self.trim_every:
                self._trim(now)

    def trim(self, now: float) -> None:
        with self._lock:
            self._trim(now)

    def _trim(self, now: float) -> None:
        self._follow()  # a stat every few thousand writes; cheaper than a split cache
        self._since_trim = 0
        self._db.execute("DELETE FROM entries WHERE expires <= ?", (now,))
        (count,) = self._db.execute("SELECT count(*) FROM entries").fetchone()
        if count > self.max_rows:  # drop the rows that would expire first
            self._db.execute("DELETE FROM entries WHERE key IN "
                             "(SELECT key FROM entries ORDER BY expires LIMIT ?)", (count - self.max_rows,))

    def purge(self, model: str | None) -> int:
        with self._lock:
            if model is None:
                return self._db.execute("DELETE FROM entries").rowcount
            return self._db.execute("DELETE FROM entries WHERE model = ?", (model,)).rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisTier:
    def __init__(self, url: str, ttl: int, prefix: str, timeout_s: float):
        import redis  # deferred: a heavy import, needed only with an L3 (cache.l3_url)

        from tritonguard.core.store import redis_client

        # no client-side retries: one failure must cost one timeout at most, the backoff does the rest
        self._r = redis_client(url, timeout=timeout_s)
        self.ttl, self.prefix = ttl, prefix
        self.errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)

    def name(self, model: str, sid: bytes) -> bytes:
        return f"{self.prefix}{model}:{sid.hex()}".encode()

    def get_many(self, names: Sequence[bytes]) -> list[bytes | None]:
        return self._r.mget(names)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for name, blob in items:
            pipe.set(name, blob, ex=self.ttl)
        pipe.execute()

    def purge(self, model: str | None) -> int:
        match = _glob_escape(self.prefix) + ("*" if model is None else _glob_escape(model) + ":*")
        n, batch = 0, []
        for name in self._r.scan_iter(match=match, count=1000):
            batch.append(name)
            if len(batch) >= 500:
                n += self._r.unlink(*batch)
                batch = []
        if batch:
            n += self._r.unlink(*batch)
        return n

    def close(self) -> None:
        self._r.close()
