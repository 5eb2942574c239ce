"""``python -m exporter route``: set a guarded model's rollout state by hand.

The guards re-read the state within ``routing.poll_interval_s`` (default 1 s); no Triton
restart. ``promote`` (a later command) drives the same document through gradual steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.errors import ExporterError
from exporter.rollout.controller import settle_progress
from exporter.rollout.gates.reasons import golden_reason, trip_reason
from exporter.rollout.guards import guard_target, validator_limits
from exporter.rollout.reconcile import reconcile_registry
from tritonguard.core import repository
from tritonguard.rollout.breaker import CLOSED
from tritonguard.rollout.endpoints import read_endpoints
from tritonguard.rollout.state import Arm, Candidate, RolloutState, StateError
from tritonguard.rollout.stores import open_store

DEFAULT_CHOICES = ("abstain", "none")


class RouteError(ExporterError, ValueError):
    """A route that cannot be applied (unknown version, bad share); nothing is written."""


@dataclass(kw_only=True)
class RouteChange:
    primary: int | None = None
    candidate: int | None = None  # 0 removes the candidate
    share: float | None = None
    shadow: float | None = None
    fallback: list[str] | None = None
    default: str | None = None  # "abstain", "none"
    reset_breaker: int | None = None  # close this version's breaker (operator override)
    arms: list[tuple[int, float]] | None = None  # A/B/n weights; [] ends the split


def parse_arms(text: str) -> list[tuple[int, float]]:
    """``"2=0.3,3=0.2"`` -> ``[(2, 0.3), (3, 0.2)]``; ``"none"`` -> ``[]``."""
    if text.strip().lower() == "none":
        return []
    arms = []
    for part in text.split(","):
        version, sep, weight = part.strip().partition("=")
        try:
            if not sep:
                raise ValueError
            arms.append((int(version), float(weight)))
        except ValueError:
            raise RouteError(f"--arms: {part.strip()!r} is not VERSION=WEIGHT (e.g. --arms 2=0.3,3=0.2, "
                             "or --arms none)") from None
    return arms


def apply(repo: Path, model: str, change: RouteChange, *, by: str = "cli", reason: str | None = None,
          rolled_back: bool = False) -> RolloutState:
    """Apply ``change`` to ``model``'s rollout state (one compare-and-set). A finished rollout
    that the change undoes is marked in its progress record: ``rolled_back`` (``rolled_back=True``,
    for ``exporter rollback``) or ``superseded``, with ``reason``."""
    repo = Path(repo)
    target = guard_target(repo, model)
    at_url = read_endpoints(repo / target)
    versions = set(repository.versions(repo / target)) | set(at_url)  # and those at a URL

    def known(v: int, what: str) -> None:
        if versions and v not in versions:
            raise RouteError(f"{what} v{v} is not a version of '{target}' (have {sorted(versions)})")

    for v, what in ((change.primary, "primary"), (change.candidate or None, "candidate"),
                    *((v, "arm") for v, _ in change.arms or [])):
        if v is not None:
            known(v, what)
    for v, w in change.arms or []:
        if not 0.0 < w <= 1.0:
            raise RouteError(f"arm v{v}: weight must be in (0, 1], got {w}")
    for value, what in ((change.share, "share"), (change.shadow, "shadow")):
        if value is not None and not 0.0 <= value <= 1.0:
            raise RouteError(f"{what} must be in [0, 1], got {value}")

    def update(state: RolloutState) -> RolloutState:
        if change.primary is not None and change.primary != state.primary:
            if state.primary > 0:
                state.previous_primary = state.primary
            state.primary = change.primary
        before = state.candidate.version if state.candidate is not None else None
        if change.candidate is not None:
            if change.candidate == 0:
                state.candidate = None
            elif change.candidate == before:  # the same candidate again: keep its share unless given
                state.candidate.share = state.candidate.share if change.share is None else change.share
            else:  # a new candidate starts from nothing: no share, no shadow, unless given
                state.candidate = Candidate(change.candidate, change.share or 0.0)
                state.shadow_share = 0.0
                declared = at_url.get(change.candidate)
                if declared is not None and str(change.candidate) not in state.judges:
                    # compared with the primary as its declaration says (task by default: another
                    # runtime's text differs by nature). With no entry the guards judged it for
                    # equivalence, and the breaker of a real server's version routed by hand
                    # tripped on the first 20 comparisons (validator_fail), 2026-11-28
                    state.judges[str(change.candidate)] = {"judge": declared.judge}
        elif change.share is not None:
            if state.candidate is None:
                raise RouteError("--share needs a candidate (--candidate N)")
            state.candidate.share = change.share
        if state.candidate is not None and state.candidate.version == state.primary:
            state.candidate = None
        if change.shadow is not None:
            if change.shadow > 0 and state.candidate is None:
                raise RouteError("--shadow needs a candidate (--candidate N): it mirrors the primary's "
                                 "traffic to the candidate")
            state.shadow_share = change.shadow
        if state.candidate is None:  # no candidate, nothing to mirror to: its shadow goes with it
            state.shadow_share = 0.0
        if change.fallback is not None:
            state.fallback = list(change.fallback)
        if change.default is not None:
            state.default_response = None if change.default == "none" else change.default
        if change.reset_breaker is not None:
            state.breakers.pop(str(change.reset_breaker), None)
        if change.arms is not None:
            if change.arms and state.candidate is not None:
                raise RouteError(f"'{model}' has candidate v{state.candidate.version} in rollout: an A/B/n "
                                 "split cannot run beside it (abort the rollout or --candidate 0 first)")
            if any(v == state.primary for v, _ in change.arms):
                raise RouteError(f"v{state.primary} is the primary: it answers the traffic the arms leave, "
                                 "so it cannot be an arm")
            state.arms = [Arm(v, w) for v, w in change.arms]
            for a in state.arms:
                state.breakers.pop(str(a.version), None)  # a fresh arm starts with a closed breaker
        elif state.arms and change.candidate:
            raise RouteError(f"'{model}' runs an A/B/n split (arms {', '.join(f'v{a.version}' for a in state.arms)}): "
                             "end it with --arms none before setting a candidate")
        # a version promoted to primary leaves the split (the primary answers the rest anyway)
        state.arms = [a for a in state.arms if a.version != state.primary]
        return state

    store = open_store(model, repo)
    try:
        state = store.update(update, by=by)
    except StateError as exc:
        raise RouteError(str(exc)) from None
    if change.primary is not None or change.candidate is not None or change.arms is not None:
        # a finished rollout whose outcome this change undid says so (status, rollout status)

        settle_progress(model, repo, state, reason or f"routing changed by {by}", rolled_back=rolled_back)
    return state


def state_summary(state: dict[str, Any], *, goldens: bool = False) -> list[str]:
    """A state document in lines, the one wording every view uses: the routing
    (``r3: primary v1, candidate v2 at 5%, shadow 0%, chain candidate → primary → default``), the
    A/B/n split, the goldens (with ``goldens``) and the breakers."""
    cand = state.get("candidate")
    lines = [f"r{state['revision']}: primary v{state['primary']['version']}"
             + (f", candidate v{cand['version']} at {cand['share']:.0%}" if cand else ", no candidate")
             + f", shadow {state['shadow_share']:.0%}, chain {' → '.join(state['fallback'])}"]
    if arms_line := describe_arms(state):
        lines.append(arms_line)
    if goldens:
        lines += [f"goldens v{v}: {g.get('summary') or g.get('verdict')}"
                  for v, g in sorted(state.get("goldens", {}).items())]
    for v, b in sorted(state.get("breakers", {}).items()):
        last = f"; last trip {b['last_trip_text']}" if b.get("last_trip_text") else ""
        lines.append(f"breaker v{v}: {b.get('state', 'closed')} (trips {b.get('trips', 0)}{last})")
    return lines


def describe_arms(state: dict[str, Any]) -> str | None:
    """``"A/B/n: v2 30%, v3 20%, primary v1 50%"`` for a state document with arms, else None."""
    arms = state.get("arms") or []
    if not arms:
        return None
    rest = 1 - sum(a["weight"] for a in arms)
    return ("A/B/n: " + ", ".join(f"v{a['version']} {a['weight']:.0%}" for a in arms)
            + f", primary v{state['primary']['version']} {rest:.0%}")


def named_versions(state: RolloutState) -> list[int]:
    """Versions the state routes to or may fall back to: primary, candidate, arms, previous primary."""
    named = [state.primary, *(a.version for a in state.arms), *state.route_versions()]
    return [v for v in dict.fromkeys(named) if v > 0]


def breakers(state: RolloutState) -> dict[str, dict[str, Any]]:
    """Breaker per version: every version the state names (a guard shares a breaker's state only
    when it changes, so a version that never tripped has no document: it is closed) plus every
    version with a shared document (a tripped breaker stays listed after its version left)."""
    out: dict[str, dict[str, Any]] = {}
    for v in sorted({*map(str, named_versions(state)), *state.breakers}, key=lambda k: (not k.isdigit(), k.zfill(9))):
        b = state.breakers.get(v) or {}
        last = b.get("last_trip")
        out[v] = {"state": b.get("state", CLOSED), "trips": b.get("trips", 0), "last_trip": last,
                  "shared": v in state.breakers}
        if last:
            out[v]["last_trip_text"] = describe_trip(last)
    return out


def describe_trip(trip: dict[str, Any]) -> str:
    """``latency: p95_ms 41.2 > budget_ms 20`` from a breaker's ``last_trip`` document."""

    return trip_reason(trip)


def show(repo: Path, model: str, *, reconcile: bool = True) -> dict[str, Any]:
    """The state as a dict for display: breakers of every version it names (closed unless shared
    otherwise), golden results with their figures against the limits (``summary``). With
    ``reconcile``, the registry is brought in line with the state first (the primary is
    PRODUCTION; a warning, never an error, when it cannot be)."""

    repo = Path(repo)
    guard_target(repo, model)
    state = open_store(model, repo).load()
    if state is None:
        return {"model": model, "state": None}
    if reconcile:

        reconcile_registry(repo, model, state=state)
    d = state.to_dict()
    d["breakers"] = breakers(state)
    limits = validator_limits(repo, model)
    for g in d.get("goldens", {}).values():
        g["summary"] = golden_reason(g, limits)
    return d
