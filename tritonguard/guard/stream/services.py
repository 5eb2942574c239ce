"""What a decoupled guard wires around its target, from its settings: the privacy services
(redactor, tenant quotas and token budget, the exact and semantic caches, the audit log) and the
stage list every generation runs, in order (:class:`~tritonguard.guard.pipeline.StreamPipeline`):
``audit -> validate -> tenancy -> redact in -> route -> cache -> semantic cache -> redact out``,
holding only the stages its settings need. The batch guard's counterpart is
:class:`~tritonguard.guard.services.PrivacyStage`; the stage classes are the same where the rules
are (tenancy, redaction, routing, audit)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.errors import ConfigError
from tritonguard.core.store import store_url
from tritonguard.generation.contract import OUTPUT
from tritonguard.guard.pipeline import StreamPipeline
from tritonguard.guard.services import AuditedMetrics, audit_file
from tritonguard.guard.stages.audit import AuditStage
from tritonguard.guard.stages.cache import Fingerprints, StreamCacheStage, StreamSemanticStage
from tritonguard.guard.stages.redact import RedactInStage, RedactOutStage
from tritonguard.guard.stages.route import RouteStage
from tritonguard.guard.stages.tenancy import TenancyStage
from tritonguard.guard.stages.validate import StreamValidateStage
from tritonguard.guard.stream.config import StreamGuardSettings
from tritonguard.privacy.audit.anchors import load_audit_key, open_anchor_store
from tritonguard.privacy.audit.log import AuditLog
from tritonguard.privacy.cache.semantic import SemanticCache
from tritonguard.privacy.cache.tiered import TieredCache
from tritonguard.privacy.redaction import Redactor
from tritonguard.privacy.tenancy.budget import TokenBudget
from tritonguard.privacy.tenancy.fleet import (
    FleetQuotaManager,
    FleetTokenBudget,
    fleet_url,
    token_budget,
)
from tritonguard.privacy.tenancy.labels import TenantLabels
from tritonguard.privacy.tenancy.quotas import QuotaManager


class StreamServices:
    def __init__(self, settings: StreamGuardSettings, *, name: str, target: str, repo: Path, metrics: Any,
                 embed: Callable[[list[str]], np.ndarray], instance: str, instances: int) -> None:
        """``embed(texts)``: the semantic cache's embeddings (``semantic_cache.model`` over BLS)."""
        s = self.settings = settings
        self.name, self.target, self.repo, self.metrics = name, target, repo, metrics
        self.redactor = Redactor(s.redaction)
        self.quotas: QuotaManager | None = None
        if s.tenancy.quotas:  # per instance; with a Redis state URL one quota for the fleet
            self.quotas = QuotaManager(s.tenancy)
            url = store_url()
            if fleet_url(url):
                self.quotas = FleetQuotaManager(s.tenancy, url, guard=name, local=self.quotas)
        # tokens reserved at admission; with a Redis state URL one budget for the fleet
        self.budget: TokenBudget = token_budget(s.tokens, guard=name, url=store_url())
        self.label = TenantLabels()
        self.cache: TieredCache | None = None
        if s.cache.enabled:
            cache = TieredCache(s.cache)
            self.cache = cache if cache.enabled else None
        self.semantic: SemanticCache | None = None
        if s.semantic.enabled:
            if s.semantic.model in (name, target):
                raise ConfigError(f"model '{name}': parameter 'semantic_cache.model' must name an embedding "
                                  f"model, not '{s.semantic.model}'")
            self.semantic = SemanticCache(s.semantic, embed)
        # one record per request (refusals included) on a hash-chained log, written off the path
        path = audit_file(s.audit.path, model=name, instance=instance, instances=instances)
        self.audit: AuditLog | None = None
        if path:
            self.audit = AuditLog(dataclasses.replace(s.audit, path=path), anchors=open_anchor_store(name, repo))

    def router_metrics(self) -> Any:
        """What the router counts into: the metrics, and the audit log for its safety events."""
        return AuditedMetrics(self.metrics, self.audit, self.name) if self.audit else self.metrics

    def pipeline(self, router: Any, inputs: tuple[str, ...]) -> StreamPipeline:
        """The stages of one generation, in order, only those the settings need."""
        s, m, label = self.settings, self.metrics, self.label
        fingerprints = Fingerprints(self.repo, self.target, self.name)
        redact_out = self.redactor.active and s.redaction.redact_outputs
        return StreamPipeline([
            *([AuditStage(self.audit, self.name, m, key=load_audit_key(s.audit.key_env))]
              if self.audit is not None else []),
            StreamValidateStage(inputs, s.validation),
            TenancyStage(s.tenancy, m, label, self.quotas, budget=self.budget),
            *([RedactInStage(self.redactor, ["text_input"], s.redaction.model_sees_redacted, False, m, label)]
              if self.redactor.active and s.redaction.model_sees_redacted else []),
            RouteStage(router),
            *([StreamCacheStage(self.cache, self.name, fingerprints, m, label)] if self.cache is not None else []),
            *([StreamSemanticStage(self.semantic, self.name, fingerprints, m, label)]
              if self.semantic is not None else []),
            *([RedactOutStage(self.redactor, [OUTPUT], m, label, holdback=s.holdback_chars)] if redact_out else []),
        ])

    def close(self) -> None:
        if self.audit is not None:
            self.audit.close()
        if isinstance(self.quotas, FleetQuotaManager):
            self.quotas.close()
        if isinstance(self.budget, FleetTokenBudget):
            self.budget.close()
