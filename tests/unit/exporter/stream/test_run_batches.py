"""exporter.stream.run's micro-batches (issue 41 item 7): several events in one Triton request
along the batch dimension, on the loop's own code with an in-memory consumer, producer and a fake
guard that decides per request as the real one does (a request placed as a whole by its
routing_key; a request refused as a whole when one row is out of range). The guarantees stay:
a request holds one key's events, so every event lands on its key's version; SERVED_BY per
event; one poison event is the only dead letter; outputs in offset order per partition; commits
only behind acknowledged outputs."""

from __future__ import annotations

import json

from confluent_kafka import TopicPartition
from tritonclient.utils import InferenceServerException

from exporter.stream.batches import Batcher, chunks
from tests.unit.exporter.stream.fakes import Consumer, Result, Triton, committed, stream
from tritonguard.guard.routing.sticky import key_point

A, B = ("in", 0), ("in", 1)
VERSIONS = ("m:1", "m:2")


def band(key: str) -> str:
    """The version the guard gives a routing key at a candidate share of 0.5."""
    return VERSIONS[1] if key_point(key) < 0.5 else VERSIONS[0]


class Guard(Triton):
    """Answers as the guard: the whole request to its routing key's version (the primary without
    a key), refused as a whole (INVALID_ARGUMENT) when any row's first value is negative."""

    def answer(self, error: Exception | None = None) -> list[str]:
        calls, self.calls = self.calls, []
        for rid, cb in calls:
            rows, params, _ = self.requests[rid]
            if (rows[:, 0] < 0).any():
                cb(None, InferenceServerException("pixel out of range", status="StatusCode.INVALID_ARGUMENT"))
                continue
            key = (params or {}).get("routing_key")
            cb(Result(rows, [band(key) if key else VERSIONS[0]] * len(rows)), None)
        return [rid for rid, _ in calls]


def run_to_end(s, consumer: Consumer, want: int) -> dict[tuple[str, int], list[int]]:
    """Step, answer, commit until ``want`` outputs; the input offsets written per partition,
    checking on the way that a commit never passes an output not written."""
    written: dict[tuple[str, int], list[int]] = {tp: [] for tp in consumer.logs}
    for _ in range(500):
        if len(s.producer.sent) >= want:
            break
        s._step()
        s.client.answer()
        s._step()
        s._commit(asynchronous=False)
        for _, rid in s.producer.sent[sum(map(len, written.values())):]:
            t, p, o = rid.split("/")
            written[(t, int(p))].append(int(o))
        for tp, o in committed(consumer).items():
            assert o <= len(written[tp])
    return written


def test_a_request_holds_one_keys_events_and_each_lands_on_its_keys_version():
    consumer = Consumer({A: 60, B: 60})  # keys k0, k1, k2 (offset % 3); X = [offset, 1]
    s = stream(consumer, max_inflight=4, max_batch=16, batch_size=8)
    s.client = Guard()
    keys = [f"k{i}" for i in range(3)]
    assert len({band(k) for k in keys}) == 2  # both versions answer some of them
    written = run_to_end(s, consumer, 120)
    assert written == {A: list(range(60)), B: list(range(60))}  # each once, in offset order
    assert committed(consumer) == {A: 60, B: 60}
    requests = s.client.requests
    assert len(requests) <= 24 < 120  # 8 events a request at most: far fewer requests than events
    for rid, (rows, params, _) in requests.items():
        offsets = rows[:, 0].astype(int)
        assert 1 <= len(rows) <= 8
        # one key per request: the guard routes a request as a whole by its routing_key
        assert {f"k{o % 3}" for o in offsets} == {params["routing_key"]}, rid
    assert max(len(rows) for rows, _, _ in requests.values()) == 8
    for h in s.producer.headers:  # SERVED_BY per event: its key's version
        offset = int(h["tritonguard-source-offset"])
        assert h["tritonguard-served-by"] == band(f"k{offset % 3}")
    assert s.sending == 0 and s.tracker.pending() == 0 and not s.waiting


def test_a_request_refused_as_a_whole_is_split_and_only_the_poison_is_a_dead_letter():
    consumer = Consumer({A: 40})
    consumer.logs[A][13] = json.dumps([-1.0, 1.0]).encode()  # the poison (key k1)
    s = stream(consumer, max_inflight=4, max_batch=40, batch_size=8, sticky=False)
    s.client = Guard()
    written = run_to_end(s, consumer, 40)
    assert written == {A: list(range(40))}
    dead = [rid for topic, rid in s.producer.sent if topic == "out.dlq"]
    assert dead == ["in/0/13"]
    assert [h["tritonguard-error-code"] for h in s.producer.headers if "tritonguard-error-code" in h] == \
        ["INVALID_ARGUMENT"]
    refused = [rows for rows, _, _ in s.client.requests.values() if (rows[:, 0] < 0).any()]
    assert len(refused[0]) == 8 and len(refused[-1]) == 1  # refused with 7 others, then alone
    assert committed(consumer) == {A: 40}
    # without keys the events fill whole requests: 5 of 8, and the 8 of the refused one alone
    assert len(s.client.requests) == 5 + 8


