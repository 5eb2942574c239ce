import json
import multiprocessing
import os
import threading

import pytest

from tritonguard.config import from_params
from tritonguard.errors import ConfigError, InvalidInput
from tritonguard.tenancy import (
    MAX_TRACKED,
    QuotaManager,
    SharedQuotaManager,
    TenancyConfig,
    TenantResolver,
)

QUOTAS = {
    "acme": {"rps": 10, "burst": 3, "priority": 2},
    "slow": {"rps": 0.5},
    "pool": {"max_in_flight": 2},
    "*": {"rps": 1, "burst": 1},
}


def config(**params):
    raw = {k: (json.dumps(v) if isinstance(v, dict) else str(v)) for k, v in params.items()}
    return from_params(TenancyConfig, raw, section="tenancy")


@pytest.fixture(params=["per_process", "shared"])
def make_q(request, tmp_path):
    """Both implementations keep the same semantics; the shared one also across processes."""
    if request.param == "per_process":
        return QuotaManager
    return lambda cfg: SharedQuotaManager(cfg, tmp_path / "quota_buckets.bin")


def test_resolve_from_parameter_header_and_default():
    r = TenantResolver(config())
    tenants, errors = r.resolve_tenants([
        {"tenant": "acme"},
        {"X-Tenant-ID": "globex"},  # forwarded header, any case
        {},
        {"tenant": "acme", "x-tenant-id": "acme"},
        {"tenant": 42},
    ])
    assert tenants == ["acme", "globex", "default", "acme", "42"]
    assert errors == [None] * 5


@pytest.mark.parametrize("params,word", [
    ({"tenant": "../etc"}, "must match"),
    ({"tenant": "x" * 65}, "must match"),
    ({"tenant": ""}, "must match"),
    ({"tenant": True}, "string"),
    ({"tenant": "a", "x-tenant-id": "b"}, "different tenants"),
])
def test_invalid_ids_fail_only_their_request(params, word):
    tenants, errors = TenantResolver(config()).resolve_tenants([{"tenant": "ok"}, params])
    assert tenants == ["ok", None] and errors[0] is None
    assert isinstance(errors[1], InvalidInput) and errors[1].rule == "tenant_id" and word in str(errors[1])


def test_disabled_everyone_is_default():
    tenants, errors = TenantResolver(config(enabled="false")).resolve_tenants([{"tenant": "../x"}])
    assert tenants == ["default"] and errors == [None]


def test_custom_parameter_and_header_names():
    r = TenantResolver(config(parameter="org", header="X-Org"))
    assert r.resolve_tenants([{"org": "a"}, {"x-org": "b"}, {"tenant": "c"}])[0] == ["a", "b", "default"]


@pytest.mark.parametrize("params,word", [
    ({"quotas": "[1]"}, "JSON object"),
    ({"quotas": {"a": {"rps": 0}}}, "rps must be > 0"),
    ({"quotas": {"a": {"rate": 1}}}, "unknown keys"),
    ({"quotas": {"a": 5}}, "must be an object"),
    ({"quotas": {"bad id!": {"rps": 1}}}, "tenant_pattern"),
    ({"tenant_pattern": "("}, "invalid regex"),
    ({"default": "no spaces"}, "tenancy.default"),
])
def test_config_errors(params, word):
    with pytest.raises(ConfigError, match=word):
        config(**params)


def test_token_bucket_burst_refill_and_retry_advice(make_q):
    q = make_q(config(quotas=QUOTAS))
    out = q.admit(["acme"] * 5, now=0.0)
    assert out[:3] == [None] * 3
    assert "retry after 100 ms" in out[3] and "rate limit of 10" in out[3]
    q.release(["acme"] * 3)
    assert q.admit(["acme"], now=0.05) != [None]  # half a token back
    assert q.admit(["acme"], now=0.1) == [None]
    assert q.admit(["acme"] * 5, now=100.0).count(None) == 3  # refill is capped at the burst
    slow = q.admit(["slow", "slow"], now=0.0)
    assert slow[0] is None and "retry after 2000 ms" in slow[1]
    assert q.rejected == 6


def test_in_flight_cap_and_release(make_q):
    q = make_q(config(quotas=QUOTAS))
    out = q.admit(["pool"] * 3, now=0.0)
    assert out[:2] == [None, None] and "2 requests in flight" in out[2] and "retry after" in out[2]
    assert q.in_flight("pool") == 2
    q.release(["pool"])
    assert q.admit(["pool"], now=0.0) == [None]
    q.release(["pool"] * 5)  # over-release never goes negative
    assert q.in_flight("pool") == 0


