"""Tenant ids from request parameters, and per-tenant admission (rate, burst, in-flight).

The tenant arrives either as a request parameter (``tenant``) or as an HTTP header that Triton
forwards as a parameter when started with ``--http-header-forward-pattern`` (the parameter key
is then the header name, ``x-tenant-id``). Neither is authenticated by Triton: with
``tenancy.auth=none`` (the default) the id is a label, not a proof. ``tenancy.auth=api_key``
(:class:`ApiKeys`: SHA-256 digests of per-tenant keys in a file re-read when it changes) or
``tenancy.auth=jwt`` (:class:`JwtTokens`: HS256 tokens whose claim names the tenant) make the
guard verify a credential that arrives the same way (a forwarded header); a tenant id the client
names as well must then be the authenticated one. Requests without a credential are refused or
served as ``tenancy.default`` (``tenancy.unauthenticated``); a wrong, expired or forged one is
always refused, and no message or log line holds a key or a token.

Quotas are token buckets. :class:`SharedQuotaManager` keeps them in a memory-mapped file beside
the guard's rollout state, so every instance (process) of a guard on one host draws from the same
bucket; :class:`QuotaManager` is the per-process version it falls back to. Replicas on other
hosts each enforce the quota on their own traffic.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import math
import mmap
import os
import re
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonguard.core.errors import ConfigError, InvalidInput, TritonGuardError

log = logging.getLogger(__name__)

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


class AuthenticationError(InvalidInput):
    """A request's tenant credential is missing (where required), wrong, expired or forged:
    HTTP 400 / gRPC INVALID_ARGUMENT (python_backend has no 401). The message names the rule,
    never the key or the token."""

    def __init__(self, detail: str):
        self.input_name = "tenant"
        self.rule = "tenant_auth"
        TritonGuardError.__init__(self, detail)


# -- API keys ------------------------------------------------------------------------------------
KEY_PREFIX = "tg_"
KEYS_RELOAD_S = 1.0  # the keys file is stat'ed at most this often
_BUCKET = 8  # hex characters of a digest that index it
_DIGEST = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")


def hash_api_key(key: str) -> str:
    """SHA-256 hex digest of an API key: what the keys file stores."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> tuple[str, str]:
    """A fresh random API key (256 bits) and its digest for the keys file."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_api_key(key)


def read_keys_file(path: Path, pattern: re.Pattern[str]) -> dict[str, str]:
    """``{digest: tenant}`` from a JSON or TOML file of ``tenant -> [digest, ...]`` (or one
    digest). Raises ValueError / OSError naming the problem, never a digest."""
    raw = path.read_bytes()
    if path.suffix.lower() == ".toml":
        try:
            import tomllib  # noqa: PLC0415 - Python >= 3.11
        except ModuleNotFoundError:  # pragma: no cover - Python 3.10 (the NGC image): tomli
            import tomli as tomllib  # noqa: PLC0415

        try:
            table = tomllib.loads(raw.decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"not valid TOML: {exc}") from None
    else:
        try:
            table = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(table, dict):
        raise ValueError('must map tenants to digests, e.g. {"acme": ["<sha256 hex>", ...]}')
    out: dict[str, str] = {}
    for tenant, digests in table.items():
        if not pattern.match(tenant):
            raise ValueError(f"tenant {tenant!r} does not match tenancy.tenant_pattern")
        if isinstance(digests, str):
            digests = [digests]
        if not isinstance(digests, list):
            raise ValueError(f"tenant {tenant!r}: expected a list of SHA-256 hex digests")
        for n, d in enumerate(digests):
            m = _DIGEST.match(d) if isinstance(d, str) else None
            if m is None:
                raise ValueError(f"tenant {tenant!r}: entry {n} is not a SHA-256 hex digest (64 hex characters)")
            digest = m.group(1).lower()
            other = out.setdefault(digest, tenant)
            if other != tenant:
                raise ValueError(f"tenants {other!r} and {tenant!r} share a key")
    return out


class ApiKeys:
    """Per-tenant API keys, kept as SHA-256 digests in ``tenancy.keys_file``.

    The file is stat'ed at most every ``interval`` seconds (by :meth:`refresh`, once per batch)
    and re-read when its mtime, size or inode changes, so keys rotate without a restart: add the
    new digest, hand out the key, remove the old digest. A file that cannot be read or parsed
    leaves the previous keys in force (logged once per change); a deleted one too. Replace it
    atomically (write a temporary file, rename it over the old one).
    """

    def __init__(self, config: TenancyConfig, *, clock: Any = time.monotonic, interval: float = KEYS_RELOAD_S):
        if not config.keys_file:
            raise ConfigError("tenancy.auth=api_key needs tenancy.keys_file (JSON or TOML: tenant -> "
                              "SHA-256 hex digests of its keys)")
        self.path = Path(config.keys_file)
        self.pattern = config.pattern
        self.header = config.key_header
        self.clock = clock
        self.interval = interval
        try:
            sig = self._stat()
            self._use(read_keys_file(self.path, self.pattern))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tenancy.keys_file '{self.path}': {_reason(exc)}") from None
        self._seen: tuple | None = sig
        self._next = clock() + interval
        self.reloads = 0

    def _use(self, digests: Mapping[str, str]) -> None:
        index: dict[str, list[tuple[str, str]]] = {}
        for digest, tenant in digests.items():
            index.setdefault(digest[:_BUCKET], []).append((digest, tenant))
        self._index = index  # swapped whole: a batch sees the old keys or the new ones
        self.tenants = len(set(digests.values()))
        self.keys = len(digests)

    def _stat(self) -> tuple:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)

    def refresh(self, now: float | None = None) -> None:
        """Re-read the file if it changed; at most one stat per ``interval``."""
        now = self.clock() if now is None else now
        if now < self._next:
            return
        self._next = now + self.interval
        try:
            sig = self._stat()
        except OSError as exc:
            if self._seen is not None:
                log.warning("tenancy.keys_file %s: cannot stat (%s); the keys read before stay in force",
                            self.path, _reason(exc))
            self._seen = None
            return
        if sig == self._seen:
            return
        try:
            digests = read_keys_file(self.path, self.pattern)
            if self._stat() != sig:
                return  # written while read: read again at the next check
        except (OSError, ValueError) as exc:
            log.warning("tenancy.keys_file %s: not reloaded (%s); the keys read before stay in force",
                        self.path, _reason(exc))
            self._seen = sig
            return
        self._seen = sig
        self._use(digests)
        self.reloads += 1
        log.info("tenancy.keys_file %s reloaded: %d keys of %d tenants", self.path, len(digests),
                 len(set(digests.values())))

    def verify(self, credential: str) -> tuple[str | None, str | None]:
        """(tenant, None) for a known key, else (None, why)."""
        if not credential:
            return None, f"authentication failed: empty API key in header '{self.header}'"
        digest = hash_api_key(credential)
        # found by a short prefix of the digest of what the client sent (its timing tells nothing
        # of the stored keys), confirmed by a constant-time compare of the whole digest
        for stored, tenant in self._index.get(digest[:_BUCKET], ()):
            if hmac.compare_digest(stored, digest):
                return tenant, None
        return None, f"authentication failed: unknown API key in header '{self.header}'"

    @property
    def required(self) -> str:
        return f"authentication required: send header '{self.header}: <API key>'"


# -- signed tenant tokens ------------------------------------------------------------------------
MIN_JWT_SECRET = 32  # bytes; RFC 7518 3.2: an HS256 key of at least the hash size


class JwtTokens:
    """HS256 tokens (PyJWT) in ``authorization: Bearer <token>``: the claim ``tenancy.jwt_claim``
    names the tenant; ``exp`` is required; the secret comes from ``$tenancy.jwt_secret_env``
    (read once, at load)."""

    def __init__(self, config: TenancyConfig, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        try:
            import jwt  # noqa: PLC0415 - only guards with tenancy.auth=jwt need PyJWT
        except ImportError:
            raise ConfigError("tenancy.auth=jwt needs the PyJWT package (pip install pyjwt)") from None
        self._jwt = jwt
        secret = env.get(config.jwt_secret_env, "")
        if len(secret.encode()) < MIN_JWT_SECRET:
            state = "is not set" if not secret else f"is shorter than {MIN_JWT_SECRET} bytes"
            raise ConfigError(f"tenancy.auth=jwt needs the HS256 secret in ${config.jwt_secret_env} "
                              f"(tenancy.jwt_secret_env), at least {MIN_JWT_SECRET} bytes: it {state} "
                              "(e.g. `openssl rand -hex 32`)")
        self._secret = secret.encode()
        self.header = config.jwt_header
        self.claim = config.jwt_claim
        self.pattern = config.pattern
        self.leeway = config.jwt_leeway_s
        self.audience = config.jwt_audience or None
        self.issuer = config.jwt_issuer or None
        require = ["exp", self.claim] + (["aud"] if self.audience else []) + (["iss"] if self.issuer else [])
        self._options = {"require": require, "verify_aud": self.audience is not None}
        self._verified: dict[bytes, tuple[str, float]] = {}  # sha256(token) -> (tenant, valid until)
        e = jwt.exceptions
        self._errors = (  # most specific first: fixed texts, never the exception's own message
            (e.ExpiredSignatureError, "token expired"),
            (e.ImmatureSignatureError, "token not valid yet (nbf/iat in the future)"),
            (e.InvalidSignatureError, "invalid token signature"),
            (e.InvalidAudienceError, "token audience not accepted"),
            (e.InvalidIssuerError, "token issuer not accepted"),
            (e.InvalidAlgorithmError, "token algorithm not allowed (HS256 only)"),
            (e.DecodeError, "malformed token"),
        )

    def refresh(self, now: float | None = None) -> None:
        pass

    def verify(self, credential: str) -> tuple[str | None, str | None]:
        scheme, _, token = credential.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None, f"authentication failed: header '{self.header}' must be 'Bearer <token>'"
        # a client sends the same token for many requests: PyJWT's checks cost ~60 us, a digest
        # of the token ~1 us. Only verified tokens are remembered, until their exp (+ leeway).
        key = hashlib.sha256(token.encode()).digest()
        hit = self._verified.get(key)
        if hit is not None:
            if time.time() <= hit[1]:
                return hit[0], None
            self._verified.pop(key, None)
        tenant, why, expires = self._decode(token)
        if tenant is not None:
            if len(self._verified) >= MAX_TRACKED:
                self._verified.clear()
            self._verified[key] = (tenant, expires)
        return tenant, why

    def _decode(self, token: str) -> tuple[str | None, str | None, float]:
        jwt = self._jwt
        try:
            claims = jwt.decode(token, self._secret, algorithms=["HS256"], options=self._options,
                                leeway=self.leeway, audience=self.audience, issuer=self.issuer)
        except jwt.exceptions.MissingRequiredClaimError as exc:
            return None, f"authentication failed: token lacks the required '{exc.claim}' claim", 0.0
        except jwt.exceptions.PyJWTError as exc:
            why = next((text for cls, text in self._errors if isinstance(exc, cls)), "invalid token")
            return None, f"authentication failed: {why}", 0.0
        except Exception:  # noqa: BLE001 - whatever a crafted token does, it is refused
            return None, "authentication failed: invalid token", 0.0
        tenant = claims.get(self.claim)
        if isinstance(tenant, bool) or not isinstance(tenant, (str, int)) or not self.pattern.match(str(tenant)):
            return None, f"authentication failed: the token's '{self.claim}' claim is not a valid tenant id", 0.0
        return str(tenant), None, float(claims["exp"]) + self.leeway

    @property
    def required(self) -> str:
        return f"authentication required: send header '{self.header}: Bearer <token>'"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)


def authenticator(config: TenancyConfig, environ: Mapping[str, str] | None = None, *,
                  clock: Any = time.monotonic) -> ApiKeys | JwtTokens | None:
    """The verifier ``tenancy.auth`` asks for (None for ``none``); ConfigError if it cannot work
    (no readable keys file, no secret): the guard then refuses to load."""
    if not config.enabled or config.auth == "none":
        return None
    if config.auth == "api_key":
        return ApiKeys(config, clock=clock)
    return JwtTokens(config, environ)


class TenantResolver:
    def __init__(self, config: TenancyConfig, environ: Mapping[str, str] | None = None, *,
                 clock: Any = time.monotonic):
        self.config = config
        self.auth = authenticator(config, environ, clock=clock)

    def _claim(self, params: Mapping[str, Any]) -> tuple[str | None, InvalidInput | None]:
        """The tenant id a request names (parameter or forwarded header), or None; or why it is invalid."""
        cfg = self.config
        # header names are case-insensitive; Triton passes on whatever case the client sent
        header = next((v for k, v in params.items() if k.lower() == cfg.header), None)
        explicit = params.get(cfg.parameter)
        if header is not None and explicit is not None and str(header) != str(explicit):
            return None, InvalidInput("tenant", "tenant_id", f"parameter '{cfg.parameter}' and header "
                                      f"'{cfg.header}' name different tenants")
        value = explicit if explicit is not None else header
        if value is None:
            return None, None
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return None, InvalidInput("tenant", "tenant_id", "tenant id must be a string")
        if not cfg.pattern.match(str(value)):
            return None, InvalidInput("tenant", "tenant_id", f"tenant id must match {cfg.tenant_pattern}")
        return str(value), None

    def resolve_tenants(self, params_list: Sequence[Mapping[str, Any]]) -> tuple[list[str | None], list[InvalidInput | None]]:
        """Tenant per request (None where invalid) and the error per request (None where valid)."""
        if self.auth is not None:
            return self._authenticated(params_list)
        cfg = self.config
        tenants: list[str | None] = []
        errors: list[InvalidInput | None] = []
        for params in params_list:
            tenant, err = cfg.default, None
            if cfg.enabled and params:
                claim, err = self._claim(params)
                if claim is not None:
                    tenant = claim
            tenants.append(None if err else tenant)
            errors.append(err)
        return tenants, errors

    def _authenticated(self, params_list: Sequence[Mapping[str, Any]]) -> tuple[list[str | None], list[InvalidInput | None]]:
        cfg, auth = self.config, self.auth
        assert auth is not None
        auth.refresh()  # api_key: one stat a second at most, a re-read when the file changed
        refuse = cfg.unauthenticated == "refuse"
        tenants: list[str | None] = []
        errors: list[InvalidInput | None] = []
        for params in params_list:
            tenant: str | None = None
            err: InvalidInput | None = None
            creds = [v for k, v in params.items() if k.lower() == auth.header] if params else []
            claim, err = self._claim(params) if params else (None, None)
            if err is not None:
                pass
            elif not creds:
                if refuse:
                    err = AuthenticationError(auth.required)
                else:
                    tenant = cfg.default  # a tenant named without a credential is not believed
            elif len(creds) > 1 and any(c != creds[0] for c in creds):
                err = AuthenticationError(f"authentication failed: header '{auth.header}' given twice")
            elif not isinstance(creds[0], str):
                err = AuthenticationError(f"authentication failed: header '{auth.header}' must be a string")
            else:
                tenant, why = auth.verify(creds[0])
                if why is not None:
                    err = AuthenticationError(why)
                elif claim is not None and claim != tenant:
                    err = AuthenticationError(f"authentication failed: the tenant named by parameter "
                                              f"'{cfg.parameter}' or header '{cfg.header}' is not the one "
                                              "the credential authenticates")
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


# -- quotas shared by every instance on the host ----------------------------------------------
QUOTA_FILE = "quota_buckets.bin"  # in the guard's model folder, beside rollout_state.json
_MAGIC = b"TGQUOTA1"
_HEADER = 64
_PIDS = 16  # processes whose in-flight requests one slot tracks (Triton instances of one guard)
_PROBE = 64  # slots probed per tenant; a tenant that finds none is limited by this process alone
_EMPTY = bytes(16)
# tenant key, tokens, stamp, time the bucket is full again, then (pid, in-flight) pairs
_SLOT = struct.Struct("<16sddd" + "ii" * _PIDS)


class SharedQuotaManager(QuotaManager):
    """The same token buckets and in-flight caps, kept in a memory-mapped file that every process
    of the guard on this host opens (each Triton instance is its own process), under an ``flock``.

    A slot per tenant: tokens, the last refill stamp (``time.monotonic`` is system-wide on Linux),
    and each process's in-flight count, so a process that dies with requests in flight is
    forgotten (its pid is checked when the cap would refuse). A slot whose bucket is full again
    with nothing in flight is as good as a new one and is reused. A tenant that finds no slot
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
                rec = list(_SLOT.unpack_from(self._mm, off))
                tokens, pairs = rec[1], rec[4:]
                limited = not math.isinf(quota.rps)
                if math.isnan(tokens):  # a new slot: a full bucket
                    tokens = quota.capacity
                elif limited:
                    tokens = min(quota.capacity, tokens + max(0.0, now - rec[2]) * quota.rps)
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
                        retry = max(1, math.ceil((1 - tokens) / quota.rps * 1000))
                        out[pos] = (f"tenant '{tenant}' is over its rate limit of {quota.rps:g} requests/s; "
                                    f"retry after {retry} ms")
                full_at = now + (quota.capacity - tokens) / quota.rps if limited else now
                _SLOT.pack_into(self._mm, off, key, tokens, now, full_at, *pairs)
        self.rejected += sum(1 for x in out if x is not None)
        if local:  # counted by super() itself
            for pos, why in zip(local, super().admit([tenants[p] for p in local], now), strict=True):
                out[pos] = why
        return out

    def release(self, tenants: Sequence[str]) -> None:
        counts: dict[str, int] = {}
        for tenant in tenants:
            counts[tenant] = counts.get(tenant, 0) + 1
        rest: list[str] = []
        now = self.clock()
        with self._locked():
            for tenant, n in counts.items():
                if self.quota(tenant) is None:
                    continue
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


