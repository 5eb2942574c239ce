""""""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from tritonguard.core.errors import TritonGuardError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE = "rollout_state.json"
CHAIN_STEPS = ("candidate", "primary", "previous_primary", "default")
VERDICTS = ("PASS", "MARGINAL", "FAIL")


class StateError(TritonGuardError):
    """The rollout state document is invalid, or could not be written."""


class StateConflict(StateError):
    """A compare-and-set found a different revision than the caller expected."""


class StateUnavailable(StateError):
    """The store cannot be reached (Redis down, or backing off after an outage)."""


@dataclass
class Candidate:
    version: int
    share: float  # fraction of live traffic routed to the candidate, 0..1


@dataclass
class Arm:
    """One extra version of an A/B/n split: ``weight`` is its fraction of live traffic."""

    version: int
    weight: float


@dataclass(kw_only=True)
class RolloutState:
    model: str
    revision: int = 0
    primary: int = -1  # -1: whatever version Triton serves as latest
    candidate: Candidate | None = None
    shadow_share: float = 0.0
    fallback: list[str] = field(default_factory=lambda: list(CHAIN_STEPS))
    previous_primary: int | None = None
    default_response: None | str | dict[str, list] = None
    goldens: dict[str, dict[str, Any]] = field(default_factory=dict)
    breakers: dict[str, dict[str, Any]] = field(default_factory=dict)
    updated_at: float = 0.0
    updated_by: str = ""
    # bumped by rollback/promote: every guard instance drops its in-process (L1) cache entries
    cache_epoch: int = 0
    # A/B/n: fixed traffic weights for extra versions; the primary answers the rest. Exclusive
    # with a candidate: a split experiment or a gated rollout, not both at once.
    arms: list[Arm] = field(default_factory=list)
    # how the guards compare a version under test with the primary (see :data:`JUDGES`), by
    # version: {"judge": "task" | "equivalence", "cosine": per-row agreement floor (embeddings)}.
    # A version with no entry is judged for equivalence (numerical tolerances).
    judges: dict[str, dict[str, Any]] = field(default_factory=dict)

    def judge_of(self, version: int) -> dict[str, Any]:
        return self.judges.get(str(version)) or {"judge": "equivalence"}

    # -- routing helpers ----------------------------------------------------------------
    def chain(self) -> list[tuple[str, int | None]]:
        """Fallback steps that can answer, in order: ``(step, version)``; ``default`` has no version."""
        steps = {"candidate": (self.candidate is not None, self.candidate and self.candidate.version),
                 "primary": (True, self.primary),
                 "previous_primary": (self.previous_primary is not None, self.previous_primary),
                 "default": (self.default_response is not None, None)}
        return [(step, steps[step][1]) for step in self.fallback if steps[step][0]]

    def route_versions(self) -> list[int]:
        """Model versions the chain may call, in chain order, each once."""
        return list(dict.fromkeys(v for _, v in self.chain() if v is not None))

    def candidate_mask(self, u: np.ndarray) -> np.ndarray:
        """Rows whose uniform draw ``u`` (shape [n], in [0, 1)) routes them to the candidate."""
        share = self.candidate.share if self.candidate is not None else 0.0
        return np.asarray(u) < share

    def arm_choice(self, u: np.ndarray) -> np.ndarray:
        """Per row, the A/B/n arm version its uniform draw ``u`` lands in, 0 for the primary.
        Arms take consecutive bands of [0, 1) in their listed order."""
        u = np.asarray(u)
        out = np.zeros(u.shape, dtype=np.int64)
        lo = 0.0
        for arm in self.arms:
            out[(u >= lo) & (u < lo + arm.weight)] = arm.version
            lo += arm.weight
        return out

    def shadow_mask(self, u: np.ndarray) -> np.ndarray:
        """Rows (primary-served) whose draw ``u`` also sends a shadow copy to the candidate."""
        share = self.shadow_share if self.candidate is not None else 0.0
        return np.asarray(u) < share

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        cand = self.candidate
        return copy.deepcopy({
            "format_version": FORMAT_VERSION, "model": self.model, "revision": self.revision,
            "primary": {"version": self.primary},
            "candidate": None if cand is None else {"version": cand.version, "share": cand.share},
            "shadow_share": self.shadow_share, "fallback": self.fallback,
            "previous_primary": self.previous_primary, "default_response": self.default_response,
            "goldens": self.goldens, "breakers": self.breakers,
            "updated_at": self.updated_at, "updated_by": self.updated_by, "cache_epoch": self.cache_epoch,
            "arms": [{"version": a.version, "weight": a.weight} for a in self.arms],
            "judges": self.judges,
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> RolloutState:
        """Strict: a missing, unknown or mistyped field raises :class:`StateError` naming it."""
        try:
            doc = _Document.model_validate(d)
        except ValidationError as exc:
            raise StateError(_problem(exc.errors()[0])) from None
        cand = doc.candidate
        candidate = None if cand is None else Candidate(cand.version, cand.share)
        return cls(
            model=doc.model, revision=doc.revision, primary=doc.primary.version, candidate=candidate,
            shadow_share=doc.shadow_share, fallback=list(doc.fallback), previous_primary=doc.previous_primary,
            default_response=copy.deepcopy(doc.default_response),
            goldens={k: {**g.model_dump(), "metrics": copy.deepcopy(g.metrics)} for k, g in doc.goldens.items()},
            breakers=copy.deepcopy(doc.breakers), updated_at=doc.updated_at, updated_by=doc.updated_by,
            cache_epoch=doc.cache_epoch, arms=_arms(doc.arms, doc.primary.version, candidate),
            judges={k: j.model_dump(exclude_none=True) for k, j in doc.judges.items()})

    @classmethod
    def from_json(cls, text: str | bytes) -> RolloutState:
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise StateError(f"state is not valid JSON: {exc}") from None
        return cls.from_dict(raw)


JUDGES = ("task", "equivalence")


# -- the document's schema: pydantic in strict mode (no "3" for 3, no true for 1) with unknown
# fields forbidden; :func:`_problem` words its first error as "state field '<path>': <rule>".
def _supported(v: int) -> int:
    if v != FORMAT_VERSION:
        raise ValueError(f"{v} is not supported (this build reads {FORMAT_VERSION})")
    return v


def _in_unit(v: float) -> float:
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{v} is not in [0, 1]")
    return v


def _primary(v: int) -> int:
    if v < 1 and v != -1:
        raise ValueError(f"version must be >= 1 or -1 (latest), got {v}")
    return v


def _fallback(v: list[str]) -> list[str]:
    if not all(s in CHAIN_STEPS for s in v) or len(set(v)) != len(v) or "primary" not in v:
        raise ValueError(f"expected unique steps from {', '.join(CHAIN_STEPS)}, including 'primary'; got {v!r}")
    return v


def _default(v: Any) -> Any:
    if v is not None and v != "abstain" and not (
            isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, list) for k, x in v.items())):
        raise ValueError('expected null, "abstain" or {"OUTPUT": [...]}')
    return v


