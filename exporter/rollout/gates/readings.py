"""What the gates read: every guard replica's /metrics (Prometheus text) summed into one
reading of a model's versions, and the window between two readings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tritonguard.core import catalogue
from tritonguard.triton import http as triton_http

log = logging.getLogger(__name__)

Series = dict[tuple[str, frozenset], float]
Buckets = dict[float, float]  # upper bound ("le") -> cumulative count

SERVED, ERRORS, BREAKER, TRIPS = catalogue.SERVED, catalogue.ERRORS, catalogue.BREAKER, catalogue.TRIPS
COMPARED, FUSED, LABELED = catalogue.COMPARED, catalogue.FUSED, catalogue.LABELED
LATENCY = catalogue.LATENCY + "_bucket"
COST, COMPUTE, CHARGED = catalogue.COST, catalogue.COMPUTE, catalogue.CHARGED


# -- Prometheus text exposition ---------------------------------------------------------
def parse(text: str) -> Series:
    """Prometheus text format -> ``{(name, frozenset(labels.items())): value}``.

    Samples only, parsed by ``prometheus_client``: comment lines are dropped before it sees the
    text, since on a ``# TYPE x counter`` it renames the samples of ``x`` to ``x_total`` (Triton's
    ``nv_*`` counters). A line it cannot parse is logged and skipped, not the whole scrape.
    """
    lines = [(n, ln) for n, raw in enumerate(text.splitlines(), 1)
             if (ln := raw.strip()) and not ln.startswith("#")]
    try:
        return _samples("\n".join(ln for _, ln in lines))
    except ValueError:  # a bad line stops the library's parser: take the lines one by one
        out: Series = {}
        for lineno, line in lines:
            try:
                out.update(_samples(line))
            except ValueError:
                log.warning("metrics line %d not understood, skipped: %.120s", lineno, line)
        return out


def _samples(text: str) -> Series:
    return {(s.name, frozenset(s.labels.items())): float(s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, timeout: float = 5.0) -> Series:
    """GET a Triton metrics endpoint (e.g. ``http://host:8002/metrics``) and :func:`parse` it."""
    return parse(triton_http.get_text(url, timeout=timeout))


# -- readings -----------------------------------------------------------------------------
@dataclass(kw_only=True)
class GuardReadings:
    """Cumulative counters of one guard model, summed over every replica scraped."""

    model: str
    primary: int
    candidate: int
    served: dict[int, float] = field(default_factory=dict)  # answered, by version
    errors: dict[int, float] = field(default_factory=dict)  # failed target calls, by version
    fused: dict[int, float] = field(default_factory=dict)  # requests of rescued fused failures
    labeled: dict[int, dict[str, float]] = field(default_factory=dict)  # version -> correct -> rows
    compared: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> verdict -> rows
    breaker_state: int | None = None  # candidate's, worst replica: 0 closed, 1 half-open, 2 open
    trips: float = 0.0  # candidate's breaker trips
    latency: dict[int, Buckets] = field(default_factory=dict)  # version -> cumulative buckets
    cost: dict[int, dict[str, float]] = field(default_factory=dict)  # version -> part -> priced compute
    compute: dict[int, dict[str, float]] = field(default_factory=dict)  # version -> part -> seconds
    charged: dict[int, float] = field(default_factory=dict)  # requests the cost meter charged, by version
    replicas: int = 0
    problems: list[str] = field(default_factory=list)  # data present but not attributable
    taken_at: float = 0.0  # wall-clock time of the scrape (latency samples are windowed by it)
    # where the counters come from: "" the replicas' metrics pages (counts since each replica
    # started); "prometheus:<url>@<anchor>" increase() since an anchor. Two readings of different
    # sources are never subtracted (the window starts again)
    source: str = ""

    @classmethod
    def from_scrapes(cls, scrapes: Iterable[Mapping[tuple[str, frozenset], float]], model: str,
                     primary: int, candidate: int, *, target: str | None = None) -> GuardReadings:
        """Sum the series labelled ``model=<guard>`` over ``scrapes`` (one per Triton server).

        ``served_by`` is ``"<target>:<version>"``; without ``target`` any target matches."""
        r = cls(model=model, primary=primary, candidate=candidate)
        versions = {primary, candidate}
        unlabelled_errors = unlabelled_latency = False
        for series in scrapes:
            seen = False
            for (name, labelset), value in series.items():
                labels = dict(labelset)
                if labels.get("model") != model or not name.startswith("tritonguard_"):
                    continue
                seen = True
                tv = _int(labels.get("target_version"))
                if name == SERVED:
                    tgt, _, v = labels.get("served_by", "").rpartition(":")
                    v = _int(v)
                    if v in versions and (target is None or tgt == target):
                        r.served[v] = r.served.get(v, 0.0) + value
                elif name == ERRORS:
                    if "target_version" not in labels:
                        unlabelled_errors = unlabelled_errors or value > 0
                    elif tv in versions:
                        r.errors[tv] = r.errors.get(tv, 0.0) + value
                elif name == FUSED and tv in versions:
                    r.fused[tv] = r.fused.get(tv, 0.0) + value
                elif name == LABELED and tv in versions:
                    right = r.labeled.setdefault(tv, {})
                    key = labels.get("correct", "?")
                    right[key] = right.get(key, 0.0) + value
                elif name == COMPARED and tv == candidate:
                    kind = r.compared.setdefault(labels.get("kind", "?"), {})
                    verdict = labels.get("verdict", "?")
                    kind[verdict] = kind.get(verdict, 0.0) + value
                elif name == BREAKER and tv == candidate:
                    r.breaker_state = max(int(value), r.breaker_state or 0)
                elif name == TRIPS and tv == candidate:
                    r.trips += value
                elif name in (COST, COMPUTE) and tv in versions:
                    parts = (r.cost if name == COST else r.compute).setdefault(tv, {})
                    part = labels.get("part", "?")
                    parts[part] = parts.get(part, 0.0) + value
                elif name == CHARGED and tv in versions:
                    r.charged[tv] = r.charged.get(tv, 0.0) + value
                elif name == LATENCY:
                    if "target_version" not in labels:
                        unlabelled_latency = True
                    elif tv in versions and "le" in labels:
                        b = r.latency.setdefault(tv, {})
                        le = float(labels["le"])
                        b[le] = b.get(le, 0.0) + value
            r.replicas += seen
        if unlabelled_errors:
            r.problems.append(f"{ERRORS} has series without a target_version label: "
                              "errors cannot be attributed to a version")
        if unlabelled_latency and not r.latency:
            r.problems.append(f"{LATENCY} has no target_version label: no per-version latency")
        if not r.replicas:
            r.problems.append(f"no tritonguard metrics for model '{model}' in any scrape")
        return r

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency"] = {str(v): {le_label(k): c for k, c in b.items()} for v, b in self.latency.items()}
        d["served"] = {str(k): v for k, v in self.served.items()}
        d["errors"] = {str(k): v for k, v in self.errors.items()}
        d["fused"] = {str(k): v for k, v in self.fused.items()}
        d["labeled"] = {str(k): dict(v) for k, v in self.labeled.items()}
        d["charged"] = {str(k): v for k, v in self.charged.items()}
        for key in ("cost", "compute"):
            d[key] = {str(k): dict(v) for k, v in getattr(self, key).items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardReadings:
        d = dict(d)
        d["served"] = {int(k): float(v) for k, v in d.get("served", {}).items()}
        d["errors"] = {int(k): float(v) for k, v in d.get("errors", {}).items()}
        d["fused"] = {int(k): float(v) for k, v in d.get("fused", {}).items()}
        d["labeled"] = {int(k): {c: float(x) for c, x in v.items()} for k, v in d.get("labeled", {}).items()}
        # absent from readings stored before the cost gate
        d["charged"] = {int(k): float(v) for k, v in d.get("charged", {}).items()}
        for key in ("cost", "compute"):
            d[key] = {int(k): {p: float(x) for p, x in v.items()} for k, v in d.get(key, {}).items()}
        d["latency"] = {int(v): {float(k): float(c) for k, c in b.items()}
                        for v, b in d.get("latency", {}).items()}
        return cls(**d)


def _int(s: str | None) -> int | None:
    try:
        return int(s) if s is not None else None
    except ValueError:
        return None


def le_label(x: float) -> str:
    return "+Inf" if math.isinf(x) else repr(x)


def window(before: GuardReadings | None, after: GuardReadings) -> GuardReadings:
    """``after - before`` series by series (``before`` None: ``after`` itself)."""
    if before is None:
        return after

    def sub(a: Mapping, b: Mapping) -> dict:
        return {k: v - b.get(k, 0.0) for k, v in a.items()}

    return replace(after, served=sub(after.served, before.served), errors=sub(after.errors, before.errors),
                   fused=sub(after.fused, before.fused),
                   labeled={v: sub(d, before.labeled.get(v, {})) for v, d in after.labeled.items()},
                   compared={k: sub(v, before.compared.get(k, {})) for k, v in after.compared.items()},
                   trips=after.trips - before.trips,
                   cost={v: sub(d, before.cost.get(v, {})) for v, d in after.cost.items()},
                   compute={v: sub(d, before.compute.get(v, {})) for v, d in after.compute.items()},
                   charged=sub(after.charged, before.charged),
                   latency={v: sub(b, before.latency.get(v, {})) for v, b in after.latency.items()})
