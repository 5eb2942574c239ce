import hashlib
import json
import logging
import multiprocessing
import os
import threading
import time

import jwt
import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError, InvalidInput
from tritonguard.privacy.tenancy.auth import (
    AuthenticationError,
    TenantResolver,
    hash_api_key,
    new_api_key,
    read_keys_file,
)
from tritonguard.privacy.tenancy.config import MAX_TRACKED, TenancyConfig
from tritonguard.privacy.tenancy.quotas import QuotaManager, SharedQuotaManager

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


def test_shared_quota_without_a_cap_counts_nothing_in_flight(tmp_path):
    """A rate-only quota takes a token and nothing else: no pid kept in its slot, and its release
    neither writes the file nor takes its lock (half the file work of a request, issue 44)."""
    path = tmp_path / "quota_buckets.bin"
    q = SharedQuotaManager(config(quotas=QUOTAS), path)
    assert q.admit(["acme"] * 2, now=0.0) == [None, None]
    assert q.in_flight("acme") == 0
    before = path.read_bytes()
    q._locked = None  # release must not take the file's lock for it
    q.release(["acme"] * 2)
    assert path.read_bytes() == before
    del q._locked
    assert _child(path, ["acme"] * 2, now=0.0) == [None, "tenant 'acme' is over its rate limit of 10 requests/s; "
                                                         "retry after 100 ms"]  # still one bucket for every process


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


# -- authenticated tenants: API keys ---------------------------------------------------------------
KEY_A, KEY_A2, KEY_B = "tg_alpha-key-0001", "tg_alpha-key-0002", "tg_beta-key-0001"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def write_keys(path, table, bump=0):
    """Replace the keys file atomically (as documented), with a distinct mtime."""
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".toml":
        tmp.write_text("".join(f'"{t}" = {json.dumps(d)}\n' for t, d in table.items()))
    else:
        tmp.write_text(json.dumps(table))
    os.replace(tmp, path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 10_000_000))


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "tenant_keys.json"
    write_keys(path, {"alpha": [hash_api_key(KEY_A)], "beta": hash_api_key(KEY_B)})
    return path


def api_resolver(keys_file, clock=None, **params):
    cfg = config(auth="api_key", keys_file=str(keys_file), **params)
    return TenantResolver(cfg, {}, clock=clock or Clock())


def test_new_api_key_and_its_digest():
    key, digest = new_api_key()
    assert key.startswith("tg_") and len(key) > 40 and digest == hashlib.sha256(key.encode()).hexdigest()
    assert new_api_key()[0] != key


def test_keys_file_json_and_toml(tmp_path):
    d1, d2 = hash_api_key("k1"), hash_api_key("k2")
    j = tmp_path / "k.json"
    j.write_text(json.dumps({"acme": [d1, "sha256:" + d2.upper()]}))
    t = tmp_path / "k.toml"
    t.write_text(f'acme = ["{d1}", "sha256:{d2}"]\n"globex.eu" = "{hash_api_key("k3")}"\n')
    pattern = TenancyConfig().pattern
    assert read_keys_file(j, pattern) == {d1: "acme", d2: "acme"}
    assert read_keys_file(t, pattern) == {d1: "acme", d2: "acme", hash_api_key("k3"): "globex.eu"}


@pytest.mark.parametrize("content,word", [
    ("[1, 2]", "must map tenants"),
    ('{"acme": ["abc"]}', "not a SHA-256 hex digest"),
    ('{"acme": 5}', "list of SHA-256"),
    ('{"bad id": []}', "tenant_pattern"),
    (json.dumps({"a": [hash_api_key("x")], "b": [hash_api_key("x")]}), "share a key"),
    ('{"acme": [', "not valid JSON"),
])
def test_keys_file_errors_name_the_problem_never_a_digest(tmp_path, content, word):
    path = tmp_path / "k.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=word) as exc:
        read_keys_file(path, TenancyConfig().pattern)
    assert hash_api_key("x") not in str(exc.value)


def test_api_key_names_the_tenant(keys_file):
    r = api_resolver(keys_file)
    tenants, errors = r.resolve_tenants([
        {"x-tritonguard-api-key": KEY_A},
        {"X-TritonGuard-API-Key": KEY_B},  # forwarded header, any case
        {"x-tritonguard-api-key": KEY_A, "x-tenant-id": "alpha"},  # naming the same tenant is fine
        {"x-tritonguard-api-key": KEY_B, "tenant": "beta", "X-Tenant-Id": "beta"},
    ])
    assert tenants == ["alpha", "beta", "alpha", "beta"] and errors == [None] * 4


