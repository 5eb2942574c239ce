"""Statistical gates between rollout steps, judged on the guards' Prometheus metrics.

Inputs are two readings of every guard replica's ``/metrics`` (:func:`scrape`, summed by
:meth:`GuardReadings.from_scrapes`); the gates look at what happened *between* them. Each gate
says PASS, FAIL or INCONCLUSIVE, and missing data or too small a sample is INCONCLUSIVE (the
controller holds), never PASS: a canary judged on no traffic must not go through.

The gates are looked at again and again while a step dwells, so each one stays valid under
repeated looks:

- **error rate**: Wald's sequential probability ratio test on the candidate's failed requests,
  H0: p <= p0 (``ok_error_rate``) against H1: p >= p1 (``max_error_rate``). The boundaries are
  FAIL at LLR >= ln(1/alpha) and PASS at LLR <= ln(beta). By Ville's inequality the likelihood
  ratio is a supermartingale under H0 (and its inverse under H1), so these error bounds hold for
  any number and schedule of looks, not only for a look after every request.
- **validator agreement**: the same SPRT on the share of compared rows the validator failed
  (H1: disagreement >= 1 - ``min_agreement``, H0: half of that).
- **breaker**: the candidate's breaker must be closed and must not have tripped in the window.
- **latency**: Mann-Whitney U (rank test; latency is heavy-tailed) of the candidate against the
  primary, on samples rebuilt from histogram bucket deltas (bucket midpoints; the open last
  bucket counts as twice its lower edge), computed on the bucket counts directly
  (:func:`mann_whitney`, equal to ``scipy.stats.mannwhitneyu`` on the rebuilt samples). Kayenta-like, it fails only when the Hodges-Lehmann
  shift exceeds ``latency_tolerance * |primary median|`` AND p < alpha_k. alpha_k is spent with
  a convergent Bonferroni series, alpha_k = alpha * 6 / (pi^2 k^2) at look k: the sum over all
  looks is alpha, so there is no planned number of looks to exceed. A Welch t-test and both
  p99s are reported, never judged on.

Samples restart at each step (the controller re-baselines), so over a rollout of S steps the
family-wise error is at most S times each gate's alpha.
"""

from __future__ import annotations

import logging
import math
import urllib.request
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
Series = dict[tuple[str, frozenset], float]
Buckets = dict[float, float]  # upper bound ("le") -> cumulative count

SERVED = "tritonguard_served_total"
ERRORS = "tritonguard_target_errors_total"
BREAKER = "tritonguard_breaker_state"
TRIPS = "tritonguard_breaker_trips_total"
COMPARED = "tritonguard_compared_total"
LATENCY = "tritonguard_target_latency_seconds_bucket"


# -- Prometheus text exposition ---------------------------------------------------------
def parse(text: str) -> Series:
    """Prometheus text format -> ``{(name, frozenset(labels.items())): value}``."""
    out: Series = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name, labels, rest = _split_sample(line)
            value = float(rest.split()[0])  # an optional timestamp follows
        except (ValueError, IndexError):
            log.warning("metrics line %d not understood, skipped: %.120s", lineno, line)
            continue
        out[(name, frozenset(labels.items()))] = value
    return out


def _split_sample(line: str) -> tuple[str, dict[str, str], str]:
    brace = line.find("{")
    space = line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        name, rest = line.split(None, 1)
        return name, {}, rest
    name, i, labels = line[:brace], brace + 1, {}
    while True:
        while line[i] in " ,":
            i += 1
        if line[i] == "}":
            return name, labels, line[i + 1:]
        eq = line.index("=", i)
        key = line[i:eq].strip()
        if line[eq + 1] != '"':
            raise ValueError("label value is not quoted")
        i, chars = eq + 2, []
        while line[i] != '"':
            if line[i] == "\\":  # the format escapes only \\, \" and \n
                i += 1
                chars.append("\n" if line[i] == "n" else line[i])
            else:
                chars.append(line[i])
            i += 1
        labels[key] = "".join(chars)
        i += 1