def test_fallback_quota_per_unknown_tenant_and_unlimited_without_fallback(make_q):
    q = make_q(config(quotas=QUOTAS))
    out = q.admit(["u1", "u1", "u2"], now=0.0)  # each unknown tenant has its own "*" bucket
    assert out[0] is None and "retry after 1000 ms" in out[1] and out[2] is None
    free = make_q(config(quotas={"acme": {"rps": 1}}))
    assert free.admit(["other"] * 100, now=0.0) == [None] * 100


def test_priority():
    q = QuotaManager(config(quotas=QUOTAS))
    assert q.priority("acme") == 2 and q.priority("unknown") == 0
    assert QuotaManager(config()).priority("x") == 0


def test_tracked_tenants_are_bounded():
    q = QuotaManager(config(quotas={"*": {"rps": 1}}))
    q.admit(["busy"], now=0.0)  # stays in flight
    for i in range(MAX_TRACKED + 50):
        q.admit([f"t{i}"], now=0.0)
        q.release([f"t{i}"])
    assert len(q._buckets) <= MAX_TRACKED and q.in_flight("busy") == 1


def test_thread_safety(make_q):
    q = make_q(config(quotas={"t": {"rps": 1e9, "burst": 100000}}))

    def worker():
        for _ in range(1000):
            if q.admit(["t"]) == [None]:
                q.release(["t"])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert q.in_flight("t") == 0


# -- shared by the processes of one host (each Triton instance is a process) -----------------------
def _admit_in_child(path, tenants, now, conn, hold):
    q = SharedQuotaManager(config(quotas=QUOTAS), path)
    out = q.admit(tenants, now=now)
    conn.send(out)
    if not hold:  # hold: exit with the requests still counted in flight, as a crashed instance would
        q.release([t for t, why in zip(tenants, out, strict=True) if why is None])
    conn.close()


def _child(path, tenants, now, hold=False):
    parent, child = multiprocessing.Pipe()
    p = multiprocessing.get_context("fork").Process(target=_admit_in_child, args=(path, tenants, now, child, hold))
    p.start()
    out = parent.recv()
    p.join(10)
    return out


def test_shared_bucket_is_one_bucket_for_every_process(tmp_path):
    path = tmp_path / "quota_buckets.bin"
    q = SharedQuotaManager(config(quotas=QUOTAS), path)
    assert q.admit(["acme"] * 2, now=0.0) == [None, None]  # burst 3: one token left
    child = _child(path, ["acme"] * 2, now=0.0)  # another instance of the same guard
    assert child[0] is None and "rate limit of 10" in child[1], child
    assert q.admit(["acme"], now=0.0) != [None]
    assert q.admit(["acme"], now=0.1) == [None]  # refilled for everyone
    # a per-process manager would have let the child take a full burst of its own
    assert QuotaManager(config(quotas=QUOTAS)).admit(["acme"] * 3, now=0.0) == [None] * 3


def test_shared_in_flight_cap_counts_every_process_and_forgets_dead_ones(tmp_path):
    path = tmp_path / "quota_buckets.bin"
    q = SharedQuotaManager(config(quotas=QUOTAS), path)  # pool: max_in_flight 2
    assert q.admit(["pool"], now=0.0) == [None]
    assert _child(path, ["pool"], now=0.0, hold=True) == [None]  # it exits holding one
    assert q.in_flight("pool") == 2  # counted until the cap is reached
    assert q.admit(["pool"], now=0.0) == [None]  # at the cap: the dead process's request is dropped
    assert q.in_flight("pool") == 2
    out = q.admit(["pool"], now=0.0)
    assert out != [None] and "2 requests in flight" in out[0], out
    q.release(["pool"] * 3)  # over-release never goes negative
    assert q.in_flight("pool") == 0


def test_shared_slots_of_idle_tenants_are_reused(tmp_path):
    q = SharedQuotaManager(config(quotas={"*": {"rps": 1, "burst": 1}}), tmp_path / "q.bin", slots=8)
    for i in range(8):
        assert q.admit([f"t{i}"], now=0.0) == [None]
        q.release([f"t{i}"])
    # every slot holds an empty bucket: new tenants get their own bucket only once old ones are full again
    assert q.admit(["late"], now=0.5) == [None]  # no slot: this process's own bucket
    assert q.admit(["late"], now=0.5) != [None]
    assert q.admit(["later"], now=2.0) == [None]  # t* refilled: a slot is reused
    assert q.admit(["later"], now=2.0) != [None]


def test_shared_file_of_another_layout_is_reset(tmp_path):
    path = tmp_path / "q.bin"
    path.write_bytes(b"junk" * 10)
    q = SharedQuotaManager(config(quotas=QUOTAS), path)
    assert q.admit(["acme"] * 4, now=0.0).count(None) == 3
    assert os.path.getsize(path) > 1000
