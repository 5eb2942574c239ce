"""Privacy, tenants, cache and audit around the guard's routing, on whole batches.

Per ``execute()`` the guard calls, in order:

1. :meth:`PrivacyStage.before` after validation: resolves each request's tenant (request
   parameter ``tenant`` or a forwarded HTTP header), applies the tenant quotas, redacts the text
   (BYTES) inputs, computes one cache key per batch row — tenant + guard + the primary version's
   artifact SHA-256 + the canonical (redacted) inputs + requested outputs + output-affecting
   settings — and looks the rows up L1 → L2 → L3. A request is answered from the cache only when
   every one of its rows hits; the rest are handed back, fused, for the router.
2. :meth:`PrivacyStage.redact_outputs` on what the router returned (text outputs, if enabled).
3. :meth:`PrivacyStage.after` once responses are built: fills the cache with the rows the
   primary answered (never a candidate's, fallback's or default answer), writes the audit
   records (hashes and ids only) and releases the tenants' in-flight slots. It never raises.

Nothing here writes request contents anywhere: the cache persists AES-GCM ciphertext under
keyed row ids (:mod:`tritonguard.cache`), the audit log holds digests (:mod:`tritonguard.audit`),
and log lines name tenants, rules and counts only.

:func:`security_findings` is the startup security check; :class:`AuditedMetrics` turns the
router's safety events (golden results, breaker trips and states, fallbacks) into audit records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import repository
from .audit import AuditLog, open_anchor_store
from .cache import PrivacyMode, TieredCache, canonical_params, load_key, row_keys
from .errors import ConfigError, QuotaExceeded, TritonGuardError
from .guard_config import SERVED_BY, GuardConfig
from .redaction import Redactor
from .tenancy import QUOTA_FILE, QuotaManager, SharedQuotaManager, TenantResolver, authenticator
from .tensors import ModelSignature, concat

log = logging.getLogger(__name__)

MAX_TENANT_LABELS = 256  # distinct tenant label values on metrics; later tenants share "_other"
OTHER_TENANTS = "_other"
_TIERS = ("l1", "l2", "l3")


# -- startup security check -------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    level: str  # "error" refuses the load; "warning" is logged
    message: str


def security_findings(config: GuardConfig, signature: ModelSignature, explicit: set[str] | Mapping[str, Any],
                      *, instances: int = 1, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """What the startup check finds in one guard's resolved configuration.

    ``explicit`` holds the parameter keys that were set in any layer (pyproject, environment,
    config.pbtxt); defaults do not count as "set". Errors: text inputs without an explicit
    ``validation.max_bytes_length``; ``cache.privacy=persisted_encrypted`` without a usable key;
    ``tenancy.auth`` without a readable keys file or a usable secret. Everything else is a warning.
    """
    out: list[Finding] = []

    def warn(msg: str) -> None:
        out.append(Finding("warning", msg))

    def fail(msg: str) -> None:
        out.append(Finding("error", msg))

    text_in = [s.name for s in signature.inputs if s.is_bytes]
    red, ten, cache, val = config.redaction, config.tenancy, config.cache, config.validation
    # tenant isolation
    if not ten.enabled:
        shared = " and share every cache entry and quota" if cache.enabled else ""
        warn(f"tenant isolation is off (tenancy.enabled=false): all requests are tenant '{ten.default}'{shared}")
    elif ten.auth != "none":
        try:
            authenticator(ten, environ)  # a readable keys file / a usable secret
        except ConfigError as exc:
            fail(str(exc))
    elif ten.quotas:
        warn("tenancy.auth=none: tenant ids are unverified claims, any client can use another tenant's quota; "
             "set tenancy.auth=api_key or jwt, or let an authenticating proxy set the header")
    # redaction where inputs are text
    if text_in:
        if not red.enabled:
            warn(f"inputs {', '.join(text_in)} are text but redaction is off (redaction.enabled=false): "
                 "PII reaches the target, and the cache key and audit digests are taken over it")
        elif not red.model_sees_redacted:
            warn("redaction.model_sees_redacted=false: the target sees unredacted text (only what the "
                 "guard caches and audits is redacted; requests with PII bypass the cache)")
    # input size limits
    if text_in and "validation.max_bytes_length" not in explicit:
        fail(f"inputs {', '.join(text_in)} are text but validation.max_bytes_length is not set: set an "
             "explicit per-element limit (bytes) for what the target may be sent")
    if "validation.max_payload_bytes" not in explicit:
        warn(f"validation.max_payload_bytes is not set; the default of {val.max_payload_bytes} bytes per request applies")
    # persistence needs encryption
    if cache.enabled and cache.mode is PrivacyMode.PERSISTED_ENCRYPTED:
        try:
            load_key(cache, environ)
        except (ConfigError, OSError) as exc:
            fail(str(exc))
        if not (cache.l2_path or cache.l3_url):
            warn("cache.privacy=persisted_encrypted without cache.l2_path or cache.l3_url: only L1 (memory) is used")
    elif cache.enabled and cache.mode is PrivacyMode.EPHEMERAL and (cache.l2_path or cache.l3_url):
        warn("cache.privacy=ephemeral ignores cache.l2_path/cache.l3_url; use persisted_encrypted to persist (encrypted)")
    if cache.enabled and signature.max_batch_size <= 0:
        warn("the cache needs a batching model (max_batch_size > 0); it is off for this guard")
    # safety checks not bypassed
    if val.allow_non_finite:
        warn("validation.allow_non_finite=true: NaN/Inf inputs reach the target")
    if text_in and not val.require_utf8:
        warn("validation.require_utf8=false: invalid UTF-8 reaches the target and is not redacted reliably")
    if not config.routing.golden_check:
        warn("routing.golden_check=false: versions get traffic without being checked against their goldens")
    return out


def enforce_security(model: str, findings: Sequence[Finding]) -> None:
    """Log the warnings; raise one :class:`ConfigError` naming every error."""
    for f in findings:
        if f.level == "warning":
            log.warning("guard %s: security check: %s", model, f.message)
    errors = [f.message for f in findings if f.level == "error"]
    if errors:
        raise ConfigError(f"model '{model}' refused by the startup security check: " + "; ".join(errors))


def audit_file(path: str, *, model: str, instance: str, instances: int) -> str:
    """``audit.path`` with ``{model}``, ``{instance}`` and ``{pid}`` filled in. Each instance needs
    its own file (one writer per chain): without a placeholder, a guard with several instances
    appends ``.<instance name>``."""
    if not path:
        return ""
    has_placeholder = any(p in path for p in ("{model}", "{instance}", "{pid}"))
    out = path.replace("{model}", model).replace("{instance}", instance).replace("{pid}", str(os.getpid()))
    if instances > 1 and not has_placeholder:
        out = f"{out}.{instance}"
    return out


# -- metrics with audit -----------------------------------------------------------------------
class AuditedMetrics:
    """The guard's metrics, forwarding the router's safety events to the audit log as well."""

    EVENTS = {"goldens": "golden", "trips": "breaker_trip", "fallbacks": "fallback"}
    STATES = {0: "closed", 1: "half_open", 2: "open"}

    def __init__(self, inner: Any, audit: AuditLog, model: str):
        self._inner, self._audit, self._model = inner, audit, model
        self._breakers: dict[tuple, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def inc(self, family: str, value: float = 1, **labels: str) -> None:
        self._inner.inc(family, value, **labels)
        kind = self.EVENTS.get(family)
        if kind is not None and value > 0:
            self._audit.record(kind, model=self._model, count=value, **labels)

    def set(self, family: str, value: float, **labels: str) -> None:
        self._inner.set(family, value, **labels)
        if family == "breaker_state":
            key = tuple(sorted(labels.items()))
            if self._breakers.get(key) != value:
                if key in self._breakers or value != 0:  # a breaker first seen closed is no change
                    self._audit.record("breaker_state", model=self._model,
                                       state=self.STATES.get(int(value), str(value)), **labels)
                self._breakers[key] = value

    def observe(self, family: str, value: float, **labels: str) -> None:
        self._inner.observe(family, value, **labels)


# -- the stage --------------------------------------------------------------------------------
def _starts(sizes: Sequence[int]) -> list[int]:
    """Start row of each request, plus the total (a list: cheaper than numpy for a few requests)."""
    return [0, *itertools.accumulate(sizes)]


@dataclass
class PrivacyBatch:
    """What :meth:`PrivacyStage.before` decided for one execute() batch (request indices)."""

    tenants: list[str]  # per request; "" where no valid tenant was named
    errors: dict[int, TritonGuardError] = field(default_factory=dict)  # tenant and quota refusals
    hits: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # answered from the cache
    hit_sizes: dict[int, int] = field(default_factory=dict)
    hit_tiers: dict[int, str] = field(default_factory=dict)  # deepest tier a hit's rows came from (traced batches)
    route: list[int] = field(default_factory=list)  # requests for the router, in order
    fused: dict[str, np.ndarray] = field(default_factory=dict)  # their inputs, as the target sees them
    sizes: list[int] = field(default_factory=list)
    keys: dict[int, list[bytes]] = field(default_factory=dict)  # row keys of cacheable requests
    digests: dict[int, str] = field(default_factory=dict)  # audit digest per valid request
    cache_state: dict[int, str] = field(default_factory=dict)  # hit / miss / bypass / off
    redacted: set[int] = field(default_factory=set)  # requests with PII replaced in their inputs
    admitted: list[str] = field(default_factory=list)  # tenants holding an in-flight slot
    primary_label: str = ""  # "<target>:<version>" whose answers may be cached
    cache_label: str = ""  # SERVED_BY of cache hits


class PrivacyStage:
    def __init__(self, *, guard: str, target: str, signature: ModelSignature, output_names: Sequence[str],
                 config: GuardConfig, repo: Path, metrics: Any, audit_path: str = "",
                 key_params: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.time):
        self.guard, self.target = guard, target
        self.signature = signature
        self.output_names = list(output_names)
        self.repo = Path(repo)
        self.metrics = metrics
        self.clock = clock
        self.config = config
        self.batched = signature.max_batch_size > 0
        self.redactor = Redactor(config.redaction)
        self.text_inputs = [s.name for s in signature.inputs if s.is_bytes]
        self.text_outputs = [s.name for s in signature.outputs if s.is_bytes and s.name != SERVED_BY]
        self.redact_in = self.redactor.active and bool(self.text_inputs)
        self.redact_out = self.redactor.active and config.redaction.redact_outputs and bool(self.text_outputs)
        self.model_sees_redacted = config.redaction.model_sees_redacted
        tcfg = config.tenancy
        self.tenancy_on = tcfg.enabled
        self.default_tenant = tcfg.default
        self.resolver = TenantResolver(tcfg, environ)
        self.quotas = self._quotas(tcfg) if tcfg.enabled and tcfg.quotas else None
        self.cache: TieredCache | None = None
        if config.cache.enabled and self.batched:
            cache = TieredCache(config.cache, environ=environ)
            self.cache = cache if cache.enabled else None
        acfg = config.audit
        # anchors of the chain go to the guard's state store too (Redis, or beside rollout_state.json)
        self.audit = AuditLog(dataclasses.replace(acfg, path=audit_path), environ=environ,
                              anchors=open_anchor_store(guard, repo) if audit_path else None)
        self.keyed = self.cache is not None or self.audit.enabled
        # low-entropy inputs hash to guessable digests: key them when a secret is at hand
        self._digest_key: bytes | None = None
        if config.cache.enabled and config.cache.mode is PrivacyMode.PERSISTED_ENCRYPTED:
            self._digest_key = hashlib.sha256(b"tritonguard-audit-digest\0" + load_key(config.cache, environ)).digest()
        self.key_params = dict(key_params or {})
        if self.redact_out:
            self.key_params["redact_outputs"] = [config.redaction.replacement, list(config.redaction.recognizers),
                                                 sorted(config.redaction.pattern.items())]
        self._key_params = canonical_params(self.key_params)
        self.tiers = self._tiers()
        self.router: Any = None
        self._revision: int | None = None
        self._epoch: int | None = None
        self._sha: dict[int, str | None] = {}
        self._labels: set[str] = set()
        self._cache_errors = {"l2": 0, "l3": 0}
        self._cache_quarantined = 0
        self._audit_dropped = 0

    # -- lifecycle --------------------------------------------------------------------------
    def wrap_metrics(self, metrics: Any) -> Any:
        """The metrics to give the router: audited when an audit log is on."""
        return AuditedMetrics(metrics, self.audit, self.guard) if self.audit.enabled else metrics

    def attach(self, router: Any) -> None:
        self.router = router
        state = getattr(router, "state", None)
        self._revision = getattr(state, "revision", None)
        c = self.config.cache
        self.audit.record("guard_start", model=self.guard, target=self.target, primary=router.primary(),
                          revision=self._revision, privacy=c.privacy if c.enabled else "off",
                          tiers=self.tiers, tenancy=self.tenancy_on, tenant_auth=self.config.tenancy.auth,
                          quotas=sorted(self.config.tenancy.quotas),
                          redaction=self.redact_in or self.redact_out, model_sees_redacted=self.model_sees_redacted)

    def _tiers(self) -> list[str]:
        c = self.config.cache
        if self.cache is None:
            return []
        persisted = c.mode is PrivacyMode.PERSISTED_ENCRYPTED
        on = {"l1": c.l1_entries > 0, "l2": persisted and bool(c.l2_path), "l3": persisted and bool(c.l3_url)}
        return [t for t in _TIERS if on[t]]

    def _quotas(self, tcfg: Any) -> QuotaManager:
        """Buckets shared by every instance of this guard on the host (a file beside its rollout
        state); per process if that file cannot be used."""
        path = self.repo / self.guard / QUOTA_FILE
        try:
            return SharedQuotaManager(tcfg, path)
        except OSError as exc:
            log.warning("guard %s: tenant quotas are per instance: cannot share them through %s: %s",
                        self.guard, path, exc)
            return QuotaManager(tcfg)

    def close(self) -> None:
        self.audit.record("guard_stop", model=self.guard)
        self.audit.close()
        if self.cache is not None:
            self.cache.close()
        if isinstance(self.quotas, SharedQuotaManager):
            self.quotas.close()

    @property
    def needs_parameters(self) -> bool:
        """Whether :meth:`before` needs the requests' parameters (the tenant is read from them)."""
        return self.tenancy_on

    def label(self, tenant: str) -> str:
        """Tenant as a metric label; bounded cardinality."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
            return tenant
        return OTHER_TENANTS

    # -- helpers ----------------------------------------------------------------------------
    def artifact_sha(self, version: int) -> str | None:
        """SHA-256 of the artifact of ``version`` of the target (its manifest.json), memoised."""
        if version not in self._sha:
            sha = None
            if version > 0:
                try:
                    manifest = repository.read_manifest(self.repo / self.target / str(version)) or {}
                    sha = manifest.get("sha256") or None
                except (OSError, ValueError):
                    sha = None
            if sha is None and self.cache is not None:
                log.warning("guard %s: %s v%d has no artifact sha256 in its manifest.json; its answers are not "
                            "cached", self.guard, self.target, version)
            self._sha[version] = sha
        return self._sha[version]

    def _primary(self) -> int:
        router = self.router
        if router is None:
            return -1
        refresh = getattr(router, "refresh", None)
        if refresh is not None and self.cache is not None:
            refresh(self.clock())  # the primary that routing will use for this batch
        state = getattr(router, "state", None)
        rev = getattr(state, "revision", None)
        epoch = getattr(state, "cache_epoch", 0)
        if self.cache is not None and epoch != self._epoch:
            if self._epoch is not None:  # a rollback/promote asked every instance to forget
                dropped = self.cache.purge_local(self.guard)
                log.info("guard %s: cache epoch %s -> %s, dropped %d L1 entries", self.guard, self._epoch,
                         epoch, dropped)
                self.audit.record("cache_purge", model=self.guard, epoch=epoch, l1=dropped)
            self._epoch = epoch
        if rev is not None and rev != self._revision:
            cand = getattr(state, "candidate", None)
            self.audit.record("state_change", model=self.guard, revision=rev, previous_revision=self._revision,
                              primary=router.primary(), candidate=getattr(cand, "version", None),
                              share=getattr(cand, "share", None), by=getattr(state, "updated_by", ""))
            self._revision = rev
        return router.primary()

    def _redact_rows(self, arr: np.ndarray, row_tenants: Sequence[str], direction: str) -> tuple[np.ndarray, np.ndarray]:
        """Redacted copy of a BYTES array (rows = first axis), and which rows changed. Spans are
        counted per tenant on the ``redactions`` metric."""
        n = len(arr)
        groups: dict[str, list[int]] = {}
        for r, t in enumerate(row_tenants):
            groups.setdefault(t, []).append(r)
        if len(groups) <= 1:
            red, counts = self.redactor.redact_bytes_array(arr)
            per_tenant = [(row_tenants[0] if n else "", counts)]
        else:
            red = np.empty_like(arr)
            per_tenant = []
            for t, rows in groups.items():
                idx = np.asarray(rows)
                part, counts = self.redactor.redact_bytes_array(arr[idx])
                red[idx] = part
                per_tenant.append((t, counts))
        for t, counts in per_tenant:
            for kind, k in counts.items():
                self.metrics.inc("redactions", k, type=kind, direction=direction, tenant=self.label(t))
        if red is arr:
            return arr, np.zeros(n, bool)
        flat_a, flat_r = arr.reshape(n, -1), red.reshape(n, -1)
        changed = np.fromiter((any(a is not b for a, b in zip(ra, rr, strict=True))
                               for ra, rr in zip(flat_a, flat_r, strict=True)), bool, count=n)
        return red, changed

    @staticmethod
    def _take(fused: Mapping[str, np.ndarray], starts: Sequence[int], positions: Sequence[int], total: int) -> dict[str, np.ndarray]:
        if len(positions) == total:
            return dict(fused)
        if not positions:
            return {}
        return {k: concat([v[starts[p]:starts[p + 1]] for p in positions]) for k, v in fused.items()}

    def _digest(self, keys: Sequence[bytes]) -> str:
        data = b"".join(keys)
        if self._digest_key is not None:
            return hmac.new(self._digest_key, data, hashlib.sha256).hexdigest()
        return hashlib.sha256(data).hexdigest()

    # -- before routing -----------------------------------------------------------------------
    def before(self, requests_params: Sequence[Mapping[str, Any]] | None, verdict: Any,
               trace: Any = None) -> PrivacyBatch:
        """``trace``: the batch's :class:`tritonguard.tracing.BatchTrace` when some of its
        requests are traced (stage marks: tenancy, redact, cache.lookup); None otherwise."""
        n = len(verdict.errors)
        if requests_params is not None and self.tenancy_on:
            tenants, terrs = self.resolver.resolve_tenants(requests_params)
        else:
            tenants, terrs = [self.default_tenant] * n, [None] * n
        batch = PrivacyBatch(tenants=[t or "" for t in tenants])
        audit = self.audit.enabled
        for i, err in enumerate(verdict.errors):
            if err is not None and audit:
                self.audit.record("reject", tenant=batch.tenants[i], model=self.guard, rule=err.rule,
                                  input=err.input_name)
        valid: list[int] = list(verdict.valid)
        sizes: list[int] = list(verdict.sizes)
        # tenant ids
        keep = []
        for pos, i in enumerate(valid):
            err = terrs[i]
            if err is None:
                keep.append(pos)
                continue
            batch.errors[i] = err
            self.metrics.inc("rejects", 1, reason=err.rule)
            if audit:
                self.audit.record("reject", model=self.guard, rule=err.rule, input=err.input_name)
        # quotas
        if self.quotas is not None and keep:
            refusals = self.quotas.admit([tenants[valid[p]] for p in keep])
            admitted = []
            for p, why in zip(list(keep), refusals, strict=True):
                i, t = valid[p], tenants[valid[p]]
                if why is None:
                    admitted.append(p)
                    batch.admitted.append(t)
                    continue
                batch.errors[i] = QuotaExceeded(why)
                reason = "in_flight" if "in flight" in why else "rate"
                self.metrics.inc("quota_rejects", 1, tenant=self.label(t), reason=reason)
                if audit:
                    self.audit.record("quota_reject", tenant=t, model=self.guard, reason=reason)
            keep = admitted
        if trace is not None:
            trace.mark("tenancy")
            for i, err in batch.errors.items():
                trace.left(i, "tenancy", err.rule, str(err))
        if not keep:
            return batch
        if not self.batched:
            # one request per execute (no batch axis): no row bookkeeping, no cache
            i = valid[keep[0]]
            fused = dict(verdict.fused)
            if self.redact_in:
                t = batch.tenants[i]
                for name in self.text_inputs:
                    red, counts = self.redactor.redact_bytes_array(fused[name])
                    for kind, k in counts.items():
                        self.metrics.inc("redactions", k, type=kind, direction="input", tenant=self.label(t))
                    if red is not fused[name] and counts:
                        batch.redacted.add(i)
                    if self.model_sees_redacted:
                        fused[name] = red
                if trace is not None:
                    trace.mark("redact", **{"tritonguard.redact.direction": "input"})
            batch.route, batch.fused, batch.sizes = [i], fused, [sizes[keep[0]]]
            batch.cache_state[i] = "off"
            return batch

        fused = verdict.fused if len(keep) == len(valid) else self._take(verdict.fused, _starts(sizes), keep, len(valid))
        ksizes = [sizes[p] for p in keep]
        kreq = [valid[p] for p in keep]  # request index per kept position
        kstarts = _starts(ksizes)
        # redaction: the key and the audit always use the redacted text
        key_inputs = fused
        if self.redact_in:
            row_changed = np.zeros(kstarts[-1], bool)
            row_tenants = [batch.tenants[i] for i, n in zip(kreq, ksizes, strict=True) for _ in range(n)]
            key_inputs = dict(fused)
            for name in self.text_inputs:
                red, changed = self._redact_rows(fused[name], row_tenants, "input")
                key_inputs[name] = red
                row_changed |= changed
            for j, i in enumerate(kreq):
                if row_changed[kstarts[j]:kstarts[j + 1]].any():
                    batch.redacted.add(i)
            if trace is not None:
                trace.mark("redact", **{"tritonguard.redact.direction": "input"})
        model_inputs = key_inputs if self.model_sees_redacted else fused

        # keys per row, grouped by tenant (the tenant is part of every key)
        primary = self._primary() if self.keyed else -1
        batch.primary_label = f"{self.target}:{primary}"
        batch.cache_label = f"cache:{self.target}:{primary}"
        sha = self.artifact_sha(primary) if self.keyed else None
        req_keys: dict[int, list[bytes]] = {}
        if self.keyed:
            groups: dict[str, list[int]] = {}
            for j, i in enumerate(kreq):
                groups.setdefault(batch.tenants[i], []).append(j)
            for t, js in groups.items():
                sub = self._take(key_inputs, kstarts, js, len(kreq))
                keys = row_keys(t, self.guard, sha or f"unversioned:{primary}", sub, self.output_names, self._key_params)
                pos = 0
                for j in js:
                    size = ksizes[j]
                    req_keys[kreq[j]] = keys[pos:pos + size]
                    pos += size
            if self.audit.enabled:
                for i, keys in req_keys.items():
                    batch.digests[i] = self._digest(keys)

        # lookups: a request is a hit only if all of its rows hit
        cacheable = self.cache is not None and sha is not None
        hit_js: set[int] = set()
        if cacheable:
            bypass = set()
            if not self.model_sees_redacted:
                # the target sees the original text, the key the redacted one: rows with PII
                # would share keys with different answers, so they neither read nor fill the cache
                bypass = {i for i in kreq if i in batch.redacted}
            by_tenant: dict[str, list[int]] = {}
            for j, i in enumerate(kreq):
                if i in bypass:
                    batch.cache_state[i] = "bypass"
                else:
                    by_tenant.setdefault(batch.tenants[i], []).append(j)
            for t, js in by_tenant.items():
                keys = [k for j in js for k in req_keys[kreq[j]]]
                found_in: list[str | None] | None = [None] * len(keys) if trace is not None else None
                values = self._lookup(keys, t, trace, found_in)
                pos = 0
                for j in js:
                    i, size = kreq[j], ksizes[j]
                    got = values[pos:pos + size]
                    if found_in is not None and i in trace.sampled:
                        tiers = [x for x in found_in[pos:pos + size] if x]
                        if tiers:
                            batch.hit_tiers[i] = max(tiers)  # l1 < l2 < l3: the deepest it reached
                    pos += size
                    batch.keys[i] = req_keys[i]
                    if all(v is not None for v in got):
                        hit_js.add(j)
                        batch.hits[i] = {name: concat([v[name] for v in got]) for name in self.output_names}
                        batch.hit_sizes[i] = size
                        batch.cache_state[i] = "hit"
                    else:
                        batch.cache_state[i] = "miss"
        else:
            for i in kreq:
                batch.cache_state[i] = "off"
        if trace is not None and cacheable:
            trace.mark("cache.lookup")
            for i in batch.hits:
                trace.left(i, "cache.lookup")
        rest = [j for j in range(len(kreq)) if j not in hit_js]
        batch.route = [kreq[j] for j in rest]
        batch.sizes = [ksizes[j] for j in rest]
        batch.fused = self._take(model_inputs, kstarts, rest, len(kreq))
        return batch

    def _lookup(self, keys: list[bytes], tenant: str, trace: Any = None,
                found_in: list[str | None] | None = None) -> list[Any]:
        cache = self.cache
        assert cache is not None
        before = {k: cache.stats[k] for k in cache.stats if k.endswith(("_hits", "_misses"))}
        try:
            values = (cache.get_many(keys) if trace is None
                      else cache.get_many(keys, timings=trace.cache_tiers, found_in=found_in))
        except Exception:  # noqa: BLE001 - a cache bug must cost a miss, never a request
            log.exception("guard %s: cache lookup failed", self.guard)
            return [None] * len(keys)
        label = self.label(tenant)
        for stat, old in before.items():
            delta = cache.stats[stat] - old
            if delta:
                tier, result = stat.split("_")
                self.metrics.inc("cache", delta, tier=tier, result="hit" if result == "hits" else "miss", tenant=label)
        return values

    # -- after routing --------------------------------------------------------------------------
    def redact_outputs(self, batch: PrivacyBatch, routed: Any) -> None:
        """Redact the text outputs of the routed requests in place (before responses and cache)."""
        if not self.redact_out or routed is None or not batch.route:
            return
        good = [k for k in range(len(batch.route)) if routed.errors[k] is None]
        if not good:
            return
        row_tenants = [batch.tenants[batch.route[k]] for k in good for _ in range(batch.sizes[k])]
        for name in self.text_outputs:
            arr = routed.outputs.get(name)
            if arr is None or arr.dtype.kind not in "OSU" or len(arr) != len(row_tenants):
                continue
            routed.outputs[name], _ = self._redact_rows(arr, row_tenants, "output")

    def after(self, batch: PrivacyBatch, routed: Any, trace: Any = None) -> None:
        """Fill the cache with the primary's answers, audit, release quota slots. Never raises."""
        try:
            self._fill(batch, routed)
            if trace is not None and self.cache is not None:
                trace.mark("cache.fill")
            self._audit_batch(batch, routed)
            if trace is not None and self.audit.enabled:
                trace.mark("audit")
            self._publish()
        except Exception:  # noqa: BLE001 - bookkeeping must never fail a served batch
            log.exception("guard %s: privacy bookkeeping failed", self.guard)
        finally:
            if self.quotas is not None and batch.admitted:
                self.quotas.release(batch.admitted)
                batch.admitted = []

    def _fill(self, batch: PrivacyBatch, routed: Any) -> None:
        if self.cache is None or routed is None or not batch.keys:
            return
        good = [k for k in range(len(batch.route)) if routed.errors[k] is None]
        starts = _starts([batch.sizes[k] for k in good])
        items = []
        for j, k in enumerate(good):
            i = batch.route[k]
            keys = batch.keys.get(i)
            if keys is None or routed.served_by[k] != batch.primary_label:
                continue  # only the primary's answers: a candidate's, fallback's or default never
            s0 = int(starts[j])
            for r, key in enumerate(keys):
                items.append((key, {n: routed.outputs[n][s0 + r:s0 + r + 1] for n in self.output_names}))
        if items:
            self.cache.put_many(items)

    def _audit_batch(self, batch: PrivacyBatch, routed: Any) -> None:
        if not self.audit.enabled:
            return
        for i in batch.hits:
            self.audit.record("inference", tenant=batch.tenants[i], model=self.guard, request=batch.digests.get(i, ""),
                              rows=batch.hit_sizes[i], cache="hit", served_by=batch.cache_label, status="ok",
                              redacted=i in batch.redacted)
        for k, i in enumerate(batch.route):
            if routed is None:
                status, served = "not_served", ""
            else:
                err = routed.errors[k]
                status, served = ("ok" if err is None else err.code), routed.served_by[k]
            self.audit.record("inference", tenant=batch.tenants[i], model=self.guard, request=batch.digests.get(i, ""),
                              rows=batch.sizes[k], cache=batch.cache_state.get(i, "off"), served_by=served,
                              status=status, redacted=i in batch.redacted)

    def _publish(self) -> None:
        if self.cache is not None:
            stats = self.cache.stats
            degraded = set(stats.get("degraded", ()))
            for tier in ("l2", "l3"):
                errs = stats.get(f"{tier}_errors", 0)
                if errs > self._cache_errors[tier]:
                    self.metrics.inc("cache_errors", errs - self._cache_errors[tier], tier=tier)
                    self._cache_errors[tier] = errs
                if tier in self.tiers:
                    self.metrics.set("cache_degraded", 1 if tier in degraded else 0, tier=tier)
            quarantined = stats.get("l2_quarantined", 0)
            if quarantined > self._cache_quarantined:
                self.metrics.inc("cache_quarantined", quarantined - self._cache_quarantined, tier="l2")
                self._cache_quarantined = quarantined
        if self.audit.dropped > self._audit_dropped:
            self.metrics.inc("audit_drops", self.audit.dropped - self._audit_dropped)
            self._audit_dropped = self.audit.dropped

    def release(self, batch: PrivacyBatch) -> None:
        if self.quotas is not None and batch.admitted:
            self.quotas.release(batch.admitted)
            batch.admitted = []


__all__ = ["PrivacyStage", "PrivacyBatch", "AuditedMetrics", "Finding", "security_findings", "enforce_security",
           "audit_file"]
