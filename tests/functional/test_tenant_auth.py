"""Authenticated tenants against a real tritonserver: per-tenant API keys (a keys file of SHA-256
digests, rotated while the server runs) and HS256 tenant tokens, over HTTP and gRPC.

One server of its own (module scope) that forwards the credential headers
(``--http-header-forward-pattern`` / ``--grpc-header-forward-pattern``), with copies of the
digits guard: ``digits_key`` (api_key, unauthenticated requests refused), ``digits_anon``
(api_key, unauthenticated requests served as the restricted tenant ``anon``), ``digits_jwt``
(jwt), and two that must refuse to load (no keys file, no secret). Who a request was served as
is read from the audit log (its ``tenant``) and from the quota of ``anon``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import jwt
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.functional.test_privacy import audit_records, wait_for
from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server
from tritonguard.privacy.tenancy.auth import hash_api_key, new_api_key

pytestmark = pytest.mark.functional

KEY_HEADER = "x-tritonguard-api-key"
FORWARD = "^(x-tenant-id|x-tritonguard-api-key|authorization)$"
SECRET_ENV = "TG_TEST_TENANT_JWT_SECRET"
SECRET = "7e" * 32
KEYS = {"alpha": new_api_key()[0], "beta": new_api_key()[0]}
ROTATED = new_api_key()[0]  # alpha's next key
FORGED = new_api_key()[0]  # in no keys file
ISSUED: list[str] = []  # every key and token handed out: none may reach a file the server writes


def _params(**kv):
    return {k: {"string_value": str(v)} for k, v in kv.items()}


def write_keys(path: Path, table: dict[str, list[str]]) -> None:
    """Replace the keys file atomically (as docs/privacy.md asks) with digests of these keys."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({t: [hash_api_key(k) for k in keys] for t, keys in table.items()}, indent=1))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def env(exported_repo, tmp_path_factory):
    base = tmp_path_factory.mktemp("tenant_auth")
    repo, data = base / "repo", base / "data"
    repo.mkdir()
    data.mkdir()
    (repo / "digits_raw").symlink_to((exported_repo / "digits_raw").resolve())
    keys_file = data / "tenant_keys.json"
    write_keys(keys_file, {"alpha": [KEYS["alpha"]], "beta": [KEYS["beta"]]})
    ISSUED.extend([*KEYS.values(), ROTATED, FORGED])
    digits = read_config(exported_repo / "digits")
    audit = data / "audit" / "{model}.{instance}.jsonl"

    def guard(name, **params):
        cfg = {**digits, "name": name, "parameters": _params(
            target="digits_raw", placement="inprocess", **{"validation.range.IMAGE": "0,16"},
            **{"audit.path": audit, "audit.flush_interval_ms": 20}, **params)}
        write_config(repo / name, cfg)
        (repo / name / "1").mkdir()

    api = {"tenancy.auth": "api_key", "tenancy.keys_file": keys_file}
    guard("digits_key", **api)
    guard("digits_anon", **api, **{"tenancy.unauthenticated": "default", "tenancy.default": "anon",
                                   "tenancy.quotas": json.dumps({"anon": {"rps": 0.01, "burst": 2}})})
    guard("digits_jwt", **{"tenancy.auth": "jwt", "tenancy.jwt_secret_env": SECRET_ENV})
    # must refuse to load, naming what is missing
    guard("digits_nokeys", **{"tenancy.auth": "api_key", "tenancy.keys_file": data / "no_such_keys.toml"})
    guard("digits_nosecret", **{"tenancy.auth": "jwt", "tenancy.jwt_secret_env": "TG_TEST_NO_SUCH_SECRET"})

    server = Server(repository=repo, log_path=base / "logs" / "tritonserver.log",
                    env={**os.environ, SECRET_ENV: SECRET},
                    extra_args=[f"--http-header-forward-pattern={FORWARD}",
                                f"--grpc-header-forward-pattern={FORWARD}"])
    server.start(wait_models=("digits_key", "digits_anon", "digits_jwt"))
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    yield {"server": server, "http": http, "grpc": grpc, "base": base, "data": data, "keys_file": keys_file}
    with contextlib.suppress(Exception):
        http.close()  # an open keep-alive connection holds the server's shutdown for 30 s
    with contextlib.suppress(Exception):
        grpc.close()
    server.stop()


