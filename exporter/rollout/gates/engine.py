"""Statistical gates between rollout steps, judged on the guards' Prometheus metrics.

Inputs are two readings of every guard replica's ``/metrics`` (:func:`scrape`, summed by
:meth:`GuardReadings.from_scrapes`); the gates look at what happened *between* them. Each gate
says PASS, FAIL or INCONCLUSIVE, and missing data or too small a sample is INCONCLUSIVE (the
controller holds), never PASS: a canary judged on no traffic must not go through.

The gates are looked at again and again while a step dwells, so each one stays valid under
repeated looks:

- **error rate**: requests that failed, plus requests of fused calls that failed and were
  rescued one by one (``tritonguard_fused_failures_total``): Wald's sequential probability ratio test on the candidate's failed requests,
  H0: p <= p0 (``ok_error_rate``) against H1: p >= p1 (``max_error_rate``). The boundaries are
  FAIL at LLR >= ln(1/alpha) and PASS at LLR <= ln(beta). By Ville's inequality the likelihood
  ratio is a supermartingale under H0 (and its inverse under H1), so these error bounds hold for
  any number and schedule of looks, not only for a look after every request.
- **validator agreement** (``judge="equivalence"``: a re-export or compiled variant of the same
  weights): the same SPRT on the share of compared rows the validator failed (H1: disagreement
  >= 1 - ``min_agreement``, H0: half of that). No FAIL before ``min_compared`` rows.
- **disagreement** (``judge="task"``: a new model, e.g. a retrain): the share of compared rows
  whose answer differs from the primary's (top-1 for a classifier, a cosine under the operator's
  floor for embeddings) against a limit the candidate did not set: ``max_disagreement`` (the
  operator's, :mod:`tritonguard.rollout.judging`), widened only when labelled offline evidence showed
  the candidate no worse (then its offline disagreement's upper bound plus ``max_regression``;
  ``disagreement_limit``, set by ``promote``). FAIL when the Wilson lower bound is above the
  limit at the look's spent alpha (looks counted by doublings of the sample,
  :func:`information_look`), PASS when the upper bound at ``beta`` is below it, otherwise
  INCONCLUSIVE (the controller holds; an undecided last step never promotes). With
  ``min_labels`` the labels decide instead, and this gate only reports (SKIPPED).
- **labels** (task judge): labelled rows of each version since the rollout began, sent with the
  request (parameter ``label``) or joined later (``exporter feedback``, :mod:`tritonguard.rollout.feedback`);
  a non-inferiority test of the candidate's accuracy against the primary's with the margin
  ``max_regression``: FAIL when the upper confidence bound of the difference is below
  ``-max_regression``, and FAIL when one true class or named slice lost more than
  ``max_slice_regression`` of its recall (Bonferroni over the slices judged, each with at least
  ``min_slice_labels`` rows a side). Without ``min_labels`` this gate can stop a candidate but
  never holds one (SKIPPED when it cannot decide); with ``min_labels`` N it holds each step until
  both versions have N labelled rows, then PASSes only when the lower bound shows the candidate
  within the margin (non-inferiority shown), and holds while it cannot tell.
- **breaker**: the candidate's breaker must be closed and must not have tripped in the window.
- **cost** (only with ``max_cost_increase``): the candidate's cost per answered request over the
  primary's, from the guards' cost meter (``tritonguard_cost_total`` by part over
  ``tritonguard_cost_requests_total``; compute seconds where no prices are set), FAIL when the
  ratio exceeds 1 + ``max_cost_increase``. Each version's own part is its target calls; the guard's
  part is the same code whichever version answers, so both sides get the window's pooled guard
  cost per request (charged per batch, it follows the batch's mix: canary copies of candidate
  requests made an identical candidate's guard part read 5-10 % higher). A point estimate on at
  least ``min_requests`` requests a side, no confidence bound: the counters hold sums, not the
  spread of per-request costs.
  Judged only at steps giving the candidate at least ``cost_min_share`` (50 %) and below 100 %:
  a version with a smaller share gets smaller sub-batches, whose fixed per-call cost weighs more
  per request, and at 100 % the primary serves nothing to compare with.
- **latency**: Mann-Whitney U (rank test; latency is heavy-tailed) of the candidate against the
  primary, on samples rebuilt from histogram bucket deltas (bucket midpoints; the open last
  bucket counts as twice its lower edge), computed on the bucket counts directly
  (:func:`mann_whitney`, equal to ``scipy.stats.mannwhitneyu`` on the rebuilt samples). Kayenta-like, it fails only when the Hodges-Lehmann
  shift exceeds ``latency_tolerance * |primary median|`` AND p < alpha_k. alpha_k is spent with
  a convergent Bonferroni series, alpha_k = alpha * 6 / (pi^2 k^2) at look k: the sum over all
  looks is alpha, so there is no planned number of looks to exceed. PASS when the same test
  shows the candidate's latencies less the allowed shift faster than the primary's at ``beta``
  (the upper bound of the shift is within the allowance; counts spread evenly within their
  buckets, :func:`bucket_samples`); in between it is INCONCLUSIVE. (Exact
  per-call samples, where the guards keep them: :mod:`exporter.rollout.gates.latency`, the same rules on
  ratios.) A Welch t-test and both p99s are reported, never judged on.

Samples restart at each step (the controller re-baselines), so over a rollout of S steps the
family-wise error is at most S times each gate's alpha.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tritonguard.core import catalogue
from tritonguard.rollout.feedback import Tally
from tritonguard.rollout.judging import (
    DEFAULT_MAX_DISAGREEMENT,
    DEFAULT_MAX_SLICE_REGRESSION,
    SOURCES,
)
from tritonguard.rollout.state import JUDGES
from tritonguard.triton import http as triton_http

log = logging.getLogger(__name__)

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
Series = dict[tuple[str, frozenset], float]
Buckets = dict[float, float]  # upper bound ("le") -> cumulative count

SERVED, ERRORS, BREAKER, TRIPS = catalogue.SERVED, catalogue.ERRORS, catalogue.BREAKER, catalogue.TRIPS
COMPARED, FUSED, LABELED = catalogue.COMPARED, catalogue.FUSED, catalogue.LABELED
SKIPPED = "SKIPPED"  # a gate that cannot decide and does not hold the rollout (live labels)
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
        d["latency"] = {str(v): {_le(k): c for k, c in b.items()} for v, b in self.latency.items()}
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


def _le(x: float) -> str:
    return "+Inf" if math.isinf(x) else repr(x)


# -- configuration and results ---------------------------------------------------------------
@dataclass(kw_only=True)
class GateConfig:
    min_requests: int = 200  # candidate requests in the window before anything may PASS
    max_error_rate: float = 0.01  # p1: a candidate this bad must FAIL
    ok_error_rate: float | None = None  # p0: a candidate this good should PASS (default p1 / 2)
    alpha: float = 0.05  # false FAIL rate of each sequential test
    beta: float = 0.10  # false PASS rate of each sequential test
    min_agreement: float | None = 0.98  # validator agreement on compared rows; None: no gate
    min_compared: int = 100
    agree_verdicts: tuple[str, ...] = ("PASS", "MARGINAL")
    latency: bool = True
    min_latency_samples: int = 100  # observations are fused target calls, not requests
    latency_tolerance: float = 0.15  # allowed slowdown: per-call ratio at equal batch size - 1 (samples), or HL shift over |primary median| (buckets)
    latency_direction: str = "increase"  # "increase": only slower fails; "both": also faster
    # how the candidate is compared with the primary: "equivalence" (same weights: validator
    # tolerances, the agreement gate) or "task" (a new model: disagreement and labels)
    judge: str = "equivalence"
    max_regression: float = 0.005  # task: accuracy the candidate may lose (0.005 = 0.5 pp)
    expected_disagreement: float | None = None  # task: offline disagreement (upper bound), for the record
    # task: the disagreement a candidate may show without labels (the operator's, never the
    # candidate's own), and the limit in force (None: max_disagreement; promote widens it only on
    # labelled offline evidence), with where it came from for the verdict's reason
    max_disagreement: float = DEFAULT_MAX_DISAGREEMENT
    disagreement_limit: float | None = None
    limit_source: str = SOURCES["max_disagreement"]
    min_labeled: int = 200  # task: labelled requests per version before the labels gate decides
    min_labels: int = 0  # task: > 0: labels decide; each step waits for this many per version
    # task: whether live disagreement is judged at all. A generator judged on bits per char
    # offline is not: two training runs' greedy texts differ by nature (a genuine tinylm retrain:
    # 80 % of offline prompts, 80-90 % live, moving with the prompt mix), so exact-text
    # disagreement says nothing about quality there; it is reported
    judge_disagreement: bool = True
    max_slice_regression: float = DEFAULT_MAX_SLICE_REGRESSION  # per class / slice, with labels
    min_slice_labels: int = 30  # labelled rows a side before a class or slice is judged
    # task, embeddings: the guards count a compared row as agreeing when its cosine to the
    # primary's is at least this (promote sets it from the offline cosines); None: validator's
    cosine_floor: float | None = None
    # latency is judged only at steps giving the candidate at least this share of traffic: a
    # version called rarely runs cache-cold (an identical architecture measured 1.15x slower at
    # 5 % on 2 cores), which would blame the version for its share; below, the gate is SKIPPED
    latency_min_share: float = 0.25
    # cost: the candidate may cost this fraction more per request than the primary (0.1 = 10 %);
    # None: no cost gate. Judged at steps giving the candidate at least cost_min_share
    max_cost_increase: float | None = None
    cost_min_share: float = 0.5

    def __post_init__(self) -> None:
        if self.ok_error_rate is None:
            self.ok_error_rate = self.max_error_rate / 2
        if self.min_requests < 1:
            raise ValueError(f"gates.min_requests must be >= 1, got {self.min_requests}")
        if not 0 < self.ok_error_rate < self.max_error_rate < 1:
            raise ValueError("gates: need 0 < ok_error_rate < max_error_rate < 1, got "
                             f"{self.ok_error_rate} and {self.max_error_rate}")
        for name in ("alpha", "beta"):
            if not 0 < getattr(self, name) < 0.5:
                raise ValueError(f"gates.{name} must be in (0, 0.5), got {getattr(self, name)}")
        if self.min_agreement is not None and not 0 < self.min_agreement < 1:
            raise ValueError(f"gates.min_agreement must be in (0, 1) or None, got {self.min_agreement}")
        if self.min_compared < 1 or self.min_latency_samples < 2:
            raise ValueError("gates.min_compared must be >= 1 and gates.min_latency_samples >= 2")
        if self.latency_tolerance < 0:
            raise ValueError(f"gates.latency_tolerance must be >= 0, got {self.latency_tolerance}")
        if self.judge not in JUDGES:
            raise ValueError(f"gates.judge must be one of {', '.join(JUDGES)}, got {self.judge!r}")
        if not 0 <= self.latency_min_share <= 1:
            raise ValueError(f"gates.latency_min_share must be in [0, 1], got {self.latency_min_share}")
        if not 0 <= self.max_regression < 1:
            raise ValueError(f"gates.max_regression must be in [0, 1), got {self.max_regression}")
        if self.expected_disagreement is not None and not 0 <= self.expected_disagreement <= 1:
            raise ValueError(f"gates.expected_disagreement must be in [0, 1], got {self.expected_disagreement}")
        if not 0 < self.max_disagreement < 1:
            raise ValueError(f"gates.max_disagreement must be in (0, 1), got {self.max_disagreement}")
        if self.disagreement_limit is not None and not 0 < self.disagreement_limit <= 1:
            raise ValueError(f"gates.disagreement_limit must be in (0, 1], got {self.disagreement_limit}")
        if self.min_labels < 0 or self.min_slice_labels < 1:
            raise ValueError("gates.min_labels must be >= 0 and gates.min_slice_labels >= 1")
        if not 0 < self.max_slice_regression < 1:
            raise ValueError(f"gates.max_slice_regression must be in (0, 1), got {self.max_slice_regression}")
        if self.max_cost_increase is not None and not (math.isfinite(self.max_cost_increase)
                                                       and self.max_cost_increase >= 0):
            raise ValueError(f"gates.max_cost_increase must be a number >= 0 (0.1 = 10 %) or None, "
                             f"got {self.max_cost_increase}")
        if not 0 <= self.cost_min_share <= 1:
            raise ValueError(f"gates.cost_min_share must be in [0, 1], got {self.cost_min_share}")
        if self.latency_direction not in ("increase", "both"):
            raise ValueError(f"gates.latency_direction must be 'increase' or 'both', "
                             f"got {self.latency_direction!r}")


@dataclass(kw_only=True)
class GateResult:
    name: str
    verdict: str
    figures: dict[str, Any] = field(default_factory=dict)
    samples: int = 0
    reason: str = ""


@dataclass(kw_only=True)
class GateReport:
    verdict: str
    gates: list[GateResult]
    look: int = 1
    reset: bool = False  # a counter went backwards (guard restart): re-baseline and look again
    primary_latency: dict[str, float] | None = None  # the primary's bucket deltas, if judged

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return "; ".join(f"{g.name} {g.verdict}" + (f" ({g.reason})" if g.reason else "")
                         for g in self.gates)


# -- the tests ------------------------------------------------------------------------------
def sprt(failures: float, n: float, p0: float, p1: float, alpha: float, beta: float) -> tuple[str, float]:
    """(verdict, log-likelihood ratio of H1 over H0); INCONCLUSIVE between the boundaries."""
    llr = failures * math.log(p1 / p0) + (n - failures) * math.log((1 - p1) / (1 - p0))
    if llr >= math.log(1 / alpha):
        return FAIL, llr
    if llr <= math.log(beta):
        return PASS, llr
    return INCONCLUSIVE, llr


def spent_alpha(alpha: float, look: int) -> float:
    """alpha_k of the convergent Bonferroni series (sums to ``alpha`` over all looks)."""
    return alpha * 6 / (math.pi ** 2 * max(1, look) ** 2)


def information_look(n: float, minimum: float) -> int:
    """The look index of a proportion test by information, not by clock: 1 up to ``2 * minimum``
    rows, then one more each time the sample doubles. A controller looking every second would
    otherwise spend its alpha on looks that added a handful of rows (after 90 looks the bound on
    443 rows with 2 disagreeing was 4.9 %, and an honest retrain could not pass); looks between
    two doublings share one alpha_k, and their statistics are nearly the same."""
    if n <= 2 * minimum or minimum <= 0:
        return 1
    return 1 + math.ceil(math.log2(n / (2 * minimum)))


def _error_gate(n: float, errors: float, primary: dict, cfg: GateConfig) -> GateResult:
    figures = {"requests": n, "errors": errors, "rate": errors / n if n else None,
               "p0": cfg.ok_error_rate, "p1": cfg.max_error_rate, **primary}
    verdict, llr = sprt(errors, n, cfg.ok_error_rate, cfg.max_error_rate, cfg.alpha, cfg.beta)
    figures.update(llr=llr, fail_at=math.log(1 / cfg.alpha), pass_at=math.log(cfg.beta))
    if verdict == PASS and n < cfg.min_requests:
        verdict = INCONCLUSIVE
    rate = f"{errors / n:.2%} ({errors:.0f}/{n:.0f})" if n else "n/a (0 requests)"
    reason = {FAIL: f"error rate {rate} > limit {cfg.max_error_rate:.2%} (SPRT: log LR {llr:.2f} >= "
                    f"{math.log(1 / cfg.alpha):.2f})",
              INCONCLUSIVE: f"error rate {rate}, limit {cfg.max_error_rate:.2%}: {n:.0f} requests, need >= "
                            f"{cfg.min_requests} and a decisive SPRT",
              PASS: ""}[verdict]
    return GateResult(name="error_rate", verdict=verdict, figures=figures, samples=int(n), reason=reason)


def _agreement_gate(compared: dict[str, float], cfg: GateConfig) -> GateResult:
    total = sum(compared.values())
    agree = sum(v for k, v in compared.items() if k in cfg.agree_verdicts)
    p1 = 1 - cfg.min_agreement
    verdict, llr = sprt(total - agree, total, p1 / 2, p1, cfg.alpha, cfg.beta)
    if verdict != INCONCLUSIVE and total < cfg.min_compared:  # early decisions need their sample
        verdict = INCONCLUSIVE
    figures = {"compared": total, "agree": agree, "agreement": agree / total if total else None,
               "min_agreement": cfg.min_agreement, "llr": llr, "by_verdict": compared}
    share = f"{agree / total:.2%} ({agree:.0f}/{total:.0f})" if total else "n/a (0 compared rows)"
    reason = {FAIL: f"agreement {share} < limit {cfg.min_agreement:.2%} (SPRT: log LR {llr:.2f} >= "
                    f"{math.log(1 / cfg.alpha):.2f})",
              INCONCLUSIVE: f"agreement {share}, limit {cfg.min_agreement:.2%}: {total:.0f} compared rows, "
                            f"need >= {cfg.min_compared} and a decisive SPRT",
              PASS: ""}[verdict]
    return GateResult(name="agreement", verdict=verdict, figures=figures, samples=int(total), reason=reason)


def wilson(k: float, n: float, z: float) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` at normal quantile ``z``."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _z(alpha: float) -> float:
    from scipy import stats  # noqa: PLC0415

    return float(stats.norm.isf(alpha))


def _disagreement_gate(compared: dict[str, float], look: int, cfg: GateConfig) -> GateResult:
    agree, dis = compared.get("AGREE", 0.0), compared.get("DISAGREE", 0.0)
    total = agree + dis
    limit = cfg.disagreement_limit if cfg.disagreement_limit is not None else cfg.max_disagreement
    # FAIL (a rollback) spends alpha over looks counted by information; PASS takes beta as it is:
    # a wrong PASS only moves the candidate to the next step, where a new window judges it on
    # more traffic, while a wrong FAIL rolls back a good model
    look = information_look(total, cfg.min_compared)
    alpha_k = spent_alpha(cfg.alpha, look)
    lo, _ = wilson(dis, total, _z(alpha_k))
    _, hi = wilson(dis, total, _z(cfg.beta))
    figures = {"compared": total, "disagree": dis, "disagreement": dis / total if total else None,
               "expected": cfg.expected_disagreement, "limit": limit, "limit_source": cfg.limit_source,
               "lower": lo, "upper": hi, "look": look, "alpha_k": alpha_k, "beta": cfg.beta}
    share = f"{dis:.0f}/{total:.0f}"
    if cfg.min_labels > 0 or not cfg.judge_disagreement:
        why = f"labels decide (min_labels {cfg.min_labels})" if cfg.min_labels > 0 else "the task metric decided offline"
        return GateResult(name="disagreement", verdict=SKIPPED, figures=figures, samples=int(total),
                          reason=f"reported, not judged: {why}; disagreement {share}")
    if total < cfg.min_compared:
        return GateResult(name="disagreement", verdict=INCONCLUSIVE, figures=figures, samples=int(total),
                          reason=f"{total:.0f} compared rows, need >= {cfg.min_compared}")
    if lo > limit:
        return GateResult(name="disagreement", verdict=FAIL, figures=figures, samples=int(total),
                          reason=f"disagrees with the primary on {share} rows (>= {lo:.2%} at alpha "
                                 f"{alpha_k:.2g}), limit {limit:.2%} ({cfg.limit_source})")
    if hi <= limit:
        return GateResult(name="disagreement", verdict=PASS, figures=figures, samples=int(total))
    return GateResult(name="disagreement", verdict=INCONCLUSIVE, figures=figures, samples=int(total),
                      reason=f"disagreement {share}, upper bound {hi:.2%} not yet below the limit {limit:.2%}")


def _label_counts(w: GuardReadings, labels: Tally | None) -> dict[int, tuple[float, float]]:
    """version -> (right, labelled): the store's tally of the rollout when given (request labels
    and joined feedback), else the window's ``tritonguard_labeled_total`` (request labels only)."""
    if labels is not None:
        return {v: (float(labels.right.get(v, 0)), float(n)) for v, n in labels.total.items()}
    out = {}
    for v, d in w.labeled.items():
        out[v] = (d.get("true", 0.0), d.get("true", 0.0) + d.get("false", 0.0))
    return out


