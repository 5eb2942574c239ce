"""``python -m exporter route``: set a guarded model's rollout state by hand.

The guards re-read the state within ``routing.poll_interval_s`` (default 1 s); no Triton
restart. ``promote`` (a later command) drives the same document through gradual steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonguard import repository
from tritonguard.breaker import CLOSED
from tritonguard.state import Arm, Candidate, RolloutState, StateError, open_store

DEFAULT_CHOICES = ("abstain", "none")


class RouteError(ValueError):
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


def _guard_target(repo: Path, model: str) -> str:
    cfg_path = repo / model / repository.CONFIG
    if not cfg_path.exists():
        raise RouteError(f"no model '{model}' in {repo}")
    found = repository.guard_dir(repo, model)
    if found is None:
        cfg = repository.read_config(repo / model)
        raise RouteError(f"'{model}' is not a guard model (backend {cfg.get('backend') or cfg.get('platform')!r})")
    return found[1]["parameters"]["target"]["string_value"]


def apply(repo: Path, model: str, change: RouteChange, *, by: str = "cli") -> RolloutState:
    repo = Path(repo)
    target = _guard_target(repo, model)
    versions = set(repository.versions(repo / target))

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
        if change.candidate is not None:
            state.candidate = None if change.candidate == 0 else Candidate(change.candidate, change.share or 0.0)
        elif change.share is not None:
            if state.candidate is None:
                raise RouteError("--share needs a candidate (--candidate N)")
            state.candidate.share = change.share
        if state.candidate is not None and state.candidate.version == state.primary:
            state.candidate = None
        if change.shadow is not None:
            state.shadow_share = change.shadow
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
        return store.update(update, by=by)
    except StateError as exc:
        raise RouteError(str(exc)) from None


def describe_arms(state: dict[str, Any]) -> str | None:
    """``"A/B/n: v2 30%, v3 20%, primary v1 50%"`` for a state document with arms, else None."""
    arms = state.get("arms") or []
    if not arms:
        return None
    rest = 1 - sum(a["weight"] for a in arms)
    return ("A/B/n: " + ", ".join(f"v{a['version']} {a['weight']:.0%}" for a in arms)
            + f", primary v{state['primary']['version']} {rest:.0%}")


def show(repo: Path, model: str) -> dict[str, Any]:
    _guard_target(repo, model)
    state = open_store(model, repo).load()
    if state is None:
        return {"model": model, "state": None}
    d = state.to_dict()
    d["breakers"] = {v: {"state": b.get("state", CLOSED), "trips": b.get("trips", 0),
                         "last_trip": b.get("last_trip")} for v, b in state.breakers.items()}
    return d
