"""The rollout latency gate on exact per-call latencies (:mod:`tritonguard.rollout.latency`).

Why stratify: a call's latency depends on its sub-batch size, and the split makes the sizes
differ by version. At a 1 % share the candidate's calls carry a row or two while the primary's
carry the rest of each batch (~8), so pooled latencies would make any candidate look fast. Calls
are compared only with calls of the same size class: exact sizes up to 31 rows, then classes
sharing their top ``stratum_bits`` bits (at most 1/16 wide at the default 5 bits). Plain log2 bins
(``stratum_bits=1``: 1, 2-3, 4-7, ...) are too wide: for a model whose time grows with rows, a
class of 4-7 rows spans a factor ~1.6, and at a step where the candidate has the larger calls of
a class, that alone reads as a slowdown.

The test: in each class both versions served, Mann-Whitney U on log latency; classes combine as
van Elteren's stratified test (each class's U deviation weighted by 1/(N+1), the locally most
powerful weights for a common shift; tie-corrected variances; normal approximation). The size of
the effect is the Hodges-Lehmann estimate of log(candidate / primary) pooled over the classes: the
median of all within-class pairwise differences (so each class weighs n1*n2), reported as a ratio.

FAIL only when the data show the candidate slower than the tolerance allows: the same stratified
test of the candidate's latencies divided by ``1 + tolerance`` finds them still slower than the
primary's at p < alpha_k (H0: ratio <= 1 + tolerance; with ``direction="both"`` the mirror test of
ratio >= 1 / (1 + tolerance) counts too, each side at alpha_k / 2), with alpha spent over looks as
in :mod:`exporter.rollout.gates` (alpha_k = 6 alpha / (pi^2 k^2)), so a build within tolerance is
failed at a rate below ``alpha`` however often the controller looks. (Before, FAIL was "point
estimate above 1 + tolerance AND significantly slower than 1x": a build 1.08x slower, within a
0.15 tolerance, was failed in 43 of 200 simulated rollouts of ten looks, and a 1.0x one in 4; the
shifted test fails them in 0 of 200, and a 1.3x one in 199.) PASS needs evidence too: the same stratified test of the candidate's latencies
divided by ``1 + tolerance`` must find them faster than the primary's at ``beta`` (the one-sided
upper confidence bound of the ratio is below ``1 + tolerance``; with ``direction="both"`` the
lower bound must be above ``1 / (1 + tolerance)`` as well). Between the two the gate is
INCONCLUSIVE and the controller holds: a window too small or too noisy to tell a 1.2x slower
build from an equal one does not pass it (before, anything short of a significant FAIL passed,
and a 1.27x slower generation build went through a 50 % step on ~30 calls a side). Fewer than
``min_samples`` comparable calls on either side is INCONCLUSIVE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from exporter.rollout.gates.verdict import FAIL, INCONCLUSIVE, PASS, GateResult, spent_alpha
from tritonguard.rollout.latency import Samples

NAME = "latency"
MIN_SECONDS = 1e-9  # a zero duration (coarse clock) must not become log(0)


@dataclass
class _Stratum:
    lo: int  # smallest and largest sub-batch rows present in the class
    hi: int
    n1: int  # comparable calls before subsampling
    n2: int
    x: np.ndarray  # candidate log seconds (subsampled to the cap), sorted
    y: np.ndarray  # primary log seconds, sorted

    def figures(self) -> dict[str, Any]:
        return {"rows": str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}",
                "candidate_n": self.n1, "primary_n": self.n2,
                "candidate_median_s": float(np.exp(np.median(self.x))),
                "primary_median_s": float(np.exp(np.median(self.y)))}


def size_class(rows: np.ndarray, bits: int = 5) -> np.ndarray:
    """Rows rounded down to their top ``bits`` significant bits: the stratum key of each call."""
    rows = np.maximum(np.asarray(rows, dtype=np.int64), 1)
    shift = np.maximum(np.frexp(rows.astype(np.float64))[1] - bits, 0)  # frexp: bit length
    return (rows >> shift) << shift


def _strata(cand: Samples, prim: Samples, bits: int, cap: int,
            rng: np.random.Generator) -> list[_Stratum]:
    kc, kp = size_class(cand.rows, bits), size_class(prim.rows, bits)
    lc = np.log(np.maximum(cand.seconds.astype(np.float64), MIN_SECONDS))
    lp = np.log(np.maximum(prim.seconds.astype(np.float64), MIN_SECONDS))
    out = []
    for key in np.intersect1d(kc, kp):
        ic, ip = np.flatnonzero(kc == key), np.flatnonzero(kp == key)
        rows = np.concatenate([cand.rows[ic], prim.rows[ip]])
        x, y = lc[ic], lp[ip]
        # uniform subsample: a 10^5-call window costs no more than 2 x cap per class
        if len(x) > cap:
            x = x[rng.choice(len(x), cap, replace=False)]
        if len(y) > cap:
            y = y[rng.choice(len(y), cap, replace=False)]
        out.append(_Stratum(int(rows.min()), int(rows.max()), len(ic), len(ip), np.sort(x), np.sort(y)))
    return out


def van_elteren(strata: list[_Stratum], shift: float = 0.0) -> float:
    """z of the stratified rank test (normal approximation); z > 0: candidate slower. ``shift``
    (log seconds) is taken off every candidate latency first: the test of H0 "the candidate is
    ``exp(shift)`` times the primary".

    Each class's U comes from two binary searches into the primary's sorted latencies (pairs
    above, plus half the ties: the same number as the mid-rank sum, without ranking the pooled
    sample), and the tie correction from the run lengths of the pooled sample sorted; no SciPy
    call per class, which on a window of ten classes was most of the gate's time."""
    num = var = 0.0
    for s in strata:
        n1, n2 = len(s.x), len(s.y)
        n = n1 + n2
        xs = s.x - shift
        below = np.searchsorted(s.y, xs, "left")  # primary calls faster than each candidate call
        upto = np.searchsorted(s.y, xs, "right")
        u1 = float(below.sum()) + 0.5 * float((upto - below).sum())
        pooled = np.sort(np.concatenate([xs, s.y]))
        edges = np.flatnonzero(pooled[1:] != pooled[:-1]) + 1
        runs = np.diff(np.concatenate(([0], edges, [n]))).astype(np.float64)
        tie = float((runs ** 3 - runs).sum())
        v = n1 * n2 / 12 * ((n + 1) - (tie / (n * (n - 1)) if n > 1 else 0.0))
        w = 1.0 / (n + 1)
        num += w * (u1 - n1 * n2 / 2)
        var += w * w * v
    return num / math.sqrt(var) if var > 0 else 0.0


