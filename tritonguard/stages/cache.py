"""The response cache (``cache.*``): lookups before routing (a request is a hit only when all of
its rows hit), fills after it with the primary's answers only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..pipeline import Batch, Stage, starts_of
from ..tensors import concat

log = logging.getLogger(__name__)


class CacheLookupStage(Stage):
    name = "cache.lookup"

    def __init__(self, cache: Any, guard: str, output_names: list[str], model_sees_redacted: bool, *,
                 metrics: Any, label: Callable[[str], str], audit: Any, state: Callable[[], Any]):
        self.cache, self.guard, self.output_names = cache, guard, output_names
        self.model_sees_redacted = model_sees_redacted
        self.metrics, self.label, self.audit, self.state = metrics, label, audit, state
        self._epoch: int | None = None

    def _check_epoch(self) -> None:
        """A promote or rollback bumps the state's cache epoch: every instance forgets its L1."""
        epoch = getattr(self.state(), "cache_epoch", 0)
        if epoch != self._epoch:
            if self._epoch is not None:
                dropped = self.cache.purge_local(self.guard)
                log.info("guard %s: cache epoch %s -> %s, dropped %d L1 entries", self.guard, self._epoch,
                         epoch, dropped)
                self.audit.record("cache_purge", model=self.guard, epoch=epoch, l1=dropped)
            self._epoch = epoch

    def run(self, b: Batch) -> None:
        if not b.route:
            return
        self._check_epoch()
        if b.artifact_sha is None:  # an artifact without a known sha256 is never cached
            return
        trace = b.trace
        # the target sees the original text, the key the redacted one: rows with PII would
        # share keys with different answers, so they neither read nor fill the cache
        bypass = set() if self.model_sees_redacted else b.redacted
        by_tenant: dict[str, list[int]] = {}
        for j, i in enumerate(b.route):
            if i in bypass:
                b.cache_state[i] = "bypass"
            else:
                by_tenant.setdefault(b.tenants[i], []).append(j)
        hit_js: set[int] = set()
        for t, js in by_tenant.items():
            keys = [k for j in js for k in b.keys[b.route[j]]]
            found_in: list[str | None] | None = [None] * len(keys) if trace is not None else None
            values = self._lookup(keys, t, trace, found_in)
            pos = 0
            for j in js:
                i, size = b.route[j], b.sizes[j]
                got = values[pos:pos + size]
                if found_in is not None and i in trace.sampled:
                    tiers = [x for x in found_in[pos:pos + size] if x]
                    if tiers:
                        b.hit_tiers[i] = max(tiers)  # l1 < l2 < l3: the deepest it reached
                pos += size
                b.lookup_keys[i] = b.keys[i]
                if all(v is not None for v in got):
                    hit_js.add(j)
                    b.hits[i] = {name: concat([v[name] for v in got]) for name in self.output_names}
                    b.hit_sizes[i] = size
                    b.cache_state[i] = "hit"
                else:
                    b.cache_state[i] = "miss"
        if trace is not None:
            trace.mark("cache.lookup")
            for i in b.hits:
                trace.left(i, "cache.lookup")
        if hit_js:
            b.keep([j for j in range(len(b.route)) if j not in hit_js])

    def _lookup(self, keys: list[bytes], tenant: str, trace: Any = None,
                found_in: list[str | None] | None = None) -> list[Any]:
        cache = self.cache
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


class CacheFillStage(Stage):
    """Stores the primary's answers (a candidate's, a fallback's or a default never), and
    publishes the tiers' health (errors, backoff, quarantined files)."""

    name = "cache.fill"
    always = True

    def __init__(self, cache: Any, output_names: list[str], tiers: list[str], metrics: Any):
        self.cache, self.output_names, self.tiers, self.metrics = cache, output_names, tiers, metrics
        self._errors = {"l2": 0, "l3": 0}
        self._quarantined = 0

    def run(self, b: Batch) -> None:
        try:
            self._fill(b)
            if b.trace is not None:
                b.trace.mark("cache.fill")
            self._publish()
        except Exception:  # noqa: BLE001 - bookkeeping must never fail a served batch
            log.exception("cache fill failed")

    def _fill(self, b: Batch) -> None:
        routed = b.routed
        if routed is None or not b.lookup_keys:
            return
        good = [k for k in range(len(b.route)) if routed.errors[k] is None]
        starts = starts_of([b.sizes[k] for k in good])
        items = []
        for j, k in enumerate(good):
            i = b.route[k]
            keys = b.lookup_keys.get(i)
            if keys is None or routed.served_by[k] != b.primary_label:
                continue
            s0 = starts[j]
            for r, key in enumerate(keys):
                items.append((key, {n: routed.outputs[n][s0 + r:s0 + r + 1] for n in self.output_names}))
        if items:
            self.cache.put_many(items)

    def _publish(self) -> None:
        stats = self.cache.stats
        degraded = set(stats.get("degraded", ()))
        for tier in ("l2", "l3"):
            errs = stats.get(f"{tier}_errors", 0)
            if errs > self._errors[tier]:
                self.metrics.inc("cache_errors", errs - self._errors[tier], tier=tier)
                self._errors[tier] = errs
            if tier in self.tiers:
                self.metrics.set("cache_degraded", 1 if tier in degraded else 0, tier=tier)
        quarantined = stats.get("l2_quarantined", 0)
        if quarantined > self._quarantined:
            self.metrics.inc("cache_quarantined", quarantined - self._quarantined, tier="l2")
            self._quarantined = quarantined
