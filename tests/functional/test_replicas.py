"""Two tritonserver replicas sharing one real Redis (``TRITONGUARD_STATE_URL``): every replica's
guards follow the same rollout and breaker state, and a rollout reads both replicas' metrics.

Both servers serve the same private repository (digits v1 primary, a good v2, a NaN-emitting v3)
on their own loopback ports; the state lives only in Redis (no rollout_state.json is written).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.http as httpclient

from exporter.build.export import export
from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server
from tritonguard.rollout.stores import open_store

pytestmark = pytest.mark.functional

ROOT = Path(__file__).resolve().parents[2]
PICKUP_S = 5.0  # a replica must follow a state change within this


@pytest.fixture(scope="module")
def replicas(redis_server, tmp_path_factory):
    from examples import faults

    base = tmp_path_factory.mktemp("replicas")
    repo = base / "repo"
    v = {"base": export(faults.base(), name="digits", repository=repo, source="examples.faults:base").version}
    v["good"] = export(faults.good(), name="digits", repository=repo, source="examples.faults:good").version
    v["nan"] = export(faults.nan_subset(), name="digits", repository=repo, source="examples.faults:nan_subset").version
    cfg = read_config(repo / "digits")
    params = {k: x["string_value"] for k, x in cfg["parameters"].items()}
    params.update({"target_version": str(v["base"]), "routing.poll_interval_s": "1",
                   "breaker.min_requests": "20", "breaker.max_nan_rate": "0.0", "breaker.min_off_s": "300"})
    cfg["parameters"] = {k: {"string_value": x} for k, x in params.items()}
    cfg["instance_group"] = [{"kind": "KIND_CPU", "count": 1}]
    write_config(repo / "digits", cfg)

    # heartbeats every second: the replica registry (found, not listed) sees them at once
    env = {**os.environ, "TRITONGUARD_STATE_URL": redis_server.url, "TRITONGUARD_HEARTBEAT_S": "1"}
    r = redis.Redis.from_url(redis_server.url)  # nothing of digits left by an earlier test
    r.delete("tritonguard:state:digits", *r.keys("tritonguard:rollout:digits*"))
    servers = [Server(repository=repo, log_path=base / f"logs{i}" / "tritonserver.log", env=env) for i in range(2)]
    try:
        for s in servers:
            s.start(wait_models=["digits"])
        clients = [httpclient.InferenceServerClient(s.http_url) for s in servers]
        images, _ = faults.load_all()
        yield {"repo": repo, "v": v, "servers": servers, "clients": clients, "env": env, "images": images,
               "url": redis_server.url}
        for c in clients:
            c.close()
    finally:
        for s in servers:
            s.stop()


def served_by(client, images: np.ndarray) -> tuple[list[str], np.ndarray]:
    inp = httpclient.InferInput("IMAGE", list(images.shape), "FP32")
    inp.set_data_from_numpy(images.astype(np.float32))
    r = client.infer("digits", [inp], outputs=[httpclient.InferRequestedOutput("PROBS"),
                                                httpclient.InferRequestedOutput("SERVED_BY")])
    return [s.decode() for s in r.as_numpy("SERVED_BY")[:, 0]], r.as_numpy("PROBS")


def exporter(ctx, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args, "--repository", str(ctx["repo"])], cwd=ROOT,
                          env=ctx["env"], capture_output=True, text=True, timeout=300)


def state(ctx):
    return open_store("digits", ctx["repo"], url=ctx["url"]).load()


def test_state_lives_in_redis_only(replicas):
    st = state(replicas)
    assert st is not None and st.primary == replicas["v"]["base"]
    assert not (replicas["repo"] / "digits" / "rollout_state.json").exists()
    # both replicas checked the primary's goldens on their own hardware; the store holds the verdict
    assert st.goldens[str(replicas["v"]["base"])]["verdict"] == "PASS"


def test_every_replica_follows_a_route_change(replicas):
    v2 = replicas["v"]["good"]
    r = exporter(replicas, "route", "digits", "--candidate", str(v2), "--share", "1.0")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    pending = set(range(2))
    took = {}
    while pending and time.monotonic() - t0 < PICKUP_S + 5:
        for i in list(pending):
            who, _ = served_by(replicas["clients"][i], replicas["images"][:4])
            if who == [f"digits_raw:{v2}"] * 4:
                took[i] = time.monotonic() - t0
                pending.discard(i)
        time.sleep(0.1)
    print(f"route change picked up after {took}")
    assert not pending, f"replicas {pending} did not follow the route change"
    assert max(took.values()) <= PICKUP_S
    r = exporter(replicas, "route", "digits", "--candidate", "0")
    assert r.returncode == 0, r.stderr


def test_idle_replicas_follow_and_check_goldens_without_traffic(replicas):
    """The reconciler loop of each guard: with no request at all, a newly routed version gets its
    golden verdict in the store and a breaker gauge on every replica's metrics port."""
    import urllib.request

    v3 = replicas["v"]["nan"]
    assert str(v3) not in state(replicas).goldens  # never routed to before
    r = exporter(replicas, "route", "digits", "--candidate", str(v3), "--share", "0.5")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    try:
        want = f'tritonguard_breaker_state{{model="digits",target_version="{v3}",version="1"}}'
        pending = set(range(2))
        while (pending or str(v3) not in state(replicas).goldens) and time.monotonic() - t0 < PICKUP_S + 5:
            for i in list(pending):
                text = urllib.request.urlopen(replicas["servers"][i].metrics_url, timeout=10).read().decode()
                if any(ln.startswith(want) for ln in text.splitlines()):
                    pending.discard(i)
            time.sleep(0.2)
        took = time.monotonic() - t0
        print(f"idle replicas followed after {took:.1f} s")
        assert not pending, f"replicas {pending} published no breaker gauge for v{v3}"
        g = state(replicas).goldens.get(str(v3))
        # the NaN fault answers its goldens finitely (only a subset of live inputs turn NaN)
        assert g is not None and g["verdict"] in ("PASS", "MARGINAL"), g
        assert took <= PICKUP_S + 2
    finally:
        r = exporter(replicas, "route", "digits", "--candidate", "0")
        assert r.returncode == 0, r.stderr


