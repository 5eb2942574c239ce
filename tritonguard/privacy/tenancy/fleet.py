"""One tenant quota for the whole fleet: every replica (every guard process on every host) that
shares ``$TRITONGUARD_STATE_URL=redis://…`` draws from one token bucket and one in-flight count
per tenant, kept in Redis, through leases, so the serving path does not wait on Redis per request.

Rate (``rps``/``burst``): the bucket lives in Redis (a hash, refilled by Redis's own clock in an
atomic Lua script, :data:`_TAKE`). A replica takes a *lease* of up to ``K`` tokens at a time
(``K`` = :attr:`FleetQuotaManager.lease_s` seconds of the rate, at least 1, at most the burst),
spends them locally, and asks for the next lease from a background thread once it holds fewer than
``K/2``; only a replica whose lease cannot cover a batch (its first request, or the bucket ran
dry) asks on the request path, bounded by the client's socket timeout (``timeout_s``, 50 ms). A
refusal from Redis says how long until a whole lease has refilled: the replica refuses locally
(with that retry advice) until then instead of asking again, so a dry bucket is asked about once
per lease, not once per token. What the fleet admits is therefore what the one bucket grants:
``rps * seconds + burst``, less the few tokens the replicas still hold when traffic stops (given
back by :meth:`FleetQuotaManager.close`).

In flight (``max_in_flight``): a Redis hash per tenant holds how many slots each replica holds
(:data:`_SLOTS`); a replica grows its share on the request path when its own requests would exceed
it (the script grants only what keeps the fleet's sum within the cap), and gives idle slots back
from the background thread after releases. Each replica keeps a lease key alive (``ttl_s``, 5 s,
refreshed every third of it); a replica whose lease lapsed (it died, or lost Redis) is swept from
the hash by the next acquire anywhere, so its slots come back within the TTL. A replica that finds
its own lease lapsed forgets what it held and re-acquires for the requests it still has in flight.

Redis unreachable (an error or a timeout): the replica judges by its host's quota instead (the
``local`` manager, :class:`~tritonguard.privacy.tenancy.quotas.SharedQuotaManager`: each host
enforces the full quota, the behaviour before fleet quotas) and counts each such request in
:attr:`FleetQuotaManager.degraded` (``tritonguard_quota_degraded_total``); Redis is skipped for a
backoff (:class:`tritonguard.core.outage.Backoff`: 1 s doubling to 30 s) and tried again after it.
Nothing here raises into the serving path.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tritonguard.core.outage import Backoff
from tritonguard.core.store import redacted, redis_client, redis_prefix, store_error
from tritonguard.privacy.tenancy.budget import TokenBudget, TokenBudgetConfig, budget_refusal
from tritonguard.privacy.tenancy.config import FALLBACK, MAX_TRACKED, Quota, TenancyConfig
from tritonguard.privacy.tenancy.quotas import QuotaManager

log = logging.getLogger(__name__)

KEY_PREFIX = "tritonguard:quota:"  # without a namespace; see FleetQuotaManager

# KEYS[1] bucket hash; ARGV rps, capacity, want (< 0: give tokens back), lease.
# Returns {granted, seconds until a whole lease has refilled (string)}; time is Redis's own (TIME).
# Waiting for a whole lease, not one token, keeps a dry bucket from being polled once per token.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rps, cap, want, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(b[1])
if tokens == nil then tokens = cap else tokens = math.min(cap, tokens + math.max(0, now - tonumber(b[2])) * rps) end
local grant
if want < 0 then
  tokens = math.min(cap, tokens - want)
  grant = want
else
  grant = math.max(0, math.min(want, math.floor(tokens)))
  tokens = tokens - grant
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'stamp', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rps * 1000) + 60000)
local wait = 0
if tokens < lease then wait = (math.min(lease, cap) - tokens) / rps end
return {grant, tostring(wait)}
"""

# KEYS[1] in-flight hash (replica id -> slots held); ARGV replica, delta, cap, lease key prefix.
# delta > 0: grow this replica's share by up to delta within the fleet's cap, sweeping replicas
# whose lease key is gone; delta < 0: give slots back. Returns {granted, the fleet's total after}.
_SLOTS = """
local me, delta, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local mine = tonumber(redis.call('HGET', KEYS[1], me) or '0')
local all = redis.call('HGETALL', KEYS[1])
local others = 0
for i = 1, #all, 2 do
  if all[i] ~= me then
    if redis.call('EXISTS', ARGV[4] .. all[i]) == 0 then
      redis.call('HDEL', KEYS[1], all[i])
    else
      others = others + tonumber(all[i + 1])
    end
  end
end
local grant
if delta > 0 then
  grant = math.max(0, math.min(delta, cap - others - mine))
else
  grant = math.max(delta, -mine)
end
mine = mine + grant
if mine > 0 then redis.call('HSET', KEYS[1], me, mine) else redis.call('HDEL', KEYS[1], me) end
return {grant, others + mine}
"""

