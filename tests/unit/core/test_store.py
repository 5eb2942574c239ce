"""The store's primitives (issue 39, items 3 and 5) against real redis-servers on loopback ports:

- a namespace (``$TRITONGUARD_NAMESPACE``) on every Redis key: two fleets on one Redis do not see
  each other's rollout state, replicas, quotas, latency samples, feedback, rollout progress,
  audit anchors or cache keys;
- a Redis Cluster node is refused with one clear message;
- a store URL's password never reaches a log line or an error message, in every form redis-py
  takes (``:password@``, ``user:password@``, ``?password=``, ``rediss://``, ``unix://``).
"""

from __future__ import annotations

import json
import logging
import secrets

import numpy as np
import pytest

from tests.fleet.harness import Redis
from tritonguard.core import store
from tritonguard.core.store import (
    NamespaceError,
    namespace,
    redacted,
    redis_prefix,
    scrubbed,
    store_error,
)
from tritonguard.ops.server import free_port

PASSWORD = f"pw-{secrets.token_hex(8)}"


def _tenancy(quotas: dict):
    from tritonguard.core.config import from_params
    from tritonguard.privacy.tenancy.config import TenancyConfig

    return from_params(TenancyConfig, {"quotas": json.dumps(quotas)}, section="tenancy")


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    """One redis-server that requires a password (as the chart's bundled Redis does)."""
    srv = Redis(tmp_path_factory.mktemp("redis-pw"), password=PASSWORD).start()
    try:
        yield srv
    finally:
        srv.stop()


# -- the namespace ------------------------------------------------------------------------------
@pytest.mark.parametrize("ns", ["production", "staging-2", "prod.tritonguard", "a", "A_1", "x" * 127])
def test_a_namespace_is_a_name(ns):
    assert namespace({"TRITONGUARD_NAMESPACE": ns}) == ns
    assert redis_prefix("state", {"TRITONGUARD_NAMESPACE": ns}) == f"tritonguard:{{{ns}}}:state:"


def test_no_namespace_keeps_the_keys_of_earlier_releases():
    assert namespace({}) == "" and namespace({"TRITONGUARD_NAMESPACE": "  "}) == ""
    assert redis_prefix("replica", {}) == "tritonguard:replica:"


@pytest.mark.parametrize("ns", ["a b", "prod*", "p?", "[p]", "a:b", "{p}", "-p", ".p", "x" * 128, "é"])
def test_a_namespace_that_could_match_another_fleets_keys_is_refused(ns):
    with pytest.raises(NamespaceError, match="TRITONGUARD_NAMESPACE"):
        namespace({"TRITONGUARD_NAMESPACE": ns})


# -- redaction ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:s3cret@h/0", "redis://user:***@h/0"),
    ("rediss://:p%40ss@h:6380/1?ssl_cert_reqs=none", "rediss://:***@h:6380/1?ssl_cert_reqs=none"),
    ("redis://h:6379/0?password=s3cret&db=2", "redis://h:6379/0?password=***&db=2"),
    ("redis://h/0?ssl_password=s3cret", "redis://h/0?ssl_password=***"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("unix://:s3cret@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
    ("redis://:s3cret@h:notaport/0", "redis://:***@h:notaport/0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://user@h/0", "redis://user@h/0"),
    ("", ""),
])
def test_redacted_hides_every_password_form(url, shown):
    assert redacted(url) == shown
    assert "s3cret" not in redacted(url) and "p@ss" not in redacted(url) and "p%40ss" not in redacted(url)


def test_the_replica_modules_redacted_is_the_same():
    from tritonguard.rollout import replicas

    assert replicas.redacted("redis://h/0?password=s3cret") == "redis://h/0?password=***"


def test_scrubbed_removes_the_secrets_of_a_url_from_any_text():
    url = "rediss://:p%40ss@h:6380/1?password=other"
    text = f"cannot reach {url}: AUTH p@ss failed (p%40ss), other"
    out = scrubbed(text, url)
    assert "p@ss" not in out and "p%40ss" not in out and "other" not in out
    assert "rediss://:***@h:6380/1" in out
    assert store_error(ValueError("bad p@ss"), url) == "ValueError: bad ***"


# -- two fleets on one Redis ----------------------------------------------------------------------
def _as(monkeypatch, ns: str) -> None:
    if ns:
        monkeypatch.setenv("TRITONGUARD_NAMESPACE", ns)
    else:
        monkeypatch.delenv("TRITONGUARD_NAMESPACE", raising=False)


