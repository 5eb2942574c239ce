"""Per-tenant admission: rate, burst and requests in flight, as token buckets.

:class:`QuotaManager` keeps each tenant's bucket in this process. :class:`SharedQuotaManager`
keeps them in a memory-mapped file beside the guard's rollout state (:data:`QUOTA_FILE`), so every
instance (process) of a guard on one host draws from the same bucket, and falls back to the
per-process buckets for a tenant that finds no slot. Replicas on other hosts each enforce the
quota on their own traffic, unless the state URL names Redis: then
:class:`~tritonguard.privacy.tenancy.fleet.FleetQuotaManager` holds one quota for the fleet and
these judge only while Redis is unreachable. The quotas themselves are ``tenancy.quotas``
(:mod:`tritonguard.privacy.tenancy.config`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import mmap
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tritonguard.privacy.tenancy.config import FALLBACK, MAX_TRACKED, Quota, TenancyConfig


def _over_rate(tenant: str, quota: Quota, tokens: float) -> str:
    """Why a request over ``quota``'s rate is refused, with when a token will be there."""
    retry = max(1, math.ceil((1 - tokens) / quota.rps * 1000))
    return f"tenant '{tenant}' is over its rate limit of {quota.rps:g} requests/s; retry after {retry} ms"


def _slot_tokens(quota: Quota, tokens: float, stamp: float, now: float) -> float:
    """A shared slot's tokens at ``now``: a new slot (NaN) is a full bucket."""
    if math.isnan(tokens):
        return quota.capacity
    if math.isinf(quota.rps):
        return tokens
    return min(quota.capacity, tokens + max(0.0, now - stamp) * quota.rps)


class _Bucket:
    __slots__ = ("quota", "tokens", "stamp", "in_flight")

    def __init__(self, quota: Quota, now: float):
        self.quota = quota
        self.tokens = quota.capacity
        self.stamp = now
        self.in_flight = 0


class QuotaManager:
    """Token bucket + in-flight cap per tenant; thread-safe, per process."""

    def __init__(self, config: TenancyConfig, clock: Any = time.monotonic):
        self.config = config
        self.clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()
        self.rejected = 0

    def quota(self, tenant: str) -> Quota | None:
        q = self.config.quotas
        return q.get(tenant) or q.get(FALLBACK)

    def priority(self, tenant: str) -> int:
        q = self.quota(tenant)
        return q.priority if q else 0

    def _bucket(self, tenant: str, quota: Quota, now: float) -> _Bucket:
        b = self._buckets.get(tenant)
        if b is None:
            # Each unknown tenant gets its own bucket sized by "*"; bound how many are remembered,
            # forgetting only idle ones (forgetting refills a bucket, so never one in use).
            if len(self._buckets) >= MAX_TRACKED:
                for name, old in self._buckets.items():
                    if old.in_flight == 0:
                        del self._buckets[name]
                        break
            b = self._buckets[tenant] = _Bucket(quota, now)
        else:
            self._buckets.move_to_end(tenant)
        return b

    def admit(self, tenants: Sequence[str], now: float | None = None) -> list[str | None]:
        """Per request: None if admitted (a token taken, in-flight counted), else why not.

        Every admitted request must later be passed to :meth:`release`.
        """
        now = self.clock() if now is None else now
        out: list[str | None] = []
        with self._lock:
            for tenant in tenants:
                quota = self.quota(tenant)
                if quota is None:  # no quota for this tenant and no "*": unlimited
                    out.append(None)
                    continue
                b = self._bucket(tenant, quota, now)
                limited = not math.isinf(quota.rps)  # a quota may cap only the in-flight count
                if limited:
                    b.tokens = min(quota.capacity, b.tokens + (now - b.stamp) * quota.rps)
                b.stamp = now
                if quota.max_in_flight and b.in_flight >= quota.max_in_flight:
                    # no completion time is known; suggest one token's worth of waiting
                    retry = max(1, math.ceil(1000 / quota.rps)) if limited else 100
                    out.append(f"tenant '{tenant}' has {b.in_flight} requests in flight "
                               f"(max {quota.max_in_flight}); retry after {retry} ms")
                elif not limited or b.tokens >= 1:
                    b.tokens -= limited
                    b.in_flight += 1
                    out.append(None)
                else:
                    out.append(_over_rate(tenant, quota, b.tokens))
        self.rejected += sum(1 for x in out if x is not None)
        return out

    def release(self, tenants: Sequence[str]) -> None:
        """The requests of these (admitted) tenants are done."""
        with self._lock:
            for tenant in tenants:
                b = self._buckets.get(tenant)
                if b is not None and b.in_flight > 0:
                    b.in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        b = self._buckets.get(tenant)
        return b.in_flight if b else 0


