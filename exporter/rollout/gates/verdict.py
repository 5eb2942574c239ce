"""The verdict vocabulary every gate speaks, and the sequential statistics they share: PASS /
FAIL / INCONCLUSIVE / SKIPPED, a gate's result and a look's report, Wald's SPRT, alpha spent
over looks (by clock or by information), Wilson bounds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
SKIPPED = "SKIPPED"  # a gate that cannot decide and does not hold the rollout (live labels)


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


def wilson(k: float, n: float, z: float) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` at normal quantile ``z``."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def z_score(alpha: float) -> float:
    from scipy import stats  # noqa: PLC0415

    return float(stats.norm.isf(alpha))