@pytest.mark.parametrize("params,word", [
    ({"x-tritonguard-api-key": "tg_forged"}, "unknown API key in header 'x-tritonguard-api-key'"),
    ({"x-tritonguard-api-key": ""}, "empty API key"),
    ({"x-tritonguard-api-key": KEY_A, "x-tenant-id": "beta"}, "not the one the credential authenticates"),
    ({"x-tritonguard-api-key": KEY_A, "tenant": "beta"}, "not the one the credential authenticates"),
    ({"x-tritonguard-api-key": KEY_A, "X-TRITONGUARD-API-KEY": KEY_B}, "given twice"),
    ({"x-tritonguard-api-key": 42}, "must be a string"),
    ({"x-tenant-id": "alpha"}, "authentication required: send header 'x-tritonguard-api-key"),
    ({}, "authentication required: send header 'x-tritonguard-api-key"),
])
def test_api_key_refusals_name_the_rule_never_the_key(keys_file, params, word):
    tenants, errors = api_resolver(keys_file).resolve_tenants([{"x-tritonguard-api-key": KEY_B}, params])
    assert tenants == ["beta", None] and errors[0] is None
    err = errors[1]
    assert isinstance(err, AuthenticationError) and isinstance(err, InvalidInput)
    assert err.code == "INVALID_ARG" and err.rule == "tenant_auth" and word in str(err), str(err)
    for secret in (KEY_A, KEY_B, "tg_forged", hash_api_key(KEY_A)):
        assert secret not in str(err)


def test_unauthenticated_default_serves_anonymous_requests_but_never_a_wrong_key(keys_file):
    r = api_resolver(keys_file, unauthenticated="default", default="anon")
    tenants, errors = r.resolve_tenants([
        {},
        {"x-tenant-id": "alpha"},  # a claim without a credential is not believed: the restricted default
        {"tenant": "alpha"},
        {"x-tritonguard-api-key": KEY_A},
        {"x-tritonguard-api-key": "tg_forged"},  # a wrong key is refused, never downgraded
        {"x-tritonguard-api-key": KEY_A, "x-tenant-id": "beta"},
        {"tenant": "../x"},  # an invalid id is still an invalid id
    ])
    assert tenants == ["anon", "anon", "anon", "alpha", None, None, None]
    assert errors[:4] == [None] * 4
    assert [e.rule for e in errors[4:]] == ["tenant_auth", "tenant_auth", "tenant_id"]


def test_custom_key_header(keys_file):
    r = api_resolver(keys_file, key_header="X-Api-Key")
    assert r.resolve_tenants([{"x-api-key": KEY_A}])[0] == ["alpha"]
    _, errors = r.resolve_tenants([{"x-tritonguard-api-key": KEY_A}])
    assert "send header 'x-api-key" in str(errors[0])


def test_keys_rotate_without_restart(keys_file, caplog):
    clock = Clock()
    r = api_resolver(keys_file, clock)
    ok = lambda key: r.resolve_tenants([{"x-tritonguard-api-key": key}])[0][0]  # noqa: E731
    assert ok(KEY_A) == "alpha" and ok(KEY_A2) is None
    # step 1: add the new key beside the old one; seen after at most a second
    write_keys(keys_file, {"alpha": [hash_api_key(KEY_A), hash_api_key(KEY_A2)], "beta": [hash_api_key(KEY_B)]}, 1)
    clock.t += 0.5
    assert ok(KEY_A2) is None  # not stat'ed yet: at most one stat a second
    clock.t += 0.6
    assert ok(KEY_A2) == "alpha" and ok(KEY_A) == "alpha" and r.auth.reloads == 1
    # step 2: remove the old key
    write_keys(keys_file, {"alpha": [hash_api_key(KEY_A2)], "beta": [hash_api_key(KEY_B)]}, 2)
    clock.t += 1.1
    assert ok(KEY_A) is None and ok(KEY_A2) == "alpha" and ok(KEY_B) == "beta"
    # a broken file (a non-atomic write caught half way) and a deleted one keep the keys in force
    with caplog.at_level(logging.WARNING, logger="tritonguard.privacy.tenancy"):
        keys_file.write_text('{"alpha": [')
        clock.t += 1.1
        assert ok(KEY_A2) == "alpha"
        keys_file.unlink()
        clock.t += 1.1
        assert ok(KEY_A2) == "alpha"
    assert "not reloaded" in caplog.text and "cannot stat" in caplog.text
    assert hash_api_key(KEY_A2) not in caplog.text
    # and a good file is picked up again
    write_keys(keys_file, {"beta": [hash_api_key(KEY_B)]}, 3)
    clock.t += 1.1
    assert ok(KEY_A2) is None and ok(KEY_B) == "beta"


