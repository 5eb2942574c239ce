"""exporter.stream.run's backpressure, on the loop's own code with an in-memory consumer, producer
and Triton client (issue 41 item 7): how many requests Triton holds (--max-inflight) is bounded
apart from how far the consumer reads ahead (--read-ahead), so partitions are paused only when
their read-ahead is full, not at every Triton slot (librdkafka's pause() throws away what it had
fetched: each resume fetches again). The guarantees stay: outputs in offset order per partition,
commits only behind acknowledged outputs, a Triton outage pauses everything and loses none of the
read-ahead, a revoked partition's unsent read-ahead is dropped and not committed past."""

from __future__ import annotations

import numpy as np
from confluent_kafka import TopicPartition
from tritonclient.utils import InferenceServerException

from tests.unit.exporter.stream.fakes import Consumer, Result, committed, stream

A, B = ("in", 0), ("in", 1)


def test_triton_gets_max_inflight_requests_while_the_consumer_reads_ahead_and_pauses_rarely():
    consumer = Consumer({A: 100, B: 100})
    s = stream(consumer, max_inflight=4, max_batch=4, batch_size=1, read_ahead=40)
    for _ in range(30):
        s._step()
    # Triton holds 4 requests; the consumer went on reading to the read-ahead's bound (40 per
    # partition, read and not acknowledged), then paused those partitions (before: paused at 4)
    assert len(s.client.calls) == 4
    assert consumer.pos == {A: 40, B: 40} and consumer.paused == {A, B}
    written: dict[tuple[str, int], list[int]] = {A: [], B: []}
    for _ in range(500):
        if len(s.producer.sent) == 200:
            break
        assert len(s.client.calls) <= 4  # never more at Triton at once
        s.client.answer()
        s._step()
        s._commit(asynchronous=False)
        for _, rid in s.producer.sent[sum(map(len, written.values())):]:
            t, p, o = rid.split("/")
            written[(t, int(p))].append(int(o))
        for tp, o in committed(consumer).items():  # a commit never passes an output not written
            assert o <= len(written[tp])
    assert written == {A: list(range(100)), B: list(range(100))}  # each once, in offset order
    assert committed(consumer) == {A: 100, B: 100}
    # paused when 40 wait, resumed at 20: about once per 20 events (pausing at every Triton
    # slot would be once per 4, 25 times a partition)
    assert 1 <= consumer.pauses[A] <= 6 and 1 <= consumer.pauses[B] <= 6
    assert s.sending == 0 and s.tracker.pending() == 0 and s.size == {A: 0, B: 0}


def test_triton_unavailable_pauses_every_partition_and_keeps_the_read_ahead_uncommitted():
    consumer = Consumer({A: 30})
    s = stream(consumer, max_inflight=4, max_batch=4, batch_size=1, read_ahead=100)
    for _ in range(10):
        s._step()
    assert consumer.pos[A] == 30 and len(s.client.calls) == 4  # all read, 4 at Triton
    first = s.client.answer(InferenceServerException("connection refused", status="StatusCode.UNAVAILABLE"))
    s._step()
    assert s.paused and consumer.paused == {A} and s.metrics.paused._value.get() == 1
    for _ in range(5):  # the backoff's time passes: the 4 are retried, nothing new is sent
        s.retry_at = 0.0
        s._step()
        assert sorted(rid for rid, _ in s.client.calls) == sorted(first)
        s.client.answer(InferenceServerException("connection refused", status="StatusCode.UNAVAILABLE"))
        s._step()
        s._commit(asynchronous=False)
        assert consumer.commits == [] and s.producer.sent == [] and len(s.waiting) == 26
    s.retry_at = 0.0
    s._step()
    s.client.answer()  # Triton is back
    for _ in range(50):
        if len(s.producer.sent) == 30:
            break
        s._step()
        s.client.answer()
    s._commit(asynchronous=False)
    assert not s.paused and consumer.paused == set() and consumer.pos[A] == 30
    assert [rid for _, rid in s.producer.sent] == [f"in/0/{o}" for o in range(30)]  # none lost, none twice
    assert {t for t, _ in s.producer.sent} == {"out"} and committed(consumer) == {A: 30}


def test_a_revoked_partition_drops_its_unsent_read_ahead_and_commits_only_what_was_acknowledged():
    consumer = Consumer({A: 50})
    s = stream(consumer, max_inflight=4, max_batch=4, batch_size=1, read_ahead=100, session_timeout_ms=100)
    for _ in range(10):
        s._step()
    assert consumer.pos[A] == 50 and len(s.client.calls) == 4 and len(s.waiting) == 46
    held = s.client.calls[2:]
    s.client.calls = s.client.calls[:2]
    s.client.answer()  # offsets 0 and 1 answered; 2 and 3 still at Triton
    s._step()
    assert [rid for _, rid in s.producer.sent] == ["in/0/0", "in/0/1"]
    held += s.client.calls  # 4 and 5 went in their place
    assert [rid for rid, _ in held] == [f"in/0/{o}" for o in (2, 3, 4, 5)] and len(s.waiting) == 44
    # the revoke waits (bounded) for what Triton holds, not for the 44 never sent
    s._revoked(consumer, [TopicPartition("in", 0)])
    assert committed(consumer) == {A: 2}
    assert not s.waiting and A not in s.queues and s.tracker.pending() == 0
    for _, cb in held:  # their answers come after the revoke: the next owner redoes them
        cb(Result(np.zeros((1, 2), np.float32), ["m:1"]), None)
    s._step()
    assert len(s.producer.sent) == 2 and s.sending == 0
