"""The whole fleet on one machine (issue 30): three replicas serving the digits guard from an
object store (moto), one Redis, nginx in front, Prometheus scraping every second
(tests/fleet/harness.py, also ``make fleet``).

Under steady client traffic through nginx (HTTP threads and one gRPC thread, real load_digits
images): the replicas are found in the registry; a digits v2 is published to the store and
promoted with gates read from Prometheus; one replica is SIGKILLed (its whole process group:
launcher, tritonserver, stubs) at the first step and started again on its ports; the only
client failures allowed are requests in flight at the kill.

``FLEET_V2_SOURCE=examples.candidates:retrain`` exports a genuine retrain as v2 (trains a CNN,
minutes); by default v2 is v1's artifact exported again (``--force``: judged by equivalence), so
the scenario takes about two minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.fleet.harness import Fleet

pytestmark = [pytest.mark.functional, pytest.mark.fleet]

ROOT = Path(__file__).resolve().parents[2]
HTTP_THREADS = 3
GRPC_THREADS = 1


@pytest.fixture(scope="module")
def fleet(exported_repo, tmp_path_factory):
    for exe in ("/usr/sbin/nginx", "/usr/bin/prometheus", "/usr/bin/promtool"):
        if not os.path.exists(exe):
            pytest.skip(f"{exe} is not installed (make system-deps)")
    if not (Path(sys.executable).parent / "moto_server").exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    f = Fleet(exported_repo, tmp_path_factory.mktemp("fleet"), replicas=3, models=("digits_raw", "digits"))
    f.start(timeout=180)
    print("fleet:", json.dumps(f.urls()))
    try:
        yield f
    finally:
        f.stop()


def exporter(fleet: Fleet, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **fleet.env(), "TRITONGUARD_REPOSITORY": fleet.url}
    return subprocess.run([sys.executable, "-m", "exporter", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


class Traffic:
    """Client threads sending digits infers through nginx until stopped; every request kept as
    (protocol, start, end, error or None, versions served)."""

    def __init__(self, fleet: Fleet):
        from sklearn.datasets import load_digits

        self.images = load_digits().images.astype(np.float32)
        self.http_url = fleet.lb.http_url.removeprefix("http://")
        self.grpc_url = fleet.lb.grpc_target
        self.stop = threading.Event()
        self.log: list[tuple[str, float, float, str | None, tuple[str, ...]]] = []
        self.threads = [threading.Thread(target=self._http, args=(i,), daemon=True) for i in range(HTTP_THREADS)]
        self.threads += [threading.Thread(target=self._grpc, args=(i,), daemon=True) for i in range(GRPC_THREADS)]

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def _loop(self, proto: str, seed: int, client, mod) -> None:
        rng = np.random.default_rng(seed)
        while not self.stop.is_set():
            x = self.images[rng.integers(0, len(self.images), 4)]
            inp = mod.InferInput("IMAGE", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            t0 = time.monotonic()
            try:
                r = client.infer("digits", [inp])
                who = tuple(s.decode() for s in r.as_numpy("SERVED_BY")[:, 0])
                self.log.append((proto, t0, time.monotonic(), None, who))
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and judged below
                self.log.append((proto, t0, time.monotonic(), str(exc)[:300], ()))
                time.sleep(0.05)

    def _http(self, i: int) -> None:
        import tritonclient.http as httpclient

        with httpclient.InferenceServerClient(self.http_url, network_timeout=60) as c:
            self._loop("http", i, c, httpclient)

    def _grpc(self, i: int) -> None:
        import tritonclient.grpc as grpcclient

        c = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            self._loop("grpc", 100 + i, c, grpcclient)
        finally:
            c.close()


def direct_served_by(replica, images: np.ndarray) -> list[str]:
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(replica.server.http_url, network_timeout=10) as c:
        inp = httpclient.InferInput("IMAGE", list(images.shape), "FP32")
        inp.set_data_from_numpy(images)
        return [s.decode() for s in c.infer("digits", [inp]).as_numpy("SERVED_BY")[:, 0]]


def listed_replicas(fleet: Fleet) -> tuple[dict, str]:
    r = exporter(fleet, "status", "--json", "--state-url", fleet.redis.url, "-r", fleet.url, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout), r.stderr


def test_the_fleet_rolls_out_through_a_replica_crash(fleet):
    numbers: dict[str, object] = {"replica_ready_s": [round(r.started_s, 1) for r in fleet.servers],
                                  "fleet_start_s": round(fleet.timings["start_s"], 1)}
    with Traffic(fleet) as traffic:
        time.sleep(2)
        # (a) no --server: the three replicas are found in the registry the guards heartbeat to
        doc, err = listed_replicas(fleet)
        assert "3 replicas live (from redis://" in err, err
        assert {x["http"] for x in doc["replicas"]} == {r.http_url for r in fleet.servers}
        assert all(x["models"].get("digits") == [1] for x in doc["replicas"]), doc["replicas"]

        # (b) a digits v2 in the store, then promoted with gates read from Prometheus
        source = os.environ.get("FLEET_V2_SOURCE")
        if source:
            args = ["--source", source]
        else:
            inputs = fleet.workdir / "inputs.npz"
            np.savez(inputs, IMAGE=traffic.images[:64])
            args = ["--source", str(fleet.workdir / "publish" / "digits_raw" / "1" / "model.onnx"),
                    "--inputs", str(inputs), "--task", "classifier", "--force"]
        t0 = time.monotonic()
        r = exporter(fleet, "export", *args, "--name", "digits", "--no-register", "-r", fleet.url)
        assert r.returncode == 0, r.stdout + r.stderr
        numbers["export_v2_s"] = round(time.monotonic() - t0, 1)
        assert "digits_raw/2/manifest.json" in {k.removeprefix(f"{fleet.prefix}/") for k in fleet.s3.keys(fleet.bucket)}

        env = {**os.environ, **fleet.env(), "TRITONGUARD_REPOSITORY": fleet.url}
        promote = subprocess.Popen(
            [sys.executable, "-m", "exporter", "promote", "digits", "--version", "2", "-r", fleet.url,
             "--state-url", fleet.redis.url, "--prometheus", fleet.prom.url, "--steps", "50,100",
             "--dwell-s", "10", "--interval-s", "1", "--min-requests", "60", "--max-error-rate", "0.05",
             "--min-compared", "40", "--min-latency-samples", "30", "--max-step-s", "120"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out: list[str] = []
        at_step1 = threading.Event()

        def read() -> None:
            for line in promote.stdout:
                out.append(line)
                if "→ step 1" in line:
                    at_step1.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        t_promote = time.monotonic()
        try:
            assert at_step1.wait(240), "".join(out)
            # (c) mid-rollout, one replica dies (SIGKILL to its whole process group) and comes back
            victim = fleet.servers[1]
            t_kill = victim.kill()
            victim.start(wait_models=fleet.models, timeout=180)
            t_ready = time.monotonic()
            numbers["restart_ready_s"] = round(victim.started_s, 1)
            # serving with the current routing: v2 is in it from step 1 (50 %) on
            seen_v2 = None
            while time.monotonic() - t_ready < 60:
                who = direct_served_by(victim, traffic.images[:16])
                if "digits_raw:2" in who:
                    seen_v2 = time.monotonic()
                    break
                time.sleep(0.1)
            if seen_v2 is None:
                import redis

                state = redis.Redis.from_url(fleet.redis.url).get("tritonguard:rollout:digits")
                log_tail = victim.server.log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"the restarted replica never served v2 (last: {who}); promote so far:\n{''.join(out)}\n"
                            f"rollout state: {state!r}\nits server log ends:\n{log_tail}")
            numbers["restart_to_routed_s"] = round(seen_v2 - (t_ready - victim.started_s), 1)
            numbers["ready_to_routed_s"] = round(seen_v2 - t_ready, 2)
            numbers["kill_to_group_gone_s"] = round(victim.dead_at - t_kill, 2)
            numbers["kill_to_routed_s"] = round(seen_v2 - t_kill, 1)
            rc = promote.wait(timeout=300)
        finally:
            if promote.poll() is None:
                promote.kill()
                promote.wait(10)
            reader.join(timeout=10)
        numbers["promote_s"] = round(time.monotonic() - t_promote, 1)
        text = "".join(out)
        print(text)
        assert rc == 0, text
        assert "promoted" in text
        time.sleep(3)  # traffic after the rollout, on every replica

    # the rollout is done in Redis, v2 is primary, every replica (the restarted one too) serves it
    import redis

    prog = json.loads(redis.Redis.from_url(fleet.redis.url).get("tritonguard:rollout:digits"))
    assert prog["status"] == "done", prog
    for rep in fleet.servers:
        assert direct_served_by(rep, traffic.images[:8]) == ["digits_raw:2"] * 8
    # the restarted replica is in the registry again (same address, a new start time)
    doc, _ = listed_replicas(fleet)
    assert len(doc["replicas"]) == 3

    # (d) failed client requests: only those in flight on the killed replica, i.e. sent before
    # its process group was gone (a request sent on a kept-alive connection while the dying
    # server's sockets still exist is lost with it) and not finished at the kill
    log = traffic.log
    failed = [x for x in log if x[3] is not None]
    in_flight = [x for x in failed if x[1] <= victim.dead_at and x[2] >= t_kill]
    numbers.update({
        "requests": len(log),
        "requests_http": sum(1 for x in log if x[0] == "http"),
        "requests_grpc": sum(1 for x in log if x[0] == "grpc"),
        "failed_http": sum(1 for x in failed if x[0] == "http"),
        "failed_grpc": sum(1 for x in failed if x[0] == "grpc"),
        "failed_in_flight_at_kill": len(in_flight),
        "failures": sorted({x[3] for x in failed})[:5],
        "failures_ms_after_kill": [round((x[1] - t_kill) * 1000) for x in failed],
        "served_v2_rows": sum(w.count("digits_raw:2") for *_, w in log),
        "nginx_retried": sum(1 for ln in fleet.lb.access_log.read_text().splitlines()
                             if "upstream_status=[502, " in ln or "upstream_status=[504, " in ln),
    })
    print("fleet numbers:", json.dumps(numbers))
    assert len(log) > 200
    assert failed == in_flight, failed[:5]
    assert len(failed) <= HTTP_THREADS + GRPC_THREADS
