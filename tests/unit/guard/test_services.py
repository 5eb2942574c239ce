"""PrivacyStage on whole batches, without Triton: fake request parameters, a real BatchVerdict."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from exporter.cli.app import app
from tritonguard.core.errors import ConfigError, InvalidInput, QuotaExceeded
from tritonguard.core.tensors import ModelSignature, TensorSpec
from tritonguard.guard.config import GuardConfig
from tritonguard.guard.routing.router import Routed
from tritonguard.guard.services import (
    AuditedMetrics,
    PrivacyStage,
    audit_file,
    enforce_security,
    security_findings,
)
from tritonguard.guard.validation import BatchValidator
from tritonguard.privacy.audit.verify import verify

KEY_HEX = "5a" * 32
ENV = {"TRITONGUARD_L2_ENCRYPTION_KEY": KEY_HEX}
PII = [b"john.doe@example.com", b"+44 20 7946 0958", b"4111 1111 1111 1111", b"192.168.10.77"]
TEXT = ModelSignature(inputs=(TensorSpec("TEXT", np.dtype(object), (1,)),),
                      outputs=(TensorSpec("EMB", np.dtype(np.float32), (4,)),), max_batch_size=8)
ECHO = ModelSignature(inputs=(TensorSpec("TEXT", np.dtype(object), (1,)),),
                      outputs=(TensorSpec("OUT", np.dtype(object), (1,)),), max_batch_size=8)
BASE = {"target": "t", "validation.max_bytes_length": "4096"}


class Metrics:
    def __init__(self):
        self.counts: dict[tuple, float] = {}
        self.gauges: dict[tuple, float] = {}

    def inc(self, family, value=1, **labels):
        key = (family, *sorted(labels.items()))
        self.counts[key] = self.counts.get(key, 0) + value

    def set(self, family, value, **labels):
        self.gauges[(family, *sorted(labels.items()))] = value

    def observe(self, family, value, **labels):
        pass

    def total(self, family, **labels):
        return sum(v for k, v in self.counts.items() if k[0] == family and all((a, b) in k[1:] for a, b in labels.items()))


class Router:
    def __init__(self, target="t", primary=1):
        self.target, self._primary = target, primary
        self.state = SimpleNamespace(revision=1, candidate=None, updated_by="test")

    def primary(self):
        return self._primary

    def refresh(self, now):
        pass


@pytest.fixture
def repo(tmp_path):
    for v, sha in ((1, "aa" * 32), (2, "bb" * 32)):
        d = tmp_path / "repo" / "t" / str(v)
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"sha256": sha}))
    return tmp_path / "repo"


def make(repo, sig=TEXT, audit="", **params):
    cfg = GuardConfig.from_parameters({**BASE, **{k.replace("__", "."): str(v) for k, v in params.items()}}, "g")
    metrics = Metrics()
    stage = PrivacyStage(guard="g", target="t", signature=sig, output_names=[s.name for s in sig.outputs],
                         config=cfg, repo=repo, metrics=metrics, audit_path=audit, environ=ENV)
    router = Router()
    stage.attach(router)
    return stage, cfg, router


def embed(texts: np.ndarray) -> np.ndarray:
    """A deterministic stand-in for a model: 4 floats per row from the text bytes."""
    out = []
    for row in texts.reshape(len(texts), -1):
        b = b"".join(row)
        out.append([len(b), sum(b) % 997, b.count(b"["), hash(b) % 1000])
    return np.asarray(out, np.float32)


def serve(stage, cfg, requests, params=None, served_by=None, sig=TEXT):
    """What GuardModel._execute does around the router, with a fake target."""
    inputs = [{"TEXT": np.array([[t] for t in req], dtype=object)} for req in requests]
    verdict = BatchValidator(sig, cfg.validation).validate(inputs)
    batch = stage.before(params if params is not None else [{}] * len(requests), verdict)
    routed = None
    if batch.route:
        out_name = sig.outputs[0].name
        got = embed(batch.fused["TEXT"]) if out_name == "EMB" else batch.fused["TEXT"].copy()
        served = ["t:1" if served_by is None else served_by] * len(batch.route)
        routed = Routed({out_name: got}, served, [None] * len(batch.route))
        stage.redact_outputs(batch, routed)
    stage.after(batch, routed)
    return batch, routed


# -- redaction -----------------------------------------------------------------------------------
def test_defaults_keep_todays_behaviour(repo):
    stage, cfg, _ = make(repo)
    assert stage.cache is None and not stage.audit.enabled and stage.quotas is None
    assert stage.needs_parameters  # tenancy is on: the tenant is read from the parameters
    batch, _ = serve(stage, cfg, [[b"hello"], [b"world"]])
    assert batch.route == [0, 1] and batch.sizes == [1, 1] and not batch.hits
    assert batch.cache_state == {}  # no cache: no lookup outcome ("off" to tracing and audit)


def test_model_sees_redacted_text(repo):
    stage, cfg, _ = make(repo)
    batch, _ = serve(stage, cfg, [[b"mail " + PII[0]], [b"no pii here"]], params=[{"tenant": "acme"}, {}])
    seen = batch.fused["TEXT"].reshape(-1)
    assert seen[0] == b"mail [EMAIL]" and seen[1] == b"no pii here"
    assert batch.redacted == {0}
    assert stage.metrics.total("redactions", type="EMAIL", tenant="acme", direction="input") == 1


def test_model_sees_original_and_pii_rows_bypass_the_cache(repo):
    stage, cfg, _ = make(repo, cache__enabled="true", redaction__model_sees_redacted="false")
    reqs = [[b"call " + PII[1]], [b"plain text"]]
    batch, _ = serve(stage, cfg, reqs)
    assert batch.fused["TEXT"].reshape(-1)[0] == b"call " + PII[1]  # the target sees the original
    assert batch.cache_state == {0: "bypass", 1: "miss"}
    batch, _ = serve(stage, cfg, reqs)
    assert batch.cache_state == {0: "bypass", 1: "hit"} and batch.route == [0]


def test_whole_batches_of_mixed_tenants_are_redacted(repo):
    stage, cfg, _ = make(repo)
    reqs = [[b"a " + PII[0], b"b " + PII[2]], [b"c " + PII[3]], [b"clean"]]
    params = [{"tenant": "x"}, {"tenant": "y"}, {"tenant": "x"}]
    batch, _ = serve(stage, cfg, reqs, params=params)
    seen = list(batch.fused["TEXT"].reshape(-1))
    assert seen == [b"a [EMAIL]", b"b [CREDIT_CARD]", b"c [IPV4]", b"clean"]
    assert stage.metrics.total("redactions", tenant="x") == 2 and stage.metrics.total("redactions", tenant="y") == 1


def test_text_outputs_are_redacted_before_response_and_cache(repo):
    stage, cfg, _ = make(repo, sig=ECHO, cache__enabled="true", redaction__model_sees_redacted="false",
                         redaction__redact_outputs="true")
    batch, routed = serve(stage, cfg, [[b"echo " + PII[0]], [b"fine"]], sig=ECHO)
    assert list(routed.outputs["OUT"].reshape(-1)) == [b"echo [EMAIL]", b"fine"]
    batch, _ = serve(stage, cfg, [[b"fine"]], sig=ECHO)
    assert batch.hits[0]["OUT"].reshape(-1)[0] == b"fine"


# -- tenants and quotas -----------------------------------------------------------------------------
def test_invalid_tenant_fails_only_its_request(repo):
    stage, cfg, _ = make(repo)
    batch, _ = serve(stage, cfg, [[b"a"], [b"b"], [b"c"]], params=[{"tenant": "ok"}, {"tenant": "bad id!"}, {}])
    assert isinstance(batch.errors[1], InvalidInput) and batch.errors[1].code == "INVALID_ARG"
    assert batch.route == [0, 2] and batch.tenants == ["ok", "", "default"]


def test_header_forwarded_by_triton_names_the_tenant(repo):
    stage, cfg, _ = make(repo)
    batch, _ = serve(stage, cfg, [[b"a"]], params=[{"X-Tenant-Id": "globex"}])
    assert batch.tenants == ["globex"]


def test_quota_refuses_with_unavailable_and_retry_advice(repo):
    stage, cfg, _ = make(repo, tenancy__quotas=json.dumps({"lim": {"rps": 1, "burst": 1}, "cap": {"max_in_flight": 1}}))
    batch, _ = serve(stage, cfg, [[b"a"], [b"b"], [b"c"], [b"d"], [b"e"]],
                     params=[{"tenant": "lim"}, {"tenant": "lim"}, {"tenant": "cap"}, {"tenant": "cap"}, {}])
    assert set(batch.errors) == {1, 3}
    for i in (1, 3):
        err = batch.errors[i]
        assert isinstance(err, QuotaExceeded) and err.code == "UNAVAILABLE" and "retry after" in str(err)
    assert batch.route == [0, 2, 4]
    assert stage.quotas.in_flight("cap") == 0  # released after the batch
    assert stage.metrics.total("quota_rejects", tenant="lim", reason="rate") == 1
    assert stage.metrics.total("quota_rejects", tenant="cap", reason="in_flight") == 1


def test_a_redis_state_url_makes_quotas_the_fleets_and_an_outage_is_counted(repo, tmp_path):
    from tests.conftest import REDIS_SERVER, RedisServer
    from tritonguard.privacy.tenancy.fleet import FleetQuotaManager
    from tritonguard.privacy.tenancy.quotas import SharedQuotaManager

    if not REDIS_SERVER:
        pytest.skip("redis-server is not installed")
    (repo / "g").mkdir(exist_ok=True)  # the host's buckets live beside the guard's state
    srv = RedisServer(tmp_path)
    srv.start()
    cfg = GuardConfig.from_parameters({**BASE, "tenancy.quotas": json.dumps({"lim": {"rps": 1, "burst": 2}})}, "g")
    stage = PrivacyStage(guard="g", target="t", signature=TEXT, output_names=["EMB"], config=cfg, repo=repo,
                         metrics=Metrics(), environ={**ENV, "TRITONGUARD_STATE_URL": srv.url})
    stage.attach(Router())
    try:
        assert isinstance(stage.quotas, FleetQuotaManager)
        assert isinstance(stage.quotas.local, SharedQuotaManager)  # what judges while Redis is away
        lim = [{"tenant": "lim"}] * 3
        batch, _ = serve(stage, cfg, [[b"a"], [b"b"], [b"c"]], params=lim)
        assert set(batch.errors) == {2} and isinstance(batch.errors[2], QuotaExceeded)
        assert stage.metrics.total("quota_degraded") == 0
        srv.stop()
        time.sleep(1.1)  # past the fleet's retry advice (its bucket was dry): Redis would be asked now
        batch, _ = serve(stage, cfg, [[b"a"], [b"b"], [b"c"]], params=lim)  # the host's own bucket: burst 2
        assert set(batch.errors) == {2} and isinstance(batch.errors[2], QuotaExceeded)
        assert stage.metrics.total("quota_degraded") == 3
    finally:
        stage.close()
        srv.stop()


# -- cache --------------------------------------------------------------------------------------------
def test_hit_only_when_every_row_hits_and_tenants_are_isolated(repo):
    stage, cfg, _ = make(repo, cache__enabled="true")
    a = [{"tenant": "a"}]
    first, routed = serve(stage, cfg, [[b"x", b"y"]], params=a)
    assert first.cache_state == {0: "miss"}
    again, _ = serve(stage, cfg, [[b"x", b"y"]], params=a)
    assert again.cache_state == {0: "hit"} and not again.route
    np.testing.assert_array_equal(again.hits[0]["EMB"], routed.outputs["EMB"])
    assert again.cache_label == "cache:t:1"
    partial, _ = serve(stage, cfg, [[b"x", b"z"]], params=a)
    assert partial.cache_state == {0: "miss"} and partial.route == [0]
    other, _ = serve(stage, cfg, [[b"x", b"y"]], params=[{"tenant": "b"}])
    assert other.cache_state == {0: "miss"}, "tenant b must never get tenant a's answer"
    assert stage.metrics.total("cache", tier="l1", result="hit", tenant="a") == 3  # x, y, then x
    assert stage.metrics.total("cache", tier="l1", result="miss", tenant="b") == 2


def test_only_the_primarys_answers_are_cached(repo):
    stage, cfg, _ = make(repo, cache__enabled="true")
    for served in ("t:2", "default", ""):
        serve(stage, cfg, [[b"q"]], served_by=served)
        batch, _ = serve(stage, cfg, [[b"q"]], served_by=served)
        assert batch.cache_state == {0: "miss"}, served
    serve(stage, cfg, [[b"q"]])
    assert serve(stage, cfg, [[b"q"]])[0].cache_state == {0: "hit"}


def test_a_candidates_share_skips_the_cache_so_repeated_inputs_still_reach_it(repo):
    from tritonguard.rollout.state import Candidate, RolloutState

    stage, cfg, router = make(repo, cache__enabled="true")
    reqs = [[f"q{i}".encode()] for i in range(400)]
    serve(stage, cfg, reqs)  # every answer is the primary's, cached
    assert serve(stage, cfg, reqs)[0].cache_state == {i: "hit" for i in range(400)}
    router.state = RolloutState(model="g", primary=1, candidate=Candidate(2, 0.25))
    batch, _ = serve(stage, cfg, reqs)
    tested = [i for i, s in batch.cache_state.items() if s == "bypass"]
    # the candidate's band (a quarter) goes on to the router, with the draws it routes by
    assert 60 < len(tested) < 140 and batch.route == tested, len(tested)
    assert batch.draws is not None and (batch.draws[tested] < 0.25).all()
    assert all(batch.draws[i] >= 0.25 for i, s in batch.cache_state.items() if s == "hit")


def test_a_new_primary_never_serves_an_old_answer(repo):
    stage, cfg, router = make(repo, cache__enabled="true")
    serve(stage, cfg, [[b"q"]])
    assert serve(stage, cfg, [[b"q"]])[0].cache_state == {0: "hit"}
    router._primary = 2
    batch, _ = serve(stage, cfg, [[b"q"]], served_by="t:2")
    assert batch.cache_state == {0: "miss"} and batch.primary_label == "t:2"
    assert serve(stage, cfg, [[b"q"]], served_by="t:2")[0].cache_state == {0: "hit"}


def test_no_manifest_sha_no_cache(repo):
    stage, cfg, router = make(repo, cache__enabled="true")
    router._primary = 7  # no manifest.json for v7
    serve(stage, cfg, [[b"q"]], served_by="t:7")
    assert serve(stage, cfg, [[b"q"]], served_by="t:7")[0].cache_state == {}  # not looked up: "off"


def test_hashes_only_caches_nothing(repo):
    stage, cfg, _ = make(repo, cache__enabled="true", cache__privacy="hashes_only")
    assert stage.cache is None
    serve(stage, cfg, [[b"q"]])
    assert serve(stage, cfg, [[b"q"]])[0].cache_state == {}  # not looked up: "off"


def test_persisted_l2_holds_no_plaintext(repo, tmp_path):
    db = tmp_path / "l2.sqlite"
    stage, cfg, _ = make(repo, cache__enabled="true", cache__privacy="persisted_encrypted",
                         cache__l2_path=str(db), cache__l1_entries="0")
    reqs = [[b"contact " + p] for p in PII]
    _, routed = serve(stage, cfg, reqs)
    batch, _ = serve(stage, cfg, reqs)
    assert set(batch.cache_state.values()) == {"hit"}  # from L2 (L1 is off)
    assert stage.metrics.total("cache", tier="l2", result="hit") == len(PII)
    stage.close()
    blob = b"".join(p.read_bytes() for p in tmp_path.glob("l2.sqlite*"))
    for p in PII:
        assert p not in blob
    for row in routed.outputs["EMB"]:
        assert row.tobytes() not in blob


# -- audit -------------------------------------------------------------------------------------------
def test_audit_records_hashes_only_and_verifies(repo, tmp_path):
    path = tmp_path / "audit.jsonl"
    stage, cfg, router = make(repo, audit=str(path), cache__enabled="true")
    serve(stage, cfg, [[b"mail " + PII[0]], [b"x" * 5000]], params=[{"tenant": "acme"}, {"tenant": "acme"}])
    serve(stage, cfg, [[b"mail " + PII[0]]], params=[{"tenant": "acme"}])
    router.state.revision = 2
    serve(stage, cfg, [[b"other"]])
    stage.close()
    raw = path.read_bytes()
    for p in PII:
        assert p not in raw
    assert b"mail" not in raw
    records = [json.loads(line) for line in raw.splitlines()]
    types = [r["type"] for r in records]
    assert types[0] == "guard_start" and types[-1] == "guard_stop"
    assert "reject" in types and "state_change" in types
    inf = [r for r in records if r["type"] == "inference"]
    assert [r["cache"] for r in inf] == ["miss", "hit", "miss"]
    assert inf[0]["request"] == inf[1]["request"] and len(inf[0]["request"]) == 64
    assert inf[0]["tenant"] == "acme" and inf[0]["redacted"] is True and inf[1]["served_by"] == "cache:t:1"
    assert verify(path).ok

    runner = CliRunner()
    ok = runner.invoke(app, ["audit", "verify", str(path)])
    assert ok.exit_code == 0, ok.output
    lines = raw.splitlines()
    for n in range(len(lines)):  # editing any record is detected, and named
        rec = json.loads(lines[n])
        rec["tenant"] = "mallory"
        edited = lines[:n] + [json.dumps(rec).encode()] + lines[n + 1:]
        path.write_bytes(b"\n".join(edited) + b"\n")
        res = runner.invoke(app, ["audit", "verify", str(path)])
        assert res.exit_code == 1, (n, res.output)
        assert f"#{n}" in res.output
    assert runner.invoke(app, ["audit", "verify", str(tmp_path / "none.jsonl")]).exit_code == 2


def test_audited_metrics_record_safety_events(tmp_path):
    from tritonguard.privacy.audit.log import AuditConfig, AuditLog

    log = AuditLog(AuditConfig(path=str(tmp_path / "a.jsonl"), flush_interval_ms=0))
    inner = Metrics()
    m = AuditedMetrics(inner, log, "g")
    m.inc("goldens", 1, target_version="2", verdict="PASS")
    m.inc("trips", 1, target_version="2", reason="error_rate")
    m.inc("fallbacks", 3, reason="error")
    m.inc("requests", 5)
    m.set("breaker_state", 0, target_version="1")
    m.set("breaker_state", 2, target_version="2")
    m.set("breaker_state", 2, target_version="2")
    m.set("breaker_state", 0, target_version="2")
    log.close()
    recs = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["type"] for r in recs] == ["golden", "breaker_trip", "fallback", "breaker_state", "breaker_state"]
    assert [r.get("state") for r in recs[3:]] == ["open", "closed"]
    assert inner.total("requests") == 5 and inner.total("trips") == 1


def test_audit_file_per_instance():
    assert audit_file("", model="m", instance="m_0", instances=2) == ""
    assert audit_file("/a/{model}.{instance}.jsonl", model="m", instance="m_0", instances=2) == "/a/m.m_0.jsonl"
    assert audit_file("/a/audit.jsonl", model="m", instance="m_1", instances=2) == "/a/audit.jsonl.m_1"
    assert audit_file("/a/audit.jsonl", model="m", instance="m_0", instances=1) == "/a/audit.jsonl"


# -- startup security check --------------------------------------------------------------------------
def findings(params, sig=TEXT, environ=None, instances=1):
    p = {"target": "t", **params}
    cfg = GuardConfig.from_parameters(p, "g")
    return security_findings(cfg, sig, p, instances=instances, environ=environ or {})


def test_security_hard_failures():
    fs = findings({"cache.enabled": "true", "cache.privacy": "persisted_encrypted", "cache.l2_path": "/tmp/x"})
    errors = [f.message for f in fs if f.level == "error"]
    assert len(errors) == 2
    assert any("validation.max_bytes_length" in e for e in errors)
    assert any("TRITONGUARD_L2_ENCRYPTION_KEY" in e for e in errors)
    with pytest.raises(ConfigError, match="refused by the startup security check.*max_bytes_length.*encryption key"):
        enforce_security("g", fs)
    ok = findings({"validation.max_bytes_length": "100", "cache.enabled": "true",
                   "cache.privacy": "persisted_encrypted", "cache.l2_path": "/tmp/x"}, environ=ENV)
    assert not [f for f in ok if f.level == "error"]


def test_security_warnings(caplog):
    fs = findings({"validation.max_bytes_length": "100", "tenancy.enabled": "false", "redaction.enabled": "false",
                   "routing.golden_check": "false", "validation.allow_non_finite": "true",
                   "tenancy.quotas": '{"a": {"rps": 1}}'}, instances=2)
    text = " | ".join(f.message for f in fs)
    assert all(f.level == "warning" for f in fs)
    for frag in ("tenant isolation is off", "redaction is off", "golden_check", "allow_non_finite",
                 "max_payload_bytes is not set"):
        assert frag in text, frag
    assert "per instance" not in text  # quotas are shared by the instances (SharedQuotaManager)
    with caplog.at_level("WARNING"):
        enforce_security("g", fs)
    assert "tenant isolation is off" in caplog.text
    digits = ModelSignature(inputs=(TensorSpec("IMAGE", np.dtype(np.float32), (8, 8)),),
                            outputs=(TensorSpec("PROBS", np.dtype(np.float32), (10,)),), max_batch_size=64)
    assert not [f for f in findings({"validation.max_payload_bytes": "1000"}, sig=digits)]


def test_guard_config_has_the_new_sections():
    cfg = GuardConfig.from_parameters({"target": "t", "cache.enabled": "true", "audit.path": "/x",
                                       "tenancy.default": "anon", "redaction.pattern.EMP": r"EMP-\d{6}"}, "g")
    assert cfg.cache.enabled and cfg.audit.path == "/x" and cfg.tenancy.default == "anon"
    assert cfg.redaction.pattern == {"EMP": r"EMP-\d{6}"}
    with pytest.raises(ConfigError, match="'cache.enabld'"):
        GuardConfig.from_parameters({"target": "t", "cache.enabld": "true"}, "g")



def test_key_prefix_memo_and_canonical_params_give_the_same_keys():
    from tritonguard.privacy.cache.keys import canonical_params, row_keys

    x = {"TEXT": np.array([[b"a"], [b"b"]], dtype=object)}
    params = {"placement": "bls", "runtime": {"threads": "2"}}
    first = row_keys("t1", "g", "aa" * 32, x, ["EMB"], params)
    assert row_keys("t1", "g", "aa" * 32, x, ["EMB"], canonical_params(params)) == first
    assert row_keys("t1", "g", "aa" * 32, x, ["EMB"], params) == first  # memoised prefix
    assert row_keys("t2", "g", "aa" * 32, x, ["EMB"], params)[0] != first[0]
    assert row_keys("t1", "g", "bb" * 32, x, ["EMB"], params)[0] != first[0]
    assert row_keys("t1", "g", "aa" * 32, x, ["EMB"], {**params, "placement": "inprocess"})[0] != first[0]
