"""In-memory stand-ins for the stream loop's network clients (a consumer, a producer and a Triton
gRPC client), so the loop's own code runs in a unit test; the broker and tritonserver are real in
tests/functional/test_stream.py."""

from __future__ import annotations

import json
import threading

import numpy as np
from confluent_kafka import TopicPartition

from exporter.stream.events import InputSpec
from exporter.stream.metrics import StreamMetrics
from exporter.stream.run import Stream, StreamConfig


class Message:
    def __init__(self, tp: tuple[str, int], offset: int, value: bytes, headers: list | None = None) -> None:
        self.tp, self.off, self.val, self.hdrs = tp, offset, value, headers

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

    def headers(self) -> list | None:
        return self.hdrs

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
        self.headers: dict[tuple[tuple[str, int], int], list] = {}  # (partition, offset): an event's headers

    def assign(self, parts: list[TopicPartition]) -> None:
        self.assigned = parts

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        out: list[Message] = []
        while len(out) < num_messages:
            ready = [tp for tp in sorted(self.logs) if tp not in self.paused and self.pos[tp] < len(self.logs[tp])]
            if not ready:
                break
            for tp in ready[: num_messages - len(out)]:
                out.append(Message(tp, self.pos[tp], self.logs[tp][self.pos[tp]], self.headers.get((tp, self.pos[tp]))))
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
        self.headers: list[dict] = []  # each output's headers, in the same order
        self.unacked: list = []

    def produce(self, topic: str, value: bytes, key: bytes, headers: list, on_delivery, **kwargs) -> None:
        self.sent.append((topic, dict(headers)["tritonguard-result-id"]))
        self.headers.append(dict(headers))
        self.unacked.append(on_delivery)

    def poll(self, timeout: float = 0) -> None:
        done, self.unacked = self.unacked, []
        for cb in done:
            cb(None, None)

    def flush(self, timeout: float = 0) -> None:
        self.poll()


class Result:
    """An answer of ``rows`` rows: each row's Y is its X, SERVED_BY per row (the guard's [N, 1])."""

    def __init__(self, x: np.ndarray, served: list[str]) -> None:
        self.x, self.served = x, served

    def as_numpy(self, name: str) -> np.ndarray:
        if name == "SERVED_BY":
            return np.array([[v.encode()] for v in self.served], dtype=object)
        return self.x


class Triton:
    """Requests held until the test answers them; ``calls``: (request id, callback) in the order
    sent, ``requests``: per request id its X rows, parameters and headers."""

    def __init__(self) -> None:
        self.calls: list = []
        self.requests: dict[str, tuple[np.ndarray, dict | None, dict | None]] = {}

    def async_infer(self, model, inputs, callback, request_id: str = "", parameters=None, headers=None,
                    **kwargs) -> None:
        (x,) = inputs
        rows = np.frombuffer(x._raw_content, np.float32).reshape(x.shape())
        self.requests[request_id] = (rows, parameters, headers)
        self.calls.append((request_id, callback))

    def answer(self, error: Exception | None = None) -> list[str]:
        calls, self.calls = self.calls, []
        for rid, cb in calls:
            rows = self.requests[rid][0]
            cb(None if error else Result(rows, ["m:1"] * len(rows)), error)
        return [rid for rid, _ in calls]


def stream(consumer: Consumer, **cfg) -> Stream:
    s = Stream.__new__(Stream)  # the loop without its network clients
    s.cfg = StreamConfig(bootstrap="127.0.0.1:9", topic="in", output="out", model="m", max_wait_ms=0,
                         commit_interval_s=0, **cfg)
    s.metrics, s.session, s.stop = StreamMetrics("m"), "test", threading.Event()
    s.client, s.consumer, s.producer = Triton(), consumer, Producer()
    s.specs, s.max_rows, s.batched, s.outputs = [InputSpec("X", "FP32", (2,))], 64, True, ["Y", "SERVED_BY"]
    s.dtypes, s.partitions = {"X": "FP32"}, {"in": 2, "out": 2, "out.dlq": 2}
    s._state()
    s._assigned(consumer, [TopicPartition(t, p) for t, p in sorted(consumer.logs)])
    return s


def committed(consumer: Consumer) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for c in consumer.commits:
        out.update(c)
    return out


