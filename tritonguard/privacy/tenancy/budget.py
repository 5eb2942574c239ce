"""A decoupled guard's per-tenant token budget (``tokens.*``): tokens generated per minute, and
generations in flight (:class:`TokenBudget`)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(kw_only=True)
class TokenBudgetConfig:
    """``tokens.*``: each tenant's generation budget (0 = unlimited)."""

    per_minute: int = 0  # generated tokens per minute, a token bucket of one minute's worth
    max_in_flight: int = 0  # generations in flight per tenant

    def __post_init__(self) -> None:
        if self.per_minute < 0 or self.max_in_flight < 0:
            raise ValueError("parameters 'tokens.per_minute' and 'tokens.max_in_flight' must be >= 0")


class TokenBudget:
    """Per tenant: a bucket of ``per_minute`` tokens refilled continuously, and a cap on
    generations in flight. A request is admitted while the bucket is positive; the tokens it
    generates are charged as they stream (the bucket may go negative: the last admitted request
    finishes, the next ones wait for the refill). Thread-safe, per process."""

    def __init__(self, config: TokenBudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.rate = config.per_minute / 60.0
        self._lock = threading.Lock()
        self._balance: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, stamp)
        self._in_flight: dict[str, int] = {}
        self.rejected = 0

    @property
    def limited(self) -> bool:
        return bool(self.config.per_minute or self.config.max_in_flight)

    def _refill(self, tenant: str, now: float) -> float:
        tokens, stamp = self._balance.get(tenant, (float(self.config.per_minute), now))
        tokens = min(float(self.config.per_minute), tokens + (now - stamp) * self.rate)
        self._balance[tenant] = (tokens, now)
        return tokens

    def admit(self, tenant: str) -> str | None:
        """None if admitted (then :meth:`release` it once), else why not, with retry advice."""
        if not self.limited:
            return None
        with self._lock:
            cap = self.config.max_in_flight
            n = self._in_flight.get(tenant, 0)
            if cap and n >= cap:
                self.rejected += 1
                return (f"tenant '{tenant}' has {n} generations in flight (tokens.max_in_flight {cap}); "
                        "retry after 500 ms")
            if self.config.per_minute:
                tokens = self._refill(tenant, self.clock())
                if tokens < 1:
                    self.rejected += 1
                    retry = max(1, math.ceil((1 - tokens) / self.rate * 1000))
                    return (f"tenant '{tenant}' used its token budget of {self.config.per_minute} tokens/minute; "
                            f"retry after {retry} ms")
            self._in_flight[tenant] = n + 1
        return None

    def charge(self, tenant: str, tokens: int) -> None:
        if not self.config.per_minute or tokens <= 0:
            return
        with self._lock:
            left = self._refill(tenant, self.clock())
            self._balance[tenant] = (left - tokens, self._balance[tenant][1])

    def release(self, tenant: str) -> None:
        if not self.limited:
            return
        with self._lock:
            n = self._in_flight.get(tenant, 0)
            if n <= 1:
                self._in_flight.pop(tenant, None)
            else:
                self._in_flight[tenant] = n - 1

    def balance(self, tenant: str) -> float:
        with self._lock:
            return self._refill(tenant, self.clock()) if self.config.per_minute else math.inf