def infer(env, model, headers=None, proto="http", parameters=None):
    """PROBS of one all-zero image, or the InferenceServerException."""
    mod = httpclient if proto == "http" else grpcclient
    x = mod.InferInput("IMAGE", [1, 8, 8], "FP32")
    x.set_data_from_numpy(np.zeros((1, 8, 8), np.float32))
    try:
        r = env[proto].infer(model, [x], headers=headers, parameters=parameters,
                             outputs=[mod.InferRequestedOutput("PROBS")])
    except InferenceServerException as exc:
        return exc
    return r.as_numpy("PROBS")


def refused(out, proto="http") -> str:
    """The refusal's message, after checking it is a 400 / INVALID_ARGUMENT."""
    assert isinstance(out, InferenceServerException), out
    assert out.status() == ("400" if proto == "http" else "StatusCode.INVALID_ARGUMENT"), (out.status(), out.message())
    return out.message()


def tenants_served(env, model):
    """Tenants of the audit log's inference records of ``model`` (each instance's file)."""
    return [r["tenant"] for r in audit_records(env, model) if r["type"] == "inference"]


def bearer(**claims):
    tok = jwt.encode({"exp": int(time.time()) + 300, **claims}, SECRET, algorithm="HS256")
    ISSUED.append(tok)
    return f"Bearer {tok}"


# -- tests -----------------------------------------------------------------------------------------
def test_missing_keys_file_or_secret_fails_the_load(env):
    index = {m["name"]: m for m in env["http"].get_model_repository_index()}
    for name, words in (("digits_nokeys", ("tenancy.keys_file", "no_such_keys.toml")),
                        ("digits_nosecret", ("TG_TEST_NO_SUCH_SECRET", "tenancy.jwt_secret_env"))):
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert all(w in index[name]["reason"] for w in words), index[name]["reason"]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_valid_key_is_served_as_its_tenant(env, proto):
    before = len(tenants_served(env, "digits_key"))
    assert isinstance(infer(env, "digits_key", {KEY_HEADER: KEYS["alpha"]}, proto), np.ndarray)
    # naming the same tenant as well is fine (header any case over HTTP; gRPC metadata is lower-case)
    assert isinstance(infer(env, "digits_key", {KEY_HEADER: KEYS["beta"], "x-tenant-id": "beta"}, proto), np.ndarray)
    assert wait_for(lambda: len(tenants_served(env, "digits_key")) >= before + 2)
    assert tenants_served(env, "digits_key")[before:] == ["alpha", "beta"]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_forged_tenants_and_wrong_keys_are_refused(env, proto):
    msg = refused(infer(env, "digits_key", {"x-tenant-id": "alpha"}, proto), proto)
    assert f"authentication required: send header '{KEY_HEADER}" in msg
    msg = refused(infer(env, "digits_key", None, proto, parameters={"tenant": "alpha"}), proto)
    assert "authentication required" in msg
    msg = refused(infer(env, "digits_key", {KEY_HEADER: FORGED}, proto), proto)
    assert "unknown API key" in msg and FORGED not in msg
    msg = refused(infer(env, "digits_key", {KEY_HEADER: KEYS["alpha"], "x-tenant-id": "beta"}, proto), proto)
    assert "not the one the credential authenticates" in msg and KEYS["alpha"] not in msg