def test_keys_file_reload_is_one_stat_a_second(keys_file, monkeypatch):
    clock = Clock()
    r = api_resolver(keys_file, clock)
    stats = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(p) or real(p, *a, **k))
    for _ in range(100):  # a hundred batches within the second
        r.resolve_tenants([{"x-tritonguard-api-key": KEY_A}] * 8)
        clock.t += 0.005
    assert len(stats) == 0
    clock.t += 1
    r.resolve_tenants([{"x-tritonguard-api-key": KEY_A}])
    assert len(stats) == 1


def test_auth_none_costs_nothing_extra_and_keeps_claims():
    r = TenantResolver(config())
    assert r.auth is None
    assert r.resolve_tenants([{"x-tenant-id": "acme", "x-tritonguard-api-key": "anything"}]) == (["acme"], [None])


@pytest.mark.parametrize("params,word", [
    ({"auth": "oauth"}, "tenancy.auth must be one of"),
    ({"auth": "api_key", "unauthenticated": "allow"}, "tenancy.unauthenticated must be one of"),
    ({"auth": "api_key", "enabled": "false"}, "needs tenancy.enabled=true"),
    ({"auth": "api_key", "key_header": "X-Tenant-Id"}, "cannot also name the tenant"),
    ({"auth": "jwt", "jwt_leeway_s": "3600"}, "jwt_leeway_s"),
])
def test_auth_config_errors(params, word):
    with pytest.raises(ConfigError, match=word):
        config(**params)


def test_startup_refuses_missing_keys_file_or_secret(tmp_path):
    with pytest.raises(ConfigError, match="needs tenancy.keys_file"):
        TenantResolver(config(auth="api_key"), {})
    with pytest.raises(ConfigError, match=r"tenancy.keys_file '.*nope.json': No such file"):
        TenantResolver(config(auth="api_key", keys_file=str(tmp_path / "nope.json")), {})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="tenancy.keys_file .* not valid JSON"):
        TenantResolver(config(auth="api_key", keys_file=str(tmp_path / "bad.json")), {})
    with pytest.raises(ConfigError, match=r"\$TRITONGUARD_TENANT_JWT_SECRET .*tenancy.jwt_secret_env.* is not set"):
        TenantResolver(config(auth="jwt"), {})
    with pytest.raises(ConfigError, match=r"\$MY_SECRET .* shorter than 32 bytes"):
        TenantResolver(config(auth="jwt", jwt_secret_env="MY_SECRET"), {"MY_SECRET": "short"})


def test_security_check_fails_the_load_naming_the_key(tmp_path):
    import numpy as np  # noqa: PLC0415

    from tritonguard.core.tensors import ModelSignature, TensorSpec  # noqa: PLC0415
    from tritonguard.guard.config import GuardConfig  # noqa: PLC0415
    from tritonguard.guard.services import enforce_security, security_findings  # noqa: PLC0415

    sig = ModelSignature(inputs=(TensorSpec("IMAGE", np.dtype(np.float32), (8, 8)),),
                         outputs=(TensorSpec("PROBS", np.dtype(np.float32), (10,)),), max_batch_size=8)

    def check(environ, **params):
        p = {"target": "t", "validation.max_payload_bytes": "1000", **params}
        return security_findings(GuardConfig.from_parameters(p, "g"), sig, p, environ=environ)

    fs = check({}, **{"tenancy.auth": "api_key", "tenancy.keys_file": str(tmp_path / "missing.toml")})
    with pytest.raises(ConfigError, match="refused by the startup security check: tenancy.keys_file"):
        enforce_security("g", fs)
    fs = check({}, **{"tenancy.auth": "jwt"})
    with pytest.raises(ConfigError, match="TRITONGUARD_TENANT_JWT_SECRET"):
        enforce_security("g", fs)
    assert not check({"TRITONGUARD_TENANT_JWT_SECRET": "s" * 32}, **{"tenancy.auth": "jwt"})
    warned = check({}, **{"tenancy.quotas": '{"a": {"rps": 1}}'})
    assert [f.level for f in warned] == ["warning"] and "unverified claims" in warned[0].message


# -- authenticated tenants: signed tokens (HS256) --------------------------------------------------
SECRET = "9f" * 32


def token(claims=None, secret=SECRET, alg="HS256", **extra):
    # a day: parametrised tokens are made when the module is collected, maybe long before they run
    body = {"sub": "alpha", "exp": int(time.time()) + 86400, **(claims or {}), **extra}
    body = {k: v for k, v in body.items() if v is not None}
    return "Bearer " + jwt.encode(body, secret, algorithm=alg)


def jwt_resolver(**params):
    env = {"TRITONGUARD_TENANT_JWT_SECRET": SECRET}
    return TenantResolver(config(auth="jwt", **params), env)


