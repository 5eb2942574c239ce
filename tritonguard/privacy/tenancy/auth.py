"""Tenant ids from request parameters, and their authentication (:class:`TenantResolver`).

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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tritonguard.core.errors import ConfigError, InvalidInput, TritonGuardError
from tritonguard.privacy.tenancy.config import MAX_TRACKED, TenancyConfig

log = logging.getLogger(__name__)


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
