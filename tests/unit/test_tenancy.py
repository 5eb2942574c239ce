import json
import threading

import pytest

from tritonguard.config import from_params
from tritonguard.errors import ConfigError, InvalidInput
from tritonguard.tenancy import MAX_TRACKED, QuotaManager, TenancyConfig, TenantResolver

QUOTAS = {
    "acme": {"rps": 10, "burst": 3, "priority": 2},
    "slow": {"rps": 0.5},
    "pool": {"max_in_flight": 2},
    "*": {"rps": 1, "burst": 1},
}


def config(**params):
    raw = {k: (json.dumps(v) if isinstance(v, dict) else str(v)) for k, v in params.items()}
    return from_params(TenancyConfig, raw, section="tenancy")


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


def test_token_bucket_burst_refill_and_retry_advice():
    q = QuotaManager(config(quotas=QUOTAS))
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


def test_in_flight_cap_and_release():
    q = QuotaManager(config(quotas=QUOTAS))
    out = q.admit(["pool"] * 3, now=0.0)
    assert out[:2] == [None, None] and "2 requests in flight" in out[2] and "retry after" in out[2]
    assert q.in_flight("pool") == 2
    q.release(["pool"])
    assert q.admit(["pool"], now=0.0) == [None]
    q.release(["pool"] * 5)  # over-release never goes negative
    assert q.in_flight("pool") == 0


def test_fallback_quota_per_unknown_tenant_and_unlimited_without_fallback():
    q = QuotaManager(config(quotas=QUOTAS))
    out = q.admit(["u1", "u1", "u2"], now=0.0)  # each unknown tenant has its own "*" bucket
    assert out[0] is None and "retry after 1000 ms" in out[1] and out[2] is None
    free = QuotaManager(config(quotas={"acme": {"rps": 1}}))
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


def test_thread_safety():
    q = QuotaManager(config(quotas={"t": {"rps": 1e9, "burst": 100000}}))

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
