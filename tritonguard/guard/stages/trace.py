"""Tracing: the batch's spans start after validation; traced requests are tagged once their
tenant and cache outcome are known. Present only when ``tracing.endpoint`` is set."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tritonguard.guard.pipeline import Batch, Stage


class TraceStartStage(Stage):
    """Picks the batch's traced requests (None when none is) and marks validation, the stage
    that ran before it; requests validation refused end their span there."""

    name = "trace"

    def __init__(self, tracer: Any):
        self.tracer = tracer

    def run(self, b: Batch) -> None:
        if b.clock is None:
            return
        validated = time.time_ns()
        tb = self.tracer.begin(b.requests, b.params, *b.clock)
        if tb is None:
            return
        tb.marks.append(("validate", validated, {}))
        for i, err in enumerate(b.verdict.errors):
            if err is not None:
                tb.left(i, "validate", err.rule, str(err))
        b.trace = tb


class TraceTagStage(Stage):
    """Tenant and cache outcome on each traced request's guard span (before routing)."""

    name = "trace.tag"

    def __init__(self, label: Callable[[str], str]):
        self.label = label

    def run(self, b: Batch) -> None:
        tb = b.trace
        if tb is None:
            return
        for i in tb.sampled:
            tenant = b.tenants[i] if i < len(b.tenants) else ""
            tb.set(i, **{"tritonguard.tenant": self.label(tenant) if tenant else "",
                         "tritonguard.cache": b.cache_state.get(i, "off")})
            if i in b.hits:
                tb.set(i, **{"tritonguard.served_by": b.cache_label})
                if i in b.hit_tiers:
                    tb.set(i, **{"tritonguard.cache.tier": b.hit_tiers[i]})