def _diff_bounds(rc: float, nc: float, rp: float, np_: float, z: float) -> tuple[float, float, float]:
    """(difference, lower, upper) of accuracy candidate - primary, two independent samples; a
    half success and failure added to each side keeps the variance away from 0 at 100 %."""
    pc, pp = (rc + 0.5) / (nc + 1), (rp + 0.5) / (np_ + 1)
    diff = rc / nc - rp / np_
    se = math.sqrt(pc * (1 - pc) / (nc + 1) + pp * (1 - pp) / (np_ + 1))
    return diff, diff - z * se, diff + z * se


def _slice_failures(labels: Tally | None, cand: int, prim: int, alpha: float, cfg: GateConfig) -> list[str]:
    """Classes (by their true label) and named slices where the candidate lost more than
    ``max_slice_regression`` of the primary's recall, Bonferroni over the slices judged."""
    if labels is None:
        return []
    cells = []
    for kind, table in (("class", labels.by_class), ("slice", labels.by_slice)):
        c, p = table.get(cand, {}), table.get(prim, {})
        for name in sorted(set(c) & set(p)):
            (rc, nc), (rp, np_) = c[name], p[name]
            if nc >= cfg.min_slice_labels and np_ >= cfg.min_slice_labels:
                cells.append((kind, name, rc, nc, rp, np_))
    if not cells:
        return []
    z = _z(alpha / len(cells))
    out = []
    for kind, name, rc, nc, rp, np_ in cells:
        diff, _, upper = _diff_bounds(rc, nc, rp, np_, z)
        if upper < -cfg.max_slice_regression:
            out.append(f"{kind} {name}: recall {rc / nc:.1%} ({rc}/{nc}) vs primary {rp / np_:.1%} "
                       f"(upper bound {upper:+.1%}, limit -{cfg.max_slice_regression:.0%})")
    return out