# KEYS[1] this replica's lease key; ARGV ttl ms. Returns 1 when the lease had lapsed (or is new).
_LEASE = """
local had = redis.call('EXISTS', KEYS[1])
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
return 1 - had
"""


class _Tenant:
    __slots__ = ("quota", "tokens", "deny_until", "wanted", "held", "in_flight", "local")

    def __init__(self, quota: Quota):
        self.quota = quota
        self.tokens = 0  # leased from the fleet's bucket, not yet spent
        self.deny_until = 0.0  # the bucket was dry: do not ask again before (local clock)
        self.wanted = False  # a lease is asked for by the background thread
        self.held = 0  # in-flight slots this replica holds in Redis
        self.in_flight = 0  # this replica's requests admitted by the fleet and not yet released
        self.local = 0  # requests in flight admitted by the local manager (Redis unreachable)


class FleetQuotaManager(QuotaManager):
    """The fleet's quotas, through Redis leases; ``local`` judges while Redis is unreachable.
    Keys under ``key_prefix``, by default this process's namespace (``redis_prefix("quota")``):
    two fleets on one Redis draw from two buckets."""

    lease_s = 0.05  # a rate lease is this many seconds of the tenant's rate
    BACKOFF_START_S = 1.0
    BACKOFF_MAX_S = 30.0

    def __init__(self, config: TenancyConfig, url: str, *, guard: str, local: QuotaManager,
                 ttl_s: float = 5.0, timeout_s: float = 0.05, key_prefix: str | None = None,
                 replica: str | None = None, clock: Any = time.monotonic, client: Any = None,
                 background: bool = True):
        import redis

        super().__init__(config, clock)
        self._redis = redis
        self.url, self.guard, self.local = url, guard, local
        self.where = redacted(url)
        self.ttl_s = ttl_s
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.prefix = f"{redis_prefix('quota') if key_prefix is None else key_prefix}{guard}:"
        self._lease_prefix = f"{self.prefix}replica:"
        # no client-side retries: a retry loop would hold the serving thread during an outage
        self.client = client or redis_client(url, timeout=timeout_s)
        self._take = self.client.register_script(_TAKE)
        self._slots = self.client.register_script(_SLOTS)
        self._lease = self.client.register_script(_LEASE)
        self._health = Backoff(clock, self.BACKOFF_START_S, self.BACKOFF_MAX_S)
        self._tenants: dict[str, _Tenant] = {}
        self._lease_at = -math.inf  # when this replica's lease key was last refreshed
        self.degraded = 0  # requests judged by the local manager: Redis unreachable
        self.errors = 0  # Redis calls that failed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=f"fleet-quota-{guard}", daemon=True)
            self._thread.start()

    # -- Redis, never raising -----------------------------------------------------------------
    def available(self) -> bool:
        """False while Redis is skipped after a failure (the local manager judges meanwhile)."""
        return self._health.available()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One Redis call; None after a failure (counted, and Redis then backs off)."""
        try:
            out = fn(*args, **kwargs)
        except (self._redis.RedisError, OSError) as exc:
            self.errors += 1
            log.warning("fleet quotas: %s unreachable (%s); judging by this host's quotas for %.0f s",
                        self.where, store_error(exc, self.url), self._health.fail())
            return None
        if self._health.recover():
            log.info("fleet quotas: %s reachable again", self.where)
        return out

    def _renew(self) -> bool:
        """Keep this replica's lease key alive; if it had lapsed, forget the slots it held (the
        fleet swept them) so the requests still in flight are acquired again. False if Redis failed."""
        now = self.clock()
        if now - self._lease_at < self.ttl_s / 3:
            return True
        lapsed = self._call(self._lease, keys=[self._lease_prefix + self.replica], args=[int(self.ttl_s * 1000)])
        if lapsed is None:
            return False
        self._lease_at = now
        if int(lapsed):
            with self._lock:
                for st in self._tenants.values():
                    st.held = 0
        return True

    def _state(self, tenant: str, quota: Quota) -> _Tenant:
        st = self._tenants.get(tenant)
        if st is None or st.quota is not quota:
            if len(self._tenants) >= MAX_TRACKED:  # forget idle tenants (their leases are small)
                for name in [n for n, s in self._tenants.items() if not (s.in_flight or s.local or s.held)]:
                    del self._tenants[name]
            st = self._tenants[tenant] = _Tenant(quota)
        return st

    def _rate_key(self, tenant: str) -> str:
        return f"{self.prefix}rate:{tenant}"

    def _slots_key(self, tenant: str) -> str:
        return f"{self.prefix}inflight:{tenant}"

    def lease_size(self, quota: Quota) -> int:
        return max(1, min(int(quota.capacity), math.ceil(quota.rps * self.lease_s)))

    def _take_tokens(self, tenant: str, quota: Quota, want: int) -> tuple[int, float] | None:
        out = self._call(self._take, keys=[self._rate_key(tenant)],
                         args=[quota.rps, quota.capacity, want, self.lease_size(quota)])
        return None if out is None else (int(out[0]), float(out[1]))

    def _grow(self, tenant: str, quota: Quota, delta: int) -> int | None:
        out = self._call(self._slots, keys=[self._slots_key(tenant)],
                         args=[self.replica, delta, quota.max_in_flight, self._lease_prefix])
        return None if out is None else int(out[0])

    # -- the serving path -----------------------------------------------------------------------
    def admit(self, tenants: Sequence[str], now: float | None = None) -> list[str | None]:
        now = self.clock() if now is None else now
        out: list[str | None] = [None] * len(tenants)
        groups: dict[str, list[int]] = {}
        for pos, tenant in enumerate(tenants):
            if self.quota(tenant) is not None:  # no quota: unlimited
                groups.setdefault(tenant, []).append(pos)
        if not groups:
            return out
        fallback: list[int] = []
        if not self.available() or not self._renew():
            fallback = [p for ps in groups.values() for p in ps]
            groups = {}
        for tenant, positions in groups.items():
            quota = self.quota(tenant)
            assert quota is not None
            limited = not math.isinf(quota.rps)
            cap = quota.max_in_flight
            with self._lock:
                st = self._state(tenant, quota)
                short_tokens = (len(positions) - st.tokens) if limited else 0
                ask_tokens = short_tokens > 0 and now >= st.deny_until
            # on the request path only when this replica holds too little (bounded by the timeout)
            if ask_tokens:
                got = self._take_tokens(tenant, quota, max(short_tokens, self.lease_size(quota)))
                if got is None:
                    fallback += positions
                    continue
                with self._lock:
                    st.tokens += got[0]
                    if got[0] < short_tokens:
                        st.deny_until = now + got[1]
            with self._lock:  # slots only for the requests that have a token
                n = min(len(positions), int(st.tokens)) if limited else len(positions)
                short_slots = (st.in_flight + n - st.held) if cap else 0
            if short_slots > 0:
                granted = self._grow(tenant, quota, short_slots)
                if granted is None:
                    fallback += positions
                    continue
                with self._lock:
                    st.held += granted
            with self._lock:
                for pos in positions:
                    if cap and st.in_flight >= st.held:
                        retry = max(1, math.ceil(1000 / quota.rps)) if limited else 100
                        out[pos] = (f"tenant '{tenant}' has {cap} requests in flight across replicas "
                                    f"(max {cap}); retry after {retry} ms")
                    elif limited and st.tokens < 1:
                        retry = max(1, math.ceil(max(st.deny_until - now, 1 / quota.rps) * 1000))
                        out[pos] = (f"tenant '{tenant}' is over its rate limit of {quota.rps:g} requests/s; "
                                    f"retry after {retry} ms")
                    else:
                        st.tokens -= limited
                        st.in_flight += 1
                if limited and st.tokens < self.lease_size(quota) / 2 and not st.wanted:
                    st.wanted = True
                    self._wake.set()
        self.rejected += sum(1 for x in out if x is not None)
        if fallback:  # Redis unreachable: the host's quotas judge these (counted by the local manager)
            self.degraded += len(fallback)
            for pos, why in zip(fallback, self.local.admit([tenants[p] for p in fallback]), strict=True):
                out[pos] = why
                if why is None:
                    with self._lock:
                        self._state(tenants[pos], self.quota(tenants[pos])).local += 1  # type: ignore[arg-type]
        return out

    def release(self, tenants: Sequence[str]) -> None:
        local: list[str] = []
        give = False
        with self._lock:
            for tenant in tenants:
                st = self._tenants.get(tenant)
                if st is None:
                    continue
                if st.local > 0:
                    st.local -= 1
                    local.append(tenant)
                elif st.in_flight > 0:
                    st.in_flight -= 1
                    give = give or st.held > st.in_flight
        if local:
            self.local.release(local)
        if give:
            self._wake.set()

    def in_flight(self, tenant: str) -> int:
        """This replica's requests in flight for ``tenant`` (fleet-admitted and local)."""
        st = self._tenants.get(tenant)
        return 0 if st is None else st.in_flight + st.local

    def fleet_in_flight(self, tenant: str) -> int | None:
        """Slots the fleet holds for ``tenant`` (live replicas); None if Redis did not answer."""
        raw = self._call(self.client.hgetall, self._slots_key(tenant))
        return None if raw is None else sum(int(v) for v in raw.values())

    # -- the background thread: leases asked ahead, idle slots given back, the lease key kept ----
    def sync(self) -> None:
        """One round of the background work (the thread runs it; tests may call it)."""
        if not self.available() or not self._renew():
            return
        with self._lock:
            want = [(t, st) for t, st in self._tenants.items() if st.wanted]
            spare = [(t, st, st.held - st.in_flight) for t, st in self._tenants.items() if st.held > st.in_flight]
        now = self.clock()
        for tenant, st in want:
            if now < st.deny_until:
                continue
            lease = self.lease_size(st.quota)
            got = self._take_tokens(tenant, st.quota, lease)
            with self._lock:
                st.wanted = got is not None and got[0] == 0  # a dry bucket: asked again once refilled
                if got is not None:
                    st.tokens += got[0]
                    if got[0] < lease:
                        st.deny_until = now + got[1]
            if got is None:
                return
        for tenant, st, n in spare:
            with self._lock:
                n = min(n, st.held - st.in_flight)
                if n <= 0:
                    continue
                st.held -= n  # given back first: a request meanwhile asks for its own
            back = self._call(self._slots, keys=[self._slots_key(tenant)],
                              args=[self.replica, -n, st.quota.max_in_flight, self._lease_prefix])
            if back is None:
                with self._lock:
                    st.held += n  # still ours; given back once Redis answers
                return

    def _loop(self) -> None:
        timeout = min(self.ttl_s / 3, 0.5)
        while not self._stop.is_set():
            self._wake.wait(timeout)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - the thread must outlive any surprise
                log.exception("fleet quotas: background round failed")
            # a tenant still short after a refusal is asked for again once its wait is over
            timeout = min(self.ttl_s / 3, 0.5)
            with self._lock:
                pending = [st.deny_until for st in self._tenants.values() if st.wanted]
            if pending and self.available():
                timeout = min(timeout, max(0.001, min(pending) - self.clock()))

    def close(self) -> None:
        """Stop the thread, give back unspent tokens and held slots, drop the lease; close the local manager."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.available():
            with self._lock:
                items = list(self._tenants.items())
            for tenant, st in items:
                if st.tokens >= 1 and not math.isinf(st.quota.rps):
                    if self._take_tokens(tenant, st.quota, -int(st.tokens)) is None:
                        break
                    st.tokens -= int(st.tokens)
                if st.held:
                    if self._call(self._slots, keys=[self._slots_key(tenant)],
                                  args=[self.replica, -st.held, st.quota.max_in_flight, self._lease_prefix]) is None:
                        break
                    st.held = 0
            if self.available():
                self._call(self.client.delete, self._lease_prefix + self.replica)
        with contextlib.suppress(Exception):
            self.client.close()
        close = getattr(self.local, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


# -- token budgets (tokens.per_minute) for the fleet ------------------------------------------
# KEYS[1] the tenant's token bucket hash; ARGV rate (tokens/s), capacity, want, extra, now (< 0:
# Redis's own TIME), mode. mode 0: all or nothing, ``want`` and up to ``extra`` more while the bucket
# holds them, else nothing and the seconds until ``want`` have refilled; mode 1: ``want`` tokens
# taken whatever the bucket holds (an overrun: it may go below zero); mode 2: ``want`` tokens given
# back (capped at the capacity). Returns {granted, wait seconds, the bucket's tokens after (strings)}.
_RESERVE = """
local now = tonumber(ARGV[5])
if now < 0 then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local rate, cap, want, extra, mode = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[6]
local b = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(b[1])
if tokens == nil then tokens = cap else tokens = math.min(cap, tokens + math.max(0, now - tonumber(b[2])) * rate) end
local grant, wait = 0, 0
if mode == '2' then
  tokens = math.min(cap, tokens + want)
  grant = want
