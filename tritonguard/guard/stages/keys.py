"""Content keys of the pending rows: what the cache looks up and fills, and what the audit log
records as a request's digest (never its content). Keyed on the tenant, the guard, the primary's
artifact sha256, the (redacted) inputs, the outputs and the settings that change answers."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence
from typing import Any

from tritonguard.core import repository
from tritonguard.guard.pipeline import Batch, GuardContext, Stage, starts_of, take
from tritonguard.privacy.cache.config import PrivacyMode, load_key
from tritonguard.privacy.cache.keys import canonical_params, row_keys

log = logging.getLogger(__name__)


class ArtifactShas:
    """SHA-256 of the target's artifact per version (its manifest.json), memoised."""

    def __init__(self, ctx: GuardContext, warn: bool):
        self.ctx, self.warn = ctx, warn
        self._sha: dict[int, str | None] = {}

    def __call__(self, version: int) -> str | None:
        if version not in self._sha:
            sha = None
            if version > 0:
                try:
                    manifest = repository.read_manifest(self.ctx.repo / self.ctx.target / str(version)) or {}
                    sha = manifest.get("sha256") or None
                except (OSError, ValueError):
                    sha = None
            if sha is None and self.warn:
                log.warning("guard %s: %s v%d has no artifact sha256 in its manifest.json; its answers are not "
                            "cached", self.ctx.guard, self.ctx.target, version)
            self._sha[version] = sha
        return self._sha[version]


class KeysStage(Stage):
    """Row keys of every pending request (``batch.keys``), and its audit digest when the audit
    log is on. With a cache, routing's state is refreshed first, so the keys name the primary
    this batch will be routed to."""

    name = "keys"

    def __init__(self, ctx: GuardContext, key_params: dict[str, Any], *, cache_on: bool, audit_on: bool):
        self.ctx = ctx
        self.cache_on, self.audit_on = cache_on, audit_on
        self.key_params = canonical_params(key_params)
        self.sha = ArtifactShas(ctx, warn=cache_on)
        # low-entropy inputs hash to guessable digests: key them when a secret is at hand
        self._digest_key: bytes | None = None
        c = ctx.config.cache
        if c.enabled and c.mode is PrivacyMode.PERSISTED_ENCRYPTED:
            self._digest_key = hashlib.sha256(b"tritonguard-audit-digest\0" + load_key(c, ctx.environ)).digest()

    def primary(self) -> int:
        router = self.ctx.router
        if router is None:
            return -1
        if self.cache_on:
            refresh = getattr(router, "refresh", None)
            if refresh is not None:
                refresh(self.ctx.clock())  # the primary that routing will use for this batch
        return router.primary()

    def digest(self, keys: Sequence[bytes]) -> str:
        data = b"".join(keys)
        if self._digest_key is not None:
            return hmac.new(self._digest_key, data, hashlib.sha256).hexdigest()
        return hashlib.sha256(data).hexdigest()

    def run(self, b: Batch) -> None:
        if not b.route:
            return
        primary = self.primary()
        target = self.ctx.target
        b.primary_label, b.cache_label = f"{target}:{primary}", f"cache:{target}:{primary}"
        sha = b.artifact_sha = self.sha(primary)
        key_inputs = b.key_inputs if b.key_inputs is not None else b.fused
        starts = starts_of(b.sizes)
        groups: dict[str, list[int]] = {}
        for j, i in enumerate(b.route):
            groups.setdefault(b.tenants[i], []).append(j)
        for t, js in groups.items():
            sub = take(key_inputs, starts, js, len(b.route))
            keys = row_keys(t, self.ctx.guard, sha or f"unversioned:{primary}", sub, self.ctx.output_names,
                            self.key_params)
            pos = 0
            for j in js:
                size = b.sizes[j]
                b.keys[b.route[j]] = keys[pos:pos + size]
                pos += size
        if self.audit_on:
            for i in b.route:
                b.digests[i] = self.digest(b.keys[i])