def test_a_breaker_tripped_on_one_replica_protects_the_other(replicas):
    v3 = replicas["v"]["nan"]
    a, b = replicas["clients"]
    r = exporter(replicas, "route", "digits", "--candidate", str(v3), "--share", "0.5")
    assert r.returncode == 0, r.stderr
    time.sleep(2.5)  # both replicas poll every second
    images = replicas["images"]
    tripped = False
    for i in range(60):  # traffic on replica A only, until its breaker opens (in Redis)
        served_by(a, images[(i * 8) % 1600:(i * 8) % 1600 + 8])
        bst = state(replicas).breakers.get(str(v3), {})
        if bst.get("state") == "open":
            tripped = True
            break
    assert tripped, "the NaN candidate's breaker never opened on replica A"
    time.sleep(2.5)
    # replica B never saw a NaN itself, yet routes nothing to the open candidate
    for i in range(25):
        who, probs = served_by(b, images[i * 8:(i + 1) * 8])
        assert f"digits_raw:{v3}" not in who, who
        assert np.isfinite(probs).all()
    r = exporter(replicas, "route", "digits", "--candidate", "0")
    assert r.returncode == 0, r.stderr


def test_a_rollout_reads_both_replicas(replicas):
    """promote with two --server URLs: the gates sum both replicas' metrics; both follow every step."""
    import threading

    v2 = replicas["v"]["good"]
    stop = threading.Event()
    errors: list[str] = []

    def traffic(url: str) -> None:
        client = httpclient.InferenceServerClient(url)
        rng = np.random.default_rng(abs(hash(url)) % 2**32)
        deadline = time.monotonic() + 240
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                x = np.clip(replicas["images"][rng.integers(0, 1700, 4)] + rng.normal(0, 0.05, (4, 8, 8)), 0, 16)
                try:
                    served_by(client, x)
                except Exception as exc:  # noqa: BLE001 - counted and asserted below
                    errors.append(str(exc))
        finally:
            client.close()

    threads = [threading.Thread(target=traffic, args=(s.http_url,), daemon=True) for s in replicas["servers"]]
    for t in threads:
        t.start()
    try:
        args = []
        for s in replicas["servers"]:
            args += ["--server", s.http_url, "--metrics-url", s.metrics_url]
        r = exporter(replicas, "promote", "digits", "--version", str(v2), "--steps", "20,100", "--dwell-s", "2",
                     "--interval-s", "1", "--min-requests", "60", "--max-error-rate", "0.05", "--min-compared", "40",
                     "--min-latency-samples", "30", "--max-step-s", "90", *args)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    # the controller's progress sits in the same Redis as the state, not in a local file
    assert not (replicas["repo"] / "digits" / "rollout_controller.json").exists()
    prog = json.loads(redis.Redis.from_url(replicas["url"]).get("tritonguard:rollout:digits"))
    assert prog["status"] == "done"
    assert prog["last_report"] is not None
    assert prog["baseline"]["replicas"] == 2, "the gates did not read both replicas"
    assert state(replicas).primary == v2
    assert not errors, errors[:3]
    for c in replicas["clients"]:
        who, _ = served_by(c, replicas["images"][:4])
        assert who == [f"digits_raw:{v2}"] * 4


def test_the_replicas_are_found_in_the_registry(replicas):
    """No --server: `status` finds both replicas in Redis, where their guards heartbeat the URLs
    the launcher advertised (tritonguard.rollout.replicas)."""
    import json

    wanted = {f"http://{s.http_url}" for s in replicas["servers"]}
    deadline = time.monotonic() + 15
    while True:
        # a beat is judged against when the command started: it reads the registry early, and
        # under a loaded machine the command itself ran 14 s (heavy imports; CI lanes, 2026-11-28)
        asked_at = time.time()
        r = exporter(replicas, "status", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        found = {x["http"]: x for x in doc["replicas"]}
        if wanted <= set(found) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert wanted <= set(found), found
    assert "replicas live (from redis://" in r.stderr, r.stderr
    for s in replicas["servers"]:
        mine = found[f"http://{s.http_url}"]
        assert mine["metrics"] == s.metrics_url and mine["grpc"] == s.grpc_url
        assert mine["models"].get("digits") and mine["heartbeat"] > asked_at - 10
    guard = next(g for g in doc["guards"] if g["model"] == "digits")
    assert guard["metrics"]["replicas"] == 2
