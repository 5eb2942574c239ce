"""Anchors: the chain's latest head, kept outside the log, so that a lost tail shows.

A chain cannot show a lost tail: without its last records (or emptied) it still verifies. So the
writer (:mod:`tritonguard.privacy.audit.log`) keeps the chain's latest *anchor* outside the log:
``{"name" (host:path), "seq" (records written so far), "head" (hash of the last one), "ts",
"dropped"}``, HMAC-SHA-256-signed with ``$TRITONGUARD_AUDIT_KEY`` (``audit.key_env``) when set,
else only checksummed (:func:`make_anchor`, :func:`check_anchor`). It is replaced atomically in
``<path>.anchor`` and, for a guard, in its state store (:class:`FileAnchors` beside the rollout
state, or :class:`RedisAnchors` when ``$TRITONGUARD_STATE_URL`` is set: :func:`open_anchor_store`).
:func:`read_anchors` reads them back, for the writer at start and for
:func:`tritonguard.privacy.audit.verify.verify`, which reports a chain shorter than an anchor, or
one whose anchored head is not in it, as truncated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tritonguard.core.errors import ConfigError, TritonGuardError
from tritonguard.core.files import atomic_write
from tritonguard.core.outage import Backoff
from tritonguard.core.store import ENV_URL, redacted, redis_client, redis_prefix, store_error
from tritonguard.privacy.audit.chain import canonical

KEY_ENV = "TRITONGUARD_AUDIT_KEY"
ANCHOR_SUFFIX = ".anchor"  # the local anchor: <path>.anchor
ANCHOR_PREFIX = "audit_anchor."  # the file store's: <repo>/<guard>/audit_anchor.<log name>.<id>.json
ANCHOR_HASH = "tritonguard:audit:anchors"  # the Redis store's anchors: one hash, a field per log
# (that name without a namespace; with one, ``redis_prefix("audit") + "anchors"``)
ANCHOR_VERSION = 1
MIN_KEY_CHARS = 16


class AnchorError(TritonGuardError):
    """An anchor store could not be read or written."""


class AnchorStore(Protocol):
    """Where anchors live besides ``<path>.anchor``: small JSON blobs by name."""

    def put(self, name: str, blob: str) -> None: ...
    def get(self, name: str) -> str | None: ...


def anchor_name(path: str | os.PathLike[str], host: str | None = None) -> str:
    """The name an audit file's anchor is stored under: ``host:absolute path`` (replicas on
    several hosts may share one Redis and one path)."""
    return f"{host or socket.gethostname()}:{os.path.abspath(path)}"


def local_anchor_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p.with_name(p.name + ANCHOR_SUFFIX)


def load_audit_key(env_name: str = KEY_ENV, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The anchors' HMAC key: the UTF-8 bytes of ``$env_name`` (stripped), None when unset."""
    env = os.environ if environ is None else environ
    raw = (env.get(env_name) or "").strip()
    if not raw:
        return None
    if len(raw) < MIN_KEY_CHARS:
        raise ConfigError(f"${env_name}: an audit key needs at least {MIN_KEY_CHARS} characters "
                          "(e.g. `openssl rand -hex 32`)")
    return raw.encode("utf-8")


def key_id(key: bytes) -> str:
    """A short public id of a key, so that verify can tell 'another key' from 'forged'."""
    return hashlib.sha256(b"tritonguard-audit-key-id\0" + key).hexdigest()[:16]


def make_anchor(*, name: str, path: str | os.PathLike[str], seq: int, head: str, ts: float,
                dropped: int = 0, key: bytes | None = None) -> dict[str, Any]:
    """A signed (``key``) or checksummed anchor of a chain with ``seq`` records ending in ``head``."""
    doc: dict[str, Any] = {"v": ANCHOR_VERSION, "name": name, "path": str(path), "seq": int(seq), "head": head,
                           "ts": ts, "dropped": int(dropped)}
    if key is not None:
        doc.update(alg="hmac-sha256", key_id=key_id(key))
        doc["sig"] = hmac.new(key, canonical(doc), hashlib.sha256).hexdigest()
    else:
        doc["alg"] = "sha256"
        doc["sig"] = hashlib.sha256(canonical(doc)).hexdigest()
    return doc


def check_anchor(doc: Any, key: bytes | None, *, require_signature: bool = True) -> str:
    """'' when ``doc`` is a well-formed anchor whose signature (with ``key``) or checksum holds,
    else what is wrong. With a key, an anchor that is only checksummed is refused
    (``require_signature``): anyone could have written it. A signed anchor is taken unchecked
    when there is no key (the caller warns)."""
    if not isinstance(doc, dict):
        return "not an anchor"
    if doc.get("v") != ANCHOR_VERSION:
        return f"anchor format {doc.get('v')!r} is not supported"
    seq, head = doc.get("seq"), doc.get("head")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        return "not an anchor (bad seq)"
    if not isinstance(head, str) or not re.fullmatch(r"[0-9a-f]{64}", head):
        return "not an anchor (bad head)"
    if not isinstance(doc.get("sig"), str):
        return "not an anchor (no signature)"
    body = canonical({k: v for k, v in doc.items() if k != "sig"})
    alg = doc.get("alg")
    if alg == "hmac-sha256":
        if key is None:
            return ""
        if doc.get("key_id") != key_id(key):
            return f"signed with another key (key id {doc.get('key_id')}, this key's is {key_id(key)})"
        if not hmac.compare_digest(doc["sig"], hmac.new(key, body, hashlib.sha256).hexdigest()):
            return "signature does not match (altered or forged)"
        return ""
    if alg == "sha256":
        if doc["sig"] != hashlib.sha256(body).hexdigest():
            return "checksum does not match (altered)"
        if key is not None and require_signature:
            return "not signed, but a key was given: anyone could have written it"
        return ""
    return f"unknown signature algorithm {alg!r}"


