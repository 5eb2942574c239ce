"""Rollout state: one small versioned JSON document per guarded model, shared by every process.

Each Triton model instance is its own process, so routing (primary, candidate share, fallback
chain) and breaker state live in a store, never in module globals. Two stores, one interface:

- :class:`FileStateStore`: ``<repo>/<guard>/rollout_state.json``; writes are atomic replaces
  under an ``flock`` (:func:`file_lock`) on a sidecar lock file, so writers in separate processes never lose
  an update; ``poll`` costs one ``stat`` while nothing changed.
- :class:`RedisStateStore`: one hash per model; writes are WATCH/MULTI/EXEC compare-and-set.

Reads never raise into serving: a corrupt or missing document, or a Redis outage, leaves the
last good state in place (logged once, counted in ``errors``). Writes raise :class:`StateError`
(:class:`StateConflict` when ``expected_revision`` no longer holds), for the caller to handle.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from filelock import FileLock
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from tritonguard.core.errors import TritonGuardError
from tritonguard.core.files import atomic_write
from tritonguard.core.outage import Backoff
from tritonguard.core.store import ENV_URL, file_lock

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


Updater = Callable[[RolloutState], "RolloutState | None"]
BreakerUpdater = Callable[["dict[str, Any] | None"], "dict[str, Any] | None"]


def _apply(fn: Updater, current: RolloutState, expected: int | None, by: str, now: float) -> RolloutState:
    if expected is not None and current.revision != expected:
        raise StateConflict(f"state of '{current.model}' is at revision {current.revision}, expected {expected}")
    work = RolloutState.from_dict(current.to_dict())  # fn may mutate its argument freely
    new = fn(work)
    new = work if new is None else new
    new.revision = current.revision + 1
    new.updated_at = now
    new.updated_by = by or new.updated_by
    # round trip: a buggy updater fails here instead of writing a document no reader accepts
    return RolloutState.from_dict(json.loads(json.dumps(new.to_dict())))


def _breaker_fn(version: int | str, fn: BreakerUpdater) -> Updater:
    key = str(version)

    def update(state: RolloutState) -> RolloutState:
        new = fn(copy.deepcopy(state.breakers.get(key)))
        if new is None:
            state.breakers.pop(key, None)
        else:
            state.breakers[key] = new
        return state

    return update


class FileStateStore:
    """The state document as a file; see the module docstring."""

    def __init__(self, path: str | os.PathLike, *, model: str = "", clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.model = model or self.path.parent.name
        self.clock = clock
        self.errors = 0
        self._last: RolloutState | None = None
        self._sig: tuple[int, int, int] | None = None
        self._failing = False

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        # the inode changes on every atomic replace, so equal signatures mean an unchanged file
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> RolloutState:
        with open(self.path, "rb") as f:
            return RolloutState.from_json(f.read())

    def _refresh(self, sig: tuple[int, int, int] | None) -> None:
        try:
            if sig is None:
                raise FileNotFoundError(f"{self.path} does not exist")
            state = self._read()
        except (OSError, StateError) as exc:
            self._sig = sig
            if self._last is None and isinstance(exc, FileNotFoundError):
                return  # never written yet: not an error
            self.errors += 1
            if not self._failing:
                log.error("rollout state %s unreadable, keeping revision %s: %s", self.path,
                          None if self._last is None else self._last.revision, exc)
            self._failing = True
            return
        if self._failing:
            log.info("rollout state %s readable again at revision %d", self.path, state.revision)
        self._failing = False
        self._last, self._sig = state, sig

    def load(self) -> RolloutState | None:
        """The current state, or the last good one; None before any state was written."""
        self._refresh(self._stat())
        return self._last

    def poll(self, last_revision: int | None = None) -> RolloutState | None:
        """The state if its revision differs from ``last_revision``, else None; one stat when unchanged."""
        sig = self._stat()
        if sig != self._sig:
            self._refresh(sig)
        if self._last is None or self._last.revision == last_revision:
            return None
        return self._last

    def _locked(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return file_lock(self.lock_path)

    def _write(self, state: RolloutState) -> None:
        # the rename itself must survive a crash too: the folder's entry is synced as well
        atomic_write(self.path, state.to_json(), sync_dir=True)

    def update(self, fn: Updater, expected_revision: int | None = None, *, by: str = "") -> RolloutState:
        """Read-modify-write under the lock; ``fn`` gets a private copy (a fresh state if none)."""
        with self._locked():
            try:
                current = self._read()
            except FileNotFoundError:
                current = RolloutState(model=self.model)
            except OSError as exc:
                raise StateError(f"cannot read {self.path}: {exc}") from None
            new = _apply(fn, current, expected_revision, by, self.clock())
            try:
                self._write(new)
            except OSError as exc:
                raise StateError(f"cannot write {self.path}: {exc}") from None
        self._last, self._sig, self._failing = new, self._stat(), False
        return new

    def update_breaker(self, version: int | str, fn: BreakerUpdater, *, by: str = "") -> RolloutState:
        """CAS on one version's breaker document only; routing fields are re-read, never clobbered."""
        return self.update(_breaker_fn(version, fn), by=by)


