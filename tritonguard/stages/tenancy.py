"""Tenancy: who each request is from (``tenancy.*``), and the tenants' quotas.

A request naming no valid tenant, or over its tenant's quota, is refused here; quota slots taken
for the admitted are released by :class:`QuotaReleaseStage` at the end of every batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import QuotaExceeded
from ..pipeline import Batch, Stage
from ..tenancy import TenantResolver


class TenancyStage(Stage):
    name = "tenancy"

    def __init__(self, config: Any, metrics: Any, label: Callable[[str], str], quotas: Any = None,
                 environ: Any = None):
        self.on = config.enabled
        self.default = config.default
        self.resolver = TenantResolver(config, environ)
        self.metrics, self.label, self.quotas = metrics, label, quotas

    def run(self, b: Batch) -> None:
        n = len(b.verdict.errors)
        if self.on and b.params:
            tenants, terrs = self.resolver.resolve_tenants(b.params)
        else:
            tenants, terrs = [self.default] * n, [None] * n
        b.tenants = [t or "" for t in tenants]
        keep = []
        for pos, i in enumerate(b.route):
            err = terrs[i]
            if err is None:
                keep.append(pos)
                continue
            b.refuse(i, err)
            self.metrics.inc("rejects", 1, reason=err.rule)
        if self.quotas is not None and keep:
            refusals = self.quotas.admit([tenants[b.route[p]] for p in keep])
            admitted = []
            for p, why in zip(list(keep), refusals, strict=True):
                i, t = b.route[p], tenants[b.route[p]]
                if why is None:
                    admitted.append(p)
                    b.admitted.append(t)
                    continue
                b.refuse(i, QuotaExceeded(why))
                self.metrics.inc("quota_rejects", 1, tenant=self.label(t), reason=quota_reason(why))
            keep = admitted
        if b.trace is not None:
            b.trace.mark("tenancy")
            for i, err in b.errors.items():
                b.trace.left(i, "tenancy", err.rule, str(err))
        b.keep(keep)


def quota_reason(why: str) -> str:
    return "in_flight" if "in flight" in why else "rate"


class QuotaReleaseStage(Stage):
    """Gives back the in-flight slots the batch's admitted requests took (every batch, whatever
    happened to it)."""

    name = "quota.release"
    always = True

    def __init__(self, quotas: Any):
        self.quotas = quotas

    def run(self, b: Batch) -> None:
        if b.admitted:
            admitted, b.admitted = b.admitted, []
            self.quotas.release(admitted)
