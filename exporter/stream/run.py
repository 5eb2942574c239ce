"""The stream's one loop: consume a micro-batch (``--max-batch`` events or ``--max-wait-ms``)
into a read-ahead queue, send its events to the guard over gRPC in requests of up to
``--batch-size`` events along the batch dimension (async, as many requests at once as
``--max-inflight`` allows; which events may share a request, and how long one waits to fill
(``--batch-wait-ms``): :mod:`exporter.stream.batches`), and produce the outputs of every
partition in input order as they complete. A request the guard refuses as a whole (one event's
validation or PII refusal refuses its request) is split: its events are sent again one by one,
so only the poison is a dead letter. Offsets are committed only behind outputs the broker acknowledged
(:mod:`exporter.stream.offsets`).

Backpressure: how many requests Triton holds (``--max-inflight``) is bounded apart from how far
the consumer reads ahead (``--read-ahead`` events and ``--read-ahead-bytes`` per partition, read
and not yet acknowledged): a partition is paused only when its read-ahead is full, and resumed
when it drains to half. Pausing on every Triton slot would be slow: librdkafka's ``pause()``
throws away what it had fetched for the partition (confluentinc/librdkafka#5343), so each resume
fetches again.

Errors: a refusal by the guard (INVALID_ARGUMENT, PERMISSION_DENIED, UNAUTHENTICATED,
FAILED_PRECONDITION, OUT_OF_RANGE) or an event that does not decode is a dead letter; Triton
unavailable (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, NOT_FOUND while a model
reloads...) pauses every assigned partition and retries with a growing backoff until an answer
comes, then resumes; any other error is retried ``max_attempts`` times, then dead-lettered, so
no event stalls its partition for ever. A result the broker refuses for good stops the process
(exit 1) without committing past it: restarted, it redoes the events from the last commit.

Rollouts: each request carries the event's Kafka key as the guard's ``routing_key`` request
parameter, so a key's events go to one version throughout a rollout step (the guard routes a
request as a whole: a request holds the events of one key only); which version answered
which offsets is kept (:mod:`exporter.stream.answered`), and :meth:`Stream.replay` scores given
offsets again through the primary (request parameter ``version=primary``)."""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from tritonclient.utils import InferenceServerException

from exporter.errors import ExporterError
from exporter.stream.answered import Answered, Span
from exporter.stream.batches import Batcher, chunks
from exporter.stream.events import (
    EventError,
    InputSpec,
    decode,
    forwarded_headers,
    specs_from_metadata,
)
from exporter.stream.metrics import StreamMetrics
from exporter.stream.offsets import TP, OffsetTracker
from tritonguard.core.outage import Backoff

log = logging.getLogger("exporter.stream")

REFUSED = frozenset({"INVALID_ARGUMENT", "PERMISSION_DENIED", "UNAUTHENTICATED", "FAILED_PRECONDITION", "OUT_OF_RANGE"})
TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED", "ABORTED", "NOT_FOUND",
                       "CLIENT"})
BAD_EVENT = "BAD_EVENT"  # the error code of an event that does not decode or fit the model
MAX_MESSAGE = 1000  # characters of an error message kept in a dead letter's header
H = "tritonguard-"  # header prefix
READ_CHUNK = 500  # events taken from the consumer per turn while requests wait (the read-ahead fills)
# the guard's request parameters (tritonguard.guard.routing.sticky; the exporter does not import the guard)
ROUTING_KEY = "routing_key"
PIN_PRIMARY = {"version": "primary"}
QUIET_S = 5.0  # a version silent this long while others answer is reported (rolled back?)


class StreamError(ExporterError):
    """Cannot start: the model or a topic is missing, Triton cannot be reached."""


