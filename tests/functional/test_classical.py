"""scikit-learn and XGBoost models served through the guard by a real tritonserver (issue 44
item 1): a StandardScaler + LogisticRegression pipeline (breast cancer) and an XGBClassifier
(iris), trained here, exported with ``python -m exporter export`` into a private repository,
answer through their guards exactly as the original models do; then a genuine retrain of the
pipeline (more data, another C) and of the booster (other trees) are promoted with ``python -m
exporter promote`` under live traffic, as tests/functional/test_promote.py does for digits, and a
slow build of the booster is rolled back by the latency gate, each with no client error.

One tritonserver start for the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import joblib
import numpy as np
import pytest
import tritonclient.http as httpclient
from sklearn.datasets import load_breast_cancer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from examples import boosters
from exporter.build.export import export_source
from tests.functional.test_promote import GATES, ROOT, cli, server_args
from tritonguard.core.repository import read_config, write_config
from tritonguard.ops.server import Server

# requests a second per client (four clients; a client behind its pace sends at once and is not
# owed the ones it missed). Flat out they sent ~700 a second alone: the module took 67 s and 104 s
# of CPU alone, against 53 s and 54 s at this pace, for the same verdicts (2026-12-01)
RATE = 25.0

pytestmark = pytest.mark.functional
pytest.importorskip("xgboost")


def export_cli(repo, source, name, goldens) -> None:
    r = subprocess.run([sys.executable, "-m", "exporter", "export", "--source", str(source), "--name", name,
                        "--repository", str(repo), "--inputs", str(goldens), "--no-register"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    base = tmp_path_factory.mktemp("classical")
    repo = base / "repo"
    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(1).permutation(len(x))
    x, y = x[order], y[order]
    gold = x[450:].astype(np.float32)  # 119 rows no model was trained on
    np.savez(base / "cancer.npz", features=gold[:64])
    v1 = Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(C=0.05, max_iter=2000))]).fit(x[:200], y[:200])
    v2 = Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(C=1.0, max_iter=2000))]).fit(x[:450], y[:450])
    joblib.dump(v1, base / "v1.joblib")
    joblib.dump(v2, base / "v2.joblib")
    iris = boosters.v1()
    iris.save_model(base / "iris.json")
    iris_gold = boosters.data()[2]
    np.savez(base / "iris.npz", features=iris_gold)
    export_cli(repo, base / "v1.joblib", "cancer", base / "cancer.npz")  # as a user runs it
    # in-process: the same code path, without a second interpreter start (seconds of wall time)
    export_source(str(base / "iris.json"), name="iris", repository=repo, inputs=base / "iris.npz", register=False)
    for name in ("cancer", "iris"):
        cfg = read_config(repo / name)  # a rollout in seconds, as test_promote's
        params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        params.update({"routing.poll_interval_s": "0.2", "breaker.window": "200", "breaker.min_requests": "20",
                       "breaker.min_compared": "40", "breaker.max_error_rate": "0.05"})
        cfg["parameters"] = {k: {"string_value": v} for k, v in params.items()}
        write_config(repo / name, cfg)
    server = Server(repository=repo, log_path=base / "logs" / "tritonserver.log", env=dict(os.environ))
    server.start(wait_models=["cancer", "cancer_raw", "iris", "iris_raw"])
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    yield {"repo": repo, "server": server, "client": client, "base": base, "v1": v1, "v2": v2, "gold": gold,
           "iris": iris, "iris_gold": iris_gold}
    client.close()
    server.stop()


def infer(client, model: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    inp = httpclient.InferInput("FEATURES", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    r = client.infer(model, [inp], outputs=[httpclient.InferRequestedOutput(n)
                                            for n in ("PROBS", "LABEL", "SERVED_BY")])
    return r.as_numpy("PROBS"), r.as_numpy("LABEL"), r.as_numpy("SERVED_BY")[0, 0].decode()


@pytest.mark.parametrize("model", ["cancer", "iris"])
def test_served_through_the_guard_as_the_original_answers(ctx, model):
    original, x = (ctx["v1"], ctx["gold"]) if model == "cancer" else (ctx["iris"], ctx["iris_gold"])
    for rows in (x[:1], x[:7], x[-64:]):  # batch of one, a few, and max_batch_size rows (not all goldens)
        probs, labels, served_by = infer(ctx["client"], model, rows)
        np.testing.assert_array_equal(labels, original.predict(rows).reshape(-1, 1))
        np.testing.assert_allclose(probs, original.predict_proba(rows), atol=1e-5, rtol=0)
        assert served_by == f"{model}_raw:1"


def promote_under_traffic(ctx, model: str, version: int, rows: np.ndarray,
                          *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, int], list[str]]:
    """`exporter promote` as a user runs it, while four clients send ``model`` one row at a time
    (``rows``, each scaled by up to 2 %: cache misses), :data:`RATE` a second each; returns the
    run, who served how many calls, and every client error."""
    errors: list[str] = []
    served: dict[str, int] = {}
    stop = threading.Event()

    def traffic() -> None:
        client = httpclient.InferenceServerClient(ctx["server"].http_url)
        rng = np.random.default_rng(2)
        deadline = time.monotonic() + 120
        due = time.monotonic()
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                if stop.wait(due - time.monotonic()):
                    break
                due = max(due + 1.0 / RATE, time.monotonic())
                row = rows[rng.integers(0, len(rows), 1)]
                row = row * rng.uniform(0.98, 1.02, row.shape).astype(np.float32)  # cache misses
                try:
                    _, _, who = infer(client, model, row)
                    served[who] = served.get(who, 0) + 1
                except Exception as exc:  # noqa: BLE001 - every error is counted and shown
                    errors.append(str(exc))
        finally:
            client.close()

    threads = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        r = cli(ctx, "promote", model, "--version", str(version), "--steps", "50,100", *GATES, *extra,
                *server_args(ctx), timeout=150)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    print(f"{model} v{version}: exit {r.returncode}, served {served}, {len(errors)} errors")
    return r, served, errors


def test_a_retrained_pipeline_is_promoted_with_no_client_error(ctx):
    export_source(str(ctx["base"] / "v2.joblib"), name="cancer", repository=ctx["repo"],
                  inputs=ctx["base"] / "cancer.npz", register=False)
    r, served, errors = promote_under_traffic(ctx, "cancer", 2, ctx["gold"], "--max-disagreement", "0.2")
    assert r.returncode == 0, r.stdout + r.stderr
    state = json.loads((ctx["repo"] / "cancer" / "rollout_state.json").read_text())
    assert state["primary"]["version"] == 2 and state["candidate"] is None
    assert not errors, errors[:3]
    assert served.get("cancer_raw:2", 0) > 0, served
    gold = ctx["gold"][-64:]
    probs, labels, who = infer(ctx["client"], "cancer", gold)
    assert who == "cancer_raw:2"
    np.testing.assert_array_equal(labels, ctx["v2"].predict(gold).reshape(-1, 1))
    np.testing.assert_allclose(probs, ctx["v2"].predict_proba(gold), atol=1e-5, rtol=0)


def test_a_slow_xgboost_build_is_rolled_back_with_no_client_error(ctx):
    """v1's booster trained on for 10,000 more rounds at learning rate 0 (examples.boosters.slow):
    v1's answers exactly (checked below) at ~16x its model time. Exported as a user would export a
    new booster; promote's latency gate stops it at its first step."""
    slow = boosters.slow(ctx["iris"])
    gold = ctx["iris_gold"]
    np.testing.assert_array_equal(slow.predict_proba(gold), ctx["iris"].predict_proba(gold))
    slow.save_model(ctx["base"] / "iris_slow.json")
    v = export_source(str(ctx["base"] / "iris_slow.json"), name="iris", repository=ctx["repo"],
                      inputs=ctx["base"] / "iris.npz", register=False).version
    r, served, errors = promote_under_traffic(ctx, "iris", v, gold)
    assert r.returncode == 1, r.stdout + r.stderr
    progress = json.loads((ctx["repo"] / "iris" / "rollout_controller.json").read_text())
    assert progress["status"] == "rolled_back", progress["reason"]
    assert progress["reason"].startswith("gate failed at 50%") and "latency FAIL" in progress["reason"], progress["reason"]
    assert not errors, errors[:3]
    assert served.get(f"iris_raw:{v}", 0) > 0, served  # judged on traffic it served
    state = json.loads((ctx["repo"] / "iris" / "rollout_state.json").read_text())
    assert state["primary"]["version"] == 1 and state["candidate"] is None