Number = Annotated[float, Field(allow_inf_nan=False)]
Share = Annotated[Number, AfterValidator(_in_unit)]
Version = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
VersionKey = Annotated[str, Field(pattern=r"^[0-9]+$")]  # "2": documents key versions by their number


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Primary(_Strict):
    version: Annotated[int, AfterValidator(_primary)]


class _Candidate(_Strict):
    version: Version
    share: Share


class _Arm(_Strict):
    version: Version
    weight: Share


class _Golden(_Strict):
    verdict: Literal[VERDICTS]
    metrics: dict[str, Any] = {}
    checked_at: Number = 0.0


class _Judge(_Strict):
    judge: Literal[JUDGES]
    cosine: Number | None = None


class _Document(_Strict):
    format_version: Annotated[int, AfterValidator(_supported)]
    model: Annotated[str, Field(min_length=1)]
    primary: _Primary
    revision: Count = 0
    candidate: _Candidate | None = None
    shadow_share: Share = 0.0
    fallback: Annotated[list[str], AfterValidator(_fallback)] = list(CHAIN_STEPS)
    previous_primary: Version | None = None
    default_response: Annotated[Any, AfterValidator(_default)] = None
    goldens: dict[VersionKey, _Golden] = {}
    breakers: dict[VersionKey, dict[str, Any]] = {}
    updated_at: Number = 0.0
    updated_by: str = ""
    cache_epoch: Count = 0
    arms: list[_Arm] = []
    judges: dict[VersionKey, _Judge] = {}


_RULES = {"extra_forbidden": "unknown field", "missing": "required field is missing",
          "int_type": "expected an integer", "float_type": "expected a finite number",
          "finite_number": "expected a finite number", "string_type": "expected a string",
          "string_too_short": "expected a non-empty string", "dict_type": "expected an object",
          "model_type": "expected an object", "list_type": "expected a list",
          "string_pattern_mismatch": "keys must be version numbers"}


def _problem(err: Any) -> str:
    """``state field 'arms[0].weight': <rule>`` from one pydantic error."""
    where = ""
    for part in err["loc"]:
        if part == "[key]" or str(part).startswith(("function-", "nullable[")):
            continue  # pydantic's own steps: a dict key's check, a validator, an optional
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else part
    kind = err["type"]
    if kind == "value_error":
        rule = str(err["ctx"]["error"])
    elif kind in ("extra_forbidden", "missing", "string_pattern_mismatch"):
        rule = _RULES[kind]
    else:
        rule = f"{_RULES.get(kind, err['msg'])}, got {err['input']!r:.60}"
    return f"state field '{where or 'state'}': {rule}"


def _arms(arms: list[_Arm], primary: int, candidate: Candidate | None) -> list[Arm]:
    """What the schema cannot check one arm at a time: versions against each other, the primary
    and a candidate, and the sum of the weights."""
    out: list[Arm] = []
    for k, a in enumerate(arms):
        if a.weight <= 0:
            raise StateError(f"state field 'arms[{k}].weight': must be > 0, got {a.weight}")
        if a.version == primary:
            raise StateError(f"state field 'arms[{k}].version': v{a.version} is the primary, which "
                             f"answers the traffic the arms leave")
        if any(x.version == a.version for x in out):
            raise StateError(f"state field 'arms[{k}].version': v{a.version} is listed twice")
        out.append(Arm(a.version, a.weight))
    total = sum(a.weight for a in out)
    if total > 1.0 + 1e-9:
        raise StateError(f"state field 'arms': weights sum to {total:g} > 1 (the primary answers 1 - sum)")
    if out and candidate is not None:
        raise StateError("state field 'arms': an A/B/n split and a candidate rollout cannot run at once "
                         f"(candidate v{candidate.version}); end one first")
    return out

