"""Tenant ids from request parameters, and per-tenant admission (rate, burst, in-flight).

The tenant arrives either as a request parameter (``tenant``) or as an HTTP header that Triton
forwards as a parameter when started with ``--http-header-forward-pattern`` (the parameter key
is then the header name, ``x-tenant-id``). Neither is authenticated by Triton: put an
authenticating proxy in front that sets the header, and treat the id as a label, not a proof.

Quotas are token buckets kept in this process: with several guard instances each one enforces
the full quota on its own share of the traffic.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidInput

FALLBACK = "*"
MAX_TRACKED = 10000  # idle tenant buckets kept; beyond this the least recently seen idle one goes


@dataclass(frozen=True)
class Quota:
    rps: float = math.inf  # sustained requests per second
    burst: int = 0  # bucket size; 0 = max(1, ceil(rps))
    max_in_flight: int = 0  # 0 = unlimited
    priority: int = 0  # larger = more important (for the scheduler)

    @property
    def capacity(self) -> float:
        if self.burst:
            return float(self.burst)
        return math.inf if math.isinf(self.rps) else float(max(1, math.ceil(self.rps)))


_QUOTA_KEYS = {"rps": float, "burst": int, "max_in_flight": int, "priority": int}


@dataclass(kw_only=True)
class TenancyConfig:
    """``tenancy.*`` parameters of a guard model."""

    enabled: bool = True
    parameter: str = "tenant"  # request parameter that carries the tenant id
    header: str = "x-tenant-id"  # forwarded HTTP header (arrives as a parameter of this name)
    default: str = "default"  # tenant of requests that name none
    # {"acme": {"rps": 50, "burst": 100, "max_in_flight": 8, "priority": 1}, "*": {"rps": 5}}
    quotas: dict[str, Any] = field(default_factory=dict)
    tenant_pattern: str = r"^[A-Za-z0-9._-]{1,64}$"

    def __post_init__(self) -> None:
        try:
            self.pattern = re.compile(self.tenant_pattern)
        except re.error as exc:
            raise ValueError(f"tenancy.tenant_pattern: invalid regex: {exc}") from None
        if not self.pattern.match(self.default):
            raise ValueError(f"tenancy.default {self.default!r} does not match tenancy.tenant_pattern")
        self.header = self.header.lower()
        parsed: dict[str, Quota] = {}
        for tenant, spec in self.quotas.items():
            where = f"tenancy.quotas[{tenant!r}]"
            if isinstance(spec, Quota):
                parsed[tenant] = spec
                continue
            if tenant != FALLBACK and not self.pattern.match(tenant):
                raise ValueError(f"{where}: tenant id does not match tenancy.tenant_pattern")
            if not isinstance(spec, Mapping):
                raise ValueError(f"{where} must be an object like {{\"rps\": 10, \"burst\": 20}}")
            unknown = set(spec) - set(_QUOTA_KEYS)
            if unknown:
                raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(_QUOTA_KEYS)})")
            try:
                q = Quota(**{k: _QUOTA_KEYS[k](v) for k, v in spec.items()})
            except (TypeError, ValueError):
                raise ValueError(f"{where}: values must be numbers") from None
            if q.rps <= 0 or q.burst < 0 or q.max_in_flight < 0:
                raise ValueError(f"{where}: rps must be > 0, burst and max_in_flight >= 0")
            parsed[tenant] = q
        self.quotas = parsed


class TenantResolver:
    def __init__(self, config: TenancyConfig):
        self.config = config

    def resolve_tenants(self, params_list: Sequence[Mapping[str, Any]]) -> tuple[list[str | None], list[InvalidInput | None]]:
        """Tenant per request (None where invalid) and the error per request (None where valid)."""
        cfg = self.config
        tenants: list[str | None] = []
        errors: list[InvalidInput | None] = []
        for params in params_list:
            tenant, err = cfg.default, None
            if cfg.enabled and params:
                # header names are case-insensitive; Triton passes on whatever case the client sent
                header = next((v for k, v in params.items() if k.lower() == cfg.header), None)
                explicit = params.get(cfg.parameter)
                if header is not None and explicit is not None and str(header) != str(explicit):
                    err = InvalidInput("tenant", "tenant_id", f"parameter '{cfg.parameter}' and header "
                                       f"'{cfg.header}' name different tenants")
                value = explicit if explicit is not None else header
                if err is None and value is not None:
                    if isinstance(value, bool) or not isinstance(value, (str, int)):
                        err = InvalidInput("tenant", "tenant_id", "tenant id must be a string")
                    elif not cfg.pattern.match(str(value)):
                        err = InvalidInput("tenant", "tenant_id", f"tenant id must match {cfg.tenant_pattern}")
                    else:
                        tenant = str(value)
            tenants.append(None if err else tenant)
            errors.append(err)
        return tenants, errors


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
                    retry = max(1, math.ceil((1 - b.tokens) / quota.rps * 1000))
                    out.append(f"tenant '{tenant}' is over its rate limit of {quota.rps:g} requests/s; "
                               f"retry after {retry} ms")
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