@dataclass
class StreamConfig:
    bootstrap: str
    topic: str
    output: str
    model: str
    url: str = "127.0.0.1:8001"
    group: str = "tritonguard-stream"
    dlq: str | None = None  # default: <output>.dlq
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_inflight: int = 256  # requests at Triton at once
    batch_size: int = 32  # events per Triton request at most (the model's max_batch_size caps it)
    batch_wait_ms: float = 2.0  # how long a request that is not full waits for more events
    read_ahead: int = 2000  # per partition: events read and not yet acknowledged (pause above)
    read_ahead_bytes: int = 32 * 2**20  # per partition: their keys and values, in bytes (pause above)
    request_timeout_s: float = 30.0
    max_attempts: int = 3
    partition_by: str = "input"  # the output partition: the event's own partition number, or "key"
    session_timeout_ms: int = 10000
    offset_reset: str = "earliest"
    startup_timeout_s: float = 60.0
    commit_interval_s: float = 0.2
    progress_interval_s: float = 10.0
    kafka: dict[str, str] = field(default_factory=dict)  # extra librdkafka settings, both clients
    record: str | None = None  # JSON file: per version, the input offsets it answered
    sticky: bool = True  # the event's key as the guard's routing_key

    @property
    def dead_letters(self) -> str:
        return self.dlq or f"{self.output}.dlq"


@dataclass(eq=False)
class Pending:
    tp: TP
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp: float | None  # seconds, the event's own
    arrays: dict[str, np.ndarray] | None = None
    params: dict[str, str] | None = None  # the guard's request parameters (routing_key, version)
    forwarded: dict[str, str] = field(default_factory=dict)  # gRPC headers (tenant, credentials, trace)
    group: Hashable = None  # events of one group may share a request (exporter.stream.batches)
    result: bytes | None = None
    served_by: str = ""
    code: str | None = None
    message: str = ""
    done: bool = False
    dropped: bool = False  # its partition was revoked: the next owner redoes it
    sent: bool = False  # taken off the read-ahead queue: sent to Triton (or failed to decode)
    size: int = 0  # bytes of its key and value (the read-ahead's byte bound)
    attempts: int = 0
    replay: str | None = None  # a replay: the version that answered it first ("" unknown); None: not one

    @property
    def rid(self) -> str:
        return f"{self.tp[0]}/{self.tp[1]}/{self.offset}"

    def fail(self, code: str, message: str) -> None:
        self.code, self.message, self.done = code, message[:MAX_MESSAGE], True


def _code(exc: Exception) -> str:
    status = exc.status() if isinstance(exc, InferenceServerException) else None
    return status.removeprefix("StatusCode.") if status else "CLIENT"


def _message(exc: Exception) -> str:
    return exc.message() if isinstance(exc, InferenceServerException) else str(exc)


def routing_key(key: bytes) -> str:
    """A Kafka key as the guard's ``routing_key`` (a string parameter): its UTF-8 text, so an
    HTTP or gRPC client naming the same customer lands on the same version; ``hex:...`` for a
    binary key."""
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + key.hex()