elseif mode == '1' then
  tokens = tokens - want
  grant = want
elseif tokens >= want then
  grant = want + math.max(0, math.min(extra, math.floor(tokens - want)))
  tokens = tokens - grant
else
  wait = (want - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'stamp', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rate * 1000) + 60000)
return {grant, tostring(wait), tostring(tokens)}
"""


class _Pool:
    __slots__ = ("tokens", "deny_until", "wait", "local")

    def __init__(self) -> None:
        self.tokens = 0  # leased from the fleet's bucket, not reserved by a generation (< 0: owed)
        self.deny_until = 0.0  # the bucket could not cover a reservation: refuse locally until then
        self.wait = 0.0
        self.local = 0  # reservations in flight made by the local budget (Redis unreachable)


class FleetTokenBudget(TokenBudget):
    """``tokens.per_minute`` for the whole fleet: one bucket per tenant in Redis, refilled by
    Redis's clock in an atomic Lua script (:data:`_RESERVE`), leased as the fleet quota's rate is.

    A replica holds a small pool of tokens per tenant (at most :attr:`lease_s` seconds of the
    rate) and reserves a generation's ``max_tokens`` from it; only a pool that cannot cover the
    reservation asks Redis, on the request path, for the reservation *all or nothing* plus a
    lease's worth more if the bucket holds it, so two replicas never split the last tokens between
    them and neither can start. A refused ask says how long until the reservation has refilled;
    the replica refuses that tenant locally until then. Settling puts the unused part back in the
    pool and gives back to Redis what the pool holds beyond a lease, at once (the end path, after
    the client's last response), so tokens never idle in a replica that stopped serving that
    tenant; an overrun is owed by the pool and paid from the next ask. A replica that dies holds at
    most a lease and its reservations in flight: the bucket refills them within the minute.

    ``tokens.max_in_flight`` stays per process. Redis unreachable: this process's own bucket
    judges (:class:`TokenBudget`, the behaviour without Redis), counted in :attr:`degraded`, and
    Redis is skipped for a backoff as for the quotas. ``shared_clock=False`` sends ``clock()`` to
    the script instead of Redis's TIME (tests)."""

    lease_s = 0.1
    BACKOFF_START_S = 1.0
    BACKOFF_MAX_S = 30.0

    def __init__(self, config: TokenBudgetConfig, url: str, *, guard: str, timeout_s: float = 0.05,
                 key_prefix: str | None = None, clock: Any = time.monotonic, minute_s: float = 60.0,
                 shared_clock: bool = True, client: Any = None) -> None:
        import redis

        super().__init__(config, clock, minute_s=minute_s)
        self._redis = redis
        self.url, self.guard, self.where = url, guard, redacted(url)
        self.shared_clock = shared_clock
        self.prefix = f"{redis_prefix('quota') if key_prefix is None else key_prefix}{guard}:tokens:"
        self.client = client or redis_client(url, timeout=timeout_s)
        self._reserve = self.client.register_script(_RESERVE)
        self._health = Backoff(clock, self.BACKOFF_START_S, self.BACKOFF_MAX_S)
        self._pools: dict[str, _Pool] = {}
        self.degraded = 0  # reservations judged by this process's bucket: Redis unreachable
        self.errors = 0  # Redis calls that failed
        self.asks = 0  # Redis calls made (most reservations are served from the pool)

    @property
    def lease(self) -> int:
        return max(1, min(self.config.per_minute, math.ceil(self.rate * self.lease_s)))

    def available(self) -> bool:
        return self._health.available()

    def _call(self, want: int, extra: int, mode: int, tenant: str) -> tuple[int, float, float] | None:
        """One script call: (granted, wait s, the bucket's tokens after); None after a failure
        (counted; Redis then backs off)."""
        now = -1.0 if self.shared_clock else self.clock()
        self.asks += 1
        try:
            out = self._reserve(keys=[self.prefix + tenant],
                                args=[self.rate, self.config.per_minute, want, extra, now, mode])
        except (self._redis.RedisError, OSError) as exc:
            self.errors += 1
            log.warning("fleet token budget: %s unreachable (%s); judging by this process's budget for %.0f s",
                        self.where, store_error(exc, self.url), self._health.fail())
            return None
        if self._health.recover():
            log.info("fleet token budget: %s reachable again", self.where)
        return int(out[0]), float(out[1]), float(out[2])

    def _pool(self, tenant: str) -> _Pool:
        pool = self._pools.get(tenant)
        if pool is None:
            if len(self._pools) >= MAX_TRACKED:  # forget idle tenants whose pools are empty
                for name in [n for n, p in self._pools.items() if not (p.tokens or p.local)]:
                    del self._pools[name]
            pool = self._pools[tenant] = _Pool()
        return pool

    def reserve(self, tenant: str, want: int) -> tuple[int, str | None]:
        if not self.config.per_minute:
            return super().reserve(tenant, want)
        want = self.cap(want)
        with self._lock:
            why = self._take_slot(tenant)
            if why is not None:
                self.rejected += 1
                return 0, why
            pool = self._pool(tenant)
            if pool.tokens >= want:
                pool.tokens -= want
                return want, None
            now = self.clock()
            denied = now < pool.deny_until
            short = want - pool.tokens  # a debt in the pool is paid with this ask
            wait = pool.deny_until - now
        if not denied and self.available():
            got = self._call(short, self.lease, 0, tenant)
            if got is not None:
                with self._lock:
                    pool.tokens += got[0]
                    if pool.tokens >= want:
                        pool.tokens -= want
                        return want, None
                    pool.deny_until, wait = now + got[1], got[1]
                    denied = True
        if denied:
            with self._lock:
                self._in_flight[tenant] -= 1
                self.rejected += 1
            return 0, budget_refusal(tenant, self.config.per_minute, want, math.ceil(wait * 1000))
        # Redis unreachable: this process's bucket judges (its slot is taken again there)
        self.release(tenant)
        self.degraded += 1
        granted, why = super().reserve(tenant, want)
        if why is None:
            with self._lock:
                self._pool(tenant).local += 1
        return granted, why

    def settle(self, tenant: str, reserved: int, used: int) -> None:
        if not self.config.per_minute:
            return
        back = reserved - max(0, used)
        with self._lock:
            pool = self._pool(tenant)
            if pool.local > 0:  # reserved from this process's bucket while Redis was away
                pool.local -= 1
                local = True
            else:
                local = False
                pool.tokens += back
                spare = pool.tokens - self.lease
                if spare > 0 or pool.tokens < 0:
                    give = spare if spare > 0 else pool.tokens  # < 0: an overrun, paid now
                    pool.tokens -= give
                else:
                    give = 0
        if local:
            super().settle(tenant, reserved, used)
        elif give and (not self.available() or
                       self._call(abs(give), 0, 2 if give > 0 else 1, tenant) is None):
            with self._lock:
                pool.tokens += give  # still ours: given back (or paid) with a later call

    def balance(self, tenant: str) -> float:
        """The fleet bucket's tokens now (without taking any); this process's if Redis is away."""
        if not self.config.per_minute or not self.available():
            return super().balance(tenant)
        got = self._call(0, 0, 2, tenant)  # gives back nothing: reads the refilled bucket
        return super().balance(tenant) if got is None else got[2]

    def close(self) -> None:
        """Give back what the pools hold (a debt is paid)."""
        if self.config.per_minute and self.available():
            with self._lock:
                items = [(t, p.tokens) for t, p in self._pools.items() if p.tokens]
                for _, p in self._pools.items():
                    p.tokens = 0
            for tenant, tokens in items:
                if self._call(abs(tokens), 0, 2 if tokens > 0 else 1, tenant) is None:
                    break
        with contextlib.suppress(Exception):
            self.client.close()


def token_budget(config: TokenBudgetConfig, *, guard: str, url: str | None = None) -> TokenBudget:
    """The guard's token budget: the fleet's (Redis state URL and a per-minute budget) or this
    process's."""
    if url is not None and fleet_url(url) and config.per_minute:
        return FleetTokenBudget(config, url, guard=guard)
    return TokenBudget(config)


def fleet_url(url: str) -> bool:
    """Whether a state URL names Redis (fleet quotas), not the file store."""
    return url.startswith(("redis://", "rediss://", "unix://"))


__all__ = ["FALLBACK", "FleetQuotaManager", "FleetTokenBudget", "KEY_PREFIX", "fleet_url", "token_budget"]
