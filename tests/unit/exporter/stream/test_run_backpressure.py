"""exporter.stream.run's backpressure, on the loop's own code with an in-memory consumer, producer
and Triton client (issue 41 item 7): how many requests Triton holds (--max-inflight) is bounded
apart from how far the consumer reads ahead (--read-ahead), so partitions are paused only when
their read-ahead is full, not at every Triton slot (librdkafka's pause() throws away what it had
fetched: each resume fetches again). The guarantees stay: outputs in offset order per partition,
commits only behind acknowledged outputs, a Triton outage pauses everything and loses none of the
read-ahead, a revoked partition's unsent read-ahead is dropped and not committed past."""

from __future__ import annotations

import json
import threading

import numpy as np
from confluent_kafka import TopicPartition
from tritonclient.utils import InferenceServerException

from exporter.stream.events import InputSpec
from exporter.stream.metrics import StreamMetrics
from exporter.stream.run import Stream, StreamConfig

A, B = ("in", 0), ("in", 1)


class Message:
    def __init__(self, tp: tuple[str, int], offset: int, value: bytes) -> None:
        self.tp, self.off, self.val = tp, offset, value

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self.tp[0]

    def partition(self) -> int:
        return self.tp[1]

    def offset(self) -> int:
        return self.off

    def key(self) -> bytes:
        return f"k{self.off % 3}".encode()

    def value(self) -> bytes:
        return self.val

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)


class Consumer:
    """Partitions in memory: consume() hands out, from each unpaused partition in turn, the events
    past its position (the position is the application's: a paused partition resumes there)."""

    def __init__(self, logs: dict[tuple[str, int], int]) -> None:
        self.logs = {tp: [json.dumps([float(i), 1.0]).encode() for i in range(n)] for tp, n in logs.items()}
        self.pos = dict.fromkeys(logs, 0)
        self.paused: set[tuple[str, int]] = set()
        self.pauses = dict.fromkeys(logs, 0)
        self.commits: list[dict[tuple[str, int], int]] = []
        self.assigned: list[TopicPartition] = []

    def assign(self, parts: list[TopicPartition]) -> None:
        self.assigned = parts

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        out: list[Message] = []
        while len(out) < num_messages:
            ready = [tp for tp in sorted(self.logs) if tp not in self.paused and self.pos[tp] < len(self.logs[tp])]
            if not ready:
                break
            for tp in ready[: num_messages - len(out)]:
                out.append(Message(tp, self.pos[tp], self.logs[tp][self.pos[tp]]))
                self.pos[tp] += 1
        return out

    def pause(self, parts: list[TopicPartition]) -> None:
        for p in parts:
            self.paused.add((p.topic, p.partition))
            self.pauses[(p.topic, p.partition)] += 1

    def resume(self, parts: list[TopicPartition]) -> None:
        for p in parts:
            self.paused.discard((p.topic, p.partition))

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.commits.append({(tp.topic, tp.partition): tp.offset for tp in offsets})


class Producer:
    """Every output acknowledged at the next poll()."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []  # (topic, result id)
        self.unacked: list = []

    def produce(self, topic: str, value: bytes, key: bytes, headers: list, on_delivery, **kwargs) -> None:
        self.sent.append((topic, dict(headers)["tritonguard-result-id"]))
        self.unacked.append(on_delivery)

    def poll(self, timeout: float = 0) -> None:
        done, self.unacked = self.unacked, []
        for cb in done:
            cb(None, None)

    def flush(self, timeout: float = 0) -> None:
        self.poll()


class Result:
    def as_numpy(self, name: str) -> np.ndarray:
        return np.array([[b"m:1"]], dtype=object) if name == "SERVED_BY" else np.zeros((1, 2), np.float32)


class Triton:
    """Requests held until the test answers them."""

    def __init__(self) -> None:
        self.calls: list = []  # (request id, callback), in the order sent

    def async_infer(self, model, inputs, callback, request_id: str = "", **kwargs) -> None:
        self.calls.append((request_id, callback))

    def answer(self, error: Exception | None = None) -> list[str]:
        calls, self.calls = self.calls, []
        for _, cb in calls:
            cb(None if error else Result(), error)
        return [rid for rid, _ in calls]


def stream(consumer: Consumer, **cfg) -> Stream:
    s = Stream.__new__(Stream)  # the loop without its network clients
    s.cfg = StreamConfig(bootstrap="127.0.0.1:9", topic="in", output="out", model="m", max_wait_ms=0,
                         commit_interval_s=0, **cfg)
    s.metrics, s.session, s.stop = StreamMetrics("m"), "test", threading.Event()
    s.client, s.consumer, s.producer = Triton(), consumer, Producer()
    s.specs, s.batched, s.outputs = [InputSpec("X", "FP32", (2,))], True, ["Y", "SERVED_BY"]
    s.dtypes, s.partitions = {"X": "FP32"}, {"in": 2, "out": 2, "out.dlq": 2}
    s._state()
    s._assigned(consumer, [TopicPartition(t, p) for t, p in sorted(consumer.logs)])
    return s


def committed(consumer: Consumer) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for c in consumer.commits:
        out.update(c)
    return out


def test_triton_gets_max_inflight_requests_while_the_consumer_reads_ahead_and_pauses_rarely():
    consumer = Consumer({A: 100, B: 100})
    s = stream(consumer, max_inflight=4, max_batch=4, read_ahead=40)
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
    s = stream(consumer, max_inflight=4, max_batch=4, read_ahead=100)
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
    s = stream(consumer, max_inflight=4, max_batch=4, read_ahead=100, session_timeout_ms=100)
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
        cb(Result(), None)
    s._step()
    assert len(s.producer.sent) == 2 and s.sending == 0
