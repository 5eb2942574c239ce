"""Audit anchors against a real tritonserver and a real redis-server (issue 12, item 5).

A digits guard with its audit log on, HMAC-signed anchors (``TRITONGUARD_AUDIT_KEY``) and its
state store in Redis (``TRITONGUARD_STATE_URL``): after serving and a clean stop, the chain
verifies as anchored; cutting the log's tail, deleting its local anchor or emptying it is
caught by ``python -m exporter audit verify`` (exit 3), through the Redis anchor where the local
one is gone; and a restarted guard writes the loss into the chain itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.http as httpclient

from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server
from tritonguard.privacy.audit.anchors import ANCHOR_HASH, anchor_name

pytestmark = pytest.mark.functional

ROOT = Path(__file__).resolve().parents[2]
GUARD = "digits_anchor"
AUDIT_KEY = "functional-test-audit-key-0123456789"


@pytest.fixture(scope="module")
def env(exported_repo, redis_server, tmp_path_factory):
    base = tmp_path_factory.mktemp("audit_anchor")
    repo, data = base / "repo", base / "data"
    repo.mkdir()
    (repo / "digits_raw").symlink_to((exported_repo / "digits_raw").resolve())
    digits = read_config(exported_repo / "digits")
    params = {k: v["string_value"] for k, v in digits["parameters"].items()}
    params.update({"audit.path": str(data / "audit" / "{model}.{instance}.jsonl"), "audit.flush_interval_ms": "20",
                   "audit.anchor_interval_ms": "100"})
    write_config(repo / GUARD, {**digits, "name": GUARD, "parameters": {k: {"string_value": v}
                                                                       for k, v in params.items()}})
    (repo / GUARD / "1").mkdir()
    r = redis.Redis.from_url(redis_server.url)
    r.delete(f"tritonguard:state:{GUARD}")
    server_env = {**os.environ, "TRITONGUARD_STATE_URL": redis_server.url, "TRITONGUARD_AUDIT_KEY": AUDIT_KEY}
    yield {"base": base, "repo": repo, "data": data, "url": redis_server.url, "redis": r, "server_env": server_env}
    r.delete(f"tritonguard:state:{GUARD}")
    r.close()


def serve(env, requests: int) -> None:
    """Start the server, send ``requests`` inferences, stop it (the guard closes its audit log)."""
    from sklearn.datasets import load_digits

    server = Server(repository=env["repo"], log_path=env["base"] / "logs" / "tritonserver.log",
                    env=env["server_env"])
    server.start(wait_models=(GUARD,))
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        x = load_digits().images[:2].astype(np.float32)
        for _ in range(requests):
            inp = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            client.infer(GUARD, [inp])
        with contextlib.suppress(Exception):
            client.close()  # an open keep-alive connection holds the server's shutdown for 30 s
    finally:
        server.stop()


def cli(env, path, *args, state=True, key=True):
    run_env = {k: v for k, v in os.environ.items() if k not in ("TRITONGUARD_STATE_URL", "TRITONGUARD_AUDIT_KEY")}
    if key:
        run_env["TRITONGUARD_AUDIT_KEY"] = AUDIT_KEY
    cmd = [sys.executable, "-m", "exporter", "audit", "verify", str(path), *args]
    if state:
        cmd += ["--state-url", env["url"]]
    return subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=120)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_truncated_audit_log_of_a_real_guard_fails_verify(env):
    serve(env, 12)
    (path,) = (env["data"] / "audit").glob(f"{GUARD}.*.jsonl")
    recs = records(path)
    assert recs[0]["type"] == "guard_start" and recs[-1]["type"] == "guard_stop"
    assert sum(r["type"] == "inference" for r in recs) == 12
    n = len(recs)
    # the anchor, signed, beside the log and in Redis, counts every record
    local = json.loads((path.parent / (path.name + ".anchor")).read_text())
    stored = json.loads(env["redis"].hget(ANCHOR_HASH, anchor_name(path)))
    assert local == stored and stored["seq"] == n and stored["head"] == recs[-1]["hash"]
    assert stored["alg"] == "hmac-sha256"

    ok = cli(env, path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"ok: {n} records, chain intact (1 file)" in ok.stdout and f"anchored: {n} records" in ok.stdout

    # the last 3 records deleted: exit 1 (TRUNCATED), naming how many and after which seq
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-3]))
    cut = cli(env, path)
    assert cut.returncode == 1, cut.stdout + cut.stderr
    assert f"TRUNCATED: 3 records missing after seq {n - 4}" in cut.stderr

    # the local anchor deleted too: alone the log looks intact, Redis still knows
    (path.parent / (path.name + ".anchor")).unlink()
    alone = cli(env, path, state=False)
    assert alone.returncode == 0 and "unanchored" in alone.stderr, alone.stdout + alone.stderr
    assert (r := cli(env, path, "--require-anchor", state=False)).returncode == 1 and "UNANCHORED" in r.stderr, r.stderr
    assert (r := cli(env, path)).returncode == 1 and "TRUNCATED" in r.stderr, r.stderr
    # without the key the signed anchor is still read (unchecked, with a warning)
    nokey = cli(env, path, key=False)
    assert nokey.returncode == 1 and "TRUNCATED" in nokey.stderr and "not checked" in nokey.stderr, nokey.stdout + nokey.stderr

    # a restarted guard finds the loss and writes it into the chain before anything else
    serve(env, 2)
    recs = records(path)
    assert recs[n - 3]["type"] == "truncation" and recs[n - 3]["missing"] == 3, recs[n - 3]
    after = cli(env, path)
    assert after.returncode == 1 and "found when writing resumed" in after.stderr, after.stdout + after.stderr

    # emptied: exit 1 (TRUNCATED), every anchored record missing
    m = len(recs)
    path.write_bytes(b"")
    empty = cli(env, path)
    assert empty.returncode == 1 and f"TRUNCATED: {m} records missing, the log is empty" in empty.stderr, \
        empty.stdout + empty.stderr
