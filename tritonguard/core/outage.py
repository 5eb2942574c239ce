"""One pause-after-failure rule for the optional dependencies (cache tiers, the Redis state store,
the audit anchor store): after a failure the dependency is skipped, not retried, for a pause
that starts at 5 s and doubles up to 60 s, until a call succeeds again.

Hand-written on purpose (issue 16): tenacity and backoff retry a call with sleeps in between,
which would hold a serving thread for the whole outage. Here nothing waits: callers ask
:meth:`Backoff.available` and do without the dependency meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Backoff:
    def __init__(self, clock: Callable[[], float] = time.monotonic, start_s: float = 5.0, max_s: float = 60.0):
        self.clock, self.start_s, self.max_s = clock, start_s, max_s
        self.backoff = 0.0  # the current pause; 0 while healthy
        self.until = 0.0

    def available(self) -> bool:
        return not self.backoff or self.clock() >= self.until

    def fail(self) -> float:
        """A call failed: start the pause, or double it. Returns the pause."""
        self.backoff = min(self.backoff * 2, self.max_s) if self.backoff else self.start_s
        self.until = self.clock() + self.backoff
        return self.backoff

    def recover(self) -> bool:
        """A call worked: healthy again. True when it was paused (a recovery worth a log line)."""
        was, self.backoff = self.backoff != 0, 0.0
        return was
