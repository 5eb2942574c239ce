"""Privacy, tenants, cache and audit against a real tritonserver and a real redis-server.

One server of its own (module scope), with guard variants configured for the tiered cache (L1,
L2 SQLite in a temp folder, L3 on the ``redis_server`` fixture), the audit log, redaction on text
inputs and outputs, tenant quotas, Triton's header forwarding and restricted APIs. Parameters
come through all three layers: a pyproject.toml beside the repository, ``TRITONGUARD_*`` in the
server's environment, and config.pbtxt.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server
from tritonguard.privacy.audit.verify import verify

pytestmark = pytest.mark.functional

ROOT = Path(__file__).resolve().parents[2]
KEY_HEX = "3c" * 32
ADMIN_HEADER, ADMIN_KEY = "x-tg-admin", "s3cr3t-admin-key"
# planted PII: none of these may appear in any file the server or the guards write
PII = {
    "EMAIL": "zelda.quinn@example.org",
    "PHONE": "+44 20 7946 0958",
    "CREDIT_CARD": "4111 1111 1111 1111",
    "SSN": "078-05-1120",
    "IBAN": "GB82 WEST 1234 5698 7654 32",
    "IPV4": "203.0.113.77",
    "IPV6": "2001:db8::8a2e:370:7334",
}
NEEDLES = sorted({v.encode() for v in PII.values()} | {v.replace(" ", "").encode() for v in PII.values()}
                 | {b"zelda.quinn", b"4111111111111111", b"GB82WEST"})
PII_TEXTS = [f"my {kind.lower().replace('_', ' ')} is {value}, please remember it" for kind, value in PII.items()]

ECHO_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Returns its text and the byte length of each element it was given."""

    def execute(self, requests):
        out = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()
            n = np.array([[len(x)] for x in t.reshape(len(t), -1)[:, 0]], dtype=np.int32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", t), pb_utils.Tensor("LEN", n)]))
        return out
'''


def _params(**kv):
    return {k.replace("__", "."): {"string_value": str(v)} for k, v in kv.items()}


def _io(name, dtype, dims):
    return {"name": name, "data_type": dtype, "dims": dims}


SERVED_BY = _io("SERVED_BY", "TYPE_STRING", [1])


@pytest.fixture(scope="module")
def env(exported_repo, redis_server, tmp_path_factory):
    base = tmp_path_factory.mktemp("privacy")
    repo, data = base / "repo", base / "data"
    repo.mkdir()
    data.mkdir()
    for name in ("digits_raw", "minilm_raw", "minilm_tokenizer", "minilm_encoder"):
        (repo / name).symlink_to((exported_repo / name).resolve())
    # the pyproject layer: found in the repository's parent folder
    (base / "pyproject.toml").write_text(
        "[tool.tritonguard.audit]\nflush_interval_ms = 20\n\n"
        "[tool.tritonguard.cache]\nl3_prefix = \"tgtest:\"\nl3_timeout_ms = 100\nl2_ttl_s = 600\n")
    l2 = data / "l2" / "cache.sqlite"
    audit = data / "audit" / "{model}.{instance}.jsonl"
    persisted = {"cache.enabled": "true", "cache.privacy": "persisted_encrypted", "cache.l3_url": redis_server.url}

    minilm = read_config(exported_repo / "minilm")
    text_io = {"input": minilm["input"], "output": [o for o in minilm["output"] if o["name"] != "SERVED_BY"] + [SERVED_BY],
               "max_batch_size": minilm["max_batch_size"]}

    def guard(name, io, **params):
        cfg = {"name": name, "backend": "guard", **io, "dynamic_batching": {"max_queue_delay_microseconds": 500},
               "instance_group": [{"kind": "KIND_CPU", "count": 1}], "parameters": _params(**params)}
        write_config(repo / name, cfg)
        (repo / name / "1").mkdir()

    guard("minilm_priv", text_io, target="minilm_raw", **persisted, cache__l2_path=l2, audit__path=audit,
          validation__max_bytes_length=16384, **{"tenancy.quotas": json.dumps({"limited": {"rps": 0.2, "burst": 2}})})
    digits = read_config(exported_repo / "digits")
    digits_io = {"input": digits["input"], "output": [o for o in digits["output"] if o["name"] != "SERVED_BY"] + [SERVED_BY],
                 "max_batch_size": digits["max_batch_size"]}
    # L3 only (no L1, no L2): every hit comes from Redis
    guard("digits_priv", digits_io, target="digits_raw", placement="inprocess", **persisted, cache__l1_entries=0,
          audit__path=audit, **{"validation.range.IMAGE": "0,16"})
    # a test-only python model that echoes its text: shows what the target saw
    echo_io = {"input": [_io("TEXT", "TYPE_STRING", [1])],
               "output": [_io("OUT", "TYPE_STRING", [1]), _io("LEN", "TYPE_INT32", [1])], "max_batch_size": 8}
    write_config(repo / "echo", {"name": "echo", "backend": "python", **echo_io, "dynamic_batching": {},
                                 "instance_group": [{"kind": "KIND_CPU", "count": 1}]})
    (repo / "echo" / "1").mkdir()
    (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    guard("echo_red", echo_io, target="echo", validation__max_bytes_length=4096, cache__enabled="true",
          audit__path=audit)
    guard("echo_orig", echo_io, target="echo", validation__max_bytes_length=4096,
          redaction__model_sees_redacted="false", redaction__redact_outputs="true", audit__path=audit)
    # must refuse to load, each with a clear message
    guard("nokey", text_io, target="minilm_raw", validation__max_bytes_length=100, **persisted,
          cache__key_env="TRITONGUARD_TEST_NO_SUCH_KEY")
    guard("nolimit", text_io, target="minilm_raw")

    logs = base / "logs"
    server = Server(
        repository=repo, log_path=logs / "tritonserver.log",
        env={**os.environ, "TRITONGUARD_L2_ENCRYPTION_KEY": KEY_HEX,
             "TRITONGUARD_VALIDATION__MAX_PAYLOAD_BYTES": "65536"},  # the environment layer
        extra_args=["--http-header-forward-pattern=x-tenant-id", "--grpc-header-forward-pattern=x-tenant-id",
                    f"--http-restricted-api=model-repository,model-config:{ADMIN_HEADER}={ADMIN_KEY}",
                    f"--grpc-restricted-protocol=model-repository,model-config:{ADMIN_HEADER}={ADMIN_KEY}"])
    server.start(wait_models=("minilm_priv", "digits_priv", "echo_red", "echo_orig", "minilm_raw"))
    client = httpclient.InferenceServerClient(server.http_url, concurrency=16)
    yield {"server": server, "client": client, "base": base, "data": data, "l2": l2, "redis": redis_server}
    with contextlib.suppress(Exception):
        client.close()  # an open keep-alive connection holds the server's shutdown for 30 s
    server.stop()


def text_input(texts, cls=httpclient):
    arr = np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=object)
    i = cls.InferInput("TEXT", list(arr.shape), "BYTES")
    i.set_data_from_numpy(arr)
    return i


def image_input(x, cls=httpclient):
    i = cls.InferInput("IMAGE", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return i


def embed(env, texts, tenant=None, header=None, model="minilm_priv"):
    outs = [httpclient.InferRequestedOutput("EMBEDDING"), httpclient.InferRequestedOutput("SERVED_BY")]
    r = env["client"].infer(model, [text_input(texts)], outputs=outs,
                            parameters={"tenant": tenant} if tenant else None,
                            headers={"X-Tenant-Id": header} if header else None)
    return r.as_numpy("EMBEDDING"), [s.decode() for s in r.as_numpy("SERVED_BY")[:, 0]]


def audit_records(env, model):
    recs = []
    for p in sorted((env["data"] / "audit").glob(f"{model}.*.jsonl")):
        recs += [json.loads(line) for line in p.read_text().splitlines()]
    return recs


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def metric_lines(env, prefix):
    text = urllib.request.urlopen(env["server"].metrics_url, timeout=10).read().decode()
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


# -- tests -----------------------------------------------------------------------------------------
def test_unsafe_configs_refuse_to_load_with_a_clear_message(env):
    url = f"http://{env['server'].http_url}/v2/repository/index"
    with pytest.raises(urllib.error.HTTPError) as denied:  # restricted API: no key, no index
        urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=10)
    assert denied.value.code == 403, (denied.value.code, denied.value.read())
    req = urllib.request.Request(url, data=b"{}", method="POST", headers={ADMIN_HEADER: ADMIN_KEY})
    with urllib.request.urlopen(req, timeout=10) as r:
        index = {m["name"]: m for m in json.loads(r.read())}
    assert index["nokey"]["state"] == "UNAVAILABLE"
    assert "TRITONGUARD_TEST_NO_SUCH_KEY" in index["nokey"]["reason"] and "32-byte" in index["nokey"]["reason"]
    assert index["nolimit"]["state"] == "UNAVAILABLE"
    assert "validation.max_bytes_length" in index["nolimit"]["reason"]
    assert index["minilm_priv"]["state"] == "READY"
    # over gRPC Triton wants the key under its prefixed metadata name (as docs/privacy.md shows); the
    # bare header name is refused even with the right key
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    grpc = grpcclient.InferenceServerClient(env["server"].grpc_url)
    try:
        models = grpc.get_model_repository_index(headers={f"triton-grpc-protocol-{ADMIN_HEADER}": ADMIN_KEY}).models
        assert "nokey" in {m.name for m in models}
        with pytest.raises(InferenceServerException, match="(?i)permission|denied|unavailable|restricted"):
            grpc.get_model_repository_index(headers={ADMIN_HEADER: ADMIN_KEY})
    finally:
        grpc.close()
    # soft findings are warnings in the server log
    log = env["server"].log_path.read_text(errors="replace")
    assert "security check:" in log and "redaction.model_sees_redacted=false" in log


def test_model_sees_redacted_text_and_outputs_are_redacted(env):
    text = f"reach me at {PII['EMAIL']} or {PII['PHONE']}"
    r = env["client"].infer("echo_red", [text_input([text])])
    assert r.as_numpy("OUT")[0, 0] == b"reach me at [EMAIL] or [PHONE]"  # what the target saw
    assert r.as_numpy("LEN")[0, 0] == len(b"reach me at [EMAIL] or [PHONE]")
    r = env["client"].infer("echo_orig", [text_input([text])])
    assert r.as_numpy("LEN")[0, 0] == len(text.encode())  # the target saw the original...
    assert r.as_numpy("OUT")[0, 0] == b"reach me at [EMAIL] or [PHONE]"  # ...its text output is redacted


def test_tenant_never_gets_another_tenants_cached_answer(env):
    text = "tenant isolation sentence, asked by two tenants"
    e1, s1 = embed(env, [text], tenant="alpha")
    e2, s2 = embed(env, [text], tenant="alpha")
    assert s1 == ["minilm_raw:1"] and s2 == ["cache:minilm_raw:1"]
    np.testing.assert_array_equal(e1, e2)
    _, s3 = embed(env, [text], tenant="beta")
    assert s3 == ["minilm_raw:1"], "beta got alpha's cached answer"
    # the tenant from a forwarded HTTP header (--http-header-forward-pattern=x-tenant-id)
    _, s4 = embed(env, [text], header="gamma")
    _, s5 = embed(env, [text], header="gamma")
    assert s4 == ["minilm_raw:1"] and s5 == ["cache:minilm_raw:1"]
    # and over gRPC
    g = grpcclient.InferenceServerClient(env["server"].grpc_url)
    try:
        out = g.infer("minilm_priv", [text_input([text], grpcclient)], headers={"x-tenant-id": "delta"},
                      outputs=[grpcclient.InferRequestedOutput("SERVED_BY")])
        assert out.as_numpy("SERVED_BY")[0, 0] == b"minilm_raw:1"
    finally:
        g.close()
    assert wait_for(lambda: {"alpha", "beta", "gamma", "delta"} <= {r["tenant"] for r in audit_records(env, "minilm_priv")})
    # a batch is a hit only if every row hits
    _, s6 = embed(env, [text, "a second, new row"], tenant="alpha")
    assert s6 == ["minilm_raw:1", "minilm_raw:1"]


def test_invalid_tenant_and_quota(env):
    with pytest.raises(InferenceServerException) as err:
        embed(env, ["x"], tenant=PII["EMAIL"])
    assert err.value.status() == "400" and "tenant id must match" in err.value.message()
    assert PII["EMAIL"] not in err.value.message()
    codes = []
    for i in range(5):
        try:
            embed(env, [f"quota {i}"], tenant="limited")
            codes.append("ok")
        except InferenceServerException as exc:
            codes.append(exc.status())
            assert "retry after" in exc.message() and "limited" in exc.message()
    assert codes[:2] == ["ok", "ok"] and "503" in codes[2:], codes
    # the bucket lives in a file every instance of the guard maps: a third process (this one)
    # opening it finds the tenant's burst spent by the server's instance (refill: 1 per 5 s)
    from tritonguard.privacy.tenancy.config import TenancyConfig
    from tritonguard.privacy.tenancy.quotas import QUOTA_FILE, SharedQuotaManager

    path = env["base"] / "repo" / "minilm_priv" / QUOTA_FILE
    other = SharedQuotaManager(TenancyConfig(quotas={"limited": {"rps": 0.2, "burst": 2}}), path)
    try:
        out = other.admit(["limited"])
        assert out != [None] and "over its rate limit" in out[0], out
    finally:
        other.close()


def test_l3_hits_and_l2_holds_no_plaintext(env):
    from sklearn.datasets import load_digits

    x = load_digits().images[:8].astype(np.float32)
    outs = [httpclient.InferRequestedOutput("PROBS"), httpclient.InferRequestedOutput("SERVED_BY")]
    first = env["client"].infer("digits_priv", [image_input(x)], outputs=outs)
    again = env["client"].infer("digits_priv", [image_input(x)], outputs=outs)
    assert set(first.as_numpy("SERVED_BY")[:, 0]) == {b"digits_raw:1"}
    assert set(again.as_numpy("SERVED_BY")[:, 0]) == {b"cache:digits_raw:1"}
    np.testing.assert_array_equal(first.as_numpy("PROBS"), again.as_numpy("PROBS"))
    assert wait_for(lambda: any('tier="l3"' in ln and 'result="hit"' in ln and 'model="digits_priv"' in ln
                                for ln in metric_lines(env, "tritonguard_cache_lookups_total")))
    # L2 of the text guard: ciphertext only, neither the inputs nor the answers in clear
    emb, _ = embed(env, PII_TEXTS, tenant="scan")
    embed(env, PII_TEXTS, tenant="scan")
    blob = b"".join(p.read_bytes() for p in env["l2"].parent.glob("cache.sqlite*"))
    assert len(blob) > 4096
    for row in emb:
        assert row[:16].tobytes() not in blob
    for needle in NEEDLES:
        assert needle not in blob
    import redis

    r = redis.Redis.from_url(env["redis"].url)
    keys = r.keys("tgtest:*")
    assert keys, "L3 holds the persisted entries under the pyproject-configured prefix"
    values = b"".join(r.mget(keys))
    assert emb[0][:16].tobytes() not in values and not any(n in values for n in NEEDLES)


def test_environment_layer_reaches_the_guard(env):
    with pytest.raises(InferenceServerException) as err:
        embed(env, ["y" * 10000] * 8, tenant="env")  # 80 kB > TRITONGUARD_VALIDATION__MAX_PAYLOAD_BYTES
    assert err.value.status() == "400" and "max_payload_bytes" in err.value.message()


def test_killing_redis_mid_traffic_loses_no_request(env):
    from sklearn.datasets import load_digits

    images = load_digits().images.astype(np.float32)
    redis_srv = env["redis"]
    errors, done = [], []

    def worker(k):
        # tritonclient.http clients are not thread-safe: one per thread
        with httpclient.InferenceServerClient(env["server"].http_url) as client:
            for j in range(40):
                idx = (k * 40 + j) % 24  # repeats: hits while Redis is up
                try:
                    r = client.infer("digits_priv", [image_input(images[idx:idx + 1])])
                    assert r.as_numpy("PROBS").shape == (1, 10)
                    if j % 4 == 0:
                        e = client.infer("minilm_priv", [text_input([f"outage sentence {k} {j % 8}"])],
                                         parameters={"tenant": "outage"})
                        assert e.as_numpy("EMBEDDING").shape == (1, 384)
                    done.append(1)
                except Exception as exc:  # noqa: BLE001 - collected and asserted below
                    errors.append(repr(exc))
                time.sleep(0.005)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    assert wait_for(lambda: len(done) >= 40 or errors, timeout=60)
    redis_srv.proc.kill()  # SIGKILL our own redis-server, mid-traffic
    redis_srv.proc.wait(5)
    try:
        for t in threads:
            t.join(120)
        assert not errors, errors[:5]
        assert len(done) == 160
        assert wait_for(lambda: any('tier="l3"' in ln and not ln.endswith(" 0")
                                    for ln in metric_lines(env, "tritonguard_cache_errors_total")))
        assert "cache L3 (Redis) failed" in env["server"].log_path.read_text(errors="replace")
    finally:
        redis_srv.start()  # the same port: other tests (and the unit tier) use it too


def test_audit_chain_verifies_and_any_edit_is_detected(env, tmp_path):
    assert wait_for(lambda: any(r["type"] == "quota_reject" for r in audit_records(env, "minilm_priv")))
    path = next((env["data"] / "audit").glob("minilm_priv.*.jsonl"))
    copy = tmp_path / "audit.jsonl"
    shutil.copy(path, copy)
    lines = copy.read_bytes().splitlines()
    recs = [json.loads(line) for line in lines]
    types = {r["type"] for r in recs}
    assert {"guard_start", "inference", "reject", "quota_reject"} <= types, types
    inf = [r for r in recs if r["type"] == "inference"]
    assert {"hit", "miss"} <= {r["cache"] for r in inf}
    assert all(len(r["request"]) == 64 for r in inf)
    golden = [r for r in audit_records(env, "digits_priv") if r["type"] == "golden"]
    assert golden and golden[0]["verdict"] == "PASS"
    cli = [sys.executable, "-m", "exporter", "audit", "verify", str(copy)]
    ok = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for n in range(len(lines)):  # edit each record in turn: the chain names it
        rec = dict(recs[n])
        rec["tenant"] = "mallory" if rec.get("tenant") != "mallory" else "eve"
        copy.write_bytes(b"\n".join([*lines[:n], json.dumps(rec).encode(), *lines[n + 1:]]) + b"\n")
        res = verify(copy)
        assert not res.ok and res.first_bad == n, (n, res)
    bad = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and f"#{len(lines) - 1}" in bad.stderr, bad.stdout + bad.stderr


def test_planted_pii_never_reaches_a_file(env):
    """Runs last: PII through every model (text inputs, parameters, tenant ids, bad requests),
    then the server stops (the guards flush and close) and every byte written is scanned."""
    from sklearn.datasets import load_digits

    client = env["client"]
    for model in ("minilm_priv", "echo_red", "echo_orig", "minilm_raw"):
        out = "EMBEDDING" if "minilm" in model else "OUT"
        client.infer(model, [text_input(PII_TEXTS)], outputs=[httpclient.InferRequestedOutput(out)])
        client.infer(model, [text_input(PII_TEXTS[:3])], parameters={"tenant": "pii"},
                     outputs=[httpclient.InferRequestedOutput(out)])
    x = load_digits().images[:2].astype(np.float32)
    client.infer("digits_priv", [image_input(x)], parameters={"note": PII["EMAIL"], "card": PII["CREDIT_CARD"]})
    for bad in ([PII["SSN"] + " " + "z" * 20000], [PII["IBAN"].encode() + b"\xff\xfe"]):
        with pytest.raises(InferenceServerException):
            client.infer("minilm_priv", [text_input(bad)])
    with pytest.raises(InferenceServerException):
        client.infer("digits_priv", [image_input(np.full((1, 8, 8), 99.0, np.float32))],
                     parameters={"tenant": PII["IPV4"] + "!"})
    with pytest.raises(InferenceServerException):
        client.infer("echo_red", [text_input(["x"])], parameters={"tenant": PII["IPV6"]})

    client.close()  # an open keep-alive connection holds the server's shutdown for 30 s
    env["server"].stop()  # finalize(): audit logs drained and closed, caches closed
    scanned, found = 0, []
    for dirpath, _, files in os.walk(env["base"]):  # symlinked exported models are not followed
        for f in files:
            p = Path(dirpath) / f
            if p.is_symlink():
                continue
            data = p.read_bytes()
            scanned += 1
            found += [f"{p.relative_to(env['base'])}: {n!r}" for n in NEEDLES if n in data]
    assert scanned >= 8 and not found, found
    names = {p.name for p in env["base"].rglob("*") if p.is_file()}
    assert "cache.sqlite" in names and "tritonserver.log" in names and "rollout_state.json" in names
    assert any(n.startswith("minilm_priv.") and n.endswith(".jsonl") for n in names)
    assert audit_records(env, "minilm_priv")[-1]["type"] == "guard_stop"
