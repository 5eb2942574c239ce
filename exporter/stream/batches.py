"""The read-ahead not yet sent, grouped into Triton requests of several events (issue 41 item 7).

One gRPC call per event cost the consumer most of its time in the Python gRPC client (a future
and a channel thread per call); a request that carries ``--batch-size`` events along the batch
dimension costs one. What may share a request is decided by what the guard decides per request,
not per row:

- the rollout route: the guard places a whole request by its ``routing_key`` parameter
  (:mod:`tritonguard.guard.routing.sticky`), so events with a key share a request only with
  events of the same key (same key, same point, same version); events without a key (or with
  ``--no-sticky``) share one group; a replay's events (pinned to the primary) another;
- the forwarded headers (tenant, credentials, trace context): one set per request, so only
  events with the same ones share it (an event with its own ``traceparent`` goes alone);
- the shapes of inputs of any length (``-1``), which must stack.

A group is sent when it holds ``--batch-size`` events, or when it has waited ``--batch-wait-ms``
since it was opened (a group whose first events left re-opens behind the others, so an event
waits at most about twice that). Events keep their consume order within a group; the outputs
are produced per partition in offset order whatever order the requests answer in."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol


class Event(Protocol):
    group: Hashable
    sent: bool


class Batcher:
    """Not thread-safe: the stream's one loop owns it."""

    def __init__(self, size: int, wait_s: float) -> None:
        self.size, self.wait_s = max(1, size), max(0.0, wait_s)
        self.groups: dict[Hashable, deque[Event]] = {}  # in the order they were opened
        self.opened: dict[Hashable, float] = {}  # monotonic time each group was opened
        self.full: dict[Hashable, None] = {}  # groups holding a whole request, oldest first
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Event]:
        for dq in self.groups.values():
            yield from dq

    def add(self, event: Event, now: float) -> None:
        dq = self.groups.get(event.group)
        if dq is None:
            dq = self.groups[event.group] = deque()
            self.opened[event.group] = now
        dq.append(event)
        self.n += 1
        if len(dq) >= self.size:
            self.full[event.group] = None

    def due_in(self, now: float) -> float | None:
        """Seconds until a request is due (0: one is ready now); None when nothing waits."""
        if self.full:
            return 0.0
        for key in self.groups:  # the oldest group is due first
            return max(0.0, self.opened[key] + self.wait_s - now)
        return None

    def take(self, now: float, flush: bool = False) -> list[Event]:
        """The next request's events: a whole group first (the oldest), else the oldest group if
        it waited long enough (any group with ``flush``); [] when none is due."""
        key = next(iter(self.full), None)
        if key is None:
            key = next(iter(self.groups), None)
            if key is None or not (flush or now >= self.opened[key] + self.wait_s):
                return []
        dq = self.groups[key]
        out = [dq.popleft() for _ in range(min(self.size, len(dq)))]
        self.n -= len(out)
        self.full.pop(key, None)
        del self.groups[key], self.opened[key]
        if dq:  # what is left re-opens behind the others
            self.groups[key], self.opened[key] = dq, now
            if len(dq) >= self.size:
                self.full[key] = None
        for e in out:
            e.sent = True
        return out

    def drop(self, gone: Callable[[Event], bool]) -> None:
        """Forget the events ``gone`` says (a revoked partition's); the rest keep their order."""
        for key in list(self.groups):
            dq = self.groups[key]
            kept = deque(e for e in dq if not gone(e))
            self.n -= len(dq) - len(kept)
            if not kept:
                del self.groups[key], self.opened[key]
                self.full.pop(key, None)
                continue
            self.groups[key] = kept
            if len(kept) < self.size:
                self.full.pop(key, None)


def chunks(events: Iterable[Event], size: int) -> list[list[Event]]:
    """``events`` as requests: by group, ``size`` at most each, in order of first appearance."""
    groups: dict[Hashable, list[list[Event]]] = {}
    out: list[list[Event]] = []
    for e in events:
        runs = groups.setdefault(e.group, [])
        if not runs or len(runs[-1]) >= size:
            runs.append([])
            out.append(runs[-1])
        runs[-1].append(e)
    return out
