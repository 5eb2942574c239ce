"""GuardMiddleware on real FastAPI apps under a real uvicorn on a loopback port, spoken to over
HTTP (http.client), with a real redis-server for the fleet quota (issue 44 item 3)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import random
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tritonguard.core.errors import ConfigError
from tritonguard.hosts.asgi import SERVED_BY_HEADER, GuardMiddleware, HostConfig
from tritonguard.ops.server import free_port
from tritonguard.privacy.tenancy.auth import hash_api_key
from tritonguard.rollout.state import Candidate
from tritonguard.rollout.stores import open_store

EMAIL = "jane.doe@example.com"


@contextlib.contextmanager
def serve(app):
    """``app`` under uvicorn on 127.0.0.1 (its lifespan on), in a thread; stopped on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive()


def call(port: int, path: str, body: object = None, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def scorer() -> FastAPI:
    """An existing scoring service: echoes what it was sent, and a record holding an e-mail."""
    app = FastAPI()

    @app.post("/predict")
    async def predict(request: Request):
        got = await request.json()
        return {"seen": got["text"], "owner": EMAIL, "score": 0.9}

    @app.post("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    return app


def audit_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_two_lines_on_an_existing_app_redact_attribute_meter_and_audit(tmp_path):
    app = scorer()
    app.add_middleware(GuardMiddleware, config={"target": "scorer", "redaction.redact_outputs": True,
                                                "audit.path": str(tmp_path / "audit.jsonl")},
                       repository=tmp_path)
    with serve(app) as port:
        status, headers, body = call(port, "/predict", {"text": f"mail me at {EMAIL} today"})
        assert status == 200, body
        assert headers[SERVED_BY_HEADER] == "scorer:1"
        got = json.loads(body)
        # the handler saw the redacted text, and the e-mail it answered with left redacted
        assert got == {"seen": "mail me at [EMAIL] today", "owner": "[EMAIL]", "score": 0.9}
        assert int(headers["content-length"]) == len(body)
        status, headers, body = call(port, "/boom", {})
        assert status == 500 and json.loads(body) == {"error": "the handler failed", "rule": "target_error"}
        assert b"secret" not in body and b"Traceback" not in body
        status, _, metrics = call(port, "/metrics", method="GET")
        assert status == 200
        text = metrics.decode()
        assert 'tritonguard_requests_total{model="scorer"} 2.0' in text
        assert 'tritonguard_served_total{model="scorer",served_by="scorer:1"} 1.0' in text
        assert 'tritonguard_redactions_total{direction="input",model="scorer",tenant="default",type="EMAIL"} 1.0' in text
        assert 'tritonguard_redactions_total{direction="output",model="scorer",tenant="default",type="EMAIL"} 1.0' in text
        assert 'tritonguard_target_errors_total{code="INTERNAL",model="scorer",target_version="1"} 1.0' in text
        assert 'tritonguard_route_share{model="scorer",role="primary",target_version="1"} 1.0' in text
    # the lifespan's shutdown closed the audit log: its records are on disk
    recs = audit_records(tmp_path / "audit.jsonl")
    inference = [r for r in recs if r["type"] == "inference"]
    assert [(r["served_by"], r["status"], r["redacted"], r["redacted_out"]) for r in inference] == [
        ("scorer:1", "200", True, True), ("scorer:1", "500", False, False)]
    assert all(EMAIL not in json.dumps(r) for r in recs)
    assert {r["type"] for r in recs} >= {"guard_start", "inference", "guard_stop"}


def test_a_streaming_response_passes_through_chunk_by_chunk(tmp_path):
    """The first chunk reaches the client while the handler still waits to send the second: a
    middleware that buffered the body would only answer after the handler gave up waiting."""
    app = FastAPI()
    first_read = threading.Event()

    @app.get("/stream")
    async def stream():
        async def chunks():
            yield b"first\n"
            for _ in range(200):  # up to 10 s for the client to read the first chunk
                if first_read.is_set():
                    break
                await asyncio.sleep(0.05)
            yield b"second\n" if first_read.is_set() else b"timed out\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.add_middleware(GuardMiddleware, config={"target": "streamer", "redaction.redact_outputs": True})
    with serve(app) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("GET", "/stream")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader(SERVED_BY_HEADER) == "streamer:1"
        assert r.read(6) == b"first\n"  # while the handler waits for this read
        first_read.set()
        rest = r.read()
        conn.close()
    assert b"second\n" in rest and b"timed out" not in rest


def test_fleet_quota_is_one_bucket_for_two_replicas_and_refuses_with_429(redis_server, tmp_path):
    """Two apps (two replicas) on one Redis: a burst of 2 for tenant acme is 2 admitted in all,
    not 2 each; the refusal is 429 with Retry-After and the rule, and it is audited."""
    target = f"quota{random.randrange(10**9)}"  # its own buckets on the session's Redis
    config = {"target": target, "tenancy.quotas": {"acme": {"rps": 0.1, "burst": 2}},
              "audit.path": str(tmp_path / "audit-{pid}.jsonl")}
    a, b = scorer(), scorer()
    a.add_middleware(GuardMiddleware, config=config, state_url=redis_server.url)
    b.add_middleware(GuardMiddleware, config={**config, "audit.path": str(tmp_path / "b.jsonl")},
                     state_url=redis_server.url)
    acme = {"x-tenant-id": "acme"}
    with serve(a) as pa, serve(b) as pb:
        statuses = [call(port, "/predict", {"text": "hi"}, acme) for port in (pa, pb, pa, pb)]
        other = call(pa, "/predict", {"text": "hi"}, {"x-tenant-id": "globex"})
        scrapes = [call(port, "/metrics", method="GET")[2].decode() for port in (pa, pb)]
    codes = [s for s, _, _ in statuses]
    assert codes.count(200) == 2 and codes.count(429) == 2, codes
    for status, headers, body in statuses:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            got = json.loads(body)
            assert got["rule"] == "quota" and "acme" in got["error"]
    assert other[0] == 200  # a tenant without a quota (and no "*") is not limited
    series = f'tritonguard_quota_rejects_total{{model="{target}",reason="rate",tenant="acme"}} '
    assert sum(float(line.split()[-1]) for text in scrapes for line in text.splitlines()
               if line.startswith(series)) == 2
    recs = [r for p in tmp_path.glob("*.jsonl") for r in audit_records(p)]
    assert sum(r["type"] == "quota_reject" for r in recs) == 2


def test_unauthenticated_401_other_tenant_403_bad_id_400(tmp_path):
    keys = tmp_path / "keys.json"
    key = "tg_acme-test-key-0123456789"
    keys.write_text(json.dumps({"acme": [hash_api_key(key)]}))
    app = scorer()
    app.add_middleware(GuardMiddleware, config={"target": "authn", "tenancy.auth": "api_key",
                                                "tenancy.keys_file": str(keys)})
    with serve(app) as port:
        ok = call(port, "/predict", {"text": "x"}, {"x-tritonguard-api-key": key})
        none = call(port, "/predict", {"text": "x"})
        wrong = call(port, "/predict", {"text": "x"}, {"x-tritonguard-api-key": "tg_not-a-key"})
        other = call(port, "/predict", {"text": "x"}, {"x-tritonguard-api-key": key, "x-tenant-id": "globex"})
    assert ok[0] == 200
    for status, _, body in (none, wrong):
        assert status == 401
        got = json.loads(body)
        assert got["rule"] == "tenant_auth" and key not in got["error"]
    assert other[0] == 403 and json.loads(other[2])["rule"] == "tenant_auth"

    bad = scorer()
    bad.add_middleware(GuardMiddleware, config={"target": "ids"})
    with serve(bad) as port:
        status, _, body = call(port, "/predict", {"text": "x"}, {"x-tenant-id": "not a valid id!"})
    assert status == 400 and json.loads(body)["rule"] == "tenant_id"


def versioned() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/predict")
    async def v1():
        return {"model": "v1"}

    @app.post("/v2/predict")
    async def v2():
        return {"model": "v2"}

    return app


def test_routing_follows_the_rollout_state_in_the_store(tmp_path):
    store = open_store("ranker", tmp_path)

    def share(s: float):
        def fn(state):
            state.primary, state.candidate = 1, Candidate(2, s)
            return state
        return fn

    store.update(share(1.0), by="test")
    app = versioned()
    app.add_middleware(GuardMiddleware, config={"target": "ranker", "routing.poll_interval_s": 0},
                       versions={1: "/v1", 2: "/v2"}, repository=tmp_path, rng=random.Random(7))
    with serve(app) as port:
        all_cand = [call(port, "/predict", {}) for _ in range(10)]
        store.update(share(0.0), by="test")
        none_cand = [call(port, "/predict", {}) for _ in range(10)]
        store.update(share(0.5), by="test")
        half = [call(port, "/predict", {}) for _ in range(40)]
        _, _, metrics = call(port, "/metrics", method="GET")
        pinned = call(port, "/predict", {}, {"x-tritonguard-version": "1"})
        unrouted = call(port, "/predict", {}, {"x-tritonguard-version": "3"})
    assert {(r[1][SERVED_BY_HEADER], json.loads(r[2])["model"]) for r in all_cand} == {("ranker:2", "v2")}
    assert {(r[1][SERVED_BY_HEADER], json.loads(r[2])["model"]) for r in none_cand} == {("ranker:1", "v1")}
    n2 = sum(r[1][SERVED_BY_HEADER] == "ranker:2" for r in half)
    assert 8 <= n2 <= 32, n2  # seeded draws: a split, not all one way
    assert 'tritonguard_route_share{model="ranker",role="candidate",target_version="2"} 0.5' in metrics.decode()
    assert json.loads(pinned[2]) == {"model": "v1"}
    assert unrouted[0] == 503 and json.loads(unrouted[2])["rule"] == "version"


def test_per_version_apps_and_wrapping_form(tmp_path):
    """``app = GuardMiddleware(app, ...)`` with an ASGI app per version; paths outside ``paths``
    pass untouched (no served-by, no admission)."""
    v1, v2 = versioned(), versioned()
    store = open_store("apps", tmp_path)
    store.update(lambda s: (setattr(s, "primary", 2), s)[1], by="test")
    app = GuardMiddleware(scorer(), config={"target": "apps"}, versions={1: v1, 2: v2}, paths=("/v",),
                          repository=tmp_path)
    with serve(app) as port:
        status, headers, body = call(port, "/v1/predict", {})
        plain = call(port, "/predict", {"text": "t"})
    assert status == 200 and headers[SERVED_BY_HEADER] == "apps:2"
    assert plain[0] == 200 and SERVED_BY_HEADER not in plain[1]


def test_config_uses_the_guards_keys_and_refuses_others():
    cfg = HostConfig.from_parameters({"target": "m", "tenancy.quotas": '{"*": {"rps": 5}}',
                                      "redaction.redact_outputs": "true", "routing.poll_interval_s": "0.5"})
    assert cfg.tenancy.quotas["*"].rps == 5 and cfg.redaction.redact_outputs and cfg.poll_interval_s == 0.5
    with pytest.raises(ConfigError, match="placement"):
        HostConfig.from_parameters({"target": "m", "placement": "bls"})
    with pytest.raises(ConfigError, match="routing.golden_check"):
        HostConfig.from_parameters({"target": "m", "routing.golden_check": "false"})
    with pytest.raises(ConfigError, match="cache"):
        HostConfig.from_parameters({"target": "m", "cache.enabled": "true"})
    with pytest.raises(ConfigError, match="target"):
        HostConfig.from_parameters({})
