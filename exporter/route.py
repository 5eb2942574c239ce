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
from tritonguard.state import Candidate, RolloutState, StateError, open_store

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


def _guard_target(repo: Path, model: str) -> str:
    cfg_path = repo / model / repository.CONFIG
    if not cfg_path.exists():
        raise RouteError(f"no model '{model}' in {repo}")
    cfg = repository.read_config(repo / model)
    if cfg.get("backend") != "guard":
        raise RouteError(f"'{model}' is not a guard model (backend {cfg.get('backend') or cfg.get('platform')!r})")
    return cfg["parameters"]["target"]["string_value"]


def apply(repo: Path, model: str, change: RouteChange, *, by: str = "cli") -> RolloutState:
    repo = Path(repo)
    target = _guard_target(repo, model)
    versions = set(repository.versions(repo / target))

    def known(v: int, what: str) -> None:
        if versions and v not in versions:
            raise RouteError(f"{what} v{v} is not a version of '{target}' (have {sorted(versions)})")

    for v, what in ((change.primary, "primary"), (change.candidate or None, "candidate")):
        if v is not None:
            known(v, what)
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
        return state

    store = open_store(model, repo)
    try:
        return store.update(update, by=by)
    except StateError as exc:
        raise RouteError(str(exc)) from None


def show(repo: Path, model: str) -> dict[str, Any]:
    _guard_target(repo, model)
    state = open_store(model, repo).load()
    if state is None:
        return {"model": model, "state": None}
    d = state.to_dict()
    d["breakers"] = {v: {"state": b.get("state", CLOSED), "trips": b.get("trips", 0),
                         "last_trip": b.get("last_trip")} for v, b in state.breakers.items()}
    return d
