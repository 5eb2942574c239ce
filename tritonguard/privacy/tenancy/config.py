"""``tenancy.*``: :class:`TenancyConfig`, checked when the guard loads, and each tenant's :class:`Quota`.

``tenancy.quotas`` maps tenant ids to quotas, ``"*"`` (:data:`FALLBACK`) standing for every tenant
not named (each such tenant still gets a bucket of its own: :mod:`tritonguard.privacy.tenancy.quotas`);
``tenancy.auth`` says how a tenant id is believed (:mod:`tritonguard.privacy.tenancy.auth`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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


AUTH_MODES = ("none", "api_key", "jwt")
UNAUTHENTICATED = ("refuse", "default")
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
    # authenticated tenants: none (ids are claims) | api_key | jwt
    auth: str = "none"
    unauthenticated: str = "refuse"  # no credential: refuse | default (served as tenancy.default)
    keys_file: str = ""  # api_key: JSON or TOML, tenant -> SHA-256 hex digests of its keys
    key_header: str = "x-tritonguard-api-key"  # api_key: forwarded header carrying the key
    jwt_secret_env: str = "TRITONGUARD_TENANT_JWT_SECRET"  # jwt: env var holding the HS256 secret
    jwt_claim: str = "sub"  # jwt: claim naming the tenant
    jwt_header: str = "authorization"  # jwt: forwarded header, "Bearer <token>"
    jwt_leeway_s: float = 10.0  # jwt: clock skew allowed on exp / nbf / iat
    jwt_audience: str = ""  # jwt: required "aud" if set
    jwt_issuer: str = ""  # jwt: required "iss" if set

    def __post_init__(self) -> None:
        try:
            self.pattern = re.compile(self.tenant_pattern)
        except re.error as exc:
            raise ValueError(f"tenancy.tenant_pattern: invalid regex: {exc}") from None
        if not self.pattern.match(self.default):
            raise ValueError(f"tenancy.default {self.default!r} does not match tenancy.tenant_pattern")
        self.header = self.header.lower()
        self.key_header = self.key_header.lower()
        self.jwt_header = self.jwt_header.lower()
        if self.auth not in AUTH_MODES:
            raise ValueError(f"tenancy.auth must be one of {', '.join(AUTH_MODES)}, got {self.auth!r}")
        if self.unauthenticated not in UNAUTHENTICATED:
            raise ValueError(f"tenancy.unauthenticated must be one of {', '.join(UNAUTHENTICATED)}, "
                             f"got {self.unauthenticated!r}")
        if self.auth != "none" and not self.enabled:
            raise ValueError(f"tenancy.auth={self.auth} needs tenancy.enabled=true")
        if self.jwt_leeway_s < 0 or self.jwt_leeway_s > 300:
            raise ValueError("tenancy.jwt_leeway_s must lie in [0, 300] seconds")
        credential = {"api_key": self.key_header, "jwt": self.jwt_header}.get(self.auth)
        if credential is not None and credential in (self.header, self.parameter.lower()):
            raise ValueError(f"tenancy: the credential header '{credential}' cannot also name the tenant")
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
