"""What a rollout is and where it stands: :class:`RolloutConfig` (steps, mode, arms, dwell,
gates: promote's flags), :class:`Progress` (the document :mod:`exporter.records.progress`
stores: step, window, status, per-arm windows, what each gate's last PASS rested on), the
statuses, the routing-state edits both kinds of rollout make, and :func:`evidence`: what a
rollout's decisions rested on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from exporter.rollout.gates.config import GateConfig
from exporter.rollout.judge import OfflineJudgement
from tritonguard.rollout.state import RolloutState

FORMAT_VERSION = 1
RUNNING, PAUSED, ABORTED, DONE, ROLLED_BACK = "running", "paused", "aborted", "done", "rolled_back"
# a finished rollout whose outcome was later replaced by hand (route --primary, --arms, promote
# --no-rollout): the record stays, saying it no longer describes what serves
SUPERSEDED = "superseded"
ACTIVE = (RUNNING, PAUSED)


@dataclass(kw_only=True)
class RolloutConfig:
    steps: tuple[float, ...] = (1, 5, 10, 25, 50, 100)  # percent of traffic (or mirrored traffic)
    mode: str = "split"  # "split", "shadow" or "abn"
    arms: dict[int, float] | None = None  # abn: version -> full traffic weight (fraction)
    dwell_s: float = 300.0  # minimum time at each step
    interval_s: float = 30.0  # time between looks
    max_step_s: float | None = None  # an inconclusive step this old rolls back; None: hold forever
    promote: bool = True  # after the last step: make the candidate primary; False: stop there
    gates: GateConfig = field(default_factory=GateConfig)
    offline: dict[str, Any] | None = None  # the judgement before traffic (exporter.rollout.judge), for the record

    def __post_init__(self) -> None:
        self.steps = tuple(float(s) for s in self.steps)
        if not self.steps or any(not 0 < s <= 100 for s in self.steps) or \
                list(self.steps) != sorted(set(self.steps)):
            raise ValueError(f"rollout.steps must be increasing percentages in (0, 100], got {self.steps}")
        if self.mode not in ("split", "shadow", "abn"):
            raise ValueError(f"rollout.mode must be 'split', 'shadow' or 'abn', got {self.mode!r}")
        if self.mode == "abn":
            arms = {int(v): float(w) for v, w in (self.arms or {}).items()}
            if not arms or any(not 0 < w < 1 for w in arms.values()) or sum(arms.values()) >= 1:
                raise ValueError(f"rollout.arms (abn) must give each version a weight in (0, 1), summing "
                                 f"below 1 (the primary answers the rest), got {self.arms}")
            self.arms = arms
        elif self.arms:
            raise ValueError(f"rollout.arms is for mode 'abn', not {self.mode!r}")
        if self.dwell_s < 0 or self.interval_s <= 0:
            raise ValueError("rollout.dwell_s must be >= 0 and rollout.interval_s > 0")
        if self.max_step_s is not None and self.max_step_s < self.dwell_s:
            raise ValueError(f"rollout.max_step_s ({self.max_step_s}) must be >= dwell_s ({self.dwell_s})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutConfig:
        gates = dict(d.get("gates", {}))
        if "agree_verdicts" in gates:
            gates["agree_verdicts"] = tuple(gates["agree_verdicts"])
        return cls(**{**d, "steps": tuple(d["steps"]), "gates": GateConfig(**gates),
                      "arms": {int(v): w for v, w in d["arms"].items()} if d.get("arms") else None})


@dataclass(kw_only=True)
class Progress:
    model: str
    candidate: int
    primary: int
    mode: str
    steps: list[float]
    config: dict[str, Any] = field(default_factory=dict)  # the RolloutConfig it was started with
    status: str = RUNNING
    step_index: int = 0
    step_started_at: float = 0.0
    started_at: float = 0.0
    look: int = 0
    baseline: dict[str, Any] | None = None  # GuardReadings at the start of the step's window
    reference: dict[str, float] | None = None  # primary latency buckets of an earlier window
    last_report: dict[str, Any] | None = None
    reason: str = ""
    updated_at: float = 0.0
    # abn: per arm ("<version>"): weight, status, and its own window (baseline, look, reference,
    # last_report, reason); the fields above then describe the rollout as a whole
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    # gate -> what its last PASS rested on (the evidence promote's last line names)
    judged: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def live_arms(self) -> list[int]:
        return [int(v) for v, a in self.arms.items() if a["status"] == RUNNING]

    @property
    def share(self) -> float:
        return self.steps[self.step_index] / 100

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pin_primary(s: RolloutState, primary: int) -> None:
    """Make ``primary`` the state's primary, remembering the one it replaces."""
    if s.primary != primary:
        if s.primary > 0:
            s.previous_primary = s.primary
        s.primary = primary


def judge_doc(cfg: RolloutConfig) -> dict[str, Any]:
    """The rollout state's ``judges`` entry for a version under test: how the guards compare it."""
    doc: dict[str, Any] = {"judge": cfg.gates.judge}
    if cfg.gates.judge == "task" and cfg.gates.cosine_floor is not None:
        doc["cosine"] = cfg.gates.cosine_floor
    return doc


def passed_on(g: dict[str, Any]) -> str | None:
    """A few words on what a passing gate rested on; None for gates every rollout passes."""
    f = g.get("figures") or {}
    name = g["name"]
    if name == "disagreement":
        return (f"disagreement limit {f.get('limit', 0):.2%} ({f.get('limit_source', '')}): "
                f"{f.get('disagree', 0):.0f}/{f.get('compared', 0):.0f} rows differ")
    if name == "labels":
        origins = ", ".join(f"{k} {v:.0f}" for k, v in sorted((f.get("origins") or {}).items()))
        return (f"live labels: accuracy {f.get('candidate_accuracy', 0):.2%} vs {f.get('primary_accuracy', 0):.2%} "
                f"on {f.get('candidate_labeled', 0):.0f} / {f.get('primary_labeled', 0):.0f} rows ({origins})")
    if name == "agreement":
        return f"validator agreement {f.get('agreement', 0):.2%} on {f.get('compared', 0):.0f} rows"
    if name == "latency":
        return "latency" + (f" (ratio {f['ratio']:.3f})" if isinstance(f.get("ratio"), (int, float)) else "")
    if name == "cost":
        return "cost"
    return None


def evidence(p: Progress) -> str:
    """What the rollout's decisions rested on: the offline judgement, then each live gate's
    last PASS, so that a promotion without labels reads as one on a disagreement limit."""

    parts = []
    offline = (p.config or {}).get("offline")
    if offline:
        try:
            parts.append(OfflineJudgement(**offline).evidence())
        except TypeError:  # a progress written by an older release
            parts.append(f"offline {offline.get('verdict', '?')}")
    else:
        parts.append("no offline judgement")
    parts.extend(p.judged.values())
    return "; ".join(parts)