class RedisStateStore:
    """The state document in a Redis hash (``doc``, ``revision``); see the module docstring."""

    BACKOFF_START_S = 5.0
    BACKOFF_MAX_S = 60.0
    MAX_CAS_ATTEMPTS = 200

    def __init__(self, url: str, model: str, *, key_prefix: str = "tritonguard:state:",
                 socket_timeout: float = 0.1, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, client: Any = None):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        self.url, self.model = url, model
        self.key = f"{key_prefix}{model}"
        self.clock, self.monotonic = clock, monotonic
        # no client-side retries: a retry loop would hold the serving thread during an outage
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.errors = 0
        self._last: RolloutState | None = None
        self._health = Backoff(monotonic, self.BACKOFF_START_S, self.BACKOFF_MAX_S)

    # -- outage handling ------------------------------------------------------------------
    def _available(self) -> bool:
        return self._health.available()

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        log.error("rollout state store %s unreachable (%s: %s); retrying in %.0f s", self.url,
                  type(exc).__name__, exc, self._health.fail())

    def _ok(self) -> None:
        if self._health.recover():
            log.info("rollout state store %s reachable again", self.url)

    # -- reads ----------------------------------------------------------------------------
    def _parse(self, raw: bytes | None) -> RolloutState | None:
        if raw is None:
            return None
        try:
            return RolloutState.from_json(raw)
        except StateError as exc:
            self.errors += 1
            log.error("rollout state %s invalid, keeping the last good one: %s", self.key, exc)
            return None

    def load(self) -> RolloutState | None:
        if not self._available():
            return self._last
        try:
            raw = self.client.hget(self.key, "doc")
        except self._redis.RedisError as exc:
            self._failed(exc)
            return self._last
        self._ok()
        state = self._parse(raw)
        if state is not None:
            self._last = state
        return self._last

    def poll(self, last_revision: int | None = None) -> RolloutState | None:
        """Like :meth:`FileStateStore.poll`; one small HGET while the revision is unchanged."""
        if self._available():
            try:
                rev = self.client.hget(self.key, "revision")
                self._ok()
                if rev is not None and (self._last is None or int(rev) != self._last.revision):
                    self.load()
            except self._redis.RedisError as exc:
                self._failed(exc)
            except ValueError as exc:
                self.errors += 1
                log.error("rollout state %s: bad revision field: %s", self.key, exc)
        if self._last is None or self._last.revision == last_revision:
            return None
        return self._last

    # -- writes ---------------------------------------------------------------------------
    def update(self, fn: Updater, expected_revision: int | None = None, *, by: str = "") -> RolloutState:
        if not self._available():
            raise StateUnavailable(f"state store {self.url} is backing off after an error")
        redis = self._redis
        try:
            with self.client.pipeline() as pipe:
                for _ in range(self.MAX_CAS_ATTEMPTS):
                    try:
                        pipe.watch(self.key)
                        raw = pipe.hget(self.key, "doc")
                        current = (RolloutState.from_json(raw) if raw is not None
                                   else RolloutState(model=self.model))
                        new = _apply(fn, current, expected_revision, by, self.clock())
                        pipe.multi()
                        pipe.hset(self.key, mapping={"doc": new.to_json(), "revision": new.revision})
                        pipe.execute()
                    except redis.WatchError:
                        # another writer won the race: re-read and re-apply, after a short jitter
                        time.sleep(random.uniform(0, 0.002))
                        continue
                    self._ok()
                    self._last = new
                    return new
        except redis.RedisError as exc:
            self._failed(exc)
            raise StateUnavailable(f"state store {self.url}: {type(exc).__name__}: {exc}") from None
        raise StateConflict(f"state of '{self.model}': gave up after {self.MAX_CAS_ATTEMPTS} contended attempts")

    def update_breaker(self, version: int | str, fn: BreakerUpdater, *, by: str = "") -> RolloutState:
        return self.update(_breaker_fn(version, fn), by=by)


StateStore = FileStateStore | RedisStateStore


def open_store(model: str, repo_dir: str | os.PathLike, url: str | None = None, **kwargs: Any) -> StateStore:
    """Redis when ``url`` (default ``$TRITONGUARD_STATE_URL``) is set, else the file beside the guard."""
    if url is None:
        url = os.environ.get(ENV_URL, "")
    if url:
        return RedisStateStore(url, model, **kwargs)
    return FileStateStore(Path(repo_dir) / model / STATE_FILE, model=model, **kwargs)

