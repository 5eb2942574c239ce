"""A rollout's gate settings (``promote``'s flags, kept with the rollout's progress).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exporter.errors import BadInput
from tritonguard.rollout.judging import (
    DEFAULT_MAX_DISAGREEMENT,
    DEFAULT_MAX_SLICE_REGRESSION,
    SOURCES,
)
from tritonguard.rollout.state import JUDGES


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


def parse_increase(text: str, flag: str = "--max-cost-increase") -> float:
    """``10%`` / ``0.1`` -> 0.1: how much more the candidate may cost. Negative, not a number,
    or empty is a ValueError naming the flag."""
    t = str(text).strip()
    try:
        value = float(t[:-1].strip()) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise BadInput(f"{flag} must look like 10% or 0.1, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise BadInput(f"{flag} must be >= 0 (10% or 0.1), got {text!r}")
    return value