def test_jwt_valid_token_names_the_tenant():
    r = jwt_resolver()
    tenants, errors = r.resolve_tenants([
        {"authorization": token()},
        {"Authorization": token(sub="beta")},
        {"authorization": token(), "x-tenant-id": "alpha"},
        {"authorization": "bearer " + token()[7:]},  # the scheme is case-insensitive
        {"authorization": token(exp=int(time.time()) - 5)},  # expired within the 10 s leeway
    ])
    assert tenants == ["alpha", "beta", "alpha", "alpha", "alpha"], errors
    assert errors == [None] * 5


@pytest.mark.parametrize("params,word", [
    ({"authorization": token(exp=int(time.time()) - 60)}, "token expired"),
    ({"authorization": token(secret="0" * 64)}, "invalid token signature"),
    ({"authorization": token(sub=None)}, "lacks the required 'sub' claim"),
    ({"authorization": token(exp=None)}, "lacks the required 'exp' claim"),
    ({"authorization": token(nbf=int(time.time()) + 43200)}, "not valid yet"),
    ({"authorization": token(sub="../etc")}, "'sub' claim is not a valid tenant id"),
    ({"authorization": token(sub=["alpha"])}, "authentication failed"),
    ({"authorization": token(alg="HS512")}, "algorithm not allowed"),
    ({"authorization": "Bearer " + jwt.encode({"sub": "alpha", "exp": int(time.time()) + 86400}, None, algorithm="none")},
     "algorithm not allowed"),
    ({"authorization": "Bearer not.a.token"}, "malformed token"),
    ({"authorization": "Basic YWxwaGE6cHc="}, "must be 'Bearer <token>'"),
    ({"authorization": token(), "x-tenant-id": "beta"}, "not the one the credential authenticates"),
    ({"x-tenant-id": "alpha"}, "authentication required: send header 'authorization: Bearer <token>'"),
])
def test_jwt_refusals_name_the_rule_never_the_token(params, word):
    tenants, errors = jwt_resolver().resolve_tenants([params])
    err = errors[0]
    assert tenants == [None] and isinstance(err, AuthenticationError) and word in str(err), str(err)
    auth = params.get("authorization", "")
    assert not auth or auth.split()[-1] not in str(err)
    assert SECRET not in str(err)


def test_jwt_custom_claim_audience_issuer_and_default():
    r = jwt_resolver(jwt_claim="tenant", jwt_audience="tritonguard", jwt_issuer="https://idp.example",
                     unauthenticated="default")
    good = token(tenant="gamma", aud="tritonguard", iss="https://idp.example")
    tenants, errors = r.resolve_tenants([
        {"authorization": good},
        {"authorization": token(tenant="gamma", aud="other", iss="https://idp.example")},
        {"authorization": token(tenant="gamma", aud="tritonguard", iss="https://evil.example")},
        {"authorization": token(tenant="gamma", iss="https://idp.example")},
        {},
    ])
    assert tenants == ["gamma", None, None, None, "default"]
    assert "audience not accepted" in str(errors[1]) and "issuer not accepted" in str(errors[2])
    assert "required 'aud' claim" in str(errors[3])


def test_jwt_remembered_tokens_still_expire():
    r = jwt_resolver(jwt_leeway_s="0")
    exp = int(time.time()) + 2
    tok = {"authorization": token(exp=exp)}
    assert r.resolve_tenants([tok, tok]) == (["alpha", "alpha"], [None, None])  # the second from memory
    assert len(r.auth._verified) == 1
    time.sleep(max(0.0, exp + 0.05 - time.time()))
    tenants, errors = r.resolve_tenants([tok])
    assert tenants == [None] and "token expired" in str(errors[0]) and not r.auth._verified


def test_jwt_verification_is_cheap():
    r = jwt_resolver()
    batch = [{"authorization": token(sub=f"t{i}")} for i in range(8)]
    t0 = time.perf_counter()
    for _ in range(50):
        tenants, _ = r.resolve_tenants(batch)
    per_request = (time.perf_counter() - t0) / 400
    assert tenants[7] == "t7" and per_request < 0.002, per_request


def test_tenant_key_command_prints_a_key_and_its_digest():
    from typer.testing import CliRunner  # noqa: PLC0415

    from exporter.cli.app import app  # noqa: PLC0415

    res = CliRunner().invoke(app, ["tenant-key", "acme"])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip()
    assert key.startswith("tg_") and f'"acme" = ["{hash_api_key(key)}"]' in res.stderr
    assert CliRunner().invoke(app, ["tenant-key", "no spaces"]).exit_code == 2