def test_unauthenticated_requests_are_the_restricted_default(env):
    before = len(tenants_served(env, "digits_anon"))
    assert isinstance(infer(env, "digits_anon"), np.ndarray)
    # a tenant named without a key is not believed: served as "anon", on anon's quota
    assert isinstance(infer(env, "digits_anon", {"x-tenant-id": "alpha"}, "grpc"), np.ndarray)
    over = infer(env, "digits_anon", {"x-tenant-id": "alpha"})
    assert isinstance(over, InferenceServerException) and over.status() == "503"
    assert "tenant 'anon' is over its rate limit" in over.message()
    # a key is still the way to a tenant of one's own; a wrong one is refused, never downgraded
    assert isinstance(infer(env, "digits_anon", {KEY_HEADER: KEYS["alpha"]}), np.ndarray)
    assert "unknown API key" in refused(infer(env, "digits_anon", {KEY_HEADER: FORGED}))
    assert wait_for(lambda: len(tenants_served(env, "digits_anon")) >= before + 3)
    assert tenants_served(env, "digits_anon")[before:] == ["anon", "anon", "alpha"]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_signed_tokens(env, proto):
    before = len(tenants_served(env, "digits_jwt"))
    assert isinstance(infer(env, "digits_jwt", {"authorization": bearer(sub="gamma")}, proto), np.ndarray)
    assert wait_for(lambda: tenants_served(env, "digits_jwt")[before:] == ["gamma"])
    expired = bearer(sub="gamma", exp=int(time.time()) - 120)
    assert "token expired" in refused(infer(env, "digits_jwt", {"authorization": expired}, proto), proto)
    forged = "Bearer " + jwt.encode({"sub": "gamma", "exp": int(time.time()) + 60}, "f" * 64, algorithm="HS256")
    msg = refused(infer(env, "digits_jwt", {"authorization": forged}, proto), proto)
    assert "invalid token signature" in msg and forged.split()[1] not in msg
    assert "lacks the required 'sub' claim" in refused(infer(env, "digits_jwt", {"authorization": bearer()}, proto), proto)
    assert "authentication required: send header 'authorization: Bearer" in refused(
        infer(env, "digits_jwt", {"x-tenant-id": "gamma"}, proto), proto)


def test_a_rotated_key_works_without_restart_and_the_old_one_is_refused(env):
    pid = env["server"].proc.pid
    keys_file = env["keys_file"]
    assert "unknown API key" in refused(infer(env, "digits_key", {KEY_HEADER: ROTATED}))
    # step 1: alpha has two keys; the guard sees the file within a second or so
    write_keys(keys_file, {"alpha": [KEYS["alpha"], ROTATED], "beta": [KEYS["beta"]]})
    assert wait_for(lambda: isinstance(infer(env, "digits_key", {KEY_HEADER: ROTATED}), np.ndarray), 10)
    assert isinstance(infer(env, "digits_key", {KEY_HEADER: KEYS["alpha"]}, "grpc"), np.ndarray)
    # step 2: the old key goes
    write_keys(keys_file, {"alpha": [ROTATED], "beta": [KEYS["beta"]]})
    assert wait_for(lambda: isinstance(infer(env, "digits_key", {KEY_HEADER: KEYS["alpha"]}), InferenceServerException), 10)
    assert "unknown API key" in refused(infer(env, "digits_key", {KEY_HEADER: KEYS["alpha"]}, "grpc"), "grpc")
    before = len(tenants_served(env, "digits_key"))
    assert isinstance(infer(env, "digits_key", {KEY_HEADER: ROTATED, "x-tenant-id": "alpha"}, "grpc"), np.ndarray)
    assert wait_for(lambda: tenants_served(env, "digits_key")[before:] == ["alpha"])
    assert env["server"].proc.pid == pid and env["server"].alive()  # no restart
    assert "reloaded" in env["server"].log_path.read_text(errors="replace")


def test_no_key_or_token_reaches_a_file(env):
    """Runs last: the server stops (audit logs flushed) and every file it wrote is scanned."""
    env["http"].close()
    env["grpc"].close()
    env["server"].stop()
    needles = [s.encode() for s in ISSUED] + [SECRET.encode()]
    found, scanned = [], 0
    for dirpath, _, files in os.walk(env["base"]):  # the symlinked digits_raw is not followed
        for f in files:
            p = Path(dirpath) / f
            if p.is_symlink() or p.name.startswith("tenant_keys"):
                continue
            data = p.read_bytes()
            scanned += 1
            found += [f"{p.relative_to(env['base'])}" for n in needles if n in data]
    assert scanned >= 5 and not found, found