def _labels_gate(w: GuardReadings, look: int, cfg: GateConfig, labels: Tally | None = None) -> GateResult:
    counts = _label_counts(w, labels)
    rc, nc = counts.get(w.candidate, (0.0, 0.0))
    rp, np_ = counts.get(w.primary, (0.0, 0.0))
    required = cfg.min_labels > 0
    need = cfg.min_labels if required else cfg.min_labeled
    figures: dict[str, Any] = {"candidate_labeled": nc, "primary_labeled": np_,
                               "candidate_accuracy": rc / nc if nc else None,
                               "primary_accuracy": rp / np_ if np_ else None, "max_regression": cfg.max_regression,
                               "required": required, "min_labels": need,
                               "origins": dict(labels.origins) if labels is not None else {"request": nc + np_}}
    waiting = GateResult(name="labels", verdict=INCONCLUSIVE if required else SKIPPED, figures=figures,
                         samples=int(nc), reason=f"waiting for labels: {nc:.0f} / {np_:.0f} labelled rows "
                                                 f"(candidate / primary), need >= {need} each")
    if nc < need or np_ < need:
        return waiting
    alpha_k = spent_alpha(cfg.alpha, information_look(min(nc, np_), need))
    diff, _, upper = _diff_bounds(rc, nc, rp, np_, _z(alpha_k))
    _, lower, _ = _diff_bounds(rc, nc, rp, np_, _z(cfg.beta))
    figures.update(difference=diff, upper=upper, lower=lower, alpha_k=alpha_k)
    if upper < -cfg.max_regression:
        return GateResult(name="labels", verdict=FAIL, figures=figures, samples=int(nc),
                          reason=f"accuracy on labels {rc / nc:.2%} vs primary {rp / np_:.2%}: worse by more "
                                 f"than {cfg.max_regression:.2%} (upper bound {upper:+.2%})")
    slices = _slice_failures(labels, w.candidate, w.primary, alpha_k, cfg)
    figures["slices_failed"] = slices
    if slices:
        return GateResult(name="labels", verdict=FAIL, figures=figures, samples=int(nc),
                          reason="worse on part of the data: " + "; ".join(slices))
    if required:
        if lower > -cfg.max_regression:
            return GateResult(name="labels", verdict=PASS, figures=figures, samples=int(nc))
        return GateResult(name="labels", verdict=INCONCLUSIVE, figures=figures, samples=int(nc),
                          reason=f"accuracy {rc / nc:.2%} vs {rp / np_:.2%} on {nc:.0f} / {np_:.0f} labelled rows: "
                                 f"lower bound {lower:+.2%} not yet within -{cfg.max_regression:.2%}; more labels")
    return GateResult(name="labels", verdict=SKIPPED if upper < 0 else PASS, figures=figures, samples=int(nc),
                      reason="" if upper >= 0 else "not conclusive either way; does not hold the rollout")