class Stream:
    def __init__(self, cfg: StreamConfig, metrics: StreamMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or StreamMetrics(cfg.model)
        self.session = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.stop = threading.Event()
        # gRPC's own reconnect backoff grows to 2 minutes: a Triton back after an outage would
        # wait for it; the stream's backoff (0.2..5 s) paces the retries instead
        self.client = grpcclient.InferenceServerClient(cfg.url, channel_args=[
            ("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
            ("grpc.max_reconnect_backoff_ms", 1000)])
        self.specs, self.max_rows, self.outputs = self._model()
        self.batched = self.max_rows > 0
        self.dtypes = {s.name: s.datatype for s in self.specs}
        common = {"bootstrap.servers": cfg.bootstrap, **cfg.kafka}
        self.consumer = Consumer({**common, "group.id": cfg.group, "enable.auto.commit": False,
                                  "enable.auto.offset.store": False, "auto.offset.reset": cfg.offset_reset,
                                  "session.timeout.ms": cfg.session_timeout_ms,
                                  "heartbeat.interval.ms": max(100, cfg.session_timeout_ms // 4),
                                  "on_commit": self._on_commit})
        # idempotent: the broker drops the producer's own retried duplicates and keeps its order
        # (--kafka may change linger.ms; the stream's guarantee settings win over it)
        self.producer = Producer({"linger.ms": 2, **common, "enable.idempotence": True, "acks": "all"})
        self.partitions = {t: self._partitions(t) for t in (cfg.topic, cfg.output, cfg.dead_letters)}
        self._state()

    def _state(self) -> None:
        """The loop's own state (apart from the clients, so that a test can wire fakes to it)."""
        self.tracker = OffsetTracker()
        self.queues: dict[TP, deque[Pending]] = {}  # per partition: read, output not yet produced
        # read and not yet sent, grouped into requests (a model without batching: one event each)
        self.rows = max(1, min(self.cfg.batch_size, self.max_rows)) if self.batched else 1
        self.waiting = Batcher(self.rows, self.cfg.batch_wait_ms / 1000)
        self.split: deque[Pending] = deque()  # events of a request refused as a whole: sent alone
        self.sending = 0  # requests at Triton (sent, not yet answered)
        self.size: dict[TP, int] = {}  # per partition: bytes read and not yet acknowledged
        self.held: set[TP] = set()  # partitions whose read-ahead is full
        self.stopped: set[TP] = set()  # partitions paused in the consumer now
        self.answers: queue.SimpleQueue = queue.SimpleQueue()  # (pending, result, error) from gRPC threads
        self.retry: list[Pending] = []
        self.retry_at = 0.0
        # Triton unavailable: a retry after 0.2 s, doubling up to 5 s (the stores' pause rule)
        self.outage = Backoff(start_s=0.2, max_s=5.0)
        self.paused = False  # Triton unavailable: every assigned partition paused, nothing new sent
        self.fatal: str | None = None
        self.counts = {"consumed": 0, "results": 0, "dead": 0, "requests": 0, "sent": 0}
        self.progressed = (0, time.monotonic())  # results + dead letters at the last progress line
        self.answered = Answered()
        self.quiet: set[str] = set()  # versions reported silent (rolled back?), until they answer again

    # -- start ------------------------------------------------------------------------------
    def _model(self) -> tuple[list[InputSpec], int, list[str]]:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            try:
                meta = self.client.get_model_metadata(self.cfg.model, as_json=True)
                config = self.client.get_model_config(self.cfg.model, as_json=True)["config"]
                break
            except InferenceServerException as exc:
                code = _code(exc)
                if code not in TRANSIENT:
                    raise StreamError(f"model {self.cfg.model!r} on {self.cfg.url}: {_message(exc)}") from None
                if time.monotonic() > deadline:
                    raise StreamError(f"Triton at {self.cfg.url} did not answer in {self.cfg.startup_timeout_s:g} s: "
                                      f"{_message(exc)}") from None
                time.sleep(1.0)
        max_rows = int(config.get("max_batch_size", 0) or 0)
        try:
            specs = specs_from_metadata(meta, max_rows)
        except EventError as exc:
            raise StreamError(f"model {self.cfg.model!r}: {exc}") from None
        return specs, max_rows, [o["name"] for o in meta.get("outputs", [])]

    def _partitions(self, topic: str) -> int:
        md = self.producer.list_topics(topic, timeout=10)
        t = md.topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            raise StreamError(f"topic {topic!r} does not exist on {self.cfg.bootstrap} (create it first)")
        return len(t.partitions)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        """Until :attr:`stop` is set (SIGTERM, SIGINT) or an output is lost; 0 or 1."""
        self.consumer.subscribe([self.cfg.topic], on_assign=self._assigned, on_revoke=self._revoked,
                                on_lost=self._lost)
        last_commit = last_lag = last_progress = time.monotonic()
        try:
            while not self.stop.is_set() and self.fatal is None:
                self._step()
                now = time.monotonic()
                if now - last_commit >= self.cfg.commit_interval_s:
                    self._commit(asynchronous=True)
                    last_commit = now
                if now - last_lag >= 1.0:
                    self._lag()
                    self._record()
                    last_lag = now
                if now - last_progress >= self.cfg.progress_interval_s:
                    self._progress()
                    last_progress = now
            if self.fatal is None:  # a stop: finish what Triton has, commit it, leave the group
                self._unread(set(self.queues))  # the read-ahead: the next owner reads it again
                self._drain(set(self.queues), deadline=time.monotonic() + 30.0)
                self._commit(asynchronous=False)
        finally:
            self._progress()
            self._record(final=True)
            self.consumer.close()  # leaves the group: its partitions move at once
            self.producer.flush(10)
            self.client.close()
        if self.fatal is not None:
            log.error("stream stopped: %s (offsets committed only up to the last acknowledged result)", self.fatal)
            return 1
        return 0

    def _step(self) -> None:
        self._backpressure()
        # consume() is called on every turn, paused or not: it serves the group's callbacks and
        # keeps max.poll.interval.ms from expelling a consumer that waits for Triton. It waits
        # (the micro-batch's time) only when there is nothing else to do
        full = self.sending >= self.cfg.max_inflight
        due = self.waiting.due_in(time.monotonic())  # a request not full waits (--batch-wait-ms) for more
        busy = self.paused or full or bool(self.split) or due == 0.0
        wait = 0.0 if busy else self.cfg.max_wait_ms / 1000 if due is None else min(due, self.cfg.max_wait_ms / 1000)
        # no partition reads past its read-ahead: at most the least room of those not held
        room = min((self.cfg.read_ahead - self.tracker.pending(tp) for tp in self.queues if tp not in self.held),
                   default=1)
        chunk = READ_CHUNK if busy or self.waiting else self.cfg.max_batch
        for msg in self.consumer.consume(num_messages=max(1, min(room, chunk)), timeout=wait):
            self._take(msg)  # (a paused partition may still hand over what was fetched before)
        self._dispatch()
        self._settle(timeout=0.005 if self.paused or self.sending >= self.cfg.max_inflight else 0.0)
        self._dispatch()
        self._emit()
        self.producer.poll(0)
        self.metrics.inflight.set(self.tracker.pending())

    def _take(self, msg: Any) -> None:
        if msg.error() is not None:
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("consumer: %s", msg.error())
                if msg.error().fatal():
                    self.fatal = f"consumer: {msg.error()}"
            return
        tp = (msg.topic(), msg.partition())
        if tp not in self.queues:
            return  # a message of a partition revoked meanwhile
        kind, ms = msg.timestamp()
        p = Pending(tp, msg.offset(), msg.key(), msg.value(), msg.headers() or [], ms / 1000 if kind and ms > 0 else None)
        p.size = len(p.key or b"") + len(p.value or b"")
        self.tracker.take(tp, p.offset)
        self.queues[tp].append(p)
        if self._prepare(p):
            self.waiting.add(p, time.monotonic())
        self.size[tp] = self.size.get(tp, 0) + p.size
        self.counts["consumed"] += 1
        self.metrics.consumed.labels(tp[0]).inc()

    def _prepare(self, p: Pending) -> bool:
        """Decode the event and name its group (what may share its request); False: it does not
        decode and is a dead letter of its own."""
        try:
            p.arrays = decode(p.value, self.specs, self.batched)
        except EventError as exc:
            p.sent = True
            p.fail(BAD_EVENT, str(exc))
            return False
        p.params = PIN_PRIMARY if p.replay is not None else (
            {ROUTING_KEY: routing_key(p.key)} if p.key and self.cfg.sticky else None)
        p.forwarded = forwarded_headers(p.headers)
        # the guard routes a whole request by its routing_key: only one key's events share one
        p.group = (p.replay is not None, p.params.get(ROUTING_KEY) if p.params else None,
                   tuple(sorted(p.forwarded.items())), tuple(a.shape for a in p.arrays.values()))
        return True

    def _dispatch(self, flush: bool = False) -> None:
        """Send what waits, retries first, while Triton holds fewer than ``--max-inflight`` of the
        stream's requests; a request not full goes once it waited ``--batch-wait-ms`` (at once
        with ``flush``). While Triton is unavailable only the retries go (at the backoff's pace);
        the read-ahead waits, uncommitted, and goes once Triton answers again."""
        now = time.monotonic()
        if self.retry and now >= self.retry_at:
            requests = chunks(self.retry, self.rows)
            room = max(0, self.cfg.max_inflight - self.sending)
            self.retry = [p for r in requests[room:] for p in r]
            for r in requests[:room]:
                for p in r:
                    self.metrics.retries.labels(p.code or "UNAVAILABLE").inc()
                    p.code = None
                self._send(r)
        if self.paused:
            if not self.retry and not self.sending and now >= self.retry_at:
                # nothing left to retry (revoked): a waiting request asks instead
                probe = [self.split.popleft()] if self.split else self.waiting.take(now, flush=True)
                if probe:
                    self._send(probe)
            return
        while self.split and self.sending < self.cfg.max_inflight:
            self._send([self.split.popleft()])
        while self.sending < self.cfg.max_inflight:
            request = self.waiting.take(now, flush)
            if not request:
                return
            self._send(request)

    def _send(self, ps: list[Pending]) -> None:
        """One request: the events' rows stacked along the batch dimension (their group shares
        the routing key, the forwarded headers and the shapes)."""
        self.sending += 1
        self.counts["requests"] += 1
        self.counts["sent"] += len(ps)
        first = ps[0]
        inputs = []
        for name in first.arrays or {}:
            arr = first.arrays[name] if len(ps) == 1 else np.concatenate([p.arrays[name] for p in ps])
            i = grpcclient.InferInput(name, list(arr.shape), self.dtypes[name])
            i.set_data_from_numpy(arr)
            inputs.append(i)
        rid = first.rid if len(ps) == 1 else f"{first.rid}+{len(ps) - 1}"
        try:
            self.client.async_infer(self.cfg.model, inputs, partial(self._answered, ps),
                                    outputs=[grpcclient.InferRequestedOutput(n) for n in self.outputs],
                                    request_id=rid, headers=first.forwarded or None,
                                    client_timeout=self.cfg.request_timeout_s, parameters=first.params)
        except Exception as exc:  # noqa: BLE001 - a channel that cannot send: retried like UNAVAILABLE
            self.answers.put((ps, None, exc))

    def _answered(self, ps: list[Pending], result: Any, error: Exception | None) -> None:
        self.answers.put((ps, result, error))  # gRPC's thread: the loop does the rest

    def _settle(self, timeout: float = 0.0) -> None:
        """Take every answer that arrived (waiting up to ``timeout`` for the first)."""
        try:
            item = self.answers.get(timeout=timeout) if timeout > 0 else self.answers.get_nowait()
        except queue.Empty:
            return
        while True:
            self._answer(*item)
            try:
                item = self.answers.get_nowait()
            except queue.Empty:
                return

    def _answer(self, ps: list[Pending], result: Any, error: Exception | None) -> None:
        self.sending -= 1
        live = [p for p in ps if not p.dropped]
        if not live:
            return
        if error is None:
            outs = {n: result.as_numpy(n) for n in self.outputs}
            served = outs.pop("SERVED_BY", None)  # per row: [N, 1]
            labels = served.reshape(len(ps), -1)[:, 0] if served is not None and served.size else None
            for i, p in enumerate(ps):
                if p.dropped:
                    continue
                p.served_by = labels[i].decode() if labels is not None else ""
                body = {n: (v[i] if self.batched else v).tolist() for n, v in outs.items() if v is not None}
                p.result = json.dumps({"outputs": body, "served_by": p.served_by}, separators=(",", ":")).encode()
                p.done = True
            if self.paused:
                self._resume()
            return
        code, message = _code(error), _message(error)
        if code in REFUSED:
            if len(ps) > 1:  # the request as a whole: each event again alone, so only the poison fails
                for p in live:
                    p.group = ("alone", p.rid)
                self.split.extend(live)
                return
            live[0].fail(code, message)
            return
        for p in live:
            p.code = code
        if code in TRANSIENT:
            self._pause(code, message)
            self.retry.extend(live)
            return
        for p in live:
            p.attempts += 1
            if p.attempts >= self.cfg.max_attempts:
                p.fail(code, message)
            else:
                self.retry.append(p)
        self.retry_at = max(self.retry_at, time.monotonic() + 0.2)

    def _pause(self, code: str, message: str) -> None:
        if self.outage.available():  # the scheduled retry failed too: wait longer
            self.retry_at = time.monotonic() + self.outage.fail()
        if not self.paused:
            self.paused = True
            self._hold()
            self.metrics.pauses.inc()
            self.metrics.paused.set(1)
            log.warning("Triton unavailable (%s: %s): partitions paused, retrying", code, message[:200])

    def _resume(self) -> None:
        self.paused, self.retry_at = False, 0.0
        self.outage.recover()
        self._hold()
        self.metrics.paused.set(0)
        log.warning("Triton answers again: partitions resumed")

    def _backpressure(self) -> None:
        """A partition's read-ahead full (``--read-ahead`` events or ``--read-ahead-bytes``, read
        and not yet acknowledged): held; resumed when both drained to half."""
        cfg, changed = self.cfg, False
        for tp in self.queues:
            n, size = self.tracker.pending(tp), self.size.get(tp, 0)
            if tp in self.held:
                if 2 * n <= cfg.read_ahead and 2 * size <= cfg.read_ahead_bytes:
                    self.held.discard(tp)
                    changed = True
            elif n >= cfg.read_ahead or size >= cfg.read_ahead_bytes:
                self.held.add(tp)
                changed = True
        if changed:
            self._hold()

    def _hold(self) -> None:
        """Pause every assigned partition while Triton is unavailable, else those held by their
        read-ahead; resume the others."""
        want = set(self.queues) if self.paused else self.held & set(self.queues)
        pause, resume = want - self.stopped, self.stopped - want
        try:
            if pause:
                self.consumer.pause([TopicPartition(t, p) for t, p in sorted(pause)])
            if resume:
                self.consumer.resume([TopicPartition(t, p) for t, p in sorted(resume)])
        except Exception as exc:  # noqa: BLE001 - a partition revoked meanwhile: the next turn sees the new set
            log.warning("pause/resume: %s", exc)
            return
        self.stopped = want

    # -- outputs, acknowledgements, commits --------------------------------------------------
    def _emit(self) -> None:
        for dq in self.queues.values():
            while dq and dq[0].done:
                self._produce(dq.popleft())

    def _produce(self, p: Pending) -> None:
        topic, part, off = p.tp[0], p.tp[1], p.offset
        headers: list[tuple[str, str | bytes]] = [
            (H + "result-id", p.rid), (H + "source-topic", topic), (H + "source-partition", str(part)),
            (H + "source-offset", str(off)), (H + "session", self.session)]
        if p.replay is not None:  # the same result-id as the first result: a reader keeps the replay
            headers.append((H + "replay", "1"))
            if p.replay:
                headers.append((H + "replay-of", p.replay))
        trace = forwarded_headers(p.headers).get("traceparent")
        if trace:
            headers.append(("traceparent", trace))
            if len(bits := trace.split("-")) >= 2:
                headers.append((H + "trace-id", bits[1]))
        if p.code is None:
            out, value = self.cfg.output, p.result
            headers.append((H + "served-by", p.served_by))
        else:
            out, value = self.cfg.dead_letters, p.value
            headers += [(H + "error-code", p.code), (H + "error-message", p.message)]
        kwargs = {"partition": part} if self.cfg.partition_by == "input" and part < self.partitions[out] else {}
        for _ in range(1000):  # the producer's queue full: serve its callbacks and try again
            try:
                self.producer.produce(out, value=value, key=p.key, headers=headers,
                                      on_delivery=partial(self._delivered, p, out), **kwargs)
                return
            except BufferError:
                self.producer.poll(0.05)
        self.fatal = f"the producer's queue stayed full; {p.rid} not produced"

    def _delivered(self, p: Pending, out: str, err: Any, _msg: Any) -> None:
        if err is not None:
            self.fatal = f"{p.rid} not acknowledged on {out}: {err}"
            return
        if self.fatal is not None:
            return  # never commit past a lost output
        self.tracker.ack(p.tp, p.offset)
        if not p.dropped and p.replay is None:
            self.size[p.tp] = self.size.get(p.tp, 0) - p.size
        if p.code is None:
            self.counts["results"] += 1
            self.metrics.produced.labels(out).inc()
            if p.replay is None and p.served_by:
                self.answered.add(p.served_by, p.tp, p.offset)
        else:
            self.counts["dead"] += 1
            self.metrics.dead.labels(out, p.code).inc()
        if p.timestamp is not None:
            self.metrics.latency.observe(max(0.0, time.time() - p.timestamp))

    def _commit(self, asynchronous: bool, only: set[TP] | None = None) -> None:
        if self.fatal is not None:
            return
        offsets = {tp: o for tp, o in self.tracker.committable().items() if only is None or tp in only}
        if not offsets:
            return
        try:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                 asynchronous=asynchronous)
        except Exception as exc:  # noqa: BLE001 - a failed commit is redone by the next one (or by the new owner)
            log.warning("commit failed: %s", exc)
            return
        self.tracker.committed(offsets)

    def _on_commit(self, err: Any, partitions: list[TopicPartition]) -> None:
        failed = [tp for tp in partitions if err is not None or tp.error is not None]
        for tp in failed:  # (runs in consume() or commit(): the loop's thread)
            self.tracker.commit_failed((tp.topic, tp.partition))
        if failed:
            log.warning("commit failed, done again at the next one: %s", err or failed[0].error)

    # -- rebalances --------------------------------------------------------------------------
    def _assigned(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        for tp in parts:
            self.queues[(tp.topic, tp.partition)] = deque()
            self.stopped.discard((tp.topic, tp.partition))  # assigned anew: not paused
        consumer.assign(parts)  # here, so that a stream paused now pauses them too
        if parts and self.paused:
            self._hold()
        log.info("assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in parts) or "nothing")

    def _revoked(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        """Finish the revoked partitions' events sent to Triton (bounded), commit them, let them
        go; their read-ahead not yet sent is dropped (the next owner reads it from the commit)."""
        tps = {(tp.topic, tp.partition) for tp in parts}
        self._unread(tps)
        if self.fatal is None:
            self._drain(tps, deadline=time.monotonic() + min(10.0, self.cfg.session_timeout_ms / 2000))
            self._commit(asynchronous=False, only=tps)
        self._forget(tps)

    def _lost(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self._forget({(tp.topic, tp.partition) for tp in parts})  # already someone else's: no commit

    def _drain(self, tps: set[TP], deadline: float) -> None:
        while self.fatal is None and any(self.tracker.pending(tp) for tp in tps) and time.monotonic() < deadline:
            self._dispatch(flush=True)
            self._settle(timeout=0.01)
            self._emit()
            self.producer.poll(0.01)

    def _unread(self, tps: set[TP]) -> None:
        """Drop the events of ``tps`` read and not yet sent after the last one sent (the
        suffix of each partition's queue), so that the commit waits only for those sent; an event
        not sent before one sent (another group's request went first) is sent by the drain."""
        for tp in tps:
            dq = self.queues.get(tp)
            while dq and not dq[-1].sent:
                p = dq.pop()
                p.dropped = True
                self.tracker.untake(tp, p.offset)
                self.size[tp] = self.size.get(tp, 0) - p.size
        self.waiting.drop(lambda p: p.dropped)

    def _forget(self, tps: set[TP]) -> None:
        for tp in tps:
            for p in self.queues.pop(tp, ()):
                p.dropped = True
            self.tracker.forget(tp)
            self.size.pop(tp, None)
            self.held.discard(tp)
            self.stopped.discard(tp)
            try:
                self.metrics.lag.remove(tp[0], str(tp[1]))
            except KeyError:
                pass
        self.retry = [p for p in self.retry if p.tp not in tps]
        self.split = deque(p for p in self.split if p.tp not in tps)
        self.waiting.drop(lambda p: p.tp in tps)

    # -- observability -----------------------------------------------------------------------
    def _lag(self) -> None:
        """From the watermarks the fetches already brought (no request to the broker)."""
        for t, part in list(self.queues):
            try:
                _, high = self.consumer.get_watermark_offsets(TopicPartition(t, part), cached=True)
                pos = self.consumer.position([TopicPartition(t, part)])[0].offset
            except Exception:  # noqa: BLE001 - no figure yet
                continue
            if high >= 0 and pos >= 0:  # + what was read ahead and is not answered yet
                self.metrics.lag.labels(t, str(part)).set(max(0, high - pos) + self.tracker.pending((t, part)))

    def _record(self, final: bool = False) -> None:
        """The record file rewritten when it changed; a version that answered nothing for
        ``QUIET_S`` while others did (a rollback, most likely) reported once with its ranges; at
        exit, every version's."""
        a, cfg = self.answered, self.cfg
        if cfg.record and (a.changed or final):
            try:
                a.write(Path(cfg.record), topic=cfg.topic, model=cfg.model, group=cfg.group)
            except OSError as exc:
                log.warning("record %s not written: %s", cfg.record, exc)
        latest = max(a.last.values(), default=0.0)
        for version, last in a.last.items():
            if latest - last < QUIET_S:
                self.quiet.discard(version)
            elif version not in self.quiet:
                self.quiet.add(version)
                log.warning("%s answered no event for %.0f s while others did (rolled back?): %s; score them "
                            "again through the primary with --replay %s", version, latest - last,
                            a.summary(version), cfg.record or "TOPIC:PARTITION:START-END")
        if final:
            for version in sorted(a.counts):
                log.info("answered by %s: %s", version, a.summary(version))

    # -- replay ------------------------------------------------------------------------------
    def replay(self, wanted: dict[TP, list[Span]], timeout_s: float = 120.0) -> dict[str, int]:
        """Score the events at the offsets ``wanted`` again through the primary (request parameter
        ``version=primary``) and write their results to the output topic with the header
        ``tritonguard-replay: 1`` (and ``-replay-of``: the version that answered first). Spans
        from a record answered by the primary itself are skipped: the first event sent tells which
        version the primary is. Commits nothing; the group is not joined. Returns counts."""
        reader = Consumer({"bootstrap.servers": self.cfg.bootstrap, **self.cfg.kafka, "group.id": self.cfg.group,
                           "enable.auto.commit": False, "enable.partition.eof": True})
        todo: dict[TP, list[Pending]] = {}
        forced: set[Pending] = set()  # asked for by a range: replayed whoever answered it first
        deadline = time.monotonic() + timeout_s
        try:
            reader.assign([TopicPartition(t, p, spans[0][0]) for (t, p), spans in wanted.items()])
            ends = {tp: max(b for _, b, _ in spans) for tp, spans in wanted.items()}
            open_ = set(ends)
            while open_ and time.monotonic() < deadline:
                for msg in reader.consume(500, timeout=0.5):
                    tp = (msg.topic(), msg.partition())
                    if msg.error() is not None:
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            open_.discard(tp)
                        continue
                    off = msg.offset()
                    if off > ends[tp]:
                        open_.discard(tp)
                        continue
                    covering = [s for s in wanted[tp] if s[0] <= off <= s[1]]
                    if covering:
                        kind, ms = msg.timestamp()
                        p = Pending(tp, off, msg.key(), msg.value(), msg.headers() or [],
                                    ms / 1000 if kind and ms > 0 else None,
                                    replay=next((s[2] for s in covering if s[2]), ""))
                        todo.setdefault(tp, []).append(p)
                        if any(not s[2] for s in covering):
                            forced.add(p)
                    if off >= ends[tp]:
                        open_.discard(tp)
        finally:
            reader.close()
        if open_:
            raise StreamError(f"--replay: {', '.join(f'{t}[{p}]' for t, p in sorted(open_))} not read to the "
                              f"end of the range in {timeout_s:g} s")
        counts = {"replayed": 0, "skipped": 0, "dead": 0}
        events = [p for tp in sorted(todo) for p in todo[tp]]
        for p in events:
            self._prepare(p)
        primary = ""
        probe = next((p for p in events if p.replay and not p.done), None)
        if probe is not None:  # which version is the primary now: the first answer says
            self._score([probe], deadline)
            primary = probe.served_by
        keep = []
        for p in events:
            if primary and p.replay == primary and p not in forced:
                counts["skipped"] += 1  # the primary answered it the first time
            else:
                keep.append(p)
        self._score([p for p in keep if not p.done], deadline)
        for p in keep:
            self.tracker.take(p.tp, p.offset)
            self.queues.setdefault(p.tp, deque()).append(p)
        self._emit()
        self.producer.flush(30)
        if self.fatal is not None or self.tracker.pending():
            raise StreamError(f"--replay: {self.fatal or 'results not acknowledged by the broker'}")
        counts["replayed"] = sum(p.code is None for p in keep)
        counts["dead"] = len(keep) - counts["replayed"]
        return counts

    def close(self) -> None:
        """After :meth:`replay` (:meth:`run` closes its own clients)."""
        self.consumer.close()
        self.producer.flush(10)
        self.client.close()

    def _score(self, events: list[Pending], deadline: float) -> None:
        """Send ``events`` and wait for every answer (retries and Triton outages as the stream)."""
        for r in chunks(events, self.rows):
            self._send(r)
        while not all(p.done for p in events):
            if time.monotonic() > deadline:
                raise StreamError(f"--replay: {sum(not p.done for p in events)} events not answered in time")
            self._settle(timeout=0.01)
            while self.split:
                self._send([self.split.popleft()])
            if self.retry and time.monotonic() >= self.retry_at:
                again, self.retry = self.retry, []
                for p in again:
                    p.code = None
                for r in chunks(again, self.rows):
                    self._send(r)

    def _progress(self) -> None:
        c, now = self.counts, time.monotonic()
        done, (done_before, then) = c["results"] + c["dead"], self.progressed
        self.progressed = (done, now)
        lag = sum(s.value for m in self.metrics.families["lag"].collect() for s in m.samples)
        log.info("stream %s: %d consumed, %d results, %d dead letters, %d in flight, %.0f events/s, "
                 "%.1f events a request, lag %d%s", self.cfg.topic, c["consumed"], c["results"], c["dead"],
                 self.tracker.pending(), (done - done_before) / max(now - then, 1e-6),
                 c["sent"] / max(1, c["requests"]), lag, ", PAUSED (Triton unavailable)" if self.paused else "")
