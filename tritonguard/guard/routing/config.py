"""``routing.*``: how a guard routes among its target's versions and judges them live."""

from __future__ import annotations

from dataclasses import dataclass

SKIPPED = "SKIPPED"
# a golden check that could not reach its target (not loaded yet, loading, unloaded) is no
# verdict: the version is not routable meanwhile, nothing is stored, and it is tried again after
UNREADY_RETRY_S = 2.0
UNREADY_CODES = ("UNAVAILABLE", "NOT_FOUND")
TASK_TO_WORKLOAD = {"classifier": "classifier", "embedding": "embedding", "regression": "regression"}


@dataclass(kw_only=True)
class RoutingConfig:
    """``routing.*`` parameters of a guard model."""

    poll_interval_s: float = 1.0  # how often the rollout state is re-read
    compare_queue: int = 64  # pending canary/shadow comparisons; more are dropped and counted
    canary_compare: bool = True  # also run the primary on candidate-served requests, and compare
    golden_check: bool = True
    # output drift: EWMA of the FAIL share over canary/shadow comparisons; over it, the
    # candidate's breaker trips with reason "drift"
    output_drift_alpha: float = 0.05  # per compared row
    output_drift_threshold: float = 0.2
    output_drift_min_rows: int = 50  # no judgement on fewer compared rows
    # latency judged against the primary, in the same process and window: the candidate trips
    # when its p95 exceeds this multiple of the primary's (0 = off). Robust where an absolute
    # budget is not: both versions see the same load. breaker.latency_budget_ms stays absolute.
    latency_ratio: float = 0.0
    # ... but only while the version gets at least this share of calls (its traffic share, plus
    # the shadow share for a candidate): a version called rarely runs cache-cold, and on a
    # sub-millisecond model that alone put an identical copy's p95 at 2.1x the primary's at a
    # 15 % share. The rollout's latency gate skips below the same share (gates.latency_min_share)
    latency_min_share: float = 0.25
    input_drift_interval_s: float = 5.0  # how often the input-drift window is scored
    # a loop in each instance that, without waiting for traffic, re-reads the state, checks the
    # goldens of versions it names and publishes breaker gauges every this many seconds (0 = off)
    reconcile_interval_s: float = 2.0
    alert_webhook: str = ""  # POSTed JSON on golden FAIL, trips, input drift
    alert_callable: str = ""  # "package.module:callable", called with the same event

    def __post_init__(self) -> None:
        if not 0 < self.output_drift_alpha <= 1:
            raise ValueError("routing.output_drift_alpha must be in (0, 1]")
        if not 0 < self.output_drift_threshold <= 1:
            raise ValueError("routing.output_drift_threshold must be in (0, 1]")
        if self.poll_interval_s < 0:
            raise ValueError("routing.poll_interval_s must be >= 0")
        if self.compare_queue < 1:
            raise ValueError("routing.compare_queue must be >= 1")
        if self.reconcile_interval_s < 0:
            raise ValueError("routing.reconcile_interval_s must be >= 0 (0 = off)")
        if not 0 <= self.latency_min_share <= 1:
            raise ValueError("routing.latency_min_share must be in [0, 1]")
