"""A decoupled guard's per-tenant token budget (``tokens.*``): tokens generated per minute, and
generations in flight (:class:`TokenBudget`).

Tokens are *reserved at admission*, not charged after the fact: a generation reserves its
``max_tokens`` (the guard's default when the client sends none) before the target is called, and
is refused, with how long until that many tokens have refilled, when the tenant's bucket holds
fewer. At its end, however it ended (done, cancelled, failed, the client gone), it is *settled*
with the tokens it really generated: the unused part goes back to the bucket, an overrun (a target
that ignores ``max_tokens``) is taken from it. A reservation is at most one minute's worth (the
bucket's size): a request asking for more is cut there (the guard stops its stream at the tokens
reserved, ``finish_reason`` ``length``). So what a tenant is sent never exceeds what its budget
allowed, and concurrent generations cannot each be admitted on the same last tokens.

This class keeps the buckets in the process; with a Redis state URL
:class:`~tritonguard.privacy.tenancy.fleet.FleetTokenBudget` keeps one bucket per tenant for every
replica and judges by this one only while Redis is unreachable.
"""

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


def budget_refusal(tenant: str, per_minute: int, want: int, retry_ms: int) -> str:
    """The refusal of a reservation. Its wording is a contract: the OpenAI front
    (:func:`tritonguard.llm.errors.from_guard`) maps "tenant '…' … token budget … retry after N ms"
    to 429 with ``Retry-After``."""
    return (f"tenant '{tenant}' used its token budget of {per_minute} tokens/minute "
            f"(the request reserves {want}); retry after {max(1, retry_ms)} ms")


class TokenBudget:
    """Per tenant: a bucket of ``per_minute`` tokens refilled continuously, and a cap on
    generations in flight. :meth:`reserve` takes a generation's tokens up front (all or nothing),
    :meth:`settle` gives back what it did not use. Thread-safe, per process.

    ``minute_s``: the length of the budget's minute (60; tests shorten it)."""

    def __init__(self, config: TokenBudgetConfig, clock: Callable[[], float] = time.monotonic, *,
                 minute_s: float = 60.0) -> None:
        self.config, self.clock, self.minute_s = config, clock, minute_s
        self.rate = config.per_minute / minute_s  # tokens a second
        self._lock = threading.Lock()
        self._balance: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, stamp)
        self._in_flight: dict[str, int] = {}
        self.rejected = 0

    @property
    def limited(self) -> bool:
        return bool(self.config.per_minute or self.config.max_in_flight)

    def _refill(self, tenant: str, now: float) -> float:
        tokens, stamp = self._balance.get(tenant, (float(self.config.per_minute), now))
        tokens = min(float(self.config.per_minute), tokens + max(0.0, now - stamp) * self.rate)
        self._balance[tenant] = (tokens, now)
        return tokens

    def cap(self, want: int) -> int:
        """What a request asking for ``want`` tokens reserves: at most a minute's worth, at least 1."""
        want = max(1, int(want))
        return min(want, self.config.per_minute) if self.config.per_minute else want

    # -- in flight ------------------------------------------------------------------------------
    def _take_slot(self, tenant: str) -> str | None:
        """Under the lock: a ``tokens.max_in_flight`` slot, or why not."""
        cap = self.config.max_in_flight
        n = self._in_flight.get(tenant, 0)
        if cap and n >= cap:
            return (f"tenant '{tenant}' has {n} generations in flight (tokens.max_in_flight {cap}); "
                    "retry after 500 ms")
        self._in_flight[tenant] = n + 1
        return None

    def release(self, tenant: str) -> None:
        """The generation's in-flight slot is given back (its tokens: :meth:`settle`)."""
        if not self.limited:
            return
        with self._lock:
            n = self._in_flight.get(tenant, 0)
            if n <= 1:
                self._in_flight.pop(tenant, None)
            else:
                self._in_flight[tenant] = n - 1

    # -- tokens ---------------------------------------------------------------------------------
    def reserve(self, tenant: str, want: int) -> tuple[int, str | None]:
        """(tokens reserved, None) with an in-flight slot taken, or (0, why not with retry
        advice). The reservation is :meth:`cap` (``want``); pass it to :meth:`settle` and the slot
        to :meth:`release`, once, however the generation ends."""
        if not self.limited:
            return max(1, int(want)), None
        want = self.cap(want)
        with self._lock:
            why = self._take_slot(tenant)
            if why is None and self.config.per_minute:
                why = self._take_tokens(tenant, want)
                if why is not None:
                    self._in_flight[tenant] -= 1
            if why is not None:
                self.rejected += 1
                return 0, why
        return want, None

    def _take_tokens(self, tenant: str, want: int) -> str | None:
        """Under the lock: ``want`` tokens from the tenant's bucket, or why not."""
        tokens = self._refill(tenant, self.clock())
        if tokens < want:
            retry = math.ceil((want - tokens) / self.rate * 1000)
            return budget_refusal(tenant, self.config.per_minute, want, retry)
        self._balance[tenant] = (tokens - want, self._balance[tenant][1])
        return None

    def settle(self, tenant: str, reserved: int, used: int) -> None:
        """A generation that reserved ``reserved`` tokens generated ``used``: the difference goes
        back to the bucket (an overrun is taken from it; the bucket may go below zero)."""
        self._adjust(tenant, reserved - max(0, used))

    def _adjust(self, tenant: str, tokens: int) -> None:
        if not self.config.per_minute or tokens == 0:
            return
        with self._lock:
            left = self._refill(tenant, self.clock())
            self._balance[tenant] = (min(float(self.config.per_minute), left + tokens), self._balance[tenant][1])

    # -- the earlier interface: admission on a positive bucket, charged after the fact ----------
    def admit(self, tenant: str) -> str | None:
        """Admitted while the bucket holds a token (none is kept: :meth:`charge` the tokens
        used); None if admitted (then :meth:`release` it)."""
        granted, why = self.reserve(tenant, 1)
        if why is None:
            self._adjust(tenant, granted)
        return why

    def charge(self, tenant: str, tokens: int) -> None:
        """``tokens`` more taken from the tenant's bucket (beyond what was reserved)."""
        if tokens > 0:
            self._adjust(tenant, -tokens)

    def balance(self, tenant: str) -> float:
        with self._lock:
            return self._refill(tenant, self.clock()) if self.config.per_minute else math.inf
