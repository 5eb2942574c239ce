"""What every host adapter shares: the guard's configuration parsers, admission (tenants and
quotas), the rollout state read as the guard reads it, version picking, audit and the guard's
metric families in a prometheus-client registry.

One implementation for :mod:`.asgi` and :mod:`.ray_serve`, so a tenant, a quota bucket, a rollout
state and a metric mean the same thing whichever host serves the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tritonguard.core import catalogue
from tritonguard.core.config import from_params, split_parameters
from tritonguard.core.errors import ConfigError, InvalidInput
from tritonguard.guard.config import TargetConfig
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.routing.view import RolloutView, route_shares
from tritonguard.guard.stages.tenancy import quota_reason
from tritonguard.privacy.audit.anchors import load_audit_key, open_anchor_store
from tritonguard.privacy.audit.log import AuditConfig, AuditLog
from tritonguard.privacy.redaction import RedactionConfig
from tritonguard.privacy.tenancy.auth import AuthenticationError, TenantResolver
from tritonguard.privacy.tenancy.config import TenancyConfig
from tritonguard.privacy.tenancy.fleet import FleetQuotaManager, fleet_url
from tritonguard.privacy.tenancy.labels import TenantLabels
from tritonguard.privacy.tenancy.quotas import QUOTA_FILE, QuotaManager, SharedQuotaManager
from tritonguard.rollout.state import RolloutState, StateError

log = logging.getLogger(__name__)

_RETRY_MS = re.compile(r"retry after (\d+) ms")


# -- configuration: the guard's keys and parsers ---------------------------------------------------
def parse_sections(params: Mapping[str, Any], sections: Mapping[str, type | None], *, model: str, host: str,
                   only: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """``params`` as a guard's config.pbtxt spells them (``"tenancy.quotas": "{...}"``; a value may
    be a Python object, written as JSON here) -> one parsed config per section: ``sections`` maps
    a section ("" = top level) to the guard's dataclass that parses it (None: the raw strings).
    ``only`` restricts a section to the keys that mean something in this host: any other fails,
    naming it (a guard key this host cannot honour must not be silently ignored)."""
    wire = {k: v if isinstance(v, str) else json.dumps(v) for k, v in params.items()}
    groups = split_parameters(wire, tuple(sections), model=model)
    for section, known in only.items():
        extra = sorted(set(groups[section]) - set(known))
        if extra:
            prefix = f"{section}." if section else ""
            raise ConfigError(f"model '{model}': parameter '{prefix}{extra[0]}' has no meaning in the {host} "
                              f"(it takes {', '.join(prefix + k for k in known)})")
    out: dict[str, Any] = {}
    for section, cls in sections.items():
        if cls is None:
            out[section] = groups[section]
        elif section:
            out[section] = from_params(cls, groups[section], section=section, model=model)
        else:
            out[section] = from_params(cls, groups[section], model=model)
    return out


HOST_SECTIONS: dict[str, type | None] = {"": TargetConfig, "tenancy": TenancyConfig, "redaction": RedactionConfig,
                                         "audit": AuditConfig, "routing": RoutingConfig}


# -- metrics: the guard's families, in a prometheus-client registry ---------------------------------
# family key -> its labels besides ``model`` (as the Triton guard labels them)
FAMILIES: dict[str, tuple[str, ...]] = {
    "requests": (), "rejects": ("reason",), "quota_rejects": ("tenant", "reason"), "quota_degraded": (),
    "served": ("served_by",), "target_errors": ("code", "target_version"), "redactions": ("type", "direction", "tenant"),
    "audit_drops": (), "state_errors": (), "route_share": ("target_version", "role"), "latency": ("target_version",),
}
# what a host that calls the model versions itself adds: fused calls, fallbacks, breakers and
# the canary's comparisons (the families `exporter promote`'s gates read besides served and errors)
MODEL_FAMILIES: dict[str, tuple[str, ...]] = {
    **FAMILIES, "target_calls": (), "fallbacks": ("reason",), "trips": ("target_version", "reason"),
    "breaker_state": ("target_version",), "compared": ("kind", "verdict", "target_version"), "compare_drops": (),
    "validator_score": ("target_version", "kind", "figure"), "output_drift": ("target_version",),
}
ZERO_AT_LOAD = ("requests", "audit_drops", "state_errors", "quota_degraded", "target_calls", "compare_drops")


class HostMetrics:
    """``inc`` / ``set`` / ``observe`` by the guard's family keys (the interface of
    :class:`tritonguard.triton.metrics.Metrics`), into prometheus-client families named as in
    :mod:`tritonguard.core.catalogue` and labelled ``model=<target>`` like the guard's."""

    def __init__(self, model: str, registry: CollectorRegistry, families: Mapping[str, tuple[str, ...]] = FAMILIES):
        self.model, self.registry = model, registry
        self._families: dict[str, Any] = {}
        self._children: dict[tuple, Any] = {}
        for key, labels in families.items():
            names = ("model", *labels)
            if key in catalogue.GUARD_COUNTERS:
                name, doc = catalogue.GUARD_COUNTERS[key]
                fam: Any = Counter(name.removesuffix("_total"), doc, names, registry=registry)
            elif key in catalogue.GUARD_GAUGES:
                name, doc = catalogue.GUARD_GAUGES[key]
                fam = Gauge(name, doc, names, registry=registry)
            else:
                name, doc, buckets = catalogue.GUARD_HISTOGRAMS[key]
                fam = Histogram(name, doc, names, buckets=buckets, registry=registry)
            self._families[key] = fam
        for key in ZERO_AT_LOAD:
            if key in families:
                self._child(key, {})  # at 0 from the start, as the guard's ZERO_AT_LOAD

    def _child(self, family: str, labels: Mapping[str, str]) -> Any:
        key = (family, *sorted(labels.items()))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._families[family].labels(model=self.model, **labels)
        return child

    def child(self, family: str, **labels: str) -> Any:
        """The prometheus child of ``family`` with ``labels`` (and ``model``), for a host's hot path
        to keep: ``inc`` / ``observe`` on it skip the label lookup."""
        return self._child(family, labels)

    def inc(self, family: str, value: float = 1, **labels: str) -> None:
        self._child(family, labels).inc(value)

    def set(self, family: str, value: float, **labels: str) -> None:
        self._child(family, labels).set(value)

    def observe(self, family: str, value: float, **labels: str) -> None:
        self._child(family, labels).observe(value)


