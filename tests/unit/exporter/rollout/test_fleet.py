"""Replicas found, not listed: the exporter reads the live replicas from the registry the guards
keep in a real redis-server, re-resolves them at each look (a dead one drops out with a line, a
new one counts from its first reading), and `status --json` / `rollout status` use them."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
from typer.testing import CliRunner

from exporter.cli.app import app
from exporter.rollout.controller import RolloutController
from exporter.rollout.fleet import Fleet, FleetReader, discover
from exporter.rollout.progress import RolloutConfig
from exporter.rollout.route import RouteChange, apply
from tritonguard.core.repository import write_config
from tritonguard.rollout.replicas import KEY_PREFIX, ReplicaRegistry
from tritonguard.triton import http as triton_http

MODEL = "fleetm"
GUARD = {"name": MODEL, "backend": "guard", "max_batch_size": 4,
         "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],
         "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}],
         "parameters": {"target": {"string_value": "fleetm_raw"}}}


def info(port: int, started: float = 1.0) -> dict:
    return {"http": f"http://127.0.0.1:{port}", "grpc": f"127.0.0.1:{port + 1}",
            "metrics": f"http://127.0.0.1:{port + 2}/metrics", "host": "127.0.0.1", "started": started}


def series(served1: float, served2: float, errors2: float, breaker: int = 0) -> dict:
    def key(name, **labels):
        return (name, frozenset({"model": MODEL, **labels}.items()))
    return {key("tritonguard_served_total", served_by="fleetm_raw:1"): served1,
            key("tritonguard_served_total", served_by="fleetm_raw:2"): served2,
            key("tritonguard_target_errors_total", target_version="2"): errors2,
            key("tritonguard_breaker_state", target_version="2"): float(breaker)}


@pytest.fixture
def registry(redis_server, request):
    reg = ReplicaRegistry(redis_server.url, period_s=5.0, key_prefix=f"f:{request.node.name}:")
    yield reg
    for r in reg.live():
        reg.remove(r.id)
    reg.close()


class FakeScrapes:
    def __init__(self):
        self.by_url: dict[str, dict] = {}

    def __call__(self, url: str, timeout: float) -> dict:
        if url not in self.by_url:
            raise triton_http.Unreachable(url, "connection refused")
        return self.by_url[url]


def test_reader_drops_dead_replicas_and_counts_new_ones_from_their_first_reading(registry):
    lines: list[str] = []
    scrapes = FakeScrapes()
    fleet = Fleet(registry.url, registry)
    read = FleetReader(fleet, MODEL, target="fleetm_raw", say=lines.append, scraper=scrapes)
    for port, s in ((8000, series(100, 10, 0)), (9000, series(50, 5, 0))):
        registry.beat(info(port), MODEL, [1, 2])
        scrapes.by_url[info(port)["metrics"]] = s
    r = read(1, 2)
    assert (r.served, r.errors, r.replicas) == ({1: 150, 2: 15}, {2: 0}, 2)
    assert lines == [f"2 replicas live (from {registry.url})"]

    # 9000 stops heartbeating (its key expired): dropped at this look, its counts stay
    registry.remove("127.0.0.1:9000")
    scrapes.by_url[info(8000)["metrics"]] = series(120, 12, 0)
    r = read(1, 2)
    assert (r.served, r.replicas) == ({1: 170, 2: 17}, 1)
    assert any("replica 127.0.0.1:9000 dropped out (no heartbeat" in x for x in lines), lines
    assert lines[-1] == f"1 replica live (from {registry.url})"

    # 7000 joins with 1000 requests and 500 errors behind it: only what follows counts
    registry.beat(info(7000), MODEL, [1, 2])
    scrapes.by_url[info(7000)["metrics"]] = series(1000, 900, 500, breaker=1)
    r = read(1, 2)
    assert (r.served, r.errors, r.replicas) == ({1: 170, 2: 17}, {2: 0}, 2)
    assert r.breaker_state == 1  # gauges are as they are, from live replicas
    assert "replica 127.0.0.1:7000 joined: counted from this reading" in lines
    scrapes.by_url[info(7000)["metrics"]] = series(1010, 902, 501)
    assert read(1, 2).errors == {2: 1}

    # 7000 restarts (new start time, counters from 0): its counts so far stay, and what it
    # counted since the restart is added (3 and 1: they were served inside the window)
    registry.beat(info(7000, started=2.0), MODEL, [1, 2])
    scrapes.by_url[info(7000)["metrics"]] = series(3, 1, 0)
    r = read(1, 2)
    assert r.served == {1: 183, 2: 20} and r.errors == {2: 1}
    assert any("127.0.0.1:7000 restarted (a new start time)" in x for x in lines), lines

    # metrics unreadable while still registered: dropped within this look
    del scrapes.by_url[info(8000)["metrics"]]
    r = read(1, 2)
    assert r.replicas == 1 and r.served == {1: 183, 2: 20}
    assert any("127.0.0.1:8000 dropped out (metrics" in x for x in lines), lines


def restart_mid_rollout(registry, new_start_time: bool) -> None:
    """Issue 39 item 7: 8000 is read at 0/0, then 100 served and 40 errors to v2, then restarts
    (Triton's counters from zero) and reads 110 served and 5 errors. The window holds +210 / +45,
    not +110 / +5 (a reset seen only against the join offset) nor +0 (the new counts taken for
    an offset). Without a new start time (a supervisor that kept the launcher's) the counters
    that went down say it."""
    lines: list[str] = []
    scrapes = FakeScrapes()
    read = FleetReader(Fleet(registry.url, registry), MODEL, target="fleetm_raw", say=lines.append, scraper=scrapes)
    for port in (8000, 9000):
        registry.beat(info(port), MODEL, [1, 2])
        scrapes.by_url[info(port)["metrics"]] = series(0, 0, 0)
    r0 = read(1, 2)
    scrapes.by_url[info(8000)["metrics"]] = series(0, 100, 40)
    r1 = read(1, 2)
    assert (r1.served[2], r1.errors[2]) == (100, 40)
    if new_start_time:
        registry.beat(info(8000, started=2.0), MODEL, [1, 2])
    scrapes.by_url[info(8000)["metrics"]] = series(0, 110, 5)
    r2 = read(1, 2)
    assert (r2.served[2] - r0.served[2], r2.errors[2] - r0.errors[2]) == (210, 45), lines
    assert r2.replicas == 2
    why = "a new start time" if new_start_time else "its counters went back"
    assert any(f"replica 127.0.0.1:8000 restarted ({why})" in x for x in lines), lines
    # and it keeps counting from there; another model's counters on the server are not read
    other = ("tritonguard_served_total", frozenset({"model": "other", "served_by": "o:1"}.items()))
    scrapes.by_url[info(8000)["metrics"]] = {**series(0, 130, 6), other: 9.0}
    r3 = read(1, 2)
    assert (r3.served[2], r3.errors[2]) == (230, 46)
    scrapes.by_url[info(8000)["metrics"]] = {**series(0, 131, 6), other: 1.0}  # "other" reloaded
    assert read(1, 2).served[2] == 231
    assert sum("restarted" in x for x in lines) == 1, lines


def test_a_replica_restarting_mid_rollout_with_its_old_start_time_keeps_its_counts(registry):
    restart_mid_rollout(registry, new_start_time=False)


def test_a_replica_restarting_mid_rollout_with_a_new_start_time_keeps_its_counts(registry):
    restart_mid_rollout(registry, new_start_time=True)


def test_a_replica_unread_for_a_look_is_read_again_from_where_it_was(registry):
    """A metrics blip is not a restart: the replica's counts while it was unread are not lost."""
    lines: list[str] = []
    scrapes = FakeScrapes()
    read = FleetReader(Fleet(registry.url, registry), MODEL, target="fleetm_raw", say=lines.append, scraper=scrapes)
    registry.beat(info(8000), MODEL, [1, 2])
    scrapes.by_url[info(8000)["metrics"]] = series(10, 10, 1)
    assert read(1, 2).served == {1: 10, 2: 10}
    del scrapes.by_url[info(8000)["metrics"]]
    r = read(1, 2)
    assert r.served == {1: 10, 2: 10} and r.replicas == 0
    scrapes.by_url[info(8000)["metrics"]] = series(30, 25, 2)
    r = read(1, 2)
    assert (r.served, r.errors, r.replicas) == ({1: 30, 2: 25}, {2: 2}, 1)
    assert "replica 127.0.0.1:8000 is back: counted again from its last reading" in lines


def test_controller_is_not_failed_by_a_replica_joining_with_old_errors(registry, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    repo = tmp_path / "repo"
    write_config(repo / MODEL, GUARD)
    for v in (1, 2):
        (repo / "fleetm_raw" / str(v)).mkdir(parents=True)
    apply(repo, MODEL, RouteChange(primary=1))
    scrapes = FakeScrapes()
    registry.beat(info(8000), MODEL, [1, 2])
    scrapes.by_url[info(8000)["metrics"]] = series(100, 10, 0)
    lines: list[str] = []
    reader = FleetReader(Fleet(registry.url, registry), MODEL, target="fleetm_raw", say=lines.append,
                         scraper=scrapes)
    ctl = RolloutController(MODEL, repo, reader, config=RolloutConfig(steps=(10, 100), dwell_s=0.0))
    ctl.start(2, primary=1)
    ctl.tick()  # baseline
    registry.beat(info(9000), MODEL, [1, 2])  # joins with a history of failures
    scrapes.by_url[info(9000)["metrics"]] = series(0, 400, 400)
    scrapes.by_url[info(8000)["metrics"]] = series(200, 20, 0)
    p = ctl.tick()
    assert p.status == "running", p.reason
    assert "error rate" not in p.reason or "0.00%" in p.reason, p.reason
    # the newcomer's errors after it joined do count
    scrapes.by_url[info(9000)["metrics"]] = series(0, 500, 480)
    p = ctl.tick()
    assert p.status == "rolled_back" and "error rate" in p.reason, p.reason


def test_discover_needs_redis(redis_server):
    assert discover("") is None and discover("/tmp/x") is None
    assert isinstance(discover(redis_server.url), Fleet)


# -- the CLI ---------------------------------------------------------------------------------------
class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fleet_repo(tmp_path, monkeypatch, redis_server):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)  # restored after --state-url set it
    repo = tmp_path / "model_repository"
    write_config(repo / MODEL, GUARD)
    for v in (1, 2):
        (repo / "fleetm_raw" / str(v)).mkdir(parents=True)
    reg = ReplicaRegistry(redis_server.url, period_s=5.0)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield repo, reg, srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    for k in reg.client.scan_iter(match=f"{KEY_PREFIX}*"):
        reg.client.delete(k)
    for k in reg.client.scan_iter(match=f"tritonguard:*{MODEL}*"):
        reg.client.delete(k)
    reg.close()


def _exposition(served1: int, served2: int, errors2: int) -> bytes:
    return (f'tritonguard_served_total{{model="{MODEL}",served_by="fleetm_raw:1"}} {served1}\n'
            f'tritonguard_served_total{{model="{MODEL}",served_by="fleetm_raw:2"}} {served2}\n'
            f'tritonguard_target_errors_total{{model="{MODEL}",target_version="2"}} {errors2}\n'
            f'tritonguard_breaker_state{{model="{MODEL}",target_version="2"}} 0\n').encode()


def test_status_json_lists_the_live_replicas(fleet_repo, redis_server):
    repo, reg, port = fleet_repo
    _Metrics.body = _exposition(7, 0, 0)
    live = {"http": f"http://127.0.0.1:{port - 2}", "grpc": f"127.0.0.1:{port - 1}",
            "metrics": f"http://127.0.0.1:{port}/metrics", "host": "127.0.0.1", "started": 5.0}
    reg.beat(live, MODEL, [1])
    reg.beat(info(1), MODEL, [1, 2])  # registered, but nothing listens there
    t0 = time.time()
    res = CliRunner().invoke(app, ["status", "-r", str(repo), "--json", "--state-url", redis_server.url])
    assert res.exit_code == 0, res.output
    assert f"2 replicas live (from {redis_server.url})" in res.stderr
    doc = json.loads(res.stdout)
    reps = {r["id"]: r for r in doc["replicas"]}
    assert set(reps) == {"127.0.0.1:1", f"127.0.0.1:{port - 2}"}
    mine = reps[f"127.0.0.1:{port - 2}"]
    assert mine["metrics"] == live["metrics"] and mine["models"] == {MODEL: [1]} and mine["host"] == "127.0.0.1"
    assert mine["started"] == 5.0 and abs(mine["heartbeat"] - t0) < 30
    met = doc["guards"][0]["metrics"]
    assert met["replicas"] == 1 and met["served"]["fleetm_raw:1"] == 7.0
    assert any("127.0.0.1:3/metrics" in u for u in met["unreachable"]), met  # said, not an error


def test_rollout_status_finds_the_replicas(fleet_repo, redis_server, monkeypatch):
    repo, reg, port = fleet_repo
    monkeypatch.setenv("TRITONGUARD_STATE_URL", redis_server.url)
    apply(repo, MODEL, RouteChange(primary=1))
    live = {"http": f"http://127.0.0.1:{port - 2}", "grpc": "", "metrics": f"http://127.0.0.1:{port}/metrics",
            "host": "127.0.0.1", "started": 5.0}
    reg.beat(live, MODEL, [1, 2])
    _Metrics.body = _exposition(100, 10, 0)
    from exporter.rollout.window import metrics_reader

    ctl = RolloutController(MODEL, repo, metrics_reader([live["metrics"]], MODEL, target="fleetm_raw"),
                            config=RolloutConfig(steps=(10, 100)))
    ctl.start(2, primary=1)
    ctl.tick()
    _Metrics.body = _exposition(1000, 400, 40)
    res = CliRunner().invoke(app, ["rollout", "status", MODEL, "-r", str(repo)])  # no --server
    assert res.exit_code == 0, res.output
    assert f"1 replica live (from {redis_server.url})" in res.stderr
    assert "live v2: FAIL now" in res.stdout, res.stdout


def test_promote_without_server_uses_the_registry(fleet_repo, redis_server):
    repo, reg, port = fleet_repo
    for v in (1, 2):
        (repo / "fleetm_raw" / str(v) / "manifest.json").write_text(json.dumps(
            {"sha256": f"{v:02d}" * 32, "task": "classifier", "created": "2026-01-01T00:00:00+00:00",
             "golden": {"verdict": "PASS", "metrics": {"top1_agreement": 1.0}, "n": 8}}))
    live = {"http": f"http://127.0.0.1:{port - 2}", "grpc": "", "metrics": f"http://127.0.0.1:{port}/metrics",
            "host": "127.0.0.1", "started": 5.0}
    reg.beat(live, MODEL, [1])
    _Metrics.body = _exposition(100, 10, 0)
    # no traffic moves: the step stays inconclusive and times out, read from the replica found
    res = CliRunner().invoke(app, ["promote", MODEL, "--version", "2", "--primary", "1", "--steps", "100",
                                   "--dwell-s", "0", "--interval-s", "0.2", "--max-step-s", "1",
                                   "-r", str(repo), "--state-url", redis_server.url])
    assert f"1 replica live (from {redis_server.url})" in res.stderr, res.output
    assert res.exit_code == 1, res.output
    assert "rolled_back" in res.stdout and "inconclusive" in res.stdout.lower(), res.stdout
