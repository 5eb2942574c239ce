"""The time a batch job has left, said only once the rate behind it means something.

Rows are counted from the first answers on, so Ray's start-up (seconds with nothing answered)
does not drag the rate down, and no ETA is given before :data:`MIN_FRACTION` of the rows or
:data:`MIN_RATE_S` seconds of answers are behind it: the first figure of a 13-second job used to
read 18 minutes, from a rate measured over its first few rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MIN_FRACTION = 0.05  # of this run's rows answered before an ETA is given
MIN_RATE_S = 3.0  # or this many seconds of answers


class Eta:
    """Rows per second and seconds left of ``total`` rows, fed the rows answered so far."""

    def __init__(self, total: int, *, clock: Callable[[], float] = time.monotonic):
        self.total, self.clock = total, clock
        self._first: tuple[float, int] | None = None  # (when, rows) of the first answers seen
        self.rate: float | None = None  # rows/s since the first answers; None until known
        self.left: float | None = None  # seconds; None until the rate rests on enough
        self._lock = threading.Lock()  # fed by the driver's commits and the row counter's poller

    def update(self, done: int) -> float | None:
        """Record ``done`` rows answered (of ``total``); the seconds left, or None while unknown."""
        with self._lock:
            return self._update(done, self.clock())

    def _update(self, done: int, now: float) -> float | None:
        if done <= 0:
            return self.left
        if self._first is None:
            self._first = (now, done)
            return self.left
        t0, d0 = self._first
        span, gained = now - t0, done - d0
        if span <= 0 or gained <= 0:
            return self.left
        self.rate = gained / span
        if done >= self.total:
            self.left = 0.0
        elif done >= MIN_FRACTION * self.total or span >= MIN_RATE_S:
            self.left = (self.total - done) / self.rate
        return self.left


def eta_text(left: float | None) -> str:
    """``0:00:13``; ``-:--:--`` while unknown."""
    if left is None:
        return "-:--:--"
    s = max(0, round(left))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


__all__ = ["MIN_FRACTION", "MIN_RATE_S", "Eta", "eta_text"]