class FileAnchors:
    """Anchors as one small file per audit log in ``directory`` (replaced atomically). A guard's
    are ``<repo>/<guard>/audit_anchor.*.json``, beside its rollout state (files, not a folder:
    Triton reads every sub-folder of a model's folder as a version)."""

    def __init__(self, directory: str | os.PathLike[str], *, prefix: str = ""):
        self.directory = Path(directory)
        self.prefix = prefix

    def __str__(self) -> str:
        return str(self.directory / f"{self.prefix}*.json")

    def file_for(self, name: str) -> Path:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", name.rsplit("/", 1)[-1])[:80]
        return self.directory / f"{self.prefix}{base}.{hashlib.sha256(name.encode()).hexdigest()[:16]}.json"

    def put(self, name: str, blob: str) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(self.file_for(name), blob.encode("utf-8"), mode=0o600)
        except OSError as exc:
            raise AnchorError(f"cannot write an anchor in {self.directory}: {exc}") from None

    def get(self, name: str) -> str | None:
        try:
            return self.file_for(name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise AnchorError(f"cannot read {self.file_for(name)}: {exc}") from None

    def where(self, name: str) -> str:
        return str(self.file_for(name))


class RedisAnchors:
    """Anchors as fields (one per audit log) of one Redis hash. Short timeouts, no client
    retries, and a growing pause after a failure: the audit writer must not stall on Redis."""

    BACKOFF_START_S = 5.0
    BACKOFF_MAX_S = 60.0

    def __init__(self, url: str, *, key: str | None = None, socket_timeout: float = 0.5, client: Any = None,
                 monotonic: Any = time.monotonic):
        import redis  # deferred: a heavy import, needed only when the anchors live in Redis

        self._redis = redis
        # this fleet's own hash: two fleets on one Redis may both have a log named "digits"
        self.url, self.monotonic = url, monotonic
        self.key = f"{redis_prefix('audit')}anchors" if key is None else key
        self.client = client or redis_client(url, timeout=socket_timeout)
        self._health = Backoff(monotonic, self.BACKOFF_START_S, self.BACKOFF_MAX_S)

    def __str__(self) -> str:
        return f"{redacted(self.url)} {self.key}"

    def where(self, name: str) -> str:
        return f"{self}[{name}]"

    def _call(self, fn: Any) -> Any:
        if not self._health.available():
            raise AnchorError(f"anchor store {self} is backing off after an error")
        try:
            out = fn()
        except self._redis.RedisError as exc:
            self._health.fail()
            raise AnchorError(f"anchor store {self}: {store_error(exc, self.url)}") from None
        self._health.recover()
        return out

    def put(self, name: str, blob: str) -> None:
        self._call(lambda: self.client.hset(self.key, name, blob))

    def get(self, name: str) -> str | None:
        raw = self._call(lambda: self.client.hget(self.key, name))
        return None if raw is None else raw.decode("utf-8", "replace")

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing must not fail a shutdown
            pass


def open_anchor_store(model: str, repo_dir: str | os.PathLike[str], url: str | None = None) -> AnchorStore:
    """A guard's anchor store, chosen like :func:`tritonguard.rollout.state.open_store`: Redis when
    ``url`` (default ``$TRITONGUARD_STATE_URL``) is set, else files beside the rollout state."""

    if url is None:
        url = os.environ.get(ENV_URL, "")
    if url:
        return RedisAnchors(url)
    return FileAnchors(Path(repo_dir) / model, prefix=ANCHOR_PREFIX)


def anchor_where(store: Any, name: str) -> str:
    """Where the anchor ``name`` lives in ``store``, for messages."""
    return store.where(name) if hasattr(store, "where") else f"{store}[{name}]"


def read_anchors(path: str | os.PathLike[str], stores: Sequence[Any] = (), *, name: str | None = None,
                 key: bytes | None = None, require_signature: bool = True, other_key_ok: bool = False,
                 ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The anchors of the audit log ``path``: ``<path>.anchor``, then ``name`` (default
    :func:`anchor_name`) in each store. Returns (good anchors, each with ``"at"`` naming where it
    was found; problems with bad ones; warnings). ``other_key_ok`` (the writer, after a key
    change): an anchor signed with another key is taken, unchecked, with a warning."""
    name = name or anchor_name(path)
    found: list[dict[str, Any]] = []
    bad: list[str] = []
    warnings: list[str] = []
    sources: list[tuple[str, Any]] = [(str(local_anchor_path(path)), None), *((anchor_where(s, name), s) for s in stores)]
    for where, store in sources:
        try:
            if store is None:
                try:
                    blob: str | None = local_anchor_path(path).read_text(encoding="utf-8")
                except FileNotFoundError:
                    blob = None
            else:
                blob = store.get(name)
        except (OSError, UnicodeDecodeError, AnchorError) as exc:
            warnings.append(f"anchor {where} could not be read: {exc}")
            continue
        if blob is None:
            continue
        try:
            doc = json.loads(blob)
        except ValueError:
            doc = None
        problem = check_anchor(doc, key, require_signature=require_signature)
        if problem and other_key_ok and key is not None and check_anchor(doc, None) == "" \
                and doc.get("alg") == "hmac-sha256" and doc.get("key_id") != key_id(key):
            warnings.append(f"anchor {where}: {problem}; its counts were compared unchecked")
        elif problem:
            bad.append(f"anchor {where}: {problem}")
            continue
        if doc.get("alg") != "sha256" and key is None:
            warnings.append(f"anchor {where} is signed, but no key was given (${KEY_ENV}): its signature was "
                            "not checked")
        found.append({**doc, "at": where})
    return found, bad, warnings