@pytest.mark.parametrize("other", ["staging", ""])
def test_two_fleets_on_one_redis_do_not_see_each_other(locked_redis, monkeypatch, other):
    """production and ``other`` (a named fleet, or one without a namespace: the keys of earlier
    releases) share one Redis and use the same model names; each sees only its own."""
    from exporter.records.progress import open_progress
    from tritonguard.privacy.audit.anchors import RedisAnchors
    from tritonguard.privacy.tenancy.fleet import FleetQuotaManager
    from tritonguard.privacy.tenancy.quotas import QuotaManager
    from tritonguard.rollout.feedback import PRED, Prediction, RedisFeedbackLog
    from tritonguard.rollout.latency import RedisLatencyLog, Samples
    from tritonguard.rollout.replicas import ReplicaRegistry
    from tritonguard.rollout.stores import RedisStateStore

    url, model, addr = locked_redis.url, f"digits{len(other)}", f"127.0.0.1:{8000 + len(other)}"
    fleets = {}
    for ns in ("production", other):
        _as(monkeypatch, ns)
        cfg = _tenancy({"t": {"rps": 0.01, "burst": 1}})
        fleets[ns] = {
            "state": RedisStateStore(url, model), "replicas": ReplicaRegistry(url, period_s=5),
            "latency": RedisLatencyLog(url, model), "feedback": RedisFeedbackLog(url, model),
            "quota": FleetQuotaManager(cfg, url, guard=model, local=QuotaManager(cfg), background=False),
            "anchors": RedisAnchors(url),
        }
        fleets[ns]["progress"] = open_progress(model, "/nonexistent", fleets[ns]["state"])
    prod, oth = fleets["production"], fleets[other]
    assert len({f["state"].key for f in fleets.values()}) == 2

    # production writes everything
    prod["state"].update(lambda s: setattr(s, "primary", 7) or s, by="test")
    prod["replicas"].beat({"http": addr, "started": 1.0}, model, [7])
    prod["latency"].write(7, "w1", Samples(np.array([1.0]), np.array([1]), np.array([0.01])))
    prod["feedback"].write(PRED, "w1", 1, [Prediction(tenant="t", request_id="r1", t=1.0, version=7,
                                                      source="model", answer=(1,))])
    prod["anchors"].put("audit.jsonl", "anchor-of-production")
    with prod["progress"].lock():
        prod["progress"].write('{"status": "running"}')
    assert prod["quota"].admit(["t"]) == [None]  # the burst of 1: production's only token ...
    assert prod["quota"].admit(["t"]) != [None]  # ... is gone for production

    # the other fleet sees none of it, and its own quota is untouched
    assert oth["state"].load() is None
    assert oth["replicas"].live() == []
    assert len(oth["latency"].read(7)) == 0
    assert oth["feedback"].read(PRED) == []
    assert oth["anchors"].get("audit.jsonl") is None
    assert oth["progress"].read() is None
    assert oth["quota"].admit(["t"]) == [None], "the other fleet's bucket was drawn by production"

    # ... and production still sees all of it
    assert prod["state"].load().primary == 7
    assert [(r.id, r.models) for r in prod["replicas"].live() if r.id == addr] == [(addr, {model: [7]})]
    assert len(prod["latency"].read(7)) == 1 and len(prod["feedback"].read(PRED)) == 1
    assert prod["anchors"].get("audit.jsonl") == "anchor-of-production"
    assert prod["progress"].read() == '{"status": "running"}'
    for f in fleets.values():
        f["quota"].close()
        f["replicas"].close()


def test_every_key_a_namespaced_fleet_writes_carries_its_namespace(locked_redis, monkeypatch):
    """What a guard and the exporter write with ``TRITONGUARD_NAMESPACE=ns1``: every key is under
    ``tritonguard:{ns1}:`` (one Redis Cluster hash slot), none under the shared ``tritonguard:``."""
    import redis

    from tritonguard.privacy.cache.config import CacheConfig
    from tritonguard.privacy.cache.tiers import RedisTier
    from tritonguard.privacy.tenancy.fleet import FleetQuotaManager
    from tritonguard.privacy.tenancy.quotas import QuotaManager
    from tritonguard.rollout.feedback import LABEL, Label, RedisFeedbackLog
    from tritonguard.rollout.latency import RedisLatencyLog, Samples
    from tritonguard.rollout.replicas import ReplicaRegistry
    from tritonguard.rollout.stores import RedisStateStore

    _as(monkeypatch, "ns1")
    url, model = locked_redis.url, "keys_model"
    RedisStateStore(url, model).update(lambda s: s, by="test")
    ReplicaRegistry(url).beat({"http": "127.0.0.1:9"}, model, [1])
    RedisLatencyLog(url, model).write(1, "w", Samples(np.array([1.0]), np.array([1]), np.array([0.1])))
    RedisFeedbackLog(url, model).write(LABEL, "w", 1, [Label(tenant="t", request_id="r", t=1.0, version=1,
                                                              source="model", truth=(1,), predicted=(1,))])
    cfg = _tenancy({"t": {"rps": 5, "burst": 5, "max_in_flight": 2}})
    q = FleetQuotaManager(cfg, url, guard=model, local=QuotaManager(cfg), background=False)
    assert q.admit(["t"]) == [None]
    cache = CacheConfig(enabled=True, privacy="persisted_encrypted", l3_url=url)
    assert cache.l3_key_prefix() == "tritonguard:{ns1}:cache:"
    tier = RedisTier(url, 60, cache.l3_key_prefix(), 1.0)
    tier.put_many([(tier.name(model, b"\x01"), b"x")])
    tier.close()
    keys = {k.decode() for k in redis.Redis.from_url(url).scan_iter(match="tritonguard:*")}
    mine = {k for k in keys if model in k or k.endswith(":127.0.0.1:9")}  # the replica's key names its address
    kinds = {k.split(":")[2] for k in mine}
    assert {"state", "replica", "latency", "feedback", "quota", "cache"} <= kinds, sorted(mine)
    assert all(k.startswith("tritonguard:{ns1}:") for k in mine), sorted(mine)
    q.release(["t"])
    q.close()


