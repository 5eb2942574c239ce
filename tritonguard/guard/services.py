"""Privacy, tenants, cache and audit around the guard's routing, on whole batches.

:class:`PrivacyStage` holds a guard's privacy services and builds the stages that use them
(``tritonguard/guard/stages/``: tenancy, redaction, keys, cache, audit), which the guard runs in its
pipeline (:mod:`tritonguard.guard.pipeline`): tenants and quotas, redacted text inputs, one cache key per
batch row — tenant + guard + the primary version's artifact SHA-256 + the canonical (redacted)
inputs + requested outputs + output-affecting settings — looked up L1 → L2 → L3 (a request is
answered from the cache only when every one of its rows hits), redacted text outputs, then the
cache filled with the primary's answers only (never a candidate's, fallback's or default), the
audit records (hashes and ids only), and the tenants' in-flight slots released.

Nothing here writes request contents anywhere: the cache persists AES-GCM ciphertext under
keyed row ids (:mod:`tritonguard.privacy.cache`), the audit log holds digests (:mod:`tritonguard.privacy.audit`),
and log lines name tenants, rules and counts only.

:func:`security_findings` is the startup security check; :class:`AuditedMetrics` turns the
router's safety events (golden results, breaker trips and states, fallbacks) into audit records.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonguard.core.errors import ConfigError
from tritonguard.core.store import store_url
from tritonguard.core.tensors import ModelSignature
from tritonguard.guard.config import SERVED_BY, GuardConfig
from tritonguard.guard.pipeline import Batch, GuardContext, Pipeline, Stage
from tritonguard.guard.stages.audit import AuditStage
from tritonguard.guard.stages.cache import CacheFillStage, CacheLookupStage
from tritonguard.guard.stages.keys import KeysStage
from tritonguard.guard.stages.redact import RedactInStage, RedactOutStage
from tritonguard.guard.stages.tenancy import QuotaReleaseStage, TenancyStage
from tritonguard.privacy.audit.anchors import open_anchor_store
from tritonguard.privacy.audit.log import AuditLog
from tritonguard.privacy.cache.config import PrivacyMode, load_key
from tritonguard.privacy.cache.tiered import TieredCache
from tritonguard.privacy.redaction import Redactor
from tritonguard.privacy.tenancy.auth import authenticator
from tritonguard.privacy.tenancy.fleet import FleetQuotaManager, fleet_url
from tritonguard.privacy.tenancy.labels import MAX_TENANT_LABELS, OTHER_TENANTS, TenantLabels
from tritonguard.privacy.tenancy.quotas import QUOTA_FILE, QuotaManager, SharedQuotaManager

log = logging.getLogger(__name__)

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


# -- the privacy services and their stages ----------------------------------------------------
PrivacyBatch = Batch  # the name tests and benchmarks used before the stages had their own modules


class PrivacyStage:
    """A guard's privacy services — tenant labels, quotas, the redactor, the cache, the audit
    log — and the stages that use them (``tritonguard/guard/stages/``), in the guard's order:

    - before routing (:attr:`inbound`): tenancy → redact (input) → keys → cache.lookup;
    - after routing, before responses (:attr:`outbound`): redact (output);
    - after responses (:attr:`closing`): cache.fill → audit → quota release (these always run).

    The guard puts these lists into its pipeline. :meth:`before`, :meth:`redact_outputs` and
    :meth:`after` run them on their own, for tests and benchmarks that have no router or Triton.
    """

    def __init__(self, *, guard: str, target: str, signature: ModelSignature, output_names: Sequence[str],
                 config: GuardConfig, repo: Path, metrics: Any, audit_path: str = "",
                 key_params: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.time):
        self.ctx = GuardContext(guard=guard, target=target, signature=signature, output_names=list(output_names),
                                config=config, repo=Path(repo), metrics=metrics, clock=clock, environ=environ)
        self.guard, self.target, self.config, self.metrics = guard, target, config, metrics
        self.output_names = list(output_names)
        self.batched = signature.max_batch_size > 0
        self.label = TenantLabels()
        self.redactor = Redactor(config.redaction)
        self.text_inputs = [s.name for s in signature.inputs if s.is_bytes]
        self.text_outputs = [s.name for s in signature.outputs if s.is_bytes and s.name != SERVED_BY]
        self.redact_in = self.redactor.active and bool(self.text_inputs)
        self.redact_out = self.redactor.active and config.redaction.redact_outputs and bool(self.text_outputs)
        self.model_sees_redacted = config.redaction.model_sees_redacted
        tcfg = config.tenancy
        self.tenancy_on = tcfg.enabled
        self.quotas = self._quotas(tcfg) if tcfg.enabled and tcfg.quotas else None
        self.cache: TieredCache | None = None
        if config.cache.enabled and self.batched:
            cache = TieredCache(config.cache, environ=environ)
            self.cache = cache if cache.enabled else None
        # anchors of the chain go to the guard's state store too (Redis, or beside rollout_state.json)
        self.audit = AuditLog(dataclasses.replace(config.audit, path=audit_path), environ=environ,
                              anchors=open_anchor_store(guard, repo) if audit_path else None)
        self.tiers = self._tiers()
        key_params = dict(key_params or {})
        if self.redact_out:
            key_params["redact_outputs"] = [config.redaction.replacement, list(config.redaction.recognizers),
                                            sorted(config.redaction.pattern.items())]
        self.key_params = key_params
        self.router: Any = None

        self.tenancy = TenancyStage(tcfg, metrics, self.label, self.quotas, environ)
        inbound: list[Stage] = [self.tenancy]
        if self.redact_in:
            inbound.append(RedactInStage(self.redactor, self.text_inputs, self.model_sees_redacted, self.batched,
                                         metrics, self.label))
        self.audit_stage = AuditStage(self.audit, guard, metrics) if self.audit.enabled else None
        if self.batched and (self.cache is not None or self.audit.enabled):
            self.keys = KeysStage(self.ctx, key_params, cache_on=self.cache is not None, audit_on=self.audit.enabled)
            inbound.append(self.keys)
        if self.cache is not None:
            inbound.append(CacheLookupStage(self.cache, guard, self.output_names, self.model_sees_redacted,
                                            metrics=metrics, label=self.label, audit=self.audit,
                                            state=lambda: getattr(self.router, "state", None)))
        self.inbound = inbound
        self.outbound: list[Stage] = ([RedactOutStage(self.redactor, self.text_outputs, metrics, self.label)]
                                      if self.redact_out else [])
        closing: list[Stage] = []
        if self.cache is not None:
            closing.append(CacheFillStage(self.cache, self.output_names, self.tiers, metrics))
        if self.audit_stage is not None:
            closing.append(self.audit_stage)
        if self.quotas is not None:
            closing.append(QuotaReleaseStage(self.quotas))
        self.closing = closing

    # -- lifecycle --------------------------------------------------------------------------
    def wrap_metrics(self, metrics: Any) -> Any:
        """The metrics to give the router: audited when an audit log is on."""
        return AuditedMetrics(metrics, self.audit, self.guard) if self.audit.enabled else metrics

    def attach(self, router: Any) -> None:
        self.router = self.ctx.router = router
        if self.audit_stage is not None:
            self.audit_stage.attach(router)
        c = self.config.cache
        self.audit.record("guard_start", model=self.guard, target=self.target, primary=router.primary(),
                          revision=getattr(getattr(router, "state", None), "revision", None),
                          privacy=c.privacy if c.enabled else "off",
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
        state); per process if that file cannot be used. With a Redis state URL
        (``$TRITONGUARD_STATE_URL``), one quota for the whole fleet, the host's buckets judging
        while Redis is unreachable."""
        path = self.ctx.repo / self.guard / QUOTA_FILE
        try:
            local: QuotaManager = SharedQuotaManager(tcfg, path)
        except OSError as exc:
            log.warning("guard %s: tenant quotas are per instance: cannot share them through %s: %s",
                        self.guard, path, exc)
            local = QuotaManager(tcfg)
        url = store_url(environ=self.ctx.environ)
        if fleet_url(url):
            return FleetQuotaManager(tcfg, url, guard=self.guard, local=local)
        return local

    def close(self) -> None:
        """The services' files and threads (the stages hold none of their own)."""
        self.audit.record("guard_stop", model=self.guard)
        self.audit.close()
        if self.cache is not None:
            self.cache.close()
        if isinstance(self.quotas, (SharedQuotaManager, FleetQuotaManager)):
            self.quotas.close()

    @property
    def needs_parameters(self) -> bool:
        """Whether the stages need the requests' parameters (the tenant is read from them)."""
        return self.tenancy_on

    # -- the stages on their own (tests, benchmarks) ------------------------------------------
    def before(self, requests_params: Sequence[Mapping[str, Any]] | None, verdict: Any,
               trace: Any = None) -> Batch:
        """The inbound stages on a validated batch: what is left to route is ``batch.route``."""
        n = len(verdict.errors)
        batch = Batch(params=list(requests_params) if requests_params is not None else [],
                      responses=[None] * n, trace=trace)
        batch.verdict = verdict
        batch.route, batch.sizes, batch.fused = list(verdict.valid), list(verdict.sizes), verdict.fused
        Pipeline(self.inbound).run(batch)
        return batch

    def redact_outputs(self, batch: Batch, routed: Any) -> None:
        batch.routed = routed
        Pipeline(self.outbound).run(batch)

    def after(self, batch: Batch, routed: Any, trace: Any = None) -> None:
        """Cache fill, audit, quota release. Never raises."""
        batch.routed = routed
        if trace is not None:
            batch.trace = trace
        try:
            Pipeline(self.closing).run(batch)
        except Exception:  # noqa: BLE001 - the closing stages catch their own; belt and braces
            log.exception("guard %s: privacy bookkeeping failed", self.guard)


__all__ = ["PrivacyStage", "PrivacyBatch", "AuditedMetrics", "TenantLabels", "MAX_TENANT_LABELS", "OTHER_TENANTS", "Finding", "security_findings", "enforce_security",
           "audit_file"]