# -- the rollout state and version picking ---------------------------------------------------------
class HandlerView(RolloutView):
    """The rollout state as the guard reads it, with the host's versions standing for the
    versions on disk: a new state pins the highest of them as primary."""

    def __init__(self, handlers: list[int], **kwargs: Any):
        self.handlers = sorted(handlers)
        super().__init__(**kwargs)

    def versions_on_disk(self) -> list[int]:
        return self.handlers


class StaticStore:
    """No repository and no state URL: one in-memory state, the highest handler as primary."""

    errors = 0

    def __init__(self, model: str):
        self.model = model

    def load(self) -> RolloutState | None:
        return None

    def poll(self, last_revision: int | None = None) -> RolloutState | None:
        return None

    def update(self, fn: Any, expected_revision: int | None = None, *, by: str = "") -> RolloutState:
        return fn(RolloutState(model=self.model)) or RolloutState(model=self.model)

    def update_breaker(self, version: int | str, fn: Any, *, by: str = "") -> RolloutState:
        """Nowhere to share a breaker's state: it stays with the process that holds it."""
        raise StateError("no rollout store (no repository, no state URL): breaker states are per process")


@dataclass
class Refusal:
    """A request the host answers itself: an HTTP status, the rule that refused it, why."""

    status: int
    rule: str
    message: str
    retry_after_s: int = 0


def error_body(message: str, rule: str) -> bytes:
    return json.dumps({"error": message, "rule": rule}).encode("utf-8")


class Routes:
    """Which version answers: the rollout state of ``target`` (through ``view``) over the
    versions this host can serve (``handlers``), as the guard's router picks its first hop, and
    ``tritonguard_route_share`` published whenever the state's revision or primary changes."""

    def __init__(self, view: RolloutView, handlers: Sequence[int], metrics: HostMetrics, target: str,
                 pin_name: str):
        """``pin_name``: how a refusal names the way a request pins a version (e.g. a header)."""
        self.view, self.handlers, self.metrics, self.target = view, set(handlers), metrics, target
        self.pin_name = pin_name
        self._published: tuple[int, int] | None = None
        self._published_shares: set[tuple[int, str]] = set()

    def primary(self) -> int:
        p = self.view.state.primary
        return p if p in self.handlers else max(self.handlers)

    def publish(self) -> None:
        key = (self.view.state.revision, self.primary())
        if key == self._published:
            return
        self._published = key
        shares = route_shares(self.view.state, key[1])
        for gone in self._published_shares - shares.keys():
            shares[gone] = 0.0
        for (version, role), share in shares.items():
            self.metrics.set("route_share", share, target_version=str(version), role=role)
        self._published_shares = {k for k, v in shares.items() if v > 0}

    def pick(self, draw: float) -> int:
        """The version a request with uniform draw ``draw`` goes to: the candidate's band, the
        arms' bands, else the primary; a version with no handler here sends its band to the primary."""
        state = self.view.state
        cand = state.candidate
        if cand is not None and draw < cand.share and cand.version in self.handlers:
            return cand.version
        lo = 0.0
        for arm in state.arms:
            if lo <= draw < lo + arm.weight and arm.version in self.handlers:
                return arm.version
            lo += arm.weight
        return self.primary()

    def pinned(self, raw: str) -> int | Refusal:
        """The version a request names (the guard's ``version`` parameter), if the state routes there."""
        try:
            version = int(raw)
        except ValueError:
            version = 0
        if version <= 0:
            return Refusal(400, "version", f"{self.pin_name} must be a positive integer")
        named = set(self.view.named_versions()) | {self.primary()}
        if version not in self.handlers or version not in named:
            served = ", ".join(f"v{v}" for v in sorted(named & self.handlers))
            return Refusal(503, "version", f"version {version} of '{self.target}' is not routed here (served: {served})")
        return version