def test_triton_unavailable_retries_a_whole_request_and_loses_none():
    consumer = Consumer({A: 24})
    s = stream(consumer, max_inflight=2, max_batch=24, batch_size=8, sticky=False)
    for _ in range(3):
        s._step()
    assert [len(s.client.requests[rid][0]) for rid, _ in s.client.calls] == [8, 8]
    s.client.answer(InferenceServerException("connection refused", status="StatusCode.UNAVAILABLE"))
    s._step()
    assert s.paused and consumer.paused == {A}
    s._commit(asynchronous=False)
    assert consumer.commits == [] and s.producer.sent == []
    s.retry_at = 0.0
    written = run_to_end(s, consumer, 24)
    assert written == {A: list(range(24))} and committed(consumer) == {A: 24}
    assert not s.paused and all(t == "out" for t, _ in s.producer.sent)


def test_a_group_is_sent_full_at_once_or_when_it_waited_and_chunks_keep_groups_apart():
    class E:
        def __init__(self, group: str, n: int) -> None:
            self.group, self.n, self.sent = group, n, False

    b = Batcher(size=3, wait_s=0.002)
    for n, g in enumerate("abab"):
        b.add(E(g, n), now=0.0)
    assert b.take(now=0.001) == [] and b.due_in(0.001) == 0.001 and len(b) == 4  # not full, not due
    b.add(E("a", 4), now=0.001)  # "a" holds a whole request now: it goes first
    assert [e.n for e in b.take(now=0.001)] == [0, 2, 4]
    assert [e.n for e in b.take(now=0.002)] == [1, 3]  # "b" waited its 2 ms
    assert b.take(now=1.0) == [] and b.due_in(1.0) is None and len(b) == 0
    b.add(E("c", 5), now=2.0)
    assert [e.n for e in b.take(now=2.0, flush=True)] == [5]  # a drain sends what waits at once
    events = [E(g, n) for n, g in enumerate("aabaaa")]
    assert [[e.n for e in r] for r in chunks(events, 3)] == [[0, 1, 3], [2], [4, 5]]
    assert not any(e.sent for e in events)  # chunks() marks nothing sent: the loop sends them


def test_a_request_holds_one_tenants_events_and_an_event_with_its_own_trace_goes_alone():
    consumer = Consumer({A: 24})
    for o in range(24):  # two tenants, alternating; offset 5 carries its own trace context
        consumer.headers[(A, o)] = [("x-tenant-id", f"t{o % 2}".encode())]
    consumer.headers[(A, 5)].append(("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01"))
    s = stream(consumer, max_inflight=8, max_batch=24, batch_size=8, sticky=False)
    written = run_to_end(s, consumer, 24)
    assert written == {A: list(range(24))}
    for rid, (rows, _, headers) in s.client.requests.items():
        offsets = rows[:, 0].astype(int).tolist()
        assert {f"t{o % 2}" for o in offsets} == {headers["x-tenant-id"]}, rid  # the tenant forwarded is each row's
        assert ("traceparent" in headers) == (offsets == [5]), rid
    # t0: 12 events (8 + 4), t1: 11 (8 + 3), and offset 5 alone
    assert sorted(len(rows) for rows, _, _ in s.client.requests.values()) == [1, 3, 4, 8, 8]


def test_a_revoke_sends_the_events_left_between_sent_ones_and_commits_no_further():
    class Answering(Triton):
        def async_infer(self, *args, **kwargs) -> None:
            super().async_infer(*args, **kwargs)
            self.answer()

    consumer = Consumer({A: 30})  # keys k0, k1, k2 (offset % 3)
    s = stream(consumer, max_inflight=1, max_batch=30, batch_size=4, read_ahead=100, session_timeout_ms=2000)
    for _ in range(3):
        s._step()
    assert [rid for rid, _ in s.client.calls] == ["in/0/0+3"]  # k0: 0, 3, 6, 9
    held = s.client
    held.answer()  # its answer is in the queue when the partition is revoked
    s.client = Answering()
    s._revoked(consumer, [TopicPartition("in", 0)])
    # the events after 9 were never sent: dropped, the next owner reads them; those between 0 and 9
    # (other keys' requests) were sent by the revoke's drain, so the commit reaches 10 and no further
    assert committed(consumer) == {A: 10}
    assert sorted(int(rid.split("/")[2]) for _, rid in s.producer.sent) == list(range(10))
    assert sorted(len(rows) for rows, _, _ in s.client.requests.values()) == [3, 3]  # k1: 1, 4, 7; k2: 2, 5, 8