BREAKER_NAMES = {0: "closed", 1: "half-open", 2: "open"}


def _breaker_gate(after: GuardReadings, trips: float) -> GateResult:
    figures = {"state": after.breaker_state, "trips": trips}
    if trips > 0 or (after.breaker_state or 0) > 0:
        state = BREAKER_NAMES.get(after.breaker_state or 0, str(after.breaker_state))
        return GateResult(name="breaker", verdict=FAIL, figures=figures,
                          reason=f"breaker {state}, {trips:.0f} trip{'s' if trips != 1 else ''} in the window "
                                 "(limit: closed, 0 trips)")
    if after.breaker_state is None:
        return GateResult(name="breaker", verdict=INCONCLUSIVE, figures=figures,
                          reason="the candidate's breaker state is not reported")
    return GateResult(name="breaker", verdict=PASS, figures=figures)


def parse_increase(text: str, flag: str = "--max-cost-increase") -> float:
    """``10%`` / ``0.1`` -> 0.1: how much more the candidate may cost. Negative, not a number,
    or empty is a ValueError naming the flag."""
    t = str(text).strip()
    try:
        value = float(t[:-1].strip()) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"{flag} must look like 10% or 0.1, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{flag} must be >= 0 (10% or 0.1), got {text!r}")
    return value