# -- admission: the guard's resolver and quota managers --------------------------------------------
class Admission:
    """Tenants (``tenancy.*``) and their quotas, as the guard admits them: per process, shared by
    the processes of a host through ``<repository>/<target>/quota_buckets.bin``, or one quota for
    the fleet through Redis leases when the state URL is a ``redis://`` URL."""

    def __init__(self, config: TenancyConfig, *, target: str, metrics: HostMetrics, environ: Mapping[str, str],
                 repository: Path | None, url: str, host: str):
        self.config, self.target, self.metrics, self.host = config, target, metrics, host
        self.resolver = TenantResolver(config, environ)
        self.label = TenantLabels()
        self.quotas = self._quotas(repository, url) if config.enabled and config.quotas else None
        self._degraded = 0

    def _quotas(self, repository: Path | None, url: str) -> QuotaManager:
        local = QuotaManager(self.config)
        if repository is not None:
            try:
                (repository / self.target).mkdir(parents=True, exist_ok=True)
                local = SharedQuotaManager(self.config, repository / self.target / QUOTA_FILE)
            except OSError as exc:
                log.warning("%s %s: tenant quotas are per process: %s", self.host, self.target, exc)
        if fleet_url(url):
            return FleetQuotaManager(self.config, url, guard=self.target, local=local)
        return local

    def admit(self, params: dict[str, Any]) -> tuple[str, Refusal | None]:
        """(tenant, None) or (tenant or "", the refusal); an admitted tenant is :meth:`release` d."""
        cfg = self.config
        if not cfg.enabled:
            return cfg.default, None
        tenants, errors = self.resolver.resolve_tenants([params])
        err = errors[0]
        if err is not None:
            self.metrics.inc("rejects", 1, reason=err.rule)
            return "", self._refusal_of(err, params)
        tenant = tenants[0] or cfg.default
        if self.quotas is not None:
            why = self.quotas.admit([tenant])[0]
            n = getattr(self.quotas, "degraded", 0)
            if n > self._degraded:
                self.metrics.inc("quota_degraded", n - self._degraded)
                self._degraded = n
            if why is not None:
                reason = quota_reason(why)
                self.metrics.inc("quota_rejects", 1, tenant=self.label(tenant), reason=reason)
                m = _RETRY_MS.search(why)
                retry = max(1, math.ceil(int(m.group(1)) / 1000)) if m else 1
                return tenant, Refusal(429, "quota", why, retry)
        return tenant, None

    def release(self, tenant: str) -> None:
        if self.quotas is not None:
            self.quotas.release([tenant])

    def _refusal_of(self, err: InvalidInput, params: Mapping[str, Any]) -> Refusal:
        if not isinstance(err, AuthenticationError):
            return Refusal(400, err.rule, str(err))
        auth = self.resolver.auth
        cred = params.get(auth.header) if auth is not None else None
        if isinstance(cred, str) and auth is not None and auth.verify(cred)[1] is None:
            # the credential is good, but the request names another tenant than it authenticates
            return Refusal(403, err.rule, str(err))
        return Refusal(401, err.rule, str(err))

    def close(self) -> None:
        if isinstance(self.quotas, (SharedQuotaManager, FleetQuotaManager)):
            self.quotas.close()


# -- audit ----------------------------------------------------------------------------------------
def open_audit(config: AuditConfig, *, target: str, repository: Path | None, url: str,
               environ: Mapping[str, str]) -> tuple[AuditLog, bytes | None]:
    """The audit log (one writer per file: ``{pid}`` in ``audit.path`` gives each process its
    own) with its anchors beside the rollout state, and the key request digests are keyed with."""
    path = config.path.replace("{pid}", str(os.getpid()))
    anchors = open_anchor_store(target, repository, url or None) if path and (repository or url) else None
    audit = AuditLog(dataclasses.replace(config, path=path), environ=environ, anchors=anchors)
    key = load_audit_key(config.key_env, environ) if audit.enabled else None
    return audit, key


def audit_refusal(audit: AuditLog, r: Refusal, tenant: str, target: str) -> None:
    if audit.enabled:
        if r.status == 429:
            audit.record("quota_reject", tenant=tenant, model=target, reason=quota_reason(r.message))
        else:
            audit.record("reject", tenant=tenant, model=target, rule=r.rule, status=r.status)


__all__ = ["Admission", "FAMILIES", "HOST_SECTIONS", "HandlerView", "HostMetrics", "MODEL_FAMILIES", "Refusal",
           "Routes", "StaticStore", "audit_refusal", "error_body", "open_audit", "parse_sections"]
