"""Circuit breaker per (target, version), with hysteresis.

CLOSED: traffic flows and every batch feeds a sliding window of the last ``window`` requests
(errors, non-finite outputs, fused failures, latency) and of the last ``window`` compared
requests (validator verdicts). A rate over its limit, once ``min_requests`` are in the window
(``min_compared`` compared requests for the validator FAIL rate), trips the breaker.

A *fused failure* is a fused call of the version that failed while each of its requests,
retried alone, succeeded: users saw no error, but the version cannot serve a batch. It is a hard
fault of the version, like an error (a call that failed because one request was poisonous is
not one: that request fails alone too).

OPEN: no traffic for at least ``min_off_s``; then HALF_OPEN: only probe traffic, judged one
probe batch at a time. ``probes_to_close`` consecutive PASS probe rows close it (MARGINAL neither
counts nor resets the streak); a FAIL anywhere in a probe batch opens it again (that batch's
PASSes do not count) and restarts the off timer. A version whose fault hits a fraction ``f`` of
rows still comes back with probability about ``(1 - f) ** probes_to_close`` per off period: size
``probes_to_close`` to the faults that must stay out (the default, 20, lets a 25 % fault back
0.3 % of the time; 5 would let it back 24 %). For ``min_on_s`` after
closing, the non-critical signals (latency, validator FAIL rate) cannot trip it, so one noisy
window does not flap it; the critical ones (non-finite outputs, errors) always can.

Sharing between processes: every Triton model instance has its own :class:`Breaker` and its own
window, so rates are judged on the traffic that process saw. The *state* (open/closed, timers,
probe streak, last trip) is what is shared: a process that changes it writes :meth:`to_dict`
through ``store.update_breaker(version, fn)``, and the others :meth:`adopt` it when they poll the
store. ``changed_at`` orders transitions, so the latest one wins.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)
REASONS = ("error_rate", "non_finite", "fused_failures", "validator_fail", "latency", "drift", "manual")
CRITICAL = ("error_rate", "non_finite", "fused_failures")
FAIL = "FAIL"


@dataclass(kw_only=True)
class BreakerConfig:
    """``breaker.*`` parameters of a guard model."""

    window: int = 200  # requests in the sliding window
    min_requests: int = 20  # no judgement on fewer requests
    max_error_rate: float = 0.05
    max_nan_rate: float = 0.0  # requests with NaN/Inf outputs
    max_fused_rate: float = 0.05  # requests in fused calls that failed and were rescued alone
    max_fail_rate: float = 0.1  # validator FAIL rate over compared requests
    min_compared: int = 50  # no FAIL-rate judgement on fewer compared requests
    latency_budget_ms: float = 0.0  # window p95 over this trips; 0 = off
    min_off_s: float = 300.0
    probes_to_close: int = 20  # 5 would let a 25 % fault back a quarter of the time
    min_on_s: float = 60.0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("breaker.window must be >= 1")
        if not 1 <= self.min_requests <= self.window:
            raise ValueError("breaker.min_requests must be in 1..breaker.window")
        if not 1 <= self.min_compared <= self.window:
            raise ValueError("breaker.min_compared must be in 1..breaker.window")
        for name in ("max_error_rate", "max_nan_rate", "max_fused_rate", "max_fail_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"breaker.{name} must be in [0, 1]")
        for name in ("latency_budget_ms", "min_off_s", "min_on_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"breaker.{name} must be >= 0")
        if self.probes_to_close < 1:
            raise ValueError("breaker.probes_to_close must be >= 1")


@dataclass
class Trip:
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "figures": dict(self.figures), "at": self.at}


class _Ring:
    """Fixed-size ring of per-request values, written a batch at a time (at most two slices).

    ``nonzero`` is kept up to date on every write, so judging a window never rescans it.
    """

    def __init__(self, size: int, dtype: Any):
        self.buf = np.zeros(size, dtype=dtype)
        self.pos = 0
        self.count = 0
        self.nonzero = 0

    def push(self, values: np.ndarray) -> None:
        size = len(self.buf)
        values = values[-size:]
        k = len(values)
        first = min(k, size - self.pos)
        for dst, src in ((slice(self.pos, self.pos + first), values[:first]), (slice(0, k - first), values[first:])):
            if len(src):
                self.nonzero += int(np.count_nonzero(src)) - int(np.count_nonzero(self.buf[dst]))
                self.buf[dst] = src
        self.pos = (self.pos + k) % size
        self.count = min(size, self.count + k)

    def push_flags(self, n: int, ones: int) -> None:
        """Push ``n`` flags, the first ``ones`` of them set. The usual batch (no error, an all-
        zero window) only moves the position: the buffer is zeros wherever ``nonzero`` is 0."""
        if not ones and not self.nonzero:
            size = len(self.buf)
            k = min(n, size)
            self.pos = (self.pos + k) % size
            self.count = min(size, self.count + k)
            return
        self.push(np.arange(n) < ones)

    def values(self) -> np.ndarray:
        return self.buf if self.count == len(self.buf) else self.buf[:self.count]

    def clear(self) -> None:
        self.buf[:] = 0  # zeros, so overwriting them never changes ``nonzero``
        self.pos = self.count = self.nonzero = 0


class Breaker:
    def __init__(self, config: BreakerConfig | None = None, *, name: str = ""):
        self.config = config or BreakerConfig()
        self.name = name
        self.state = CLOSED
        self.opened_at: float | None = None
        self.closed_at: float | None = None  # last HALF_OPEN -> CLOSED, for min_on_s
        self.changed_at = 0.0
        self.probes_passed = 0
        self.trips = 0
        self.last_trip: Trip | None = None
        w = self.config.window
        # one entry per request (per compared request for _fails); order inside a batch does not
        # matter to a count-based window, so a batch's flags are written as a run of Trues first
        self._errors = _Ring(w, np.bool_)
        self._non_finite = _Ring(w, np.bool_)
        self._fused = _Ring(w, np.bool_)
        self._latency = _Ring(w, np.float32)
        self._fails = _Ring(w, np.bool_)

    # -- state machine --------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        if self.state == OPEN and self.opened_at is not None and now - self.opened_at >= self.config.min_off_s:
            self._set(HALF_OPEN, now)
            self.probes_passed = 0

    def _set(self, state: str, now: float) -> None:
        if state != self.state:
            log.info("breaker %s: %s -> %s", self.name or "?", self.state, state)
        self.state = state
        self.changed_at = now

    def _clear_window(self) -> None:
        for ring in (self._errors, self._non_finite, self._fused, self._latency, self._fails):
            ring.clear()

    def allow(self, now: float) -> bool:
        """Whether live traffic may go to this version (probes are asked for by :meth:`wants_probe`)."""
        self._tick(now)
        return self.state == CLOSED

    def wants_probe(self, now: float) -> bool:
        self._tick(now)
        return self.state == HALF_OPEN

    def trip(self, now: float, reason: str, figures: dict[str, Any] | None = None) -> Trip:
        """Open the breaker (or restart its off timer), for a window signal or an external one."""
        if reason not in REASONS:
            raise ValueError(f"unknown trip reason {reason!r} (reasons: {', '.join(REASONS)})")
        trip = Trip(reason, dict(figures or {}), now)
        self._set(OPEN, now)
        self.opened_at = now
        self.probes_passed = 0
        self.trips += 1
        self.last_trip = trip
        # the window that tripped it must not trip it again right after it closes
        self._clear_window()
        log.warning("breaker %s tripped: %s %s", self.name or "?", reason, trip.figures)
        return trip

    def close(self, now: float) -> None:
        """Operator override: close now (``min_on_s`` still shields it from noisy signals)."""
        self._set(CLOSED, now)
        self.closed_at = now
        self.probes_passed = 0
        self._clear_window()

    def record_probe(self, now: float, verdict: str | Sequence[str]) -> Trip | None:
        """Judge one batch of HALF_OPEN probe verdicts; probes in any other state are ignored.

        The batch is judged as a whole: a FAIL anywhere in it re-opens the breaker, and its
        PASSes do not count (a batch whose first rows pass must not close the breaker before its
        later rows are read)."""
        verdicts = [verdict] if isinstance(verdict, str) else list(verdict)
        for v in verdicts:
            if v not in ("PASS", "MARGINAL", FAIL):
                raise ValueError(f"probe verdict must be PASS, MARGINAL or FAIL, got {v!r}")
        self._tick(now)
        if self.state != HALF_OPEN or not verdicts:
            return None
        if FAIL in verdicts:
            return self.trip(now, "validator_fail", {"probe": "FAIL", "probes_passed": self.probes_passed,
                                                      "probe_fails": verdicts.count(FAIL),
                                                      "probe_rows": len(verdicts)})
        self.probes_passed += verdicts.count("PASS")
        if self.probes_passed >= self.config.probes_to_close:
            self.close(now)
        return None

    # -- the window -----------------------------------------------------------------------
    def record_batch(self, now: float, n: int, errors: int = 0, non_finite: int = 0,
                     latency_ms: float | np.ndarray | None = None,
                     verdicts: Sequence[str] | np.ndarray = (), fused: int = 0) -> Trip | None:
        """Add one batch of ``n`` requests; returns the :class:`Trip` if this batch tripped it.

        ``errors`` / ``non_finite`` / ``fused`` (requests of a rescued fused failure) count requests; ``latency_ms`` is one value for the whole
        batch or one per request; ``verdicts`` has one status per compared request. Batches
        that reach a breaker that is not CLOSED are ignored (only probes judge those states).
        """
        self._tick(now)
        if self.state != CLOSED:
            return None
        if not 0 <= errors <= n or not 0 <= non_finite <= n or not 0 <= fused <= n:
            raise ValueError(f"errors ({errors}), non_finite ({non_finite}) and fused ({fused}) "
                             f"must be in 0..n ({n})")
        if n:
            self._errors.push_flags(n, errors)
            self._non_finite.push_flags(n, non_finite)
            self._fused.push_flags(n, fused)
            if latency_ms is not None:
                lat = np.asarray(latency_ms, dtype=np.float32)
                self._latency.push(np.full(n, lat, np.float32) if lat.ndim == 0 else lat.ravel())
        compared = len(verdicts)
        if compared:
            fails = (verdicts.count(FAIL) if isinstance(verdicts, list)
                     else int(np.count_nonzero(np.asarray(verdicts) == FAIL)))
            self._fails.push_flags(compared, fails)
        return self._judge(now)

    def latency_p95(self, min_count: int = 1) -> float | None:
        """Nearest-rank p95 of the window's latencies; None with fewer than ``min_count``."""
        return self.latency_quantile(0.95, min_count)

    def latency_quantile(self, q: float, min_count: int = 1) -> float | None:
        """Nearest-rank ``q`` quantile of the window's latencies; None with fewer than ``min_count``."""
        lat = self._latency.values()
        if len(lat) < max(min_count, 1):
            return None
        k = min(len(lat) - 1, max(0, int(np.ceil(q * len(lat))) - 1))
        return float(np.partition(lat, k)[k])

    def shielded(self, now: float) -> bool:
        """Within ``min_on_s`` of closing: non-critical signals may not trip it yet."""
        return self.closed_at is not None and now - self.closed_at < self.config.min_on_s

    def window_counts(self) -> dict[str, int]:
        return {"requests": self._errors.count, "errors": self._errors.nonzero,
                "non_finite": self._non_finite.nonzero, "fused": self._fused.nonzero,
                "compared": self._fails.count,
                "fails": self._fails.nonzero}

    def _judge(self, now: float) -> Trip | None:
        cfg = self.config
        c = self.window_counts()
        n = c["requests"]
        if n < cfg.min_requests:
            return None
        rate = c["non_finite"] / n
        if rate > cfg.max_nan_rate:
            return self.trip(now, "non_finite", {"rate": rate, "count": c["non_finite"], "window": n,
                                                 "limit": cfg.max_nan_rate})
        rate = c["errors"] / n
        if rate > cfg.max_error_rate:
            return self.trip(now, "error_rate", {"rate": rate, "count": c["errors"], "window": n,
                                                 "limit": cfg.max_error_rate})
        rate = c["fused"] / n
        if rate > cfg.max_fused_rate:
            return self.trip(now, "fused_failures", {"rate": rate, "count": c["fused"], "window": n,
                                                     "limit": cfg.max_fused_rate})
        # right after closing, only the critical signals above may trip it
        if self.closed_at is not None and now - self.closed_at < cfg.min_on_s:
            return None
        if c["compared"] >= cfg.min_compared:
            rate = c["fails"] / c["compared"]
            if rate > cfg.max_fail_rate:
                return self.trip(now, "validator_fail", {"rate": rate, "count": c["fails"],
                                                         "compared": c["compared"], "limit": cfg.max_fail_rate})
        if cfg.latency_budget_ms > 0 and self._latency.count >= cfg.min_requests:
            # nearest-rank p95 via a partial sort: np.percentile costs 30x more per batch
            lat = self._latency.values()
            k = max(0, int(np.ceil(0.95 * len(lat))) - 1)
            p95 = float(np.partition(lat, k)[k])
            if p95 > cfg.latency_budget_ms:
                return self.trip(now, "latency", {"p95_ms": p95, "window": int(self._latency.count),
                                                  "budget_ms": cfg.latency_budget_ms})
        return None

    # -- shared state ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "opened_at": self.opened_at,
            "closed_at": self.closed_at,
            "changed_at": self.changed_at,
            "probes_passed": self.probes_passed,
            "trips": self.trips,
            "last_trip": None if self.last_trip is None else self.last_trip.to_dict(),
            # a summary only: window contents stay with the process that saw the traffic
            "window": self.window_counts(),
        }

    def adopt(self, d: dict[str, Any]) -> bool:
        """Take the shared state ``d`` if it is newer than ours; keeps this process's window."""
        state = d.get("state")
        if state not in STATES:
            raise ValueError(f"breaker state must be one of {', '.join(STATES)}, got {state!r}")
        changed_at = float(d.get("changed_at", 0.0))
        if changed_at <= self.changed_at and self.changed_at:
            return False
        was_closed = self.state == CLOSED
        self.state = state
        self.changed_at = changed_at
        self.opened_at = _opt_float(d.get("opened_at"))
        self.closed_at = _opt_float(d.get("closed_at"))
        self.probes_passed = int(d.get("probes_passed", 0))
        self.trips = int(d.get("trips", 0))
        lt = d.get("last_trip")
        self.last_trip = None if lt is None else Trip(lt["reason"], dict(lt.get("figures", {})), float(lt.get("at", 0)))
        if was_closed != (state == CLOSED):
            self._clear_window()
        return True

    @classmethod
    def from_dict(cls, d: dict[str, Any], config: BreakerConfig | None = None, *, name: str = "") -> Breaker:
        b = cls(config, name=name)
        b.adopt(d)
        return b


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)