def hodges_lehmann(strata: list[_Stratum], iterations: int = 60) -> float:
    """Median of every within-class difference x_i - y_j (log seconds), by bisection on the
    shift: counting the pairs below a shift is one binary search of every candidate call into
    its class's sorted primary calls, so O(n log n) per step instead of the n1*n2 differences
    themselves. The classes are laid end to end (each moved by a multiple of a span wider than
    any shift the bisection tries), so a step is one search over them all, not one per class:
    the move rounds the values to the spacing of floats near the largest offset (~1e-13 at a
    thousand), far below the bisection's 1e-9 resolution."""
    total = sum(len(s.x) * len(s.y) for s in strata)
    lo = min(float(s.x.min() - s.y[-1]) for s in strata)
    hi = max(float(s.x.max() - s.y[0]) for s in strata)
    # class k's values move by k * span: span exceeds every class's range plus the widest shift,
    # so x - mid of class k never reaches into class k-1's or k+1's primary calls
    low = min(min(float(s.x.min()), float(s.y[0])) for s in strata)
    high = max(max(float(s.x.max()), float(s.y[-1])) for s in strata)
    span = 2 * (high - low) + (hi - lo) + 1.0
    ys = np.concatenate([s.y - low + k * span for k, s in enumerate(strata)])
    # sorted within each class, so the queries rise and each search starts where the last ended
    xs = np.concatenate([s.x - low + k * span for k, s in enumerate(strata)])
    # a candidate call's count starts at the first primary call of its class
    first = np.repeat(np.cumsum([0] + [len(s.y) for s in strata[:-1]]), [len(s.x) for s in strata])
    half = total / 2
    for _ in range(iterations):
        mid = (lo + hi) / 2
        # pairs with x - y <= mid: for each x, the y >= x - mid of its class
        below = total - int((np.searchsorted(ys, xs - mid, "left") - first).sum())
        if below >= half:
            hi = mid
        else:
            lo = mid
        if hi - lo < 1e-9:
            break
    return hi


def _quantiles(seconds: np.ndarray) -> tuple[float | None, float | None]:
    if not len(seconds):
        return None, None
    p50, p99 = np.quantile(seconds.astype(np.float64), [0.5, 0.99])
    return float(p50), float(p99)


