"""Tiered response cache: L1 in-process LRU, L2 SQLite on the host, L3 Redis shared by hosts.

:class:`TieredCache` looks up whole batches of keys (:mod:`tritonguard.privacy.cache.keys`) L1 →
L2 → L3, promotes lower-tier hits upwards, writes through every enabled tier and purges one
model's entries or all. What may be cached, and how persisted values are encrypted, is
``cache.privacy`` (:mod:`tritonguard.privacy.cache.config`); the tiers and their backoff are
:mod:`tritonguard.privacy.cache.tiers`. A failing tier is skipped, never waited on; ``stats``
shows the errors and degraded tiers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tritonguard.core.errors import ConfigError
from tritonguard.privacy.cache.codec import decode_value, encode_value, frozen
from tritonguard.privacy.cache.config import CacheConfig, PrivacyMode, load_key
from tritonguard.privacy.cache.keys import Value, key_model
from tritonguard.privacy.cache.tiers import (
    LruTier,
    RedisTier,
    SqliteTier,
    TierHealth,
    is_corruption,
)

log = logging.getLogger(__name__)


class TieredCache:
    """L1 → L2 → L3 lookups for whole batches of keys; lower-tier hits are promoted upwards.

    Each process has its own L1; :meth:`purge` clears this process's L1 and the shared L2/L3.
    """

    def __init__(self, config: CacheConfig, *, environ: Mapping[str, str] | None = None, clock: Any = time.time):
        self.config, self.clock = config, clock
        self.stats: dict[str, Any] = {f"{t}_{k}": 0 for t in ("l1", "l2", "l3") for k in ("hits", "misses")}
        self.stats.update(l2_errors=0, l3_errors=0, errors=0, corrupt=0, l2_quarantined=0, degraded=())
        self._l1: LruTier | None = None
        self._l2: SqliteTier | None = None
        self._l3: RedisTier | None = None
        self._health = {"l2": TierHealth("L2 (SQLite)", clock), "l3": TierHealth("L3 (Redis)", clock)}
        if not config.enabled or config.mode is PrivacyMode.HASHES_ONLY:
            return
        if config.l1_entries:
            self._l1 = LruTier(config.l1_entries, config.l1_ttl_s)
        if config.mode is PrivacyMode.EPHEMERAL:
            if config.l2_path or config.l3_url:
                log.warning("cache.privacy=ephemeral: ignoring cache.l2_path/cache.l3_url (responses stay "
                            "in process memory; use persisted_encrypted to share them)")
            return
        key = load_key(config, environ)
        self._aead = AESGCM(key)
        self._mac = hashlib.sha256(b"tritonguard-cache-row-id\0" + key).digest()
        if config.l2_path:
            try:
                self._l2 = SqliteTier(config.l2_path, config.l2_max_rows, clock=clock)
            except sqlite3.Error as exc:
                raise ConfigError(f"cache.l2_path '{config.l2_path}': {exc}") from None
            self.stats["l2_quarantined"] = self._l2.quarantined
        if config.l3_url:
            self._l3 = RedisTier(config.l3_url, config.l3_ttl_s, config.l3_key_prefix(), config.l3_timeout_ms / 1000)
            u = urlsplit(config.l3_url)
            log.info("cache L3: redis at %s:%s (credentials not logged)", u.hostname, u.port or 6379)

    @property
    def enabled(self) -> bool:
        return self._l1 is not None or self._l2 is not None or self._l3 is not None

    def _sid(self, key: bytes) -> bytes:
        # keyed BLAKE2b is a MAC, and 3x faster than HMAC-SHA-256 at this size
        return hashlib.blake2b(key, digest_size=32, key=self._mac).digest()

    def _open(self, sid: bytes, nonce: bytes, ct: bytes) -> Value | None:
        try:
            return decode_value(self._aead.decrypt(nonce, ct, sid))
        except (InvalidTag, ValueError):
            self.stats["corrupt"] += 1  # tampered, truncated or written with another key: a miss
            return None

    def _call(self, tier: str, fn: Any, *args: Any) -> Any:
        """Run one tier operation; on failure count it, start the backoff, return None."""
        health = self._health[tier]
        errors = self._l3.errors if tier == "l3" else (sqlite3.Error, OSError)
        try:
            out = fn(*args)
        except errors as exc:
            self.stats[f"{tier}_errors"] += 1
            self.stats["errors"] += 1
            out = None
            if tier == "l2" and is_corruption(exc) and self._heal_l2(exc):
                health.ok()  # a fresh file: no outage to wait out
            else:
                health.failed(exc)
        else:
            health.ok()
        self.stats["degraded"] = tuple(t for t, h in self._health.items() if h.backoff)
        return out

    def _heal_l2(self, exc: BaseException) -> bool:
        """Quarantine a damaged L2 file and reopen it empty; False (then: backoff) when rate-limited
        or when that failed too."""
        assert self._l2 is not None
        try:
            healed = self._l2.heal(exc)
        except (sqlite3.Error, OSError) as err:
            log.warning("cache L2 (SQLite): could not replace the damaged %s: %s", self._l2.path, err)
            healed = False
        self.stats["l2_quarantined"] = self._l2.quarantined
        return healed

    def get_many(self, keys: Sequence[bytes], *, timings: list | None = None,
                 found_in: list[str | None] | None = None) -> list[Value | None]:
        """Cached value per key (None = miss), in order. Values are read-only arrays.

        Traced batches only: ``timings`` gets ``(tier, start, end, hits, misses)`` per tier asked
        (``time.perf_counter_ns``), ``found_in`` (one slot per key) the tier each hit came from."""
        out: list[Value | None] = [None] * len(keys)
        if not self.enabled:
            return out
        now = self.clock()
        missing = range(len(keys))
        if self._l1 is not None:
            t0 = time.perf_counter_ns() if timings is not None else 0
            for i, k in enumerate(keys):
                out[i] = self._l1.get(k, now)
            missing = [i for i, v in enumerate(out) if v is None]
            self.stats["l1_hits"] += len(keys) - len(missing)
            self.stats["l1_misses"] += len(missing)
            if timings is not None:
                timings.append(("l1", t0, time.perf_counter_ns(), len(keys) - len(missing), len(missing)))
                if found_in is not None:
                    for i, v in enumerate(out):
                        if v is not None:
                            found_in[i] = "l1"
        if not missing or (self._l2 is None and self._l3 is None):
            return out
        sids = {i: self._sid(keys[i]) for i in missing}
        if self._l2 is not None and self._health["l2"].available():
            t0 = time.perf_counter_ns() if timings is not None else 0
            rows = self._call("l2", self._l2.get_many, [sids[i] for i in missing], now) or {}
            still = []
            for i in missing:
                row = rows.get(sids[i])
                value = self._open(sids[i], row[0], row[1]) if row else None
                if value is None:
                    still.append(i)
                    continue
                out[i] = value
                if self._l1 is not None:
                    self._l1.put(keys[i], value, min(now + self.config.l1_ttl_s, row[2]))
            self.stats["l2_hits"] += len(missing) - len(still)
            self.stats["l2_misses"] += len(still)
            if timings is not None:
                timings.append(("l2", t0, time.perf_counter_ns(), len(missing) - len(still), len(still)))
                if found_in is not None:
                    for i in set(missing) - set(still):
                        found_in[i] = "l2"
            missing = still
        if missing and self._l3 is not None and self._health["l3"].available():
            t0 = time.perf_counter_ns() if timings is not None else 0
            names = [self._l3.name(key_model(keys[i]), sids[i]) for i in missing]
            blobs = self._call("l3", self._l3.get_many, names) or [None] * len(missing)
            promote, hits = [], 0
            for i, blob in zip(missing, blobs, strict=True):
                value = self._open(sids[i], blob[:12], blob[12:]) if blob else None
                if value is None:
                    continue
                out[i], hits = value, hits + 1
                if found_in is not None:
                    found_in[i] = "l3"
                ttl = min(self.config.l3_ttl_s, self.config.l2_ttl_s)
                promote.append((sids[i], key_model(keys[i]), blob[:12], blob[12:], now + ttl))
                if self._l1 is not None:
                    self._l1.put(keys[i], value, now + min(self.config.l1_ttl_s, self.config.l3_ttl_s))
            self.stats["l3_hits"] += hits
            self.stats["l3_misses"] += len(missing) - hits
            if timings is not None:
                timings.append(("l3", t0, time.perf_counter_ns(), hits, len(missing) - hits))
            if promote and self._l2 is not None and self._health["l2"].available():
                self._call("l2", self._l2.put_many, promote, now)
        return out

    def put_many(self, items: Iterable[tuple[bytes, Mapping[str, np.ndarray]]]) -> None:
        """Write through every enabled tier."""
        if not self.enabled:
            return
        now = self.clock()
        rows, blobs = [], []
        for key, value in items:
            if self._l1 is not None:
                self._l1.put(key, frozen(value), now + self.config.l1_ttl_s)
            if self._l2 is None and self._l3 is None:
                continue
            try:
                plain = encode_value(value)
            except TypeError as exc:  # an output dtype Triton cannot even send; L1 holds it anyway
                self.stats["errors"] += 1
                log.debug("cache: not persisting a value: %s", exc)
                continue
            sid, nonce = self._sid(key), os.urandom(12)
            ct = self._aead.encrypt(nonce, plain, sid)
            rows.append((sid, key_model(key), nonce, ct, now + self.config.l2_ttl_s))
            if self._l3 is not None:
                blobs.append((self._l3.name(key_model(key), sid), nonce + ct))
        if rows and self._l2 is not None and self._health["l2"].available():
            self._call("l2", self._l2.put_many, rows, now)
        if blobs and self._health["l3"].available():
            self._call("l3", self._l3.put_many, blobs)

    def purge_local(self, model: str | None = None) -> int:
        """Drop this process's L1 entries (of ``model``); L2/L3 are purged by whoever changed the
        rollout (``exporter rollback``), once, not by every guard instance."""
        return self._l1.purge(model) if self._l1 is not None else 0

    def purge(self, model: str | None = None) -> dict[str, int]:
        """Drop every entry, or one model's, from all tiers; entries removed per tier."""
        done = {"l1": self._l1.purge(model) if self._l1 is not None else 0}
        if self._l2 is not None:
            done["l2"] = self._call("l2", self._l2.purge, model) or 0
        if self._l3 is not None:
            done["l3"] = self._call("l3", self._l3.purge, model) or 0
        return done

    def close(self) -> None:
        for tier in (self._l2, self._l3):
            if tier is not None:
                tier.close()
