"""Rank statistics on latency histograms: samples rebuilt from bucket counts, quantiles, the
Mann-Whitney U computed on the counts directly (equal to scipy's on the rebuilt samples), Welch.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from exporter.rollout.gates.readings import Buckets


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


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
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


def welch(cm: np.ndarray, cc: np.ndarray, pm: np.ndarray, pc: np.ndarray) -> float | None:
    from scipy import stats  # noqa: PLC0415

    def moments(m: np.ndarray, w: np.ndarray) -> tuple[float, float, float]:
        n = float(w.sum())
        mean = float((m * w).sum() / n)
        return mean, math.sqrt(float((w * (m - mean) ** 2).sum()) / (n - 1)), n

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # equal samples: t is undefined, reported as None
        p = float(stats.ttest_ind_from_stats(*moments(cm, cc), *moments(pm, pc), equal_var=False).pvalue)
    return None if math.isnan(p) else p
