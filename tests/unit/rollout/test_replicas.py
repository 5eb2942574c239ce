"""The replica registry against a real redis-server: beats, TTL expiry, one key per replica,
versions per guard, and a heartbeat that survives an outage."""

from __future__ import annotations

import time

import pytest

from tritonguard.rollout import replicas as rep
from tritonguard.rollout.state import Arm, Candidate, RolloutState


def info(port: int, host: str = "127.0.0.1") -> dict:
    return {"http": f"http://{host}:{port}", "grpc": f"{host}:{port + 1}",
            "metrics": f"http://{host}:{port + 2}/metrics", "host": host, "started": 100.0}


@pytest.fixture
def registry(redis_server, request):
    # a key prefix per test: tests share one redis-server
    reg = rep.ReplicaRegistry(redis_server.url, period_s=1.0, key_prefix=f"t:{request.node.name}:")
    yield reg
    for r in reg.live():
        reg.remove(r.id)
    reg.close()


def test_beat_and_live(registry):
    registry.beat(info(8000), "digits", [1, 2], now=time.time())
    registry.beat(info(9000), "digits", [1], now=time.time())
    live = registry.live()
    assert [r.id for r in live] == ["127.0.0.1:8000", "127.0.0.1:9000"]
    a = live[0]
    assert (a.http, a.grpc, a.metrics, a.host, a.started) == (
        "http://127.0.0.1:8000", "127.0.0.1:8001", "http://127.0.0.1:8002/metrics", "127.0.0.1", 100.0)
    assert a.models == {"digits": [1, 2]} and a.heartbeat > 0


def test_instances_of_one_replica_share_one_key(registry):
    for _ in range(3):  # three guard instances, two guard models, one server
        registry.beat(info(8000), "digits", [1, 2])
    registry.beat(info(8000), "minilm", [4])
    live = registry.live()
    assert len(live) == 1 and live[0].models == {"digits": [1, 2], "minilm": [4]}
    ttl = registry.client.ttl(registry.key(live[0].id))
    assert 0 < ttl <= 3


def test_a_replica_that_stops_beating_expires(registry):
    registry.beat(info(8000), "digits", [1])
    registry.beat(info(9000), "digits", [1])
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:  # 8000 keeps beating, 9000 stopped
        registry.beat(info(8000), "digits", [1])
        if [r.id for r in registry.live()] == ["127.0.0.1:8000"]:
            break
        time.sleep(0.3)
    assert [r.id for r in registry.live()] == ["127.0.0.1:8000"]


def test_a_guard_unloaded_long_ago_is_not_reported(registry):
    registry.beat(info(8000), "old", [1], now=time.time() - 60)
    registry.beat(info(8000), "digits", [2])
    assert registry.live()[0].models == {"digits": [2]}


def test_heartbeat_thread_and_outage(redis_server, request):
    reg = rep.ReplicaRegistry(redis_server.url, period_s=0.2, key_prefix=f"t:{request.node.name}:")
    hb = rep.Heartbeat(reg, info(8000), "digits", lambda: [3]).start()
    try:
        deadline = time.monotonic() + 5
        while hb.beats < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hb.beats >= 2 and hb.errors == 0
        reader = rep.ReplicaRegistry(redis_server.url, period_s=0.2, key_prefix=f"t:{request.node.name}:")
        assert reader.live()[0].models == {"digits": [3]}
        redis_server.stop()
        try:
            t0 = time.monotonic()
            assert hb.beat_once() is False  # never raises, bounded by the socket timeout
            assert time.monotonic() - t0 < 2.5 and hb.errors >= 1
        finally:
            redis_server.start()
        deadline = time.monotonic() + 5
        while not reader.live() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reader.live()[0].id == "127.0.0.1:8000"  # beats again after the outage
        reader.close()
    finally:
        hb.stop()
    assert not hb._thread.is_alive()


def test_unreachable_redis_never_raises():
    reg = rep.ReplicaRegistry("redis://127.0.0.1:1/0", period_s=1.0, socket_timeout=0.2)
    hb = rep.Heartbeat(reg, info(8000), "digits", lambda: [1])
    assert hb.beat_once() is False and hb.errors == 1


def test_start_heartbeat_needs_redis_and_an_advertised_url():
    assert rep.start_heartbeat("digits", lambda: [], url="", environ={}) is None
    assert rep.start_heartbeat("digits", lambda: [], url="redis://127.0.0.1:1/0", environ={}) is None


def test_advertised_and_id():
    env = {rep.ENV_HTTP: "http://10.0.0.5:8000", rep.ENV_GRPC: "10.0.0.5:8001",
           rep.ENV_METRICS: "http://10.0.0.5:8002/metrics", rep.ENV_HOST: "10.0.0.5", rep.ENV_STARTED: "12.5"}
    adv = rep.advertised(env)
    assert adv == {"http": "http://10.0.0.5:8000", "grpc": "10.0.0.5:8001",
                   "metrics": "http://10.0.0.5:8002/metrics", "host": "10.0.0.5", "started": 12.5}
    assert rep.replica_id(adv) == "10.0.0.5:8000"
    assert rep.advertised({}) is None


def test_served_versions():
    st = RolloutState(model="m", primary=1, candidate=Candidate(version=2, share=0.1))
    assert rep.served_versions(st) == [1, 2]
    assert rep.served_versions(RolloutState(model="m", primary=1, arms=[Arm(3, 0.2)])) == [1, 3]


def test_redacted():
    assert rep.redacted("redis://:secret@h:6379/0") == "redis://:***@h:6379/0"
    assert rep.redacted("redis://h:6379/0") == "redis://h:6379/0"
