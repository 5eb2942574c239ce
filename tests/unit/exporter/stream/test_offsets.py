"""exporter.stream.offsets: a commit never passes an event whose output the broker has not
acknowledged, whatever order the acknowledgements come in."""

from __future__ import annotations

import pytest

from exporter.stream.offsets import OffsetTracker

A, B = ("in", 0), ("in", 1)


def test_the_commit_is_the_end_of_the_acknowledged_prefix():
    t = OffsetTracker()
    for off in range(5):
        t.take(A, off)
    t.ack(A, 1)
    t.ack(A, 2)
    assert t.committable() == {}  # offset 0 not acknowledged: nothing may be committed
    t.ack(A, 0)
    assert t.committable() == {A: 3}  # 0, 1, 2 acknowledged: the next to read is 3
    assert t.pending(A) == 2
    t.ack(A, 4)
    assert t.committable() == {A: 3}
    t.ack(A, 3)
    assert t.committable() == {A: 5} and t.pending() == 0


def test_partitions_advance_on_their_own_and_a_commit_is_handed_out_once():
    t = OffsetTracker()
    for off in (10, 11):
        t.take(A, off)
        t.take(B, off)
    t.ack(B, 10)
    assert t.committable() == {B: 11}
    t.committed({B: 11})
    assert t.committable() == {}  # no advance since: nothing to commit again
    t.ack(A, 10)
    t.ack(B, 11)
    assert t.committable() == {A: 11, B: 12}


def test_a_refused_commit_is_handed_out_again():
    t = OffsetTracker()
    t.take(A, 0)
    t.ack(A, 0)
    t.committed(t.committable())
    assert t.committable() == {}
    t.commit_failed(A)  # the broker refused it: the next commit must carry it again
    assert t.committable() == {A: 1}


def test_gaps_in_the_offsets_are_contiguous_in_consume_order():
    """A compacted topic (or transaction markers) leaves offsets out: contiguity is by what was read."""
    t = OffsetTracker()
    for off in (3, 7, 8):
        t.take(A, off)
    t.ack(A, 7)
    assert t.committable() == {}
    t.ack(A, 3)
    assert t.committable() == {A: 8}
    t.ack(A, 8)
    assert t.committable() == {A: 9}


def test_a_revoked_partition_is_forgotten_and_late_acknowledgements_ignored():
    t = OffsetTracker()
    t.take(A, 0)
    t.take(A, 1)
    t.forget(A)
    t.ack(A, 0)  # its delivery callback arrives after the revoke
    assert t.committable() == {} and t.pending() == 0
    t.take(A, 1)  # assigned again, from the committed offset
    t.ack(A, 1)
    assert t.committable() == {A: 2}


def test_offsets_must_ascend_within_a_partition():
    t = OffsetTracker()
    t.take(A, 5)
    with pytest.raises(ValueError, match="offset 5 taken after 5"):
        t.take(A, 5)


def test_events_read_and_never_sent_are_untaken_so_the_commit_does_not_wait_for_them():
    t = OffsetTracker()
    for off in range(6):
        t.take(A, off)
    t.ack(A, 1)
    t.untake(A, 3)  # 3, 4, 5: the read-ahead of a partition given up
    assert t.pending(A) == 3
    t.ack(A, 0)
    t.ack(A, 2)
    assert t.committable() == {A: 3} and t.pending() == 0
    t.take(A, 3)  # read again (after a seek): taken anew
    assert t.pending(A) == 1