def test_a_retrained_xgboost_model_is_promoted_with_no_client_error(ctx):
    """Another booster on the same rows (60 shallower trees, another learning rate): its
    probabilities differ from v1's, its labels on the held-out rows do not."""
    retrain = boosters.retrain()
    retrain.save_model(ctx["base"] / "iris_retrain.json")
    v = export_source(str(ctx["base"] / "iris_retrain.json"), name="iris", repository=ctx["repo"],
                      inputs=ctx["base"] / "iris.npz", register=False).version
    gold = ctx["iris_gold"]
    r, served, errors = promote_under_traffic(ctx, "iris", v, gold)
    assert r.returncode == 0, r.stdout + r.stderr
    state = json.loads((ctx["repo"] / "iris" / "rollout_state.json").read_text())
    assert state["primary"]["version"] == v and state["candidate"] is None
    assert not errors, errors[:3]
    assert served.get(f"iris_raw:{v}", 0) > 0, served
    probs, labels, who = infer(ctx["client"], "iris", gold[:64])
    assert who == f"iris_raw:{v}"
    np.testing.assert_array_equal(labels, retrain.predict(gold[:64]).reshape(-1, 1))
    np.testing.assert_allclose(probs, retrain.predict_proba(gold[:64]), atol=1e-5, rtol=0)