def latency_gate(cand: Samples, prim: Samples, look: int, *, alpha: float = 0.05, beta: float = 0.10,
                 tolerance: float = 0.15, min_samples: int = 100, direction: str = "increase",
                 stratum_bits: int = 5, max_per_stratum: int = 20_000, seed: int = 0) -> GateResult:
    """PASS / FAIL / INCONCLUSIVE of the candidate's latency against the primary's; see the
    module docstring. ``look`` numbers the looks at this window (1, 2, ...)."""
    from scipy import stats  # noqa: PLC0415

    if direction not in ("increase", "both"):
        raise ValueError(f"direction must be 'increase' or 'both', got {direction!r}")
    if stratum_bits < 1 or max_per_stratum < 2 or min_samples < 2 or tolerance < 0:
        raise ValueError("latency_gate: need stratum_bits >= 1, max_per_stratum >= 2, "
                         "min_samples >= 2 and tolerance >= 0")
    alpha_k = spent_alpha(alpha, look)
    c50, c99 = _quantiles(cand.seconds)
    p50, p99 = _quantiles(prim.seconds)
    figures: dict[str, Any] = {
        "candidate_samples": len(cand), "primary_samples": len(prim), "alpha_k": alpha_k, "beta": beta,
        "tolerance": tolerance, "direction": direction,
        "candidate_p50_s": c50, "candidate_p99_s": c99, "primary_p50_s": p50, "primary_p99_s": p99}
    strata = _strata(cand, prim, stratum_bits, max_per_stratum, np.random.default_rng(seed))
    n1, n2 = sum(s.n1 for s in strata), sum(s.n2 for s in strata)
    figures.update(comparable_candidate=n1, comparable_primary=n2,
                   strata=[s.figures() for s in strata])
    if n1 < min_samples or n2 < min_samples:
        c_rows = f"{cand.rows.min()}-{cand.rows.max()}" if len(cand) else "none"
        p_rows = f"{prim.rows.min()}-{prim.rows.max()}" if len(prim) else "none"
        return GateResult(name=NAME, verdict=INCONCLUSIVE, figures=figures, samples=n1,
                          reason=f"{n1} candidate / {n2} primary calls of sub-batch sizes both "
                                 f"served (candidate {c_rows} rows, primary {p_rows}), "
                                 f"need >= {min_samples} each")
    z = van_elteren(strata)
    both = direction == "both"
    ratio = math.exp(hodges_lehmann(strata))
    limit = 1 + tolerance
    margin = math.log(limit)
    # FAIL: the candidate's latencies over 1 + tolerance are still slower than the primary's at
    # alpha_k (and, with "both", those over 1 / (1 + tolerance) still faster), so noise around a
    # ratio within the tolerance does not fail a build
    z_over = van_elteren(strata, margin)
    p = float(stats.norm.sf(z_over))
    if both:
        z_under = van_elteren(strata, -margin)
        p = 2 * min(p, float(stats.norm.cdf(z_under)))
    # PASS: the candidate's latencies over 1 + tolerance are faster than the primary's at beta
    p_within = float(stats.norm.cdf(z_over))
    if both:
        p_within = max(p_within, float(stats.norm.sf(z_under)))
    # reported, not judged on: the plain test of "the candidate differs from 1x at all"
    p_slower = float(2 * stats.norm.sf(abs(z)) if both else stats.norm.sf(z))
    figures.update(ratio=ratio, z=z, p=min(p, 1.0), p_within=min(p_within, 1.0),
                   p_slower=min(p_slower, 1.0))
    if p < alpha_k:
        return GateResult(name=NAME, verdict=FAIL, figures=figures, samples=n1,
                          reason=f"candidate/primary latency {ratio:.3g}x at equal sub-batch sizes "
                                 f"(allowed {1 / limit:.3g}x-{limit:.3g}x), p={p:.2g} < {alpha_k:.2g}"
                          if both else
                          f"candidate/primary latency {ratio:.3g}x at equal sub-batch sizes "
                          f"> {limit:.3g}x, p={p:.2g} < {alpha_k:.2g}")
    if p_within < beta:
        return GateResult(name=NAME, verdict=PASS, figures=figures, samples=n1)
    bound = f"between {1 / limit:.3g}x and {limit:.3g}x" if both else f"below {limit:.3g}x"
    return GateResult(name=NAME, verdict=INCONCLUSIVE, figures=figures, samples=n1,
                      reason=f"candidate/primary latency {ratio:.3g}x on {n1}/{n2} calls, not yet shown "
                             f"{bound} (p={p_within:.2g}, need < {beta:.2g})")
