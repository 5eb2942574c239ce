"""tritonguard.privacy.tenancy.fleet: one tenant quota across replicas, through a real redis-server.

Replicas are processes (multiprocessing, fork), each with its own FleetQuotaManager, as guard
instances on several hosts would be; they meet only in Redis.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import time
import uuid

import pytest
import redis  # noqa: F401 - imported before the replicas fork, as a serving process has it

from tests.conftest import REDIS_SERVER, RedisServer
from tritonguard.core.config import from_params
from tritonguard.privacy.tenancy import fleet
from tritonguard.privacy.tenancy.config import TenancyConfig
from tritonguard.privacy.tenancy.fleet import FleetQuotaManager, fleet_url
from tritonguard.privacy.tenancy.quotas import QuotaManager, SharedQuotaManager

RPS, BURST, SECONDS, REPLICAS = 100, 20, 3.0, 3
QUOTAS = {"acme": {"rps": RPS, "burst": BURST}, "pool": {"max_in_flight": 4}, "cap2": {"max_in_flight": 2}}


def config(quotas=None):
    return from_params(TenancyConfig, {"quotas": json.dumps(quotas or QUOTAS)}, section="tenancy")


def manager(url, guard, **kwargs):
    cfg = config()
    return FleetQuotaManager(cfg, url, guard=guard, local=QuotaManager(cfg), **kwargs)


def _fork(target, *args):
    p = multiprocessing.get_context("fork").Process(target=target, args=args)
    p.start()
    return p


# -- rate: one bucket for every replica ---------------------------------------------------------------
def _warm(q, barrier):
    """Up like a serving replica (connected, lease key set, scripts loaded), then start together:
    a replica still importing or connecting when the others start would shorten the window."""
    q.sync()
    q.client.script_load(fleet._TAKE)
    q.client.script_load(fleet._SLOTS)
    barrier.wait(30)


def _hammer(url, guard, barrier, seconds, interval, out):
    """A replica sending 'acme' requests every ``interval`` s (above its share of the quota)."""
    q = manager(url, guard)
    admitted = attempts = 0
    _warm(q, barrier)
    end = time.time() + seconds
    while time.time() < end:
        attempts += 1
        if q.admit(["acme"])[0] is None:
            admitted += 1
            q.release(["acme"])
        time.sleep(interval)
    out.put((admitted, attempts, q.degraded, q.errors))
    q.close()


def test_replicas_share_one_rate_within_ten_percent(redis_server):
    guard = f"g{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    out, barrier = ctx.Queue(), ctx.Barrier(REPLICAS)
    procs = [_fork(_hammer, redis_server.url, guard, barrier, SECONDS, 1 / 250, out) for _ in range(REPLICAS)]
    results = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    admitted = sum(r[0] for r in results)
    attempts = sum(r[1] for r in results)
    expected = RPS * SECONDS + BURST  # 320: what one bucket lets through; per-host quotas: 3x
    print(f"fleet rate: {admitted} admitted of {attempts} attempts by {REPLICAS} replicas in {SECONDS:g} s; "
          f"one bucket allows {expected:g}; per replica {[r[0] for r in results]}")
    assert attempts > 2 * expected, "the replicas did not send above the quota"
    assert abs(admitted - expected) <= 0.1 * expected, (admitted, expected, results)
    assert all(r[2] == 0 and r[3] == 0 for r in results), results  # Redis answered throughout


def test_leases_keep_redis_off_the_path_of_most_requests(redis_server):
    q = FleetQuotaManager(config({"big": {"rps": 1000, "burst": 1000}}), redis_server.url,
                          guard=f"g{uuid.uuid4().hex[:8]}", local=QuotaManager(config()), background=False)
    try:
        calls = q.client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        for _ in range(200):
            assert q.admit(["big"]) == [None]
            q.release(["big"])
            q.sync()  # what the background thread would do: lease ahead
        after = q.client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        assert q.lease_size(q.quota("big")) == 50
        # ~200 / 50 leases (+ the lease key); a call per request would be >= 200
        assert after - calls <= 12, after - calls
    finally:
        q.close()


def test_refusal_carries_retry_advice_and_the_tokens_come_back_on_close(redis_server):
    guard = f"g{uuid.uuid4().hex[:8]}"
    cfg = config({"slow": {"rps": 2, "burst": 2}})
    a = FleetQuotaManager(cfg, redis_server.url, guard=guard, local=QuotaManager(cfg), background=False)
    b = FleetQuotaManager(cfg, redis_server.url, guard=guard, local=QuotaManager(cfg), background=False)
    assert a.admit(["slow"]) == [None]  # a leased the whole burst of 2 (lease: 1 token at least)
    out = b.admit(["slow"] * 2)
    assert out.count(None) <= 1 and "over its rate limit of 2 requests/s; retry after" in out[-1], out
    a.release(["slow"])
    a.close()  # a's unspent token goes back to the bucket
    b.close()


# -- requests in flight: one cap for every replica ------------------------------------------------------
def _hold(url, guard, barrier, seconds, live, peak, lock, out):
    """A replica admitting 'pool' requests three at a time and holding them a few ms."""
    q = manager(url, guard)
    rng = random.Random()
    admitted = 0
    _warm(q, barrier)
    end = time.time() + seconds
    while time.time() < end:
        ok = [t for t, why in zip(["pool"] * 3, q.admit(["pool"] * 3), strict=True) if why is None]
        if ok:
            with lock:
                live.value += len(ok)
                peak.value = max(peak.value, live.value)
            admitted += len(ok)
            time.sleep(rng.uniform(0.001, 0.006))
            with lock:
                live.value -= len(ok)
            q.release(ok)
        else:
            time.sleep(0.001)
    out.put(admitted)
    q.close()


def test_in_flight_cap_holds_across_replicas(redis_server):
    guard = f"g{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    live, peak, lock, out = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False), ctx.Lock(), ctx.Queue()
    barrier = ctx.Barrier(3)
    procs = [_fork(_hold, redis_server.url, guard, barrier, 2.0, live, peak, lock, out) for _ in range(3)]
    admitted = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    print(f"fleet in flight: peak {peak.value} (cap 4) over {sum(admitted)} requests, per replica {admitted}")
    assert peak.value <= 4  # 3 replicas x 3 wanted; the cap is the fleet's
    assert peak.value >= 3 and all(admitted), (peak.value, admitted)
    probe = manager(redis_server.url, guard, background=False)
    assert probe.fleet_in_flight("pool") == 0  # every slot given back on release and close
    probe.close()


def test_a_replica_whose_lease_lapsed_gives_its_slots_back(redis_server):
    guard = f"g{uuid.uuid4().hex[:8]}"
    a = manager(redis_server.url, guard, ttl_s=0.5, background=False, replica="a")
    b = manager(redis_server.url, guard, ttl_s=0.5, background=False, replica="b")
    assert a.admit(["cap2"] * 2) == [None, None]
    refused = b.admit(["cap2"])[0]
    assert refused is not None and "in flight" in refused
    time.sleep(0.8)  # a stops renewing its lease (as a dead replica would): its slots come back by TTL
    assert b.admit(["cap2"]) == [None]
    assert b.fleet_in_flight("cap2") == 1
    # a comes back: its lease lapsed, so it acquires again for the two it still has in flight
    assert a.admit(["cap2"]) != [None]
    assert a.fleet_in_flight("cap2") == 2
    a.release(["cap2"] * 2)
    b.release(["cap2"])
    a.sync()
    b.sync()
    assert a.fleet_in_flight("cap2") == 0
    a.close()
    b.close()


# -- Redis gone: the host's quota judges, counted -------------------------------------------------------
@pytest.mark.skipif(not REDIS_SERVER, reason="redis-server is not installed")
def test_redis_killed_mid_run_degrades_to_the_hosts_quota(tmp_path):
    srv = RedisServer(tmp_path)
    srv.start()
    cfg = config({"acme": {"rps": 50, "burst": 10}})
    q = FleetQuotaManager(cfg, srv.url, guard="g", local=SharedQuotaManager(cfg, tmp_path / "quota_buckets.bin"))
    try:
        def run(seconds):
            n = 0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                out = q.admit(["acme", "free"])  # "free" has no quota: never limited, never counted
                assert out[1] is None
                if out[0] is None:
                    n += 1
                    q.release(["acme"])
                time.sleep(0.004)
            return n

        fleet = run(1.0)
        assert q.degraded == 0 and 50 <= fleet <= 66, fleet
        srv.stop()  # Redis killed mid-run
        local = run(1.0)
        # judged by the host's bucket (full: 10, then 50/s), never unlimited, no exception
        assert q.degraded > 100 and 45 <= local <= 66, (local, q.degraded)
        srv.start()
        deadline = time.monotonic() + 10  # Redis is asked again once its backoff (1 s, doubling) is over
        while time.monotonic() < deadline and not (q.available() and q._health.backoff == 0):
            run(0.2)
        seen = q.degraded
        run(0.5)
        assert q.degraded == seen  # judged by the fleet again
    finally:
        q.close()
        srv.stop()


def test_state_urls_that_mean_redis():
    assert fleet_url("redis://h:6379/0") and fleet_url("rediss://h/0")
    assert not fleet_url("") and not fleet_url("/var/state")