def _cost_gate(w: GuardReadings, share: float | None, cfg: GateConfig) -> GateResult:
    cand, prim = w.candidate, w.primary
    nc, np_ = w.charged.get(cand, 0.0), w.charged.get(prim, 0.0)
    priced = all(sum(w.cost.get(v, {}).values()) > 0 for v in (cand, prim))
    sums, unit = (w.cost, "cost") if priced else (w.compute, "compute seconds")
    guard = sum(sums.get(v, {}).get("guard", 0.0) for v in (cand, prim))
    tc, tp = sums.get(cand, {}).get("target", 0.0), sums.get(prim, {}).get("target", 0.0)
    # per request: the pooled guard part (the same code for both) plus the version's own calls
    g = guard / (nc + np_) if nc + np_ else 0.0
    pc, pp = (g + tc / nc if nc else 0.0), (g + tp / np_ if np_ else 0.0)
    limit = cfg.max_cost_increase or 0.0
    figures: dict[str, Any] = {"basis": unit, "candidate_requests": nc, "primary_requests": np_,
                               "guard_per_request": g if nc + np_ else None,
                               "candidate_target_per_request": tc / nc if nc else None,
                               "primary_target_per_request": tp / np_ if np_ else None,
                               "candidate_per_request": pc if nc else None,
                               "primary_per_request": pp if np_ else None,
                               "max_increase": limit, "share": share}
    if share is not None and share < cfg.cost_min_share:
        return GateResult(name="cost", verdict=SKIPPED, figures=figures, samples=int(nc),
                          reason=f"judged from {cfg.cost_min_share:.0%} of traffic (now {share:.0%}): a smaller "
                                 "share gets smaller sub-batches, whose fixed per-call cost weighs more per request")
    if share is not None and share >= 1.0:
        return GateResult(name="cost", verdict=SKIPPED, figures=figures, samples=int(nc),
                          reason="at 100 % the primary serves no requests to compare with")
    if nc < cfg.min_requests or np_ < cfg.min_requests:
        why = "" if nc or np_ else f" (no {CHARGED}: is the guard's cost meter on, cost.enabled?)"
        return GateResult(name="cost", verdict=INCONCLUSIVE, figures=figures, samples=int(nc),
                          reason=f"{nc:.0f} candidate / {np_:.0f} primary requests charged, need >= "
                                 f"{cfg.min_requests} each{why}")
    if tc <= 0 or tp <= 0:
        return GateResult(name="cost", verdict=INCONCLUSIVE, figures=figures, samples=int(nc),
                          reason=f"no target {unit} measured for v{cand if tc <= 0 else prim}")
    ratio = pc / pp
    figures["ratio"] = ratio
    per_1k = (f"{1000 * pc:.3g} vs {1000 * pp:.3g} per 1k requests, of which guard {1000 * g:.3g}"
              + ("" if priced else " (compute s)"))
    if ratio - 1 > limit:
        return GateResult(name="cost", verdict=FAIL, figures=figures, samples=int(nc),
                          reason=f"costs {ratio:.2f}x the primary per request ({per_1k}): +{ratio - 1:.0%} > "
                                 f"limit +{limit:.0%}")
    return GateResult(name="cost", verdict=PASS, figures=figures, samples=int(nc),
                      reason=f"{ratio:.2f}x the primary per request ({per_1k})")