MAX_TENANT_LABELS = 256  # distinct tenant label values on metrics; later tenants share "_other"
OTHER_TENANTS = "_other"


class TenantLabels:
    """A tenant as a metric label, with bounded cardinality: the first ``limit`` tenants seen
    keep their name, later ones share ``_other``. One per guard process, shared by its stages."""

    def __init__(self, limit: int = MAX_TENANT_LABELS):
        self.limit = limit
        self._labels: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self.limit:
            self._labels.add(tenant)
            return tenant
        return OTHER_TENANTS


# -- a decoupled guard's per-tenant token budget (tokens.*) ----------------------------------------
@dataclass(kw_only=True)
class TokenBudgetConfig:
    """``tokens.*``: each tenant's generation budget (0 = unlimited)."""

    per_minute: int = 0  # generated tokens per minute, a token bucket of one minute's worth
    max_in_flight: int = 0  # generations in flight per tenant

    def __post_init__(self) -> None:
        if self.per_minute < 0 or self.max_in_flight < 0:
            raise ValueError("parameters 'tokens.per_minute' and 'tokens.max_in_flight' must be >= 0")


class TokenBudget:
    """Per tenant: a bucket of ``per_minute`` tokens refilled continuously, and a cap on
    generations in flight. A request is admitted while the bucket is positive; the tokens it
    generates are charged as they stream (the bucket may go negative: the last admitted request
    finishes, the next ones wait for the refill). Thread-safe, per process."""

    def __init__(self, config: TokenBudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.rate = config.per_minute / 60.0
        self._lock = threading.Lock()
        self._balance: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, stamp)
        self._in_flight: dict[str, int] = {}
        self.rejected = 0

    @property
    def limited(self) -> bool:
        return bool(self.config.per_minute or self.config.max_in_flight)

    def _refill(self, tenant: str, now: float) -> float:
        tokens, stamp = self._balance.get(tenant, (float(self.config.per_minute), now))
        tokens = min(float(self.config.per_minute), tokens + (now - stamp) * self.rate)
        self._balance[tenant] = (tokens, now)
        return tokens

    def admit(self, tenant: str) -> str | None:
        """None if admitted (then :meth:`release` it once), else why not, with retry advice."""
        if not self.limited:
            return None
        with self._lock:
            cap = self.config.max_in_flight
            n = self._in_flight.get(tenant, 0)
            if cap and n >= cap:
                self.rejected += 1
                return (f"tenant '{tenant}' has {n} generations in flight (tokens.max_in_flight {cap}); "
                        "retry after 500 ms")
            if self.config.per_minute:
                tokens = self._refill(tenant, self.clock())
                if tokens < 1:
                    self.rejected += 1
                    retry = max(1, math.ceil((1 - tokens) / self.rate * 1000))
                    return (f"tenant '{tenant}' used its token budget of {self.config.per_minute} tokens/minute; "
                            f"retry after {retry} ms")
            self._in_flight[tenant] = n + 1
        return None

    def charge(self, tenant: str, tokens: int) -> None:
        if not self.config.per_minute or tokens <= 0:
            return
        with self._lock:
            left = self._refill(tenant, self.clock())
            self._balance[tenant] = (left - tokens, self._balance[tenant][1])

    def release(self, tenant: str) -> None:
        if not self.limited:
            return
        with self._lock:
            n = self._in_flight.get(tenant, 0)
            if n <= 1:
                self._in_flight.pop(tenant, None)
            else:
                self._in_flight[tenant] = n - 1

    def balance(self, tenant: str) -> float:
        with self._lock:
            return self._refill(tenant, self.clock()) if self.config.per_minute else math.inf
