"""The MLflow registry adapter against a real MLflow sqlite store (no server), one per module."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest

from exporter.records.registry import (
    ApprovalRefused,
    HistoryCorrupt,
    Registry,
    RegistryError,
    StageConflict,
    default_uri,
)

SHA = {v: f"{v:02d}" * 32 for v in range(1, 10)}


def manifest(v: int, verdict: str = "PASS") -> dict:
    return {"sha256": SHA[v], "task": "classifier", "created": "2026-01-01T00:00:00+00:00",
            "golden": {"verdict": verdict, "metrics": {"top1_agreement": 1.0}, "n": 64}}


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    # forked workers of the concurrency test must not inherit pooled sqlite connections
    old = os.environ.get("MLFLOW_SQLALCHEMYSTORE_POOLCLASS")
    os.environ["MLFLOW_SQLALCHEMYSTORE_POOLCLASS"] = "NullPool"
    path = tmp_path_factory.mktemp("registry") / "reg" / "mlflow.db"
    yield f"sqlite:///{path}"
    if old is None:
        os.environ.pop("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", None)
    else:
        os.environ["MLFLOW_SQLALCHEMYSTORE_POOLCLASS"] = old


@pytest.fixture(scope="module")
def reg(db):
    return Registry(db)


def register(reg: Registry, name: str, *versions: int, verdict: str = "PASS") -> None:
    for v in versions:
        reg.register(name, v, manifest(v, verdict), {"data_version": "d1", "hyperparameters": {"lr": 0.002},
                                                     "metrics": {"acc": 0.98}})


def approve_if_alice(request: dict) -> bool:
    return request["approver"] == "alice"


def test_default_uri_is_beside_the_repository(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_uri(tmp_path / "model_repository") == \
        f"sqlite:///{tmp_path / 'model_repository.registry' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert default_uri(tmp_path) == "http://mlflow:5000"
    with pytest.raises(RegistryError, match="history_path"):
        Registry("http://mlflow:5000")


def test_register_tags_lineage_and_is_idempotent(reg, tmp_path):
    info = reg.register("reg_model", 1, manifest(1), {"data_version": "digits-2026-01",
                                                      "hyperparameters": {"lr": 0.002, "epochs": 30},
                                                      "metrics": {"val_acc": 0.984}},
                        source=str(tmp_path / "digits_raw" / "1"))
    assert (info.version, info.sha256, info.stage) == (1, SHA[1], "DRAFT")
    t = info.tags
    assert t["tritonguard.golden.verdict"] == "PASS"
    assert json.loads(t["tritonguard.golden.figures"]) == {"top1_agreement": 1.0}
    assert t["lineage.data_version"] == "digits-2026-01"
    assert json.loads(t["lineage.hyperparameters"]) == {"epochs": 30, "lr": 0.002}
    assert json.loads(t["lineage.metrics"]) == {"val_acc": 0.984}
    assert "lineage.code_hash" in t and t["lineage.parent_version"] == ""
    again = reg.register("reg_model", 1, manifest(1), {})
    assert again.mlflow_version == info.mlflow_version
    with pytest.raises(RegistryError, match="sha256"):
        reg.register("reg_model", 1, manifest(2), {})
    assert [v.version for v in reg.versions("reg_model")] == [1]
    assert not (tmp_path / "mlruns").exists() and not os.path.exists("mlruns")


def test_transition_is_compare_and_set(reg):
    register(reg, "cas", 1)
    with pytest.raises(StageConflict, match="DRAFT, not STAGING"):
        reg.transition("cas", 1, "PRODUCTION", "STAGING")
    assert reg.transition("cas", 1, "STAGING", "DRAFT").stage == "STAGING"
    assert reg.client.get_model_version_by_alias("cas", "staging").tags["tritonguard.version"] == "1"
    with pytest.raises(StageConflict):
        reg.transition("cas", 1, "STAGING", "DRAFT")
    with pytest.raises(RegistryError, match="unknown stage"):
        reg.transition("cas", 1, "LIVE", "STAGING")


def test_failed_golden_cannot_be_staged(reg):
    register(reg, "bad_golden", 1, verdict="FAIL")
    with pytest.raises(RegistryError, match="golden"):
        reg.transition("bad_golden", 1, "STAGING", "DRAFT")


def test_exactly_one_production_and_history(reg):
    register(reg, "prod", 1, 2, 3)
    reg.transition("prod", 1, "PRODUCTION", "DRAFT", approver="bob")
    reg.transition("prod", 2, "STAGING", "DRAFT")
    reg.transition("prod", 2, "PRODUCTION", "STAGING")
    stages = {v.version: v.stage for v in reg.versions("prod")}
    assert stages == {1: "ARCHIVED", 2: "PRODUCTION", 3: "DRAFT"}
    assert reg.production("prod") == 2
    aliases = reg.client.get_registered_model("prod").aliases
    mv2 = reg.get("prod", 2).mlflow_version  # MLflow's champion alias, and the deprecated synonym
    assert {k: str(v) for k, v in aliases.items()} == {"champion": mv2, "production": mv2}
    hist = [r for r in reg.history("prod") if r["type"] == "transition"]
    assert [(r["version"], r["from"], r["to"], r["live"]) for r in hist] == [
        (1, "DRAFT", "PRODUCTION", 1), (2, "DRAFT", "STAGING", 1), (2, "STAGING", "PRODUCTION", 2)]
    assert hist[0]["approver"] == "bob" and hist[2]["archived"] == [1]
    assert reg.verify_history().ok


def test_previous_production_and_rollback(reg):
    register(reg, "rb", 1, 2, 3)
    assert reg.previous_production("rb") is None
    for v in (1, 2, 3):
        reg.transition("rb", v, "PRODUCTION", "DRAFT")
    assert reg.previous_production("rb") == 2
    back = reg.rollback("rb", approver="carol", reason="error rate")
    assert (back.version, back.stage, reg.production("rb")) == (2, "PRODUCTION", 2)
    assert reg.get("rb", 3).tags["tritonguard.rolled_back"] == "true"
    # v3 left production through a rollback: the next rollback goes to v1, not back to v3
    assert reg.previous_production("rb") == 1
    assert reg.history("rb")[-1]["rollback"] is True


def test_approvals(db, tmp_path):
    reg = Registry(db, history_path=tmp_path / "h.jsonl", approvers={
        "STAGING": ["exit 3"],
        "PRODUCTION": [f"{__name__}:approve_if_alice", 'test "$TRITONGUARD_TO" = PRODUCTION']})
    register(reg, "appr", 1)
    with pytest.raises(ApprovalRefused, match="exit 3"):
        reg.transition("appr", 1, "STAGING", "DRAFT")
    with pytest.raises(ApprovalRefused, match="approve_if_alice"):
        reg.transition("appr", 1, "PRODUCTION", "DRAFT", approver="mallory")
    assert reg.stage("appr", 1) == "DRAFT"
    assert reg.transition("appr", 1, "PRODUCTION", "DRAFT", approver="alice").stage == "PRODUCTION"
    raising = Registry(db, history_path=tmp_path / "h2.jsonl",
                       approvers={"ARCHIVED": [lambda r: 1 / 0]})
    with pytest.raises(ApprovalRefused, match="ZeroDivisionError"):
        raising.transition("appr", 1, "ARCHIVED", "PRODUCTION")


def test_history_keeps_every_entry_and_detects_tampering(db, tmp_path):
    path = tmp_path / "history.jsonl"
    reg = Registry(db, history_path=path)
    register(reg, "tamper", 1)
    for _ in range(50):
        reg.transition("tamper", 1, "STAGING", "DRAFT")
        reg.transition("tamper", 1, "DRAFT", "STAGING")
    assert len(reg.history("tamper")) == 101 and reg.verify_history().ok
    lines = path.read_bytes().splitlines(keepends=True)
    rec = json.loads(lines[40])
    rec["approver"] = "someone else"
    path.write_bytes(b"".join(lines[:40] + [json.dumps(rec).encode() + b"\n"] + lines[41:]))
    assert not reg.verify_history().ok and "40" in reg.verify_history().reason
    with pytest.raises(HistoryCorrupt):
        reg.history("tamper")
    path.write_bytes(b"".join(lines[:40] + lines[41:]))  # a deleted line breaks the chain too
    assert reg.verify_history().first_bad == 40


def test_optimistic_token_lock_for_remote_registries(db, tmp_path):
    """The path a team server takes (no shared lock file), exercised on the sqlite store."""
    reg = Registry(db, history_path=tmp_path / "remote.jsonl", settle_s=0.01)
    reg.lock_path = None
    register(reg, "remote", 1)
    assert reg.transition("remote", 1, "STAGING", "DRAFT").stage == "STAGING"
    assert "tritonguard.txn" not in reg.client.get_registered_model("remote").tags
    reg.client.set_registered_model_tag("remote", "tritonguard.txn", f"other:{time.time() + 60:.0f}")
    with pytest.raises(StageConflict, match="in progress"):
        reg.transition("remote", 1, "PRODUCTION", "STAGING")
    reg.client.set_registered_model_tag("remote", "tritonguard.txn", f"other:{time.time() - 1:.0f}")
    assert reg.transition("remote", 1, "PRODUCTION", "STAGING").stage == "PRODUCTION"


def _promote(uri: str, barrier, results, remote: dict | None = None, model: str = "race") -> None:
    reg = Registry(uri, **(remote or {}))
    if remote:
        reg.lock_path = None  # as for a tracking server: no lock file spans clients
    barrier.wait()
    try:
        reg.transition(model, 2, "PRODUCTION", "STAGING", approver=f"pid{os.getpid()}")
        results.put("won")
    except StageConflict:
        results.put("conflict")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(f"error {type(exc).__name__}: {exc}")


def _race(uri: str, remote: dict | None = None, model: str = "race") -> list[str]:
    """Four processes promote ``model`` v2 at the same moment; their sorted outcomes."""
    ctx = multiprocessing.get_context("fork")  # children inherit the imported mlflow: fast
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_promote, args=(uri, barrier, results, remote, model)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    return sorted(results.get(timeout=5) for _ in procs)


def test_concurrent_promotions_have_one_winner(reg, db):
    register(reg, "race", 1, 2)
    reg.transition("race", 1, "PRODUCTION", "DRAFT")
    reg.transition("race", 2, "STAGING", "DRAFT")
    outcomes = _race(db)
    assert outcomes == ["conflict", "conflict", "conflict", "won"]
    assert {v.version: v.stage for v in reg.versions("race")} == {1: "ARCHIVED", 2: "PRODUCTION"}
    promotions = [r for r in reg.history("race") if r["type"] == "transition" and r["version"] == 2
                  and r["to"] == "PRODUCTION"]
    assert len(promotions) == 1 and reg.verify_history().ok


def test_remote_registry_with_redis_serialises_concurrent_promotions(db, tmp_path, redis_server):
    """A team server's path (no lock file) with a shared Redis: the lease makes the compare-and-set
    linearisable, with no settle delay at all. Four processes, one winner."""
    reg = Registry(db, history_path=tmp_path / "remote.jsonl", lock_url=redis_server.url, settle_s=0)
    reg.lock_path = None
    register(reg, "redis-race", 1, 2)
    reg.transition("redis-race", 1, "PRODUCTION", "DRAFT")
    reg.transition("redis-race", 2, "STAGING", "DRAFT")
    remote = {"history_path": tmp_path / "remote.jsonl", "lock_url": redis_server.url, "settle_s": 0}
    outcomes = _race(db, remote, "redis-race")
    assert outcomes == ["conflict", "conflict", "conflict", "won"]
    assert {v.version: v.stage for v in reg.versions("redis-race")} == {1: "ARCHIVED", 2: "PRODUCTION"}
    assert "tritonguard.txn" not in reg.client.get_registered_model("redis-race").tags  # not the token path
    import redis

    assert redis.Redis.from_url(redis_server.url).exists("tritonguard:registry:redis-race:lock") == 0


def test_remote_registry_waits_for_the_redis_lock_holder(db, tmp_path, redis_server):
    """While another client holds the Redis lease, a transition waits for it, then gives up with
    StageConflict; once released it goes through."""
    from exporter.records.progress import RedisProgress

    reg = Registry(db, history_path=tmp_path / "remote.jsonl", lock_url=redis_server.url, settle_s=0)
    reg.lock_path, reg.lock_wait_s = None, 0.5
    register(reg, "held", 1)
    other = RedisProgress(redis_server.url, "held", key="tritonguard:registry:held")
    with other.lock():
        with pytest.raises(StageConflict, match="holds the registry lock"):
            reg.transition("held", 1, "STAGING", "DRAFT")
        assert reg.stage("held", 1) == "DRAFT"
    assert reg.transition("held", 1, "STAGING", "DRAFT").stage == "STAGING"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (sqlite backend) on a free loopback port: a team's registry."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    base = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(base / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{base / 'team.db'}", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (base / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not come up in 90 s"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its uvicorn worker
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def test_team_tracking_server_with_redis_has_one_winner(mlflow_server, redis_server, tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI=http://… as a team runs it: the CLI's registry keeps its history beside
    the repository, and with TRITONGUARD_STATE_URL four concurrent promotions have one winner."""
    from exporter.records.registry import open_registry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("TRITONGUARD_STATE_URL", redis_server.url)
    reg = open_registry(tmp_path / "repo")
    assert reg.uri == mlflow_server and reg.lock_path is None and reg.lock_url == redis_server.url
    assert reg.history_path == tmp_path / "repo.registry" / "registry_history.jsonl"
    register(reg, "team", 1, 2)
    # the server refuses local paths as sources: the version folder is named with this host
    assert reg.client.get_model_version("team", "1").source.startswith("tritonguard://")
    reg.transition("team", 1, "PRODUCTION", "DRAFT")
    reg.transition("team", 2, "STAGING", "DRAFT")
    remote = {"history_path": reg.history_path, "lock_url": redis_server.url, "settle_s": 0}
    outcomes = _race(mlflow_server, remote, "team")
    assert outcomes == ["conflict", "conflict", "conflict", "won"]
    assert {v.version: v.stage for v in reg.versions("team")} == {1: "ARCHIVED", 2: "PRODUCTION"}
    assert reg.production("team") == 2 and reg.verify_history().ok