def scrape(url: str, timeout: float = 5.0) -> Series:
    """GET a Triton metrics endpoint (e.g. ``http://host:8002/metrics``) and :func:`parse` it."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - operator-given URL
        return parse(resp.read().decode("utf-8", "replace"))


# -- readings -----------------------------------------------------------------------------
@dataclass(kw_only=True)
class GuardReadings:
    """Cumulative counters of one guard model, summed over every replica scraped."""

    model: str
    primary: int
    candidate: int
    served: dict[int, float] = field(default_factory=dict)  # answered, by version
    errors: dict[int, float] = field(default_factory=dict)  # failed target calls, by version
    compared: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> verdict -> rows
    breaker_state: int | None = None  # candidate's, worst replica: 0 closed, 1 half-open, 2 open
    trips: float = 0.0  # candidate's breaker trips
    latency: dict[int, Buckets] = field(default_factory=dict)  # version -> cumulative buckets
    replicas: int = 0
    problems: list[str] = field(default_factory=list)  # data present but not attributable

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
                elif name == COMPARED and tv == candidate:
                    kind = r.compared.setdefault(labels.get("kind", "?"), {})
                    verdict = labels.get("verdict", "?")
                    kind[verdict] = kind.get(verdict, 0.0) + value
                elif name == BREAKER and tv == candidate:
                    r.breaker_state = max(int(value), r.breaker_state or 0)
                elif name == TRIPS and tv == candidate:
                    r.trips += value
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
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardReadings:
        d = dict(d)
        d["served"] = {int(k): float(v) for k, v in d.get("served", {}).items()}
        d["errors"] = {int(k): float(v) for k, v in d.get("errors", {}).items()}
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
    latency_tolerance: float = 0.25  # allowed Hodges-Lehmann shift, fraction of |primary median|
    latency_direction: str = "increase"  # "increase": only slower fails; "both": also faster

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


def _error_gate(n: float, errors: float, primary: dict, cfg: GateConfig) -> GateResult:
    figures = {"requests": n, "errors": errors, "rate": errors / n if n else None,
               "p0": cfg.ok_error_rate, "p1": cfg.max_error_rate, **primary}
    verdict, llr = sprt(errors, n, cfg.ok_error_rate, cfg.max_error_rate, cfg.alpha, cfg.beta)
    figures.update(llr=llr, fail_at=math.log(1 / cfg.alpha), pass_at=math.log(cfg.beta))
    if verdict == PASS and n < cfg.min_requests:
        verdict = INCONCLUSIVE
    reason = {FAIL: f"error rate {errors:.0f}/{n:.0f} favours >= {cfg.max_error_rate:g}",
              INCONCLUSIVE: f"{n:.0f} requests, need >= {cfg.min_requests} and a decisive SPRT",
              PASS: ""}[verdict]
    return GateResult(name="error_rate", verdict=verdict, figures=figures, samples=int(n), reason=reason)


def _agreement_gate(compared: dict[str, float], cfg: GateConfig) -> GateResult:
    total = sum(compared.values())
    agree = sum(v for k, v in compared.items() if k in cfg.agree_verdicts)
    p1 = 1 - cfg.min_agreement
    verdict, llr = sprt(total - agree, total, p1 / 2, p1, cfg.alpha, cfg.beta)
    if verdict == PASS and total < cfg.min_compared:
        verdict = INCONCLUSIVE
    figures = {"compared": total, "agree": agree, "agreement": agree / total if total else None,
               "min_agreement": cfg.min_agreement, "llr": llr, "by_verdict": compared}
    reason = {FAIL: f"agreement {agree:.0f}/{total:.0f} favours < {cfg.min_agreement:g}",
              INCONCLUSIVE: f"{total:.0f} compared rows, need >= {cfg.min_compared} and a decisive SPRT",
              PASS: ""}[verdict]
    return GateResult(name="agreement", verdict=verdict, figures=figures, samples=int(total), reason=reason)


def _breaker_gate(after: GuardReadings, trips: float) -> GateResult:
    figures = {"state": after.breaker_state, "trips": trips}
    if trips > 0 or (after.breaker_state or 0) > 0:
        return GateResult(name="breaker", verdict=FAIL, figures=figures,
                          reason=f"breaker state {after.breaker_state}, {trips:.0f} trips in the window")
    if after.breaker_state is None:
        return GateResult(name="breaker", verdict=INCONCLUSIVE, figures=figures,
                          reason="the candidate's breaker state is not reported")
    return GateResult(name="breaker", verdict=PASS, figures=figures)


def bucket_samples(deltas: Buckets) -> tuple[np.ndarray, np.ndarray]:
    """(midpoints, counts) of per-bucket deltas from cumulative ``deltas`` (le -> count)."""
    les = sorted(deltas)
    finite = [le for le in les if not math.isinf(le)]
    mids, counts, lower, prev = [], [], 0.0, 0.0
    for le in les:
        c = deltas[le] - prev
        prev = deltas[le]
        mid = 2 * lower if math.isinf(le) else (lower + le) / 2
        if math.isinf(le) and not finite:
            mid = 0.0
        mids.append(mid)
        counts.append(max(c, 0.0))
        lower = le if not math.isinf(le) else lower
    return np.asarray(mids), np.asarray(counts)


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
    u = max(u1, n1 * n2 - u1) if alternative == "two-sided" else u1
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
    if big and p < alpha_k:
        return GateResult(name="latency", verdict=FAIL, figures=figures, samples=nc,
                          reason=f"shift {shift * 1000:.3g} ms > {allowed * 1000:.3g} ms, p={p:.2g} < {alpha_k:.2g}")
    return GateResult(name="latency", verdict=PASS, figures=figures, samples=nc)


def window(before: GuardReadings | None, after: GuardReadings) -> GuardReadings:
    """``after - before`` series by series (``before`` None: ``after`` itself)."""
    if before is None:
        return after

    def sub(a: Mapping, b: Mapping) -> dict:
        return {k: v - b.get(k, 0.0) for k, v in a.items()}

    return replace(after, served=sub(after.served, before.served), errors=sub(after.errors, before.errors),
                   compared={k: sub(v, before.compared.get(k, {})) for k, v in after.compared.items()},
                   trips=after.trips - before.trips,
                   latency={v: sub(b, before.latency.get(v, {})) for v, b in after.latency.items()})


def evaluate(before: GuardReadings | None, after: GuardReadings, config: GateConfig | None = None,
             *, look: int = 1, mode: str = "split",
             primary_reference: Buckets | None = None) -> GateReport:
    """Judge the window between two readings (``before`` None: since the counters started).

    ``look`` numbers the looks at this window (1, 2, ...) for the latency test's alpha spending.
    ``mode="shadow"``: candidate requests are its mirrored (compared) rows and the latency gate
    is not run (the guard times shadow calls off the serving path, so they are not comparable).
    ``primary_reference``: primary buckets to compare against when the primary served too few
    in this window (at a 100 % step it serves none)."""
    cfg = config or GateConfig()
    if mode not in ("split", "shadow"):
        raise ValueError(f"mode must be 'split' or 'shadow', got {mode!r}")
    w = window(before, after)
    values = [*w.served.values(), *w.errors.values(), w.trips,
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
    errors = w.errors.get(cand, 0.0)
    answered = w.served.get(cand, 0.0) if mode == "split" else sum(w.compared.get("shadow", {}).values())
    pn = w.served.get(prim, 0.0) + w.errors.get(prim, 0.0)
    primary = {"primary_requests": pn, "primary_rate": w.errors.get(prim, 0.0) / pn if pn else None}
    gates.append(_error_gate(answered + errors, errors, primary, cfg))
    gates.append(_breaker_gate(after, w.trips))
    if cfg.min_agreement is not None:
        gates.append(_agreement_gate(compared, cfg))
    used_primary = None
    if mode == "split" and cfg.latency:
        prim_lat = w.latency.get(prim, {})
        if max(prim_lat.values(), default=0) < cfg.min_latency_samples and primary_reference:
            prim_lat = primary_reference
        gate = _latency_gate(w.latency.get(cand, {}), prim_lat, look, cfg)
        if gate.verdict == INCONCLUSIVE:
            gate.reason = "; ".join([gate.reason, *(p for p in after.problems if "latency" in p)])
        gates.append(gate)
        used_primary = {_le(k): v for k, v in prim_lat.items()}
    verdicts = {g.verdict for g in gates}
    verdict = FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    return GateReport(verdict=verdict, gates=gates, look=look, primary_latency=used_primary)
