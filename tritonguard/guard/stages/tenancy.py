"""Tenancy: who each request is from (``tenancy.*``), and the tenants' quotas.

A request naming no valid tenant, or over its tenant's quota, is refused here; quota slots taken
for the admitted are released by :class:`QuotaReleaseStage` at the end of every batch, and by
:class:`TenancyStage` itself at the end of a generation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tritonguard.core.errors import QuotaExceeded
from tritonguard.guard.pipeline import Batch, Stage
from tritonguard.privacy.tenancy.auth import TenantResolver
from tritonguard.triton import backend as triton


class TenancyStage(Stage):
    """Who each request is from and whether its tenant may send it now. A batch: refusals, and
    quota slots released by :class:`QuotaReleaseStage`. A generation (``budget``: its token
    budget, ``tokens.*``): its ``max_tokens`` reserved from its tenant's budget (the stream is cut
    at what was reserved) or refused with retry advice; at its end, however it ended, the
    reservation is settled with the tokens generated (the unused part given back), metered (in:
    prompt characters, out: generated tokens) and its slots given back."""

    name = "tenancy"

    def __init__(self, config: Any, metrics: Any, label: Callable[[str], str], quotas: Any = None,
                 environ: Any = None, *, budget: Any = None):
        self.on = config.enabled
        self.default = config.default
        self.resolver = TenantResolver(config, environ)
        self.metrics, self.label, self.quotas, self.budget = metrics, label, quotas, budget
        self._degraded = 0  # requests the fleet quota judged locally, already counted

    def _count_degraded(self) -> None:
        """Fleet quotas (:mod:`tritonguard.privacy.tenancy.fleet`) judged by the host's quota while
        Redis was unreachable: into ``tritonguard_quota_degraded_total``."""
        n = getattr(self.quotas, "degraded", 0)
        if n > self._degraded:
            self.metrics.inc("quota_degraded", n - self._degraded)
            self._degraded = n

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
            self._count_degraded()
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


    # -- a generation (the stream half) --------------------------------------------------------
    def tenant_of(self, params: Any) -> str:
        """The tenant a request's parameters name (its credential checked); raises the refusal.
        Also how a stop request is matched to its generation (guard/stream/stops.py)."""
        if not self.on:
            return self.default
        tenants, errors = self.resolver.resolve_tenants([params or {}])
        if errors[0] is not None:
            raise errors[0]
        return tenants[0] or self.default

    def admit(self, gen: Any) -> None:
        tenant = self.default
        if self.on:
            tenant = self.tenant_of(gen.parameters if gen.request is None else triton.request_parameters(gen.request))
        gen.tenant = tenant
        if self.quotas is not None:
            why = self.quotas.admit([tenant])[0]
            self._count_degraded()
            if why is not None:
                raise QuotaExceeded(why)
            gen.quota_admitted = True
        # the generation's max_tokens reserved now, not charged after the fact (tokens.*)
        want = gen.params.max_tokens if gen.params is not None else 1
        reserved, why = self.budget.reserve(tenant, want)
        if why is not None:
            self._release_quota(gen)
            raise QuotaExceeded(why)
        gen.budget_admitted, gen.budget_reserved = True, reserved
        if gen.params is not None and reserved < want:  # over a minute's worth: cut at the reservation
            gen.params = dataclasses.replace(gen.params, max_tokens=reserved)

    def end(self, gen: Any) -> None:
        label = self.label(gen.tenant)
        self.metrics.inc("stream_tokens", len(gen.prompt), direction="in", tenant=label)
        if gen.tokens_out:
            self.metrics.inc("stream_tokens", gen.tokens_out, direction="out", tenant=label)
        if gen.budget_admitted:  # the unused part of the reservation goes back, however it ended
            self.budget.settle(gen.tenant, gen.budget_reserved, gen.tokens_out)
            self.budget.release(gen.tenant)
            gen.budget_admitted, gen.budget_reserved = False, 0
        self._release_quota(gen)

    def _release_quota(self, gen: Any) -> None:
        if gen.quota_admitted and self.quotas is not None:
            self.quotas.release([gen.tenant])
            gen.quota_admitted = False


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

