"""The response cache (``cache.*``): lookups before routing (a request is a hit only when all of
its rows hit), fills after it with the primary's answers only. For a decoupled guard: the exact
cache of deterministic generations and the opt-in semantic cache, both per tenant."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.tensors import concat
from tritonguard.generation.contract import OUTPUT
from tritonguard.guard.pipeline import Batch, Generation, Stage, starts_of
from tritonguard.guard.routing.sticky import apply_keys
from tritonguard.guard.stages.validate import target_sampling

log = logging.getLogger(__name__)


class CacheLookupStage(Stage):
    name = "cache.lookup"

    def __init__(self, cache: Any, guard: str, output_names: list[str], model_sees_redacted: bool, *,
                 metrics: Any, label: Callable[[str], str], audit: Any, state: Callable[[], Any]):
        self.cache, self.guard, self.output_names = cache, guard, output_names
        self.model_sees_redacted = model_sees_redacted
        self.metrics, self.label, self.audit, self.state = metrics, label, audit, state
        self._epoch: int | None = None
        self._rng = np.random.default_rng()

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
        bypass = set() if self.model_sees_redacted else set(b.redacted)
        bypass |= self._rollout_band(b)
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

    def _rollout_band(self, b: Batch) -> set[int]:
        """Requests that a rollout routes to a version under test (the candidate's share, the
        A/B/n arms): they skip the cache, whose answers are the primary's, so a candidate gets
        its share of repeated inputs too. The draws go on to the router, which routes by them."""
        state = self.state()
        if state is None or (state.candidate is None and not getattr(state, "arms", ())):
            return set()
        if b.draws is None:
            b.draws = apply_keys(b.params, self._rng.random(len(b.responses)))  # routing_key: sticky
        u = b.draws[b.route]
        tested = state.candidate_mask(u) | (state.arm_choice(u) != 0)
        return {b.route[j] for j in np.flatnonzero(tested)}

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


# -- a decoupled guard's generations ------------------------------------------------------------
def target_fingerprint(version_dir: Path) -> str | None:
    """SHA-256 over the files of the target's version folder (names and contents): answers are
    cached per exact artifact, so a new checkpoint never answers from an older one's entries."""
    if not version_dir.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(x for x in version_dir.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(version_dir)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def generation_key(guard: str, fingerprint: str, gen: Generation) -> bytes | None:
    """The key of a deterministic generation (greedy, or seeded), None for any other: tenant,
    guard, the target's artifact, the prompt as the target sees it, every sampling parameter and
    the output shape (stream, prompt included or not)."""
    p = gen.params
    if not gen.deterministic:
        return None
    fields = [gen.tenant, guard, fingerprint, gen.prompt, p.max_tokens, p.temperature, p.top_p, p.seed,
              gen.stream, gen.exclude]
    if p.stop:  # only when given: the keys of answers without stop sequences stay what they were
        fields.append(list(p.stop))
    material = json.dumps(fields, separators=(",", ":"))
    return hashlib.sha256(b"tritonguard-stream\0" + material.encode()).digest()


class Fingerprints:
    """The artifact fingerprint each target version's answers are cached under, computed once
    per version (None: not cached, e.g. a target outside this repository)."""

    def __init__(self, repo: Path, target: str, guard: str):
        self.repo, self.target, self.guard = repo, target, guard
        self._known: dict[int, str | None] = {}

    def __call__(self, version: int) -> str | None:
        if version not in self._known:
            fp = target_fingerprint(self.repo / self.target / str(version)) if version > 0 else None
            if fp is None:
                log.warning("stream guard %s: %s v%d is not in %s: its answers are not cached (the cache keys "
                            "on the target's artifact)", self.guard, self.target, version, self.repo)
            self._known[version] = fp
        return self._known[version]


class StreamCacheStage(Stage):
    """The response cache for deterministic generations (``cache.*``): a hit answers (replayed
    as a stream when one was asked for); a miss keeps the answer the client gets, redacted, and
    stores it at the end. Only the primary's answers are looked up and stored: a canary's, a
    fallback's or a failed one never."""

    name = "cache"

    def __init__(self, cache: Any, guard: str, fingerprints: Fingerprints, metrics: Any,
                 label: Callable[[str], str]):
        self.cache, self.guard, self.fingerprints = cache, guard, fingerprints
        self.metrics, self.label = metrics, label

    def admit(self, gen: Any) -> None:
        if gen.role != "primary":
            return
        fp = self.fingerprints(gen.version)
        key = generation_key(self.guard, fp, gen) if fp else None
        if key is None:
            return
        try:
            hit = self.cache.get_many([key])[0]
        except Exception:  # noqa: BLE001 - a cache failure costs a miss, never the request
            log.exception("stream guard %s: cache lookup failed", self.guard)
            hit = None
        self.metrics.inc("stream_cache", 1, result="hit" if hit is not None else "miss", tenant=self.label(gen.tenant))
        if hit is not None:
            gen.answer = bytes(hit[OUTPUT].reshape(-1)[0]).decode("utf-8")
            gen.served_by = "cache"
            return
        gen.cache_key, gen.keep_text = key, True

    def end(self, gen: Any) -> None:
        if gen.outcome != "ok" or gen.cache_key is None or gen.fallback or gen.text is None:
            return
        try:  # what this client got, redacted: the next identical request gets the same
            self.cache.put_many([(gen.cache_key, {OUTPUT: np.array([gen.text.encode("utf-8")], dtype=np.object_)})])
        except Exception:  # noqa: BLE001 - never fails the request it comes after
            log.exception("stream guard %s: cache fill failed", self.guard)


class StreamSemanticStage(Stage):
    """The opt-in semantic cache (``semantic_cache.*``): a prompt of the same tenant close enough
    (embedding cosine) to one answered under the same artifact and parameters is answered with
    that answer; a miss stores this one's at the end (the primary's, as for the exact cache)."""

    name = "semantic_cache"

    def __init__(self, semantic: Any, guard: str, fingerprints: Fingerprints, metrics: Any,
                 label: Callable[[str], str]):
        self.semantic, self.guard, self.fingerprints = semantic, guard, fingerprints
        self.metrics, self.label = metrics, label

    def key(self, gen: Any) -> str:
        """What a semantic hit must share with the request: the artifact answering, the shape of
        the answer and the sampling parameters the target gets."""
        return json.dumps([self.fingerprints(gen.version), gen.stream, bool(gen.exclude), target_sampling(gen)])

    def admit(self, gen: Any) -> None:
        if gen.role != "primary":
            return
        sem = self.semantic
        deterministic = gen.deterministic
        eligible = len(gen.prompt) <= sem.config.max_prompt_chars and (
            deterministic or not sem.config.deterministic_only)
        hit, vec, result, pkey = None, None, "skipped", ""
        if eligible:
            pkey = self.key(gen)
            vec = sem.embed(gen.prompt)
            if vec is None:
                result = "error"
            else:
                hit = sem.lookup(gen.tenant, gen.prompt, pkey, embedding=vec, deterministic=deterministic)
                result = "miss" if hit is None else "hit"
        self.metrics.inc("stream_semantic", 1, result=result, tenant=self.label(gen.tenant))
        if hit is None:
            if result == "miss":
                gen.semantic, gen.keep_text = (pkey, vec), True
            return
        log.debug("stream guard %s: semantic hit (cosine %.3f) for tenant %s", self.guard, hit.cosine, gen.tenant)
        prompt_first = not gen.stream and not gen.exclude  # stored without a prompt: this one's goes first
        gen.answer = gen.prompt + hit.text if prompt_first else hit.text
        gen.served_by = "semantic_cache"

    def end(self, gen: Any) -> None:
        if gen.outcome != "ok" or gen.semantic is None or gen.fallback or gen.text is None:
            return
        text = gen.text
        if not gen.stream and not gen.exclude:  # stored without this prompt: a hit puts its own first
            text = text[len(gen.prompt):] if text.startswith(gen.prompt) else text
        pkey, vec = gen.semantic
        try:
            self.semantic.store(gen.tenant, gen.prompt, pkey, text, embedding=vec, deterministic=gen.deterministic)
        except Exception:  # noqa: BLE001 - never fails the request it comes after
            log.exception("stream guard %s: semantic cache store failed", self.guard)
