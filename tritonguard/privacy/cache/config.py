"""``cache.*``: :class:`CacheConfig`, the privacy modes, and the encryption key (:func:`load_key`).

Privacy (``cache.privacy``, :class:`PrivacyMode`):
- ``ephemeral``: L1 only; response values never leave the process.
- ``hashes_only``: nothing is cached; only hashes may appear in logs.
- ``persisted_encrypted``: L2/L3 as configured. Every persisted value is AES-256-GCM encrypted
  with a fresh nonce; rows are stored under a keyed MAC of the key (a stolen file or Redis dump
  cannot be probed with guessed inputs) which is also the associated data, so a ciphertext
  moved to another row fails authentication and reads as a miss. A 32-byte key is required.
"""

from __future__ import annotations

import base64
import binascii
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tritonguard.core.errors import ConfigError
from tritonguard.core.store import redis_prefix


class PrivacyMode(str, enum.Enum):
    EPHEMERAL = "ephemeral"
    HASHES_ONLY = "hashes_only"
    PERSISTED_ENCRYPTED = "persisted_encrypted"


@dataclass(kw_only=True)
class CacheConfig:
    """``cache.*`` parameters of a guard model."""

    enabled: bool = False
    privacy: str = "ephemeral"  # ephemeral | hashes_only | persisted_encrypted
    l1_entries: int = 4096
    l1_ttl_s: float = 300
    l2_path: str = ""  # SQLite file, shared by the processes of one host; empty = off
    l2_ttl_s: float = 3600
    l2_max_rows: int = 100000
    l3_url: str = ""  # redis:// or rediss://; empty = off
    l3_ttl_s: int = 3600
    # "" = this fleet's cache keys, ``tritonguard:cache:`` (``tritonguard:{<namespace>}:cache:`` with
    # $TRITONGUARD_NAMESPACE): never the prefix of the state, quota or replica keys, which a purge
    # of every model (a SCAN of ``<prefix>*``) would otherwise delete too
    l3_prefix: str = ""
    l3_timeout_ms: float = 50  # connect and socket timeout: a slow Redis must not slow serving
    key_env: str = "TRITONGUARD_L2_ENCRYPTION_KEY"  # 32 bytes, hex or base64
    key_file: str = ""  # takes precedence over key_env

    def __post_init__(self) -> None:
        try:
            self.mode = PrivacyMode(self.privacy)
        except ValueError:
            raise ValueError(f"cache.privacy must be one of {', '.join(m.value for m in PrivacyMode)}, "
                             f"got {self.privacy!r}") from None
        for name in ("l1_entries", "l2_max_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"cache.{name} must be >= 0")
        for name in ("l1_ttl_s", "l2_ttl_s", "l3_ttl_s", "l3_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cache.{name} must be > 0")
        if self.l3_url and urlsplit(self.l3_url).scheme not in ("redis", "rediss"):
            raise ValueError("cache.l3_url must start with redis:// or rediss://")

    def l3_key_prefix(self) -> str:
        """The L3's key prefix: ``cache.l3_prefix`` as given, else this fleet's (see the field)."""
        return self.l3_prefix or redis_prefix("cache")


def load_key(config: CacheConfig, environ: Mapping[str, str] | None = None) -> bytes:
    """The 32-byte AES key from ``key_file`` or ``$key_env`` (64 hex chars or base64)."""
    env = os.environ if environ is None else environ
    if config.key_file:
        source, raw = f"cache.key_file '{config.key_file}'", Path(config.key_file).read_bytes()
        if len(raw) == 32:
            return raw  # raw binary key file
    elif env.get(config.key_env):
        source, raw = f"${config.key_env}", env[config.key_env].encode()
    else:
        raise ConfigError(f"cache.privacy=persisted_encrypted needs a 32-byte encryption key: set "
                          f"${config.key_env} (64 hex characters or base64, e.g. `openssl rand -hex 32`) "
                          "or cache.key_file")
    text = raw.strip()
    try:
        key = bytes.fromhex(text.decode("ascii")) if len(text) == 64 else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        key = b""
    if len(key) != 32:
        raise ConfigError(f"{source}: expected a 32-byte key as 64 hex characters or base64")
    return key