# -- quotas shared by every instance on the host ----------------------------------------------
QUOTA_FILE = "quota_buckets.bin"  # in the guard's model folder, beside rollout_state.json
_MAGIC = b"TGQUOTA1"
_HEADER = 64
_PIDS = 16  # processes whose in-flight requests one slot tracks (Triton instances of one guard)
_PROBE = 64  # slots probed per tenant; a tenant that finds none is limited by this process alone
_EMPTY = bytes(16)
# tenant key, tokens, stamp, time the bucket is full again, then (pid, in-flight) pairs
_SLOT = struct.Struct("<16sddd" + "ii" * _PIDS)
_BUCKET = struct.Struct("<ddd")  # a slot's tokens, stamp and full-again time
_BUCKET_AT = 16


class SharedQuotaManager(QuotaManager):
    """The same token buckets and in-flight caps, kept in a memory-mapped file that every process
    of the guard on this host opens (each Triton instance is its own process), under an ``flock``.

    A slot per tenant: tokens, the last refill stamp (``time.monotonic`` is system-wide on Linux),
    and, for a quota with an in-flight cap, each process's in-flight count, so a process that dies
    with requests in flight is forgotten (its pid is checked when the cap would refuse). A quota
    without a cap takes only a token: its release touches neither the file nor its lock. A slot
    whose bucket is full again with nothing in flight is as good as a new one and is reused. A tenant that finds no slot
    within a short probe (thousands of active tenants) falls back to this process's buckets.
    """

    def __init__(self, config: TenancyConfig, path: str | os.PathLike, *, slots: int = 4096,
                 clock: Any = time.monotonic):
        super().__init__(config, clock)
        self.path = Path(path)
        self.slots = slots
        self.pid = os.getpid()
        self._keys: dict[str, bytes] = {}
        size = _HEADER + slots * _SLOT.size
        header = _MAGIC + struct.pack("<ii", slots, _SLOT.size)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size != size or os.pread(fd, len(header), 0) != header:
                    os.ftruncate(fd, 0)  # a new file, or another layout: start empty
                    os.ftruncate(fd, size)
                    os.pwrite(fd, header, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    # Kept on fcntl, not filelock (issue 16): this runs on every request and locks the fd that
    # also backs the mmap. filelock opens and closes its own descriptor per acquire and, when
    # contended, polls with sleeps instead of blocking in the kernel. Uncontended lock+unlock
    # (timeit, 20k, 2 shared cores): 2 us here vs 214 us with filelock 4.3.1 (one FileLock kept).
    @contextlib.contextmanager
    def _locked(self):
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _slot(self, key: bytes, now: float, create: bool) -> int | None:
        """Offset of the tenant's slot (made if ``create``), None if it has none."""
        start = int.from_bytes(key[:4], "little") % self.slots
        reuse = None
        for k in range(min(_PROBE, self.slots)):
            off = _HEADER + ((start + k) % self.slots) * _SLOT.size
            skey = self._mm[off:off + 16]
            if skey == key:
                return off
            if skey == _EMPTY:
                reuse = off if reuse is None else reuse
                break
            if reuse is None and create:
                rec = _SLOT.unpack_from(self._mm, off)
                if now >= rec[3] and not any(rec[5::2]):  # full again, nothing in flight
                    reuse = off
        if reuse is None or not create:
            return None
        _SLOT.pack_into(self._mm, reuse, key, math.nan, now, now, *([0] * 2 * _PIDS))
        return reuse

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _key(self, tenant: str) -> bytes:
        key = self._keys.get(tenant)
        if key is None:
            if len(self._keys) >= MAX_TRACKED:
                self._keys.clear()
            key = self._keys[tenant] = hashlib.blake2b(tenant.encode(), digest_size=16).digest()
        return key

    def admit(self, tenants: Sequence[str], now: float | None = None) -> list[str | None]:
        now = self.clock() if now is None else now
        out: list[str | None] = [None] * len(tenants)
        groups: dict[str, list[int]] = {}
        for pos, tenant in enumerate(tenants):
            groups.setdefault(tenant, []).append(pos)
        local: list[int] = []  # positions left to this process's buckets
        with self._locked():
            for tenant, positions in groups.items():  # one slot read and write per tenant
                quota = self.quota(tenant)
                if quota is None:
                    continue
                key = self._key(tenant)
                off = self._slot(key, now, create=True)
                if off is None:
                    local += positions
                    continue
                if not quota.max_in_flight:  # a bucket only: the slot's pids are not read or kept
                    self._take(quota, tenant, positions, out, off, now)
                    continue
                rec = list(_SLOT.unpack_from(self._mm, off))
                tokens, pairs = _slot_tokens(quota, rec[1], rec[2], now), rec[4:]
                limited = not math.isinf(quota.rps)
                mine = next((j for j in range(0, 2 * _PIDS, 2) if pairs[j] == self.pid), None)
                in_flight, swept = sum(pairs[1::2]), False
                for pos in positions:
                    cap = quota.max_in_flight
                    if cap and in_flight >= cap and not swept:  # a dead process's requests are not in flight
                        swept = True
                        for j in range(0, 2 * _PIDS, 2):
                            if pairs[j] and pairs[j] != self.pid and not self._alive(pairs[j]):
                                pairs[j] = pairs[j + 1] = 0
                        in_flight = sum(pairs[1::2])
                    if mine is None:
                        mine = next((j for j in range(0, 2 * _PIDS, 2) if pairs[j + 1] == 0), None)
                    if cap and in_flight >= cap:
                        retry = max(1, math.ceil(1000 / quota.rps)) if limited else 100
                        out[pos] = (f"tenant '{tenant}' has {in_flight} requests in flight "
                                    f"(max {cap}); retry after {retry} ms")
                    elif mine is None:  # more live processes than a slot tracks
                        local.append(pos)
                    elif not limited or tokens >= 1:
                        tokens -= limited
                        pairs[mine], pairs[mine + 1] = self.pid, pairs[mine + 1] + 1
                        in_flight += 1
                    else:
                        out[pos] = _over_rate(tenant, quota, tokens)
                full_at = now + (quota.capacity - tokens) / quota.rps if limited else now
                _SLOT.pack_into(self._mm, off, key, tokens, now, full_at, *pairs)
        self.rejected += sum(1 for x in out if x is not None)
        if local:  # counted by super() itself
            for pos, why in zip(local, super().admit([tenants[p] for p in local], now), strict=True):
                out[pos] = why
        return out

    def _take(self, quota: Quota, tenant: str, positions: list[int], out: list[str | None], off: int,
              now: float) -> None:
        """A token per request from the bucket at slot ``off`` (under the lock), for a quota with
        no in-flight cap: nothing is counted in flight, so nothing is released later."""
        tokens, stamp, _full_at = _BUCKET.unpack_from(self._mm, off + _BUCKET_AT)
        tokens = _slot_tokens(quota, tokens, stamp, now)
        limited = not math.isinf(quota.rps)
        for pos in positions:
            if not limited or tokens >= 1:
                tokens -= limited
            else:
                out[pos] = _over_rate(tenant, quota, tokens)
        full_at = now + (quota.capacity - tokens) / quota.rps if limited else now
        _BUCKET.pack_into(self._mm, off + _BUCKET_AT, tokens, now, full_at)

    def release(self, tenants: Sequence[str]) -> None:
        # a quota without an in-flight cap counts nothing in flight in the file (_take): no lock
        # to take; only a tenant this process's own buckets admitted (no slot) counts it there
        capped, uncapped = [], []
        for tenant in tenants:
            quota = self.quota(tenant)
            if quota is not None:
                (capped if quota.max_in_flight else uncapped).append(tenant)
        if uncapped:
            super().release(uncapped)
        if not capped:
            return
        counts: dict[str, int] = {}
        for tenant in capped:
            counts[tenant] = counts.get(tenant, 0) + 1
        rest: list[str] = []
        now = self.clock()
        with self._locked():
            for tenant, n in counts.items():
                off = self._slot(self._key(tenant), now, create=False)
                rec = None if off is None else list(_SLOT.unpack_from(self._mm, off))
                j = None if rec is None else next((j for j in range(4, 4 + 2 * _PIDS, 2)
                                                   if rec[j] == self.pid and rec[j + 1] > 0), None)
                done = 0 if j is None else min(n, rec[j + 1])
                if done:
                    rec[j + 1] -= done
                    if rec[j + 1] == 0:
                        rec[j] = 0
                    _SLOT.pack_into(self._mm, off, *rec)
                rest += [tenant] * (n - done)  # admitted by this process's own buckets
        if rest:
            super().release(rest)

    def in_flight(self, tenant: str) -> int:
        """In flight for ``tenant`` in every process on this host."""
        with self._locked():
            off = self._slot(self._key(tenant), self.clock(), create=False)
            shared = 0 if off is None else sum(_SLOT.unpack_from(self._mm, off)[5::2])
        return shared + super().in_flight(tenant)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