def test_a_cache_purge_of_every_model_leaves_the_fleets_state_alone(locked_redis, monkeypatch):
    """The L3's default prefix is its own (``tritonguard:cache:``): purging every model used to
    SCAN ``tritonguard:*`` and unlink the rollout state and the replica registry with it."""
    from tritonguard.privacy.cache.config import CacheConfig
    from tritonguard.privacy.cache.tiers import RedisTier
    from tritonguard.rollout.stores import RedisStateStore

    _as(monkeypatch, "purge-ns")
    state = RedisStateStore(locked_redis.url, "purged")
    state.update(lambda s: setattr(s, "primary", 3) or s, by="test")
    tier = RedisTier(locked_redis.url, 60, CacheConfig().l3_key_prefix(), 1.0)
    tier.put_many([(tier.name("purged", b"\x02"), b"x")])
    assert tier.purge(None) == 1
    tier.close()
    assert RedisStateStore(locked_redis.url, "purged").load().primary == 3


# -- Redis Cluster: refused --------------------------------------------------------------------------
def _cluster_port() -> int:
    """A free loopback port a cluster node can take: its bus listens on the port + 10000, so the
    port must be 55535 or less and that one free too. A free port from the kernel's ephemeral
    range (32768-60999) is above 55535 about one time in five (redis-server then exits 1: "Redis
    port number too high", CI 2026-11-28)."""
    import socket  # noqa: PLC0415

    for _ in range(200):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port at or below 55535 whose cluster bus port is free")


def test_a_redis_cluster_node_is_refused_with_one_clear_line(tmp_path):
    """redis.Redis does not follow MOVED/ASK and a SCAN sees one node: a cluster node is refused
    at connect, by every store, with the same sentence."""
    from tritonguard.rollout.state import StateUnavailable
    from tritonguard.rollout.stores import RedisStateStore

    node = Redis(tmp_path, port=_cluster_port(), extra_args=["--cluster-enabled", "yes", "--cluster-config-file",
                                                            str(tmp_path / "nodes.conf")]).start()
    try:
        st = RedisStateStore(node.url, "digits")
        with pytest.raises(StateUnavailable) as exc:
            st.update(lambda s: s)
        msg = str(exc.value)
        assert "is a Redis Cluster node (cluster_enabled:1)" in msg and "\n" not in msg, msg
        client = store.redis_client(node.url, timeout=1.0)
        with pytest.raises(Exception, match="not a cluster"):
            client.ping()
    finally:
        node.stop()


# -- the password stays out of logs and errors -------------------------------------------------------
DEAD = [f"redis://:{PASSWORD}@127.0.0.1:{{port}}/0", f"redis://admin:{PASSWORD}@127.0.0.1:{{port}}/0",
        f"redis://127.0.0.1:{{port}}/0?password={PASSWORD}", f"unix:///nonexistent/redis.sock?password={PASSWORD}"]


