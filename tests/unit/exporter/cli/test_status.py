"""What the rollout commands show and record: state transitions at their source (route, rollback),
the registry following the routing's primary, gate and golden verdicts with figures against their
limits, and `rollout status --server`. Real rollout state files, a real MLflow sqlite registry
beside the repository (as `exporter` uses it), the real CLI."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest
from typer.testing import CliRunner

from exporter.cli.app import app
from exporter.records.registry import Registry, default_uri
from exporter.rollout.controller import RolloutController
from exporter.rollout.gates.config import GateConfig
from exporter.rollout.gates.evaluate import evaluate
from exporter.rollout.gates.readings import GuardReadings
from exporter.rollout.gates.reasons import golden_reason, trip_reason
from exporter.rollout.progress import DONE, ROLLED_BACK, SUPERSEDED, RolloutConfig
from exporter.rollout.reconcile import reconcile_registry
from exporter.rollout.route import RouteChange, RouteError, apply, show
from tritonguard.core.repository import write_config
from tritonguard.rollout.stores import open_store
from tritonguard.rollout.validators import ValidatorConfig

MODEL = "m"
GUARD = {"name": MODEL, "backend": "guard", "max_batch_size": 4,
         "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],
         "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}],
         "parameters": {"target": {"string_value": "m_raw"}}}
SHA = {v: f"{v:02d}" * 32 for v in range(1, 6)}
runner = CliRunner()


def _manifest(v: int) -> dict:
    return {"sha256": SHA[v], "task": "classifier", "created": "2026-01-01T00:00:00+00:00",
            "golden": {"verdict": "PASS", "metrics": {"top1_agreement": 1.0}, "n": 8}}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    repo = tmp_path / "model_repository"
    write_config(repo / MODEL, GUARD)
    for v in (1, 2, 3):
        (repo / "m_raw" / str(v)).mkdir(parents=True)
        (repo / "m_raw" / str(v) / "manifest.json").write_text(json.dumps(_manifest(v)))
    return repo


def registry(repo) -> Registry:
    return Registry(default_uri(repo))


def cli(*args: str):
    res = runner.invoke(app, list(args))
    return res


def history(repo) -> list[dict]:
    return registry(repo).history(MODEL)


# -- 1. stale views ---------------------------------------------------------------------------
def test_clearing_the_candidate_clears_its_shadow_and_share(repo):
    apply(repo, MODEL, RouteChange(primary=1))
    st = apply(repo, MODEL, RouteChange(candidate=2, share=0.1, shadow=0.1))
    assert st.candidate.share == 0.1 and st.shadow_share == 0.1
    res = cli("route", MODEL, "-r", str(repo), "--candidate", "0")
    assert res.exit_code == 0, res.output
    assert "no candidate, shadow 0%" in res.stdout, res.stdout
    d = json.loads(cli("route", MODEL, "-r", str(repo), "--json").stdout)
    assert d["candidate"] is None and d["shadow_share"] == 0.0
    # the candidate promoted to primary takes its shadow with it too
    apply(repo, MODEL, RouteChange(candidate=2, share=0.2, shadow=0.3))
    st = apply(repo, MODEL, RouteChange(primary=2))
    assert st.candidate is None and st.shadow_share == 0.0


def test_shadow_needs_a_candidate_and_a_new_candidate_starts_from_nothing(repo):
    apply(repo, MODEL, RouteChange(primary=1))
    with pytest.raises(RouteError, match="--shadow needs a candidate"):
        apply(repo, MODEL, RouteChange(shadow=0.2))
    assert apply(repo, MODEL, RouteChange(shadow=0.0)).shadow_share == 0.0  # 0 is always fine
    apply(repo, MODEL, RouteChange(candidate=2, share=0.1, shadow=0.2))
    st = apply(repo, MODEL, RouteChange(candidate=2, shadow=0.3))  # same candidate: share kept
    assert (st.candidate.version, st.candidate.share, st.shadow_share) == (2, 0.1, 0.3)
    st = apply(repo, MODEL, RouteChange(candidate=3))  # another candidate: no share, no shadow
    assert (st.candidate.version, st.candidate.share, st.shadow_share) == (3, 0.0, 0.0)


def test_route_show_lists_the_breaker_of_every_named_version(repo):
    apply(repo, MODEL, RouteChange(primary=1))
    apply(repo, MODEL, RouteChange(primary=2))  # v1 becomes previous_primary
    apply(repo, MODEL, RouteChange(candidate=3, share=0.1))
    store = open_store(MODEL, repo)
    trip = {"reason": "error_rate", "figures": {"rate": 0.12, "count": 24, "window": 200, "limit": 0.05}, "at": 5.0}
    store.update_breaker(3, lambda _old: {"state": "open", "trips": 1, "last_trip": trip, "changed_at": 5.0})
    d = show(repo, MODEL)
    assert set(d["breakers"]) == {"1", "2", "3"}, d["breakers"]
    assert d["breakers"]["2"] == {"state": "closed", "trips": 0, "last_trip": None, "shared": False}
    assert d["breakers"]["3"]["state"] == "open" and d["breakers"]["3"]["trips"] == 1
    assert d["breakers"]["3"]["last_trip_text"] == "error_rate: error rate 12.0% (24/200) > 5.0%"
    res = cli("route", MODEL, "-r", str(repo))
    assert res.exit_code == 0, res.output
    for line in ("breaker v1: closed (trips 0)", "breaker v2: closed (trips 0)", "breaker v3: open (trips 1; last trip error_rate: error rate 12.0% (24/200) > 5.0%)"):
        assert line in res.stdout, res.stdout


def _finished_rollout(repo, candidate: int, primary: int) -> RolloutController:
    """A rollout of ``candidate`` over ``primary`` that went through every step: done, promoted."""
    ctl = RolloutController(MODEL, repo, reader=None, config=RolloutConfig(steps=(100,)))
    ctl.start(candidate, primary=primary)
    p = ctl.status()
    p.status, p.reason = DONE, "promoted"
    ctl._save(p)
    open_store(MODEL, repo).update(lambda s: setattr(s, "candidate", None) or setattr(s, "primary", candidate) or s)
    return ctl


def test_route_primary_away_from_a_promoted_version_supersedes_its_rollout(repo):
    apply(repo, MODEL, RouteChange(primary=1))
    ctl = _finished_rollout(repo, 2, 1)
    apply(repo, MODEL, RouteChange(fallback=["primary"]))  # no routing of versions: nothing to settle
    assert ctl.status().status == DONE
    apply(repo, MODEL, RouteChange(primary=3))
    p = ctl.status()
    assert p.status == SUPERSEDED and p.reason == "promoted; then routing changed by cli", p.reason
    res = cli("rollout", "status", MODEL, "-r", str(repo))
    assert "v2 (split) superseded" in res.stdout, res.stdout


def test_rollback_after_a_promotion_says_so_in_status_and_registry(repo):
    reg = registry(repo)
    for v in (1, 2):
        reg.register(MODEL, v, _manifest(v), {}, source=str(repo / "m_raw" / str(v)))
    reg.transition(MODEL, 1, "PRODUCTION", "DRAFT", reason="first")
    reg.transition(MODEL, 2, "STAGING", "DRAFT")
    reg.transition(MODEL, 2, "PRODUCTION", "STAGING", reason="rollout gates passed")
    apply(repo, MODEL, RouteChange(primary=1))
    ctl = _finished_rollout(repo, 2, 1)

    res = cli("rollback", MODEL, "-r", str(repo), "--reason", "bad answers")
    assert res.exit_code == 0, res.output
    assert "v1 is primary and PRODUCTION again" in res.stdout
    p = ctl.status()
    assert p.status == ROLLED_BACK, p
    assert "rolled back to v1 by `exporter rollback` (bad answers)" in p.reason
    st = json.loads(cli("status", "-r", str(repo), "--json").stdout)
    g = next(x for x in st["guards"] if x["model"] == MODEL)
    assert g["rollout"]["status"] == "rolled_back" and g["state"]["primary"]["version"] == 1
    assert {int(k): s for k, s in g["stages"].items()} == {1: "PRODUCTION", 2: "ARCHIVED"}
    res = cli("rollout", "status", MODEL, "-r", str(repo))
    assert "v2 (split) rolled_back" in res.stdout and "promoted; then rolled back to v1" in res.stdout, res.stdout


# -- 2. the registry follows the routing ------------------------------------------------------
def test_reads_change_nothing_and_say_when_the_registry_disagrees(repo):
    reg = registry(repo)
    reg.register(MODEL, 1, _manifest(1), {}, source=str(repo / "m_raw" / "1"))  # what export does: DRAFT
    open_store(MODEL, repo).update(lambda s: setattr(s, "primary", 1) or s)  # what a guard's first load does
    assert reg.stage(MODEL, 1) == "DRAFT"
    n = len(history(repo))
    # every read leaves the registry as it was
    for args in (("route", MODEL), ("status",), ("status", "--json"), ("rollout", "status", MODEL)):
        res = cli(*args, "-r", str(repo))
        assert res.exit_code == 0, (args, res.output)
        assert "reconciled" not in res.output and reg.stage(MODEL, 1) == "DRAFT", (args, res.output)
    assert len(history(repo)) == n
    # status says they disagree, and how to record what serves
    res = cli("status", "-r", str(repo))
    assert "the registry says PRODUCTION no version, the routing serves v1" in " ".join(res.output.split()), res.output
    doc = json.loads(cli("status", "--json", "-r", str(repo)).stdout)
    assert "`exporter reconcile m`" in doc["guards"][0]["registry_disagrees"]
    # the explicit command records it; a second run changes nothing
    res = cli("reconcile", MODEL, "-r", str(repo))
    assert res.exit_code == 0 and "now PRODUCTION" in res.output, res.output
    assert reg.stage(MODEL, 1) == "PRODUCTION" and reg.production(MODEL) == 1
    rec = history(repo)[-1]
    assert rec["reconcile"] is True and rec["from"] == "DRAFT" and rec["to"] == "PRODUCTION"
    n = len(history(repo))
    res = cli("reconcile", "-r", str(repo))  # every guard
    assert res.exit_code == 0 and "registry already agrees" in res.output, res.output
    assert json.loads(cli("status", "--json", "-r", str(repo)).stdout)["guards"][0]["registry_disagrees"] is None
    assert len(history(repo)) == n
    # a primary changed by hand: registered from its manifest if needed, PRODUCTION; v1 ARCHIVED
    res = cli("route", MODEL, "-r", str(repo), "--primary", "3")
    assert res.exit_code == 0, res.output
    assert reg.stage(MODEL, 3) == "PRODUCTION" and reg.stage(MODEL, 1) == "ARCHIVED"
    assert reg.production(MODEL) == 3 and reg.previous_production(MODEL) == 1
    assert registry(repo).verify_history().ok


def test_reconcile_repairs_a_stale_production_tag(repo):
    reg = registry(repo)
    for v in (1, 2):
        reg.register(MODEL, v, _manifest(v), {})
    reg.transition(MODEL, 1, "PRODUCTION", "DRAFT")
    mv2 = reg.get(MODEL, 2).mlflow_version
    reg.client.set_model_version_tag(MODEL, mv2, "tritonguard.stage", "PRODUCTION")  # a crash's leftover
    assert reconcile_registry(repo, MODEL, primary=1) is not None
    assert reg.stage(MODEL, 2) == "ARCHIVED" and reg.stage(MODEL, 1) == "PRODUCTION"
    assert reconcile_registry(repo, MODEL, primary=1) is None


def test_reconcile_registers_a_primary_served_at_a_url(repo):
    """A version declared at a URL (endpoints.json, issue 42 item 4) has no folder: made the
    primary by hand (`route --primary`), it is registered from its declaration and made
    PRODUCTION. It stayed unregistered (no manifest to register) before."""
    from tritonguard.rollout.endpoints import Endpoint, declare

    endpoint = Endpoint(version=7, url="http://127.0.0.1:9/v1", model="tiny")
    declare(repo / "m_raw", endpoint)
    reg = registry(repo)
    reg.register(MODEL, 1, _manifest(1), {})
    reg.transition(MODEL, 1, "PRODUCTION", "DRAFT")
    assert reconcile_registry(repo, MODEL, primary=7) is not None
    assert reg.stage(MODEL, 7) == "PRODUCTION" and reg.stage(MODEL, 1) == "ARCHIVED"
    assert reg.get(MODEL, 7).sha256 == endpoint.manifest("m_raw")["sha256"]  # the URL's, not a file's


def test_reconcile_waits_while_a_rollout_runs_and_reads_create_no_registry(repo):
    apply(repo, MODEL, RouteChange(primary=1))
    db = repo.parent / "model_repository.registry" / "mlflow.db"
    assert cli("route", MODEL, "-r", str(repo)).exit_code == 0
    assert not db.exists(), "a read created a registry"
    reg = registry(repo)
    reg.register(MODEL, 1, _manifest(1), {})
    RolloutController(MODEL, repo, reader=None, config=RolloutConfig(steps=(50, 100))).start(2, primary=1)
    assert reconcile_registry(repo, MODEL) is None and reg.stage(MODEL, 1) == "DRAFT"  # the controller's to move


def test_unreachable_registry_warns_and_the_command_goes_on(repo, monkeypatch):
    apply(repo, MODEL, RouteChange(primary=1))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    said: list[str] = []
    assert reconcile_registry(repo, MODEL, warn=said.append, timeout=30) is None
    assert len(said) == 1 and "could not make 'm' v1 (the primary) PRODUCTION" in said[0], said
    res = cli("route", MODEL, "-r", str(repo))
    assert res.exit_code == 0 and "primary v1" in res.stdout, res.output


def test_promote_registers_and_reconciles_the_unregistered_primary(repo):
    apply(repo, MODEL, RouteChange(primary=1))  # exported with --no-register: the registry knows nothing
    res = cli("promote", MODEL, "--version", "2", "--to", "staging", "-r", str(repo))
    assert res.exit_code == 0, res.output
    reg = registry(repo)
    assert reg.stage(MODEL, 1) == "PRODUCTION" and reg.stage(MODEL, 2) == "STAGING"
    res = cli("promote", MODEL, "--version", "2", "--no-rollout", "-r", str(repo))
    assert res.exit_code == 0, res.output
    assert reg.production(MODEL) == 2 and reg.stage(MODEL, 1) == "ARCHIVED"


def test_promote_of_a_version_that_does_not_exist_names_the_model_and_lists_its_versions(repo):
    (repo / "m_raw" / "4").mkdir()  # a folder without a manifest: not an exported version
    res = cli("promote", MODEL, "--version", "9", "--to", "staging", "-r", str(repo))
    assert res.exit_code == 2, res.output
    flat = " ".join(res.output.split())
    assert f"'{MODEL}' has no version v9" in flat and "does not exist" in flat, res.output
    assert f"exported versions of '{MODEL}' (its model 'm_raw'): v1, v2, v3" in flat, res.output
    res = cli("promote", MODEL, "--version", "4", "--to", "staging", "-r", str(repo))
    assert res.exit_code == 2 and "has a folder but no manifest" in " ".join(res.output.split()), res.output
    assert not (repo.parent / "model_repository.registry").exists()  # refused before anything was written


# -- 3. verdicts with the figure and its limit -------------------------------------------------
def test_golden_reason_names_the_figure_and_the_limit():
    fail = {"verdict": "FAIL", "metrics": {"PROBS": {"rows": 64, "agreement": 1.0, "max_abs_diff": 0.031,
                                                     "atol": 0.0001}}}
    assert golden_reason(fail) == "goldens FAIL: PROBS: max_abs_diff 0.031 > 0.001 (10 x atol 0.0001)"
    row = {"verdict": "FAIL", "metrics": {"PROBS": {"rows": 64, "agreement": 1.0, "max_abs_diff": 1e-6, "atol": 1e-4},
                                          "PROBS at batch 1 (row 0)": {"rows": 1, "agreement": 0.0,
                                                                       "max_abs_diff": 0.5, "atol": 1e-4}}}
    assert golden_reason(row) == ("goldens FAIL: PROBS at batch 1 (row 0): top-1 agreement 0 < 1 (every row must "
                                  "agree), max_abs_diff 0.5 > 0.001 (10 x atol 0.0001)")
    emb = {"verdict": "FAIL", "metrics": {"EMB": {"rows": 8, "min_cosine": 0.95, "mean_cosine": 0.99}}}
    assert golden_reason(emb, ValidatorConfig(workload="embedding", cosine_marginal=0.98)) == \
        "goldens FAIL: EMB: min_cosine 0.95 < 0.98"
    reg = {"verdict": "MARGINAL", "metrics": {"Y": {"rows": 8, "max_abs_diff": 0.0005, "max_tolerance_ratio": 2.5,
                                                    "atol": 1e-4, "rtol": 1e-4}}}
    assert "is 2.5 x the tolerance (atol 0.0001 + rtol 0.0001 x |ref|), MARGINAL up to 10 x" in golden_reason(reg)
    err = {"verdict": "FAIL", "metrics": {"error": "batch 4: RuntimeError: boom"}}
    assert golden_reason(err) == "goldens FAIL: error at batch 4: RuntimeError: boom"
    ok = {"verdict": "PASS", "metrics": {"PROBS": {"rows": 64, "agreement": 1.0, "max_abs_diff": 2e-7, "atol": 1e-4}}}
    assert golden_reason(ok) == "goldens PASS: PROBS: top-1 agreement 1, max_abs_diff 2e-07 <= atol 0.0001"


def test_gate_reasons_give_the_measured_figure_against_the_limit():
    before = GuardReadings(model=MODEL, primary=1, candidate=2, served={1: 0, 2: 0}, errors={2: 0},
                           compared={"canary": {"PASS": 0, "FAIL": 0}}, breaker_state=0, replicas=1)
    after = GuardReadings(model=MODEL, primary=1, candidate=2, served={1: 900, 2: 270}, errors={2: 30},
                          compared={"canary": {"PASS": 240, "FAIL": 60}}, breaker_state=2, trips=1, replicas=1)
    rep = evaluate(before, after, GateConfig(latency=False))
    reasons = {g.name: g.reason for g in rep.gates}
    assert reasons["error_rate"].startswith("error rate 10.00% (30/300) > limit 1.00% (SPRT"), reasons
    assert reasons["agreement"].startswith("agreement 80.00% (240/300) < limit 98.00% (SPRT"), reasons
    assert reasons["breaker"] == "breaker open, 1 trip in the window (limit: closed, 0 trips)", reasons
    assert trip_reason({"reason": "latency", "figures": {"p95_ms": 41.2, "window": 200, "budget_ms": 20.0}}) == \
        "latency: p95 41.2 ms > budget 20 ms"
    assert trip_reason({"reason": "drift", "figures": {"fail_share_ewma": 0.31, "limit": 0.2, "kind": "canary"}}) == \
        "drift: FAIL share EWMA 0.31 > 0.2 (canary rows)"


def _guarded_text_repo(repo):
    """The text layout: public ensemble m = m_intake -> m_guard, guard settings in m_guard."""
    write_config(repo / MODEL, {"name": MODEL, "platform": "ensemble", "max_batch_size": 4,
                                "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
                                "output": [{"name": "EMB", "data_type": "TYPE_FP32", "dims": [4]}],
                                "ensemble_scheduling": {"step": [
                                    {"model_name": "m_intake", "model_version": -1},
                                    {"model_name": "m_guard", "model_version": -1}]}})
    write_config(repo / "m_guard", {**GUARD, "name": "m_guard", "parameters": {
        "target": {"string_value": "m_raw"}, "serves_as": {"string_value": MODEL},
        "validator.workload": {"string_value": "embedding"},
        "validator.cosine_marginal": {"string_value": "0.97"}}})


def test_show_and_controller_render_goldens_against_the_guards_limits(repo):
    _guarded_text_repo(repo)
    apply(repo, MODEL, RouteChange(primary=1))
    bad = {"verdict": "FAIL", "metrics": {"EMB": {"rows": 8, "min_cosine": 0.9, "mean_cosine": 0.95}},
           "checked_at": 1.0}
    ctl = RolloutController(MODEL, repo, reader=lambda p, c: GuardReadings(model=MODEL, primary=p, candidate=c),
                            config=RolloutConfig(steps=(10, 100)))
    ctl.start(2, primary=1)
    open_store(MODEL, repo).update(lambda s: s.goldens.__setitem__("2", bad) or s)
    d = show(repo, MODEL)
    assert d["goldens"]["2"]["summary"] == "goldens FAIL: EMB: min_cosine 0.9 < 0.97"  # m_guard's limit
    p = ctl.tick()
    assert p.status == ROLLED_BACK and p.reason == "goldens FAIL: EMB: min_cosine 0.9 < 0.97 (on the server, at 10%)"


def test_a_failing_breaker_gate_says_why_the_breaker_tripped(repo):
    apply(repo, MODEL, RouteChange(primary=1))
    served = {"n": 0}

    def reader(p, c):
        served["n"] += 100
        return GuardReadings(model=MODEL, primary=p, candidate=c, served={p: served["n"], c: served["n"] // 10},
                             errors={c: 0}, breaker_state=2, replicas=1)

    ctl = RolloutController(MODEL, repo, reader, config=RolloutConfig(steps=(10, 100), dwell_s=0))
    ctl.start(2, primary=1)
    trip = {"reason": "non_finite", "figures": {"rate": 0.05, "count": 10, "window": 200, "limit": 0.0}, "at": 1.0}
    open_store(MODEL, repo).update_breaker(2, lambda _o: {"state": "open", "trips": 1, "last_trip": trip,
                                                          "changed_at": 1.0})
    ctl.tick()  # baseline
    p = ctl.tick()
    assert p.status == ROLLED_BACK
    assert "breaker FAIL (breaker open, 0 trips in the window (limit: closed, 0 trips); last trip non_finite: " \
           "NaN/Inf rate 5.0% (10/200) > 0.0%)" in p.reason, p.reason


# -- 4. rollout status --server -----------------------------------------------------------------
class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _exposition(served1: int, served2: int, errors2: int) -> bytes:
    return (f'tritonguard_served_total{{model="m",served_by="m_raw:1"}} {served1}\n'
            f'tritonguard_served_total{{model="m",served_by="m_raw:2"}} {served2}\n'
            f'tritonguard_target_errors_total{{model="m",target_version="2"}} {errors2}\n'
            'tritonguard_breaker_state{model="m",target_version="2"} 0\n').encode()


def test_rollout_status_server_shows_the_gates_as_of_now_and_changes_nothing(repo, metrics_server):
    apply(repo, MODEL, RouteChange(primary=1))
    port = metrics_server.server_address[1]
    url = f"http://127.0.0.1:{port}/metrics"
    _Metrics.body = _exposition(100, 10, 0)
    from exporter.rollout.window import metrics_reader

    ctl = RolloutController(MODEL, repo, metrics_reader([url], MODEL, target="m_raw"),
                            config=RolloutConfig(steps=(10, 100)))
    ctl.start(2, primary=1)
    ctl.tick()  # the driver's first look: the baseline
    before = ctl.status().to_dict()
    _Metrics.body = _exposition(1000, 400, 40)
    # --server means what it means for `rollout resume`: the replica's HTTP URL, metrics on port + 2
    res = cli("rollout", "status", MODEL, "-r", str(repo), "--server", f"127.0.0.1:{port - 2}")
    assert res.exit_code == 0, res.output
    assert "live v2: FAIL now (not recorded; the driver decides)" in res.stdout, res.stdout
    assert "error rate 9.30% (40/430) > limit 1.00%" in res.stdout, res.stdout
    doc = json.loads(cli("rollout", "status", MODEL, "-r", str(repo), "--metrics-url", url, "--json").stdout)
    assert doc["live"]["windows"]["2"]["report"]["verdict"] == "FAIL"
    assert ctl.status().to_dict() == before, "status --server changed the rollout"
    # an unreachable replica is said, not raised
    res = cli("rollout", "status", MODEL, "-r", str(repo), "--metrics-url", "http://127.0.0.1:1/metrics")
    assert res.exit_code == 0 and "live: metrics unavailable" in res.stdout, res.output


# -- versions served at a URL (issue 42 item 4) ---------------------------------------------------
def test_status_lists_versions_served_at_a_url_with_their_judge_and_never_a_key(repo, tmp_path, monkeypatch):
    """`exporter status` lists a version declared in endpoints.json among the folder versions: its
    URL, model name, judge and where the guard reads its key (the variable's name), and never the
    key itself nor a key file's contents."""
    from tritonguard.rollout.endpoints import Endpoint, declare

    write_config(repo / "m_raw", {"name": "m_raw", "backend": "python", "max_batch_size": 4,
                                  "input": GUARD["input"], "output": GUARD["output"]})
    secret, in_file = "sk-live-0123456789abcdef", "sk-file-fedcba9876543210"
    monkeypatch.setenv("VLLM_API_KEY", secret)
    key_file = tmp_path / "key.txt"
    key_file.write_text(in_file)
    declare(repo / "m_raw", Endpoint(version=7, url="http://10.0.0.5:8000/v1", model="tiny-gpt2",
                                     api_key_env="VLLM_API_KEY"))
    declare(repo / "m_raw", Endpoint(version=8, url="https://llm.example:9443/v1", api_key_file=str(key_file),
                                     judge="equivalence"))
    res = cli("status", "-r", str(repo))
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "at http://10.0.0.5:8000/v1 (tiny-gpt2)" in text and "judge task, key $VLLM_API_KEY" in text, res.output
    assert "at https://llm.example:9443/v1 (m_raw)" in text and "judge equivalence, key from a file" in text
    doc = json.loads(cli("status", "--json", "-r", str(repo)).stdout)
    raw = next(m for m in doc["models"] if m["name"] == "m_raw")
    assert [v["version"] for v in raw["versions"]] == [1, 2, 3, 7, 8]
    assert raw["versions"][3]["endpoint"] == {"url": "http://10.0.0.5:8000/v1", "model": "tiny-gpt2",
                                              "judge": "task", "api_key_env": "VLLM_API_KEY"}
    assert raw["versions"][4]["endpoint"]["judge"] == "equivalence"
    for out in (res.output, json.dumps(doc)):
        assert secret not in out and in_file not in out
    # an unreadable declaration file is said, the folder versions still listed
    (repo / "m_raw" / "endpoints.json").write_text("{not json")
    res = cli("status", "-r", str(repo))
    assert res.exit_code == 0 and "not JSON" in res.output, res.output
    raw = next(m for m in json.loads(cli("status", "--json", "-r", str(repo)).stdout)["models"] if m["name"] == "m_raw")
    assert [v["version"] for v in raw["versions"]] == [1, 2, 3] and "not JSON" in raw["endpoints_error"]
