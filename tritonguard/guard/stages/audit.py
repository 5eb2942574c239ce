"""The audit log (``audit.*``): one record per refusal and per answered request (tenant,
digest, rows, cache outcome, who served it, status), and the rollout state's changes. Records
are queued for the writer thread: never blocking, drops counted."""

from __future__ import annotations

import logging
from typing import Any

from tritonguard.core.errors import QuotaExceeded
from tritonguard.guard.pipeline import Batch, Stage
from tritonguard.guard.stages.tenancy import quota_reason
from tritonguard.privacy.audit.chain import digest

log = logging.getLogger(__name__)


class AuditStage(Stage):
    """A batch: a record per refusal and per answered request. A generation: one record
    (``generation``: who answered, how it ended, what it cost; the prompt only as a digest, keyed
    with ``key`` when the audit key is set, of its redacted form) or its refusal (``reject``,
    ``quota_reject``); first in a decoupled guard's list, so its ``end`` runs last, when every
    other stage has filled the generation in."""

    name = "audit"
    always = True

    def __init__(self, audit: Any, guard: str, metrics: Any, router: Any = None, *, key: bytes | None = None):
        self.audit, self.guard, self.metrics = audit, guard, metrics
        self.router, self.key = router, key
        self.revision: int | None = None
        self._dropped = 0

    def attach(self, router: Any) -> None:
        self.router = router
        self.revision = getattr(getattr(router, "state", None), "revision", None)

    def run(self, b: Batch) -> None:
        try:
            self._record(b)
            if b.trace is not None:
                b.trace.mark("audit")
            self._count_drops()
        except Exception:  # noqa: BLE001 - bookkeeping must never fail a served batch
            log.exception("guard %s: audit failed", self.guard)

    def _state_change(self) -> None:
        state = getattr(self.router, "state", None)
        rev = getattr(state, "revision", None)
        if rev is not None and rev != self.revision:
            cand = getattr(state, "candidate", None)
            self.audit.record("state_change", model=self.guard, revision=rev, previous_revision=self.revision,
                              primary=self.router.primary(), candidate=getattr(cand, "version", None),
                              share=getattr(cand, "share", None), by=getattr(state, "updated_by", ""))
            self.revision = rev

    def _record(self, b: Batch) -> None:
        audit, guard = self.audit, self.guard
        tenants = b.tenants
        if b.verdict is not None:
            for i, err in enumerate(b.verdict.errors):
                if err is not None:
                    audit.record("reject", tenant=tenants[i] if i < len(tenants) else "", model=guard,
                                 rule=err.rule, input=err.input_name)
        for i, err in b.errors.items():
            if isinstance(err, QuotaExceeded):
                audit.record("quota_reject", tenant=tenants[i], model=guard, reason=quota_reason(str(err)))
            else:
                audit.record("reject", model=guard, rule=err.rule, input=getattr(err, "input_name", ""))
        if not b.valid:
            return
        if self.router is not None:
            self._state_change()
        for i in b.hits:
            audit.record("inference", tenant=tenants[i], model=guard, request=b.digests.get(i, ""),
                         rows=b.hit_sizes[i], cache="hit", served_by=b.cache_label, status="ok",
                         redacted=i in b.redacted)
        routed = b.routed
        for k, i in enumerate(b.route):
            if routed is None:
                status, served = "not_served", ""
            else:
                err = routed.errors[k]
                status, served = ("ok" if err is None else err.code), routed.served_by[k]
            audit.record("inference", tenant=tenants[i], model=guard, request=b.digests.get(i, ""),
                         rows=b.sizes[k], cache=b.cache_state.get(i, "off"), served_by=served,
                         status=status, redacted=i in b.redacted)

    def _count_drops(self) -> None:
        if self.audit.dropped > self._dropped:
            self.metrics.inc("audit_drops", self.audit.dropped - self._dropped)
            self._dropped = self.audit.dropped

    # -- a generation (the stream half) --------------------------------------------------------
    def end(self, gen: Any) -> None:
        audit, err = self.audit, gen.error
        if gen.outcome == "rejected" and isinstance(err, QuotaExceeded):
            audit.record("quota_reject", tenant=gen.tenant, model=self.guard, reason=str(err)[:200])
        elif gen.outcome == "rejected":
            audit.record("reject", model=self.guard, rule=getattr(err, "rule", type(err).__name__),
                         input=getattr(err, "input_name", ""))
        else:
            audit.record("generation", tenant=gen.tenant, model=self.guard, request=digest(gen.prompt, self.key),
                         served_by=gen.served_by, status=gen.outcome, stream=gen.stream, tokens_out=gen.tokens_out,
                         redacted_in=gen.redacted_in, redacted_out=gen.redacted_out, fallback=gen.fallback)
        self._count_drops()