@pytest.mark.parametrize("form", DEAD)
def test_store_errors_never_carry_the_password(form, caplog):
    """Every Redis store pointed at a dead address with a password in its URL: each logs (or
    raises) its error naming the store as ``***``, and the password appears nowhere."""
    from tritonguard.privacy.audit.anchors import AnchorError, RedisAnchors
    from tritonguard.privacy.tenancy.fleet import FleetQuotaManager
    from tritonguard.privacy.tenancy.quotas import QuotaManager
    from tritonguard.rollout.feedback import (
        PRED,
        FeedbackConfig,
        FeedbackRecorder,
        FeedbackUnavailable,
        Prediction,
        RedisFeedbackLog,
    )
    from tritonguard.rollout.latency import LatencyRecorder, LatencyUnavailable, RedisLatencyLog
    from tritonguard.rollout.replicas import Heartbeat, ReplicaRegistry
    from tritonguard.rollout.state import StateUnavailable
    from tritonguard.rollout.stores import RedisStateStore

    url = form.format(port=free_port())
    caplog.set_level(logging.INFO)
    errors: list[str] = []
    now = [0.0]
    st = RedisStateStore(url, "digits", monotonic=lambda: now[0])
    assert st.load() is None  # logged
    now[0] += 3600  # past the backoff: the write goes to Redis
    with pytest.raises(StateUnavailable) as e:
        st.update(lambda s: s)
    errors.append(str(e.value))
    assert Heartbeat(ReplicaRegistry(url, period_s=5), {"http": "127.0.0.1:9"}, "digits", list).beat_once() is False
    lat = LatencyRecorder(RedisLatencyLog(url, "digits"))
    lat.record(1, 1, 0.01, 1.0)
    assert lat.flush() is False  # logged
    with pytest.raises(LatencyUnavailable) as e:
        RedisLatencyLog(url, "digits").read(1)
    errors.append(str(e.value))
    fb = FeedbackRecorder(RedisFeedbackLog(url, "digits"), FeedbackConfig())
    fb.add(PRED, [Prediction(tenant="t", request_id="r", t=1.0, version=1, source="model", answer=(1,))])
    assert fb.flush() is False  # logged
    with pytest.raises(FeedbackUnavailable) as e:
        RedisFeedbackLog(url, "digits").read("pred")
    errors.append(str(e.value))
    cfg = _tenancy({"t": {"rps": 1, "burst": 1}})
    q = FleetQuotaManager(cfg, url, guard="digits", local=QuotaManager(cfg), background=False)
    assert q.admit(["t"]) == [None]  # logged; the host's quota judges
    q.release(["t"])
    q.close()
    with pytest.raises(AnchorError) as e:
        RedisAnchors(url).get("x")
    errors.append(str(e.value))

    lines = [r.getMessage() for r in caplog.records]
    said = lines + errors
    assert not [x for x in said if PASSWORD in x], [x for x in said if PASSWORD in x]
    store_lines = [x for x in said if "***" in x]
    # the state store, the heartbeat, the latency and feedback flushes, the fleet quota
    assert len([x for x in lines if "***" in x]) >= 5, lines
    assert len(store_lines) >= 8, said
    assert all("***" in x for x in errors), errors


def test_a_wrong_password_and_a_restarted_redis_say_so_without_the_password(tmp_path, caplog):
    """A password-protected Redis that goes away and comes back, and a wrong password: the
    outage and recovery lines name the store redacted; redis-py's own texts carry no password."""
    from tritonguard.rollout.state import StateUnavailable
    from tritonguard.rollout.stores import RedisStateStore

    caplog.set_level(logging.INFO)
    srv = Redis(tmp_path, password=PASSWORD).start()
    try:
        now = [0.0]
        st = RedisStateStore(srv.url, "blip", socket_timeout=0.5, monotonic=lambda: now[0])
        st.update(lambda s: setattr(s, "primary", 2) or s)
        srv.stop()
        assert st.load().primary == 2  # the last good state, logged
        srv.start()
        now[0] += 3600  # past the backoff
        assert st.load().primary == 2  # logged: reachable again
        wrong = srv.url.replace(PASSWORD, PASSWORD[::-1])
        with pytest.raises(StateUnavailable) as e:
            RedisStateStore(wrong, "blip").update(lambda s: s)
        assert "AuthenticationError" in str(e.value) or "WRONGPASS" in str(e.value) or "invalid" in str(e.value)
    finally:
        srv.stop()
    lines = [r.getMessage() for r in caplog.records] + [str(e.value)]
    assert any("unreachable" in ln and "redis://:***@127.0.0.1" in ln for ln in lines), lines
    assert any("reachable again" in ln and "***" in ln for ln in lines), lines
    assert not [ln for ln in lines if PASSWORD in ln or PASSWORD[::-1] in ln]


def test_a_bad_namespace_is_one_line_and_exit_2_for_the_exporter_and_the_launcher(monkeypatch):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tritonguard.ops.launcher import LaunchError, resolve_tritonserver

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITONGUARD_NAMESPACE": "prod*"}
    r = subprocess.run([sys.executable, "-m", "exporter", "route", "digits"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        "✗ TRITONGUARD_NAMESPACE='prod*' is not a namespace: use 1-127 letters, digits, '_', '.' or '-', "
        "starting with a letter or digit"]
    monkeypatch.setenv("TRITONGUARD_NAMESPACE", "a:b")
    with pytest.raises(LaunchError, match="TRITONGUARD_NAMESPACE='a:b' is not a namespace"):
        resolve_tritonserver(["--model-repository=/nonexistent"])