def bucket_samples(deltas: Buckets, parts: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(values, counts) of per-bucket deltas from cumulative ``deltas`` (le -> count): each
    finite bucket's count spread evenly over ``parts`` sub-bins (1: its midpoint), the open last
    bucket one point at twice its lower edge. ``parts`` > 1 is the uniform-within-a-bucket
    reading ``histogram_quantile`` makes too: a shift smaller than a bucket then moves part of
    a bucket, where on midpoints it would break every tie between two versions one way."""
    values: list[float] = []
    counts: list[float] = []
    lower = prev = 0.0
    for le in sorted(deltas):
        c = max(deltas[le] - prev, 0.0)
        prev = deltas[le]
        if math.isinf(le):
            values.append(2 * lower)
            counts.append(c)
            continue
        width = (le - lower) / parts
        values.extend(lower + (i + 0.5) * width for i in range(parts))
        counts.extend([c / parts] * parts)
        lower = le
    return np.asarray(values), np.asarray(counts)


def quantile(deltas: Buckets, q: float) -> float | None:
    """Prometheus ``histogram_quantile`` on cumulative buckets (linear within a bucket)."""
    les = sorted(deltas)
    if not les or deltas[les[-1]] <= 0:
        return None
    rank, lower, prev = q * deltas[les[-1]], 0.0, 0.0
    for le in les:
        if deltas[le] >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - prev) / (deltas[le] - prev) if deltas[le] > prev else 1.0)
        lower, prev = le, deltas[le]
    return lower


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2)])


def mann_whitney(cm: np.ndarray, cc: np.ndarray, pm: np.ndarray, pc: np.ndarray,
                 alternative: str = "greater") -> float:
    """p-value of Mann-Whitney U on binned samples (values ``cm``/``pm``, counts ``cc``/``pc``).

    The same figure as ``scipy.stats.mannwhitneyu(method="asymptotic")`` on the samples
    repeated out (tie-corrected normal approximation with continuity correction), in
    O(buckets) instead of O(n log n): a busy model's window holds millions of calls."""
    from scipy import stats  # noqa: PLC0415 - seconds to import; only the controller needs it

    values = np.union1d(cm, pm)
    c = np.zeros(len(values))
    p = np.zeros(len(values))
    np.add.at(c, np.searchsorted(values, cm), cc)
    np.add.at(p, np.searchsorted(values, pm), pc)
    n1, n2 = c.sum(), p.sum()
    t = c + p
    n = n1 + n2
    midrank = np.cumsum(t) - t + (t + 1) / 2  # every tie in a bucket shares its mean rank
    u1 = float((c * midrank).sum() - n1 * (n1 + 1) / 2)
    mu = n1 * n2 / 2
    var = n1 * n2 / 12 * ((n + 1) - float((t ** 3 - t).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0
    if alternative not in ("greater", "less", "two-sided"):
        raise ValueError(f"alternative must be 'greater', 'less' or 'two-sided', got {alternative!r}")
    u = max(u1, n1 * n2 - u1) if alternative == "two-sided" else n1 * n2 - u1 if alternative == "less" else u1
    z = (u - mu - 0.5) / math.sqrt(var)
    pvalue = float(stats.norm.sf(z)) * (2 if alternative == "two-sided" else 1)
    return min(pvalue, 1.0)


def _welch(cm: np.ndarray, cc: np.ndarray, pm: np.ndarray, pc: np.ndarray) -> float | None:
    from scipy import stats  # noqa: PLC0415

    def moments(m: np.ndarray, w: np.ndarray) -> tuple[float, float, float]:
        n = float(w.sum())
        mean = float((m * w).sum() / n)
        return mean, math.sqrt(float((w * (m - mean) ** 2).sum()) / (n - 1)), n

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # equal samples: t is undefined, reported as None
        p = float(stats.ttest_ind_from_stats(*moments(cm, cc), *moments(pm, pc), equal_var=False).pvalue)
    return None if math.isnan(p) else p


def _latency_gate(cand: Buckets, prim: Buckets, look: int, cfg: GateConfig) -> GateResult:
    cm, cc = bucket_samples(cand)
    pm, pc = bucket_samples(prim)
    nc, np_ = int(cc.sum()), int(pc.sum())
    alpha_k = spent_alpha(cfg.alpha, look)
    figures: dict[str, Any] = {"candidate_samples": nc, "primary_samples": np_, "alpha_k": alpha_k,
                               "candidate_p99_s": quantile(cand, 0.99), "primary_p99_s": quantile(prim, 0.99)}
    if nc < cfg.min_latency_samples or np_ < cfg.min_latency_samples:
        return GateResult(name="latency", verdict=INCONCLUSIVE, figures=figures, samples=nc,
                          reason=f"{nc} candidate / {np_} primary latency samples, "
                                 f"need >= {cfg.min_latency_samples} each")
    prim_median = _weighted_median(pm, pc)
    # Hodges-Lehmann: the median of all pairwise differences, weighted by bucket pair counts
    shift = _weighted_median(np.subtract.outer(cm, pm).ravel(), np.outer(cc, pc).ravel())
    both = cfg.latency_direction == "both"
    p = mann_whitney(cm, cc, pm, pc, "two-sided" if both else "greater")
    allowed = cfg.latency_tolerance * abs(prim_median)
    figures.update(hodges_lehmann_s=shift, primary_median_s=prim_median, allowed_shift_s=allowed,
                   mann_whitney_p=p, welch_p=_welch(cm, cc, pm, pc))
    big = abs(shift) > allowed if both else shift > allowed
    # PASS needs evidence that the shift is within the allowance: the candidate's latencies less
    # the allowed shift are faster than the primary's at beta (and, "both", more plus slower)
    sm, sc = bucket_samples(cand, parts=8)
    qm, qc = bucket_samples(prim, parts=8)
    p_within = mann_whitney(sm - allowed, sc, qm, qc, "less")
    if both:
        p_within = max(p_within, mann_whitney(sm + allowed, sc, qm, qc, "greater"))
    figures["p_within"] = p_within
    if big and p < alpha_k:
        return GateResult(name="latency", verdict=FAIL, figures=figures, samples=nc,
                          reason=f"shift {shift * 1000:.3g} ms > {allowed * 1000:.3g} ms, p={p:.2g} < {alpha_k:.2g}")
    if p_within < cfg.beta:
        return GateResult(name="latency", verdict=PASS, figures=figures, samples=nc)
    return GateResult(name="latency", verdict=INCONCLUSIVE, figures=figures, samples=nc,
                      reason=f"shift {shift * 1000:.3g} ms on {nc}/{np_} samples, not yet shown within "
                             f"{allowed * 1000:.3g} ms (p={p_within:.2g}, need < {cfg.beta:.2g})")


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


def evaluate(before: GuardReadings | None, after: GuardReadings, config: GateConfig | None = None,
             *, look: int = 1, mode: str = "split",
             primary_reference: Buckets | None = None, latency_samples: tuple[Any, Any] | None = None,
             share: float | None = None, labels: Tally | None = None) -> GateReport:
    """Judge the window between two readings (``before`` None: since the counters started).

    ``look`` numbers the looks at this window (1, 2, ...) for the latency test's alpha spending.
    ``mode="shadow"``: candidate requests are its mirrored (compared) rows and the latency gate
    is not run (the guard times shadow calls off the serving path, so they are not comparable).
    ``primary_reference``: primary buckets to compare against when the primary served too few
    in this window (at a 100 % step it serves none). ``latency_samples``: (candidate, primary)
    exact per-call latencies of the window (:class:`tritonguard.rollout.latency.Samples`, kept in the
    store by the guards); when given, the latency gate judges those
    (:func:`exporter.rollout.gates.latency.latency_gate`) instead of histogram buckets. ``share``: the
    candidate's traffic share at this step; below ``latency_min_share`` latency is not judged.
    ``labels``: labelled rows per version since the rollout began, from the store
    (:func:`tritonguard.rollout.feedback.tally`); without it the labels gate reads the window's metrics."""
    cfg = config or GateConfig()
    if mode not in ("split", "shadow"):
        raise ValueError(f"mode must be 'split' or 'shadow', got {mode!r}")
    w = window(before, after)
    values = [*w.served.values(), *w.errors.values(), *w.fused.values(), w.trips,
              *w.charged.values(), *(x for d in (*w.cost.values(), *w.compute.values()) for x in d.values()),
              *(x for d in w.labeled.values() for x in d.values()),
              *(x for d in (*w.compared.values(), *w.latency.values()) for x in d.values())]
    if any(x < 0 for x in values):
        return GateReport(verdict=INCONCLUSIVE, look=look, reset=True, gates=[GateResult(
            name="data", verdict=INCONCLUSIVE, reason="a counter went backwards (a guard restarted?)")])
    cand, prim = after.candidate, after.primary
    gates: list[GateResult] = []
    missing = [p for p in after.problems if "latency" not in p]
    if before is not None and (before.candidate, before.primary) != (cand, prim):
        missing.append("readings compare different versions")
    if missing:
        gates.append(GateResult(name="data", verdict=INCONCLUSIVE, reason="; ".join(missing)))
    compared: dict[str, float] = {}
    for verdicts in w.compared.values():
        for verdict, value in verdicts.items():
            compared[verdict] = compared.get(verdict, 0.0) + value
    # a request of a fused call that failed is a failure of the version, even though the guard
    # rescued it by retrying it alone; it was counted as served too, so it is not added twice
    fused = w.fused.get(cand, 0.0)
    errors = w.errors.get(cand, 0.0)
    answered = w.served.get(cand, 0.0) if mode == "split" else sum(w.compared.get("shadow", {}).values())
    pn = w.served.get(prim, 0.0) + w.errors.get(prim, 0.0)
    primary = {"primary_requests": pn, "primary_rate": w.errors.get(prim, 0.0) / pn if pn else None,
               "fused_failures": fused}
    gates.append(_error_gate(answered + errors, min(errors + fused, answered + errors), primary, cfg))
    gates.append(_breaker_gate(after, w.trips))
    if cfg.judge == "task":
        gates.append(_disagreement_gate(compared, look, cfg))
        gates.append(_labels_gate(w, look, cfg, labels))
    elif cfg.min_agreement is not None:
        gates.append(_agreement_gate(compared, cfg))
    used_primary = None
    if mode == "split" and cfg.latency and share is not None and share < cfg.latency_min_share:
        gates.append(GateResult(name="latency", verdict=SKIPPED,
                                reason=f"judged from {cfg.latency_min_share:.0%} of traffic (now {share:.0%}): a "
                                       "rarely called version runs cache-cold"))
    elif mode == "split" and cfg.latency and latency_samples is not None and share is not None and share >= 1.0:
        # the primary serves nothing here: its only samples are from earlier windows, at another
        # load (an identical retrain measured 1.15x "slower" against them); judged at the steps before
        gates.append(GateResult(name="latency", verdict=SKIPPED,
                                reason="at 100 % the primary serves no calls to compare with at the same load"))
    elif mode == "split" and cfg.latency and latency_samples is not None:
        from exporter.rollout.gates.latency import latency_gate  # noqa: PLC0415

        gates.append(latency_gate(*latency_samples, look, alpha=cfg.alpha, beta=cfg.beta, tolerance=cfg.latency_tolerance,
                                  min_samples=cfg.min_latency_samples, direction=cfg.latency_direction))
    elif mode == "split" and cfg.latency:
        prim_lat = w.latency.get(prim, {})
        if max(prim_lat.values(), default=0) < cfg.min_latency_samples and primary_reference:
            prim_lat = primary_reference
        gate = _latency_gate(w.latency.get(cand, {}), prim_lat, look, cfg)
        if gate.verdict == INCONCLUSIVE:
            gate.reason = "; ".join([gate.reason, *(p for p in after.problems if "latency" in p)])
        gates.append(gate)
        used_primary = {_le(k): v for k, v in prim_lat.items()}
    if mode == "split" and cfg.max_cost_increase is not None:
        gates.append(_cost_gate(w, share, cfg))
    verdicts = {g.verdict for g in gates} - {SKIPPED}
    verdict = FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    return GateReport(verdict=verdict, gates=gates, look=look, primary_latency=used_primary)


# -- verdict texts: the measured figure against the limit it failed --------------------------------
def _g(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _output_reason(m: Mapping[str, Any], limits: Any, worst_only: bool) -> list[str]:
    """Figures of one output's golden comparison (a validator's metrics) against its limits."""
    mf = limits.marginal_factor
    parts: list[str] = []
    if "error" in m:
        return [f"error: {m['error']}"]
    if "agreement" in m and "max_abs_diff" in m and "atol" in m:  # classifier
        agree, diff, atol = float(m["agreement"]), float(m["max_abs_diff"]), float(m["atol"])
        if agree < 1 or not worst_only:
            parts.append(f"top-1 agreement {agree:.4g}" + (" < 1 (every row must agree)" if agree < 1 else ""))
        if diff > mf * atol:
            parts.append(f"max_abs_diff {diff:.3g} > {mf * atol:.3g} ({mf:g} x atol {atol:g})")
        elif diff > atol:
            parts.append(f"max_abs_diff {diff:.3g} > atol {atol:.3g} (MARGINAL up to {mf * atol:.3g})")
        elif not worst_only:
            parts.append(f"max_abs_diff {diff:.3g} <= atol {atol:.3g}")
    elif "max_tolerance_ratio" in m:  # regression / encoder
        ratio, diff = float(m["max_tolerance_ratio"]), float(m.get("max_abs_diff", float("nan")))
        tol = f"atol {_g(m.get('atol'))} + rtol {_g(m.get('rtol'))} x |ref|"
        if ratio > mf:
            parts.append(f"max_abs_diff {diff:.3g} is {ratio:.3g} x the tolerance ({tol}) > {mf:g} x")
        elif ratio > 1 or not worst_only:
            parts.append(f"max_abs_diff {diff:.3g} is {ratio:.3g} x the tolerance ({tol})"
                         + (f", MARGINAL up to {mf:g} x" if ratio > 1 else ", <= 1 x"))
    elif "min_cosine" in m:  # embedding
        cos = float(m["min_cosine"])
        if cos < limits.cosine_marginal:
            parts.append(f"min_cosine {cos:.6g} < {limits.cosine_marginal:g}")
        elif cos < limits.cosine_pass:
            parts.append(f"min_cosine {cos:.6g} < {limits.cosine_pass:g} (MARGINAL down to {limits.cosine_marginal:g})")
        elif not worst_only:
            parts.append(f"min_cosine {cos:.6g} >= {limits.cosine_pass:g}")
    elif "min_spearman" in m:  # reranker
        rho = float(m["min_spearman"])
        if rho < limits.spearman_marginal:
            parts.append(f"min_spearman {rho:.4g} < {limits.spearman_marginal:g}")
        elif rho < limits.spearman_pass:
            parts.append(f"min_spearman {rho:.4g} < {limits.spearman_pass:g} (MARGINAL down to "
                         f"{limits.spearman_marginal:g})")
        elif not worst_only:
            parts.append(f"min_spearman {rho:.4g} >= {limits.spearman_pass:g}")
    elif "exact_match_rate" in m:  # generation
        exact = float(m["exact_match_rate"])
        if exact < 1 or not worst_only:
            parts.append(f"exact_match_rate {exact:.4g}" + (" < 1" if exact < 1 else "")
                         + f", prefix_match_rate {_g(m.get('prefix_match_rate'))} (a row FAILs below "
                         f"{limits.prefix_marginal:g})")
    elif not worst_only or not parts:  # a custom validator's figures: shown as they are
        parts = [f"{k} {_g(v)}" for k, v in m.items() if k != "rows"]
    return parts


def golden_reason(result: Mapping[str, Any] | None, limits: Any = None) -> str:
    """``goldens FAIL: PROBS: max_abs_diff 0.031 > 0.001 (10 x atol 0.0001)``: a golden check
    result (``{"verdict", "metrics"}``, as the guards record it in the rollout state) with the
    figures that decided it against the validator's limits (``limits``: a
    :class:`tritonguard.rollout.validators.ValidatorConfig`, the guard's ``validator.*``; default ones
    when None). For PASS the main figures; for MARGINAL/FAIL only the ones past a limit."""
    from tritonguard.rollout.validators import ValidatorConfig  # noqa: PLC0415

    limits = limits or ValidatorConfig()
    result = result or {}
    verdict = result.get("verdict") or "?"
    metrics = result.get("metrics") or {}
    worst_only = verdict not in (PASS, SKIPPED)
    parts: list[str] = []
    for name, m in metrics.items():
        if isinstance(m, Mapping):
            figures = _output_reason(m, limits, worst_only)
            if figures:
                parts.append(f"{name}: {', '.join(figures)}")
        elif name == "error":
            parts.append(f"error at {m}")
        else:
            parts.append(f"{name}: {m}")
    return f"goldens {verdict}" + (f": {'; '.join(parts)}" if parts else "")


_TRIP_TEXT = {"error_rate": "error rate", "non_finite": "NaN/Inf rate", "fused_failures": "fused failure rate",
              "validator_fail": "validator FAIL rate"}


def trip_reason(trip: Mapping[str, Any] | None) -> str:
    """``error_rate: 12.0% (24/200) > 5.0%``: a breaker trip (``{"reason", "figures"}``, the
    ``last_trip`` of a shared breaker document) with the figure that tripped it and its limit."""
    if not trip:
        return ""
    reason, f = trip.get("reason", "?"), dict(trip.get("figures") or {})
    if "probe" in f:
        return f"{reason}: a half-open probe was {f['probe']} after {f.get('probes_passed', 0)} passing"
    if reason in _TRIP_TEXT and "rate" in f and "limit" in f:
        of = f.get("window", f.get("compared"))
        count = f" ({f.get('count', '?'):.0f}/{of:.0f})" if isinstance(of, (int, float)) and \
            isinstance(f.get("count"), (int, float)) else ""
        return f"{reason}: {_TRIP_TEXT[reason]} {float(f['rate']):.1%}{count} > {float(f['limit']):.1%}"
    if reason == "latency" and "budget_ms" in f:
        return f"latency: p95 {float(f['p95_ms']):.3g} ms > budget {float(f['budget_ms']):.3g} ms"
    if reason == "latency" and "max_ratio" in f:
        return (f"latency: p95 {float(f['p95_ms']):.3g} ms = {float(f['ratio']):.3g} x the primary's "
                f"{float(f['primary_p95_ms']):.3g} ms > {float(f['max_ratio']):.3g} x")
    if reason == "drift" and "fail_share_ewma" in f:
        limit = f" > {float(f['limit']):.3g}" if "limit" in f else ""
        return f"drift: FAIL share EWMA {float(f['fail_share_ewma']):.3g}{limit} ({f.get('kind', '?')} rows)"
    return f"{reason}: " + ", ".join(f"{k} {_g(v)}" for k, v in f.items()) if f else str(reason)
