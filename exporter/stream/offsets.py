"""Which offsets may be committed: per partition, the events taken in consume order and the
ones whose output (a result or a dead letter) the broker acknowledged. The commit offset is the
offset after the last event of the longest acknowledged prefix, so a commit never passes an event
whose output the broker has not taken (at-least-once). Contiguity is by consume order, not by
offset + 1: a compacted topic or transaction markers leave gaps in the offsets."""

from __future__ import annotations

from collections import deque

TP = tuple[str, int]  # (topic, partition)


class OffsetTracker:
    """Not thread-safe: the stream's one loop calls it (delivery callbacks run in producer.poll)."""

    def __init__(self) -> None:
        self._taken: dict[TP, deque[int]] = {}
        self._acked: dict[TP, set[int]] = {}
        self._next: dict[TP, int] = {}  # offset to commit, advanced and not yet handed out
        self._committed: dict[TP, int] = {}

    def take(self, tp: TP, offset: int) -> None:
        """An event read from the topic; offsets of one partition arrive ascending."""
        taken = self._taken.setdefault(tp, deque())
        if taken and offset <= taken[-1]:
            raise ValueError(f"{tp[0]}[{tp[1]}]: offset {offset} taken after {taken[-1]}")
        taken.append(offset)
        self._acked.setdefault(tp, set())

    def ack(self, tp: TP, offset: int) -> None:
        """The broker acknowledged the output of the event at ``offset``; the prefix advances."""
        taken, acked = self._taken.get(tp), self._acked.get(tp)
        if taken is None or acked is None:
            return  # the partition was revoked meanwhile: its new owner redoes the event
        acked.add(offset)
        while taken and taken[0] in acked:
            acked.discard(done := taken.popleft())
            self._next[tp] = done + 1

    def untake(self, tp: TP, offset: int) -> None:
        """The events from ``offset`` on were read and never sent (the read-ahead of a partition
        given up): forgotten, so the commit never waits for them; the partition's next owner reads
        them again from the committed offset."""
        taken, acked = self._taken.get(tp), self._acked.get(tp, set())
        while taken and taken[-1] >= offset:
            acked.discard(taken.pop())

    def pending(self, tp: TP | None = None) -> int:
        """Events taken and not yet acknowledged, of one partition or all."""
        if tp is not None:
            return len(self._taken.get(tp, ()))
        return sum(len(t) for t in self._taken.values())

    def committable(self) -> dict[TP, int]:
        """The offsets to commit now: per partition the acknowledged prefix's end + 1, for the
        partitions that advanced since the last :meth:`committed`."""
        return {tp: off for tp, off in self._next.items() if self._committed.get(tp) != off}

    def committed(self, offsets: dict[TP, int]) -> None:
        self._committed.update(offsets)

    def commit_failed(self, tp: TP) -> None:
        """An asynchronous commit the broker refused: the partition's offset is handed out again."""
        self._committed.pop(tp, None)

    def forget(self, tp: TP) -> None:
        """A revoked partition: its in-flight events are redone by whoever gets it next."""
        for table in (self._taken, self._acked, self._next, self._committed):
            table.pop(tp, None)
