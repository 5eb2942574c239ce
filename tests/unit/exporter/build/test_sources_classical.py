"""scikit-learn and XGBoost sources (issue 44 item 1): models trained here on real data sets
(breast cancer, iris, diabetes), saved as a user saves them (joblib, XGBoost JSON / UBJ,
``mlflow.sklearn.save_model`` / ``mlflow.xgboost.save_model``), exported through the real
pipeline, and the exported ONNX run with onnxruntime against the ORIGINAL model's own
``predict`` / ``predict_proba``: labels exactly, probabilities within 1e-5."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import joblib
import numpy as np
import onnxruntime as ort
import pytest
from sklearn.datasets import load_breast_cancer, load_diabetes, load_iris
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from exporter.build import goldens
from exporter.build.export import export_source
from exporter.build.sources import load_source
from exporter.build.sources.classical import LABEL, PREDICTION, PROBS, TARGET_OPSET
from exporter.build.sources.spec import SourceError
from tritonguard.core import repository

xgb = pytest.importorskip("xgboost")
ROOT = Path(__file__).resolve().parents[4]
PROB_TOL = 1e-5  # float32 ONNX vs the estimator's float64 arithmetic


@pytest.fixture(scope="module")
def cancer():
    x, y = load_breast_cancer(return_X_y=True)
    return x[:400], y[:400], x[400:464].astype(np.float32), y[400:464]


@pytest.fixture(scope="module")
def pipeline(cancer):
    x, y, _, _ = cancer
    return Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression(max_iter=2000))]).fit(x, y)


def goldens_file(path: Path, x: np.ndarray, labels: np.ndarray | None = None) -> Path:
    arrays = {"features": x} if labels is None else {"features": x, "labels": labels}
    np.savez(path, **arrays)
    return path


def run_onnx(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"FEATURES": x}), strict=True))


def assert_classifier_artifact(res, model, x: np.ndarray) -> None:
    """The artifact, its goldens and its config answer as the original model does."""
    assert res.report.verdict == goldens.PASS, res.report.as_dict()
    assert res.report.metrics[f"{LABEL}.label_agreement"] == 1.0
    out = run_onnx(res.artifact, x)
    assert list(out) == [PROBS, LABEL]
    np.testing.assert_array_equal(out[LABEL], model.predict(x).reshape(-1, 1))
    np.testing.assert_allclose(out[PROBS], model.predict_proba(x), atol=PROB_TOL, rtol=0)
    ins, outs = goldens.load(res.artifact.parent / repository.GOLDENS)
    np.testing.assert_array_equal(ins["FEATURES"], x)
    np.testing.assert_array_equal(outs[LABEL], model.predict(x).reshape(-1, 1))
    np.testing.assert_array_equal(outs[PROBS], model.predict_proba(x).astype(np.float32))
    for n in (1, 2, len(x) - 1):  # any batch size: the batch dim is dynamic
        assert run_onnx(res.artifact, x[:n])[PROBS].shape == (n, len(model.classes_))


def test_sklearn_pipeline_exports_with_the_pipelines_own_predictions_as_goldens(cancer, pipeline, tmp_path):
    _, _, xg, yg = cancer
    joblib.dump(pipeline, tmp_path / "model.joblib")
    res = export_source(str(tmp_path / "model.joblib"), name="cancer", repository=tmp_path / "repo",
                        inputs=goldens_file(tmp_path / "g.npz", xg, yg), register=False)
    assert_classifier_artifact(res, pipeline, xg)
    manifest = repository.read_manifest(res.artifact.parent)
    assert manifest["task"] == "classifier" and manifest["format"] == "onnx"
    assert manifest["evaluation"]["metric"] == "accuracy"  # the `labels` array became the eval set
    assert manifest["evaluation"]["value"] == pytest.approx(float(np.mean(pipeline.predict(xg) == yg)))
    cfg = repository.read_config(tmp_path / "repo" / "cancer_raw")
    assert [(i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in cfg["input"]] == \
        [("FEATURES", "TYPE_FP32", [30])]
    assert [(o["name"], o["data_type"]) for o in cfg["output"]] == [(PROBS, "TYPE_FP32"), (LABEL, "TYPE_INT64")]
    import onnx

    opsets = {o.domain: o.version for o in onnx.load(str(res.artifact)).opset_import}
    assert opsets[""] == TARGET_OPSET


def test_the_guard_is_configured_exactly_as_for_an_onnx_file_source(cancer, pipeline, tmp_path):
    """The converted model, exported again as a plain .onnx source, gets the same configs."""
    _, _, xg, _ = cancer
    joblib.dump(pipeline, tmp_path / "model.joblib")
    g = goldens_file(tmp_path / "g.npz", xg)
    res = export_source(str(tmp_path / "model.joblib"), name="a", repository=tmp_path / "r1", inputs=g,
                        register=False)
    export_source(str(res.artifact), name="a", repository=tmp_path / "r2", inputs=g, task="classifier",
                  input_names=["FEATURES"],
                  register=False)
    for model in ("a", "a_raw"):
        assert (tmp_path / "r1" / model / "config.pbtxt").read_text() == \
            (tmp_path / "r2" / model / "config.pbtxt").read_text()


def test_xgboost_classifier_json_and_raw_booster_ubj(tmp_path):
    x, y = load_iris(return_X_y=True)
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(x))
    train, gold = idx[:110], idx[110:]
    model = xgb.XGBClassifier(n_estimators=25, max_depth=3).fit(x[train], y[train])
    model.save_model(tmp_path / "iris.json")
    model.get_booster().save_model(tmp_path / "iris_raw.ubj")
    xg = x[gold].astype(np.float32)
    g = goldens_file(tmp_path / "g.npz", xg)
    res = export_source(str(tmp_path / "iris.json"), name="iris", repository=tmp_path / "repo", inputs=g,
                        register=False)
    assert_classifier_artifact(res, model, xg)
    raw = export_source(str(tmp_path / "iris_raw.ubj"), name="iris_booster", repository=tmp_path / "repo", inputs=g,
                        register=False)
    assert_classifier_artifact(raw, model, xg)


def test_xgboost_regressor_is_a_regression_with_one_prediction_column(tmp_path):
    x, y = load_diabetes(return_X_y=True)
    model = xgb.XGBRegressor(n_estimators=20, max_depth=3).fit(x[:350], y[:350])
    model.save_model(tmp_path / "diabetes.ubj")
    xg = x[350:414].astype(np.float32)
    spec = load_source(str(tmp_path / "diabetes.ubj"), inputs=goldens_file(tmp_path / "g.npz", xg))
    assert spec.task == "regression" and [t.name for t in spec.outputs] == [PREDICTION]
    res = export_source(str(tmp_path / "diabetes.ubj"), name="diabetes", repository=tmp_path / "repo",
                        inputs=tmp_path / "g.npz", register=False)
    assert res.report.verdict == goldens.PASS, res.report.as_dict()
    out = run_onnx(res.artifact, xg)[PREDICTION]
    np.testing.assert_allclose(out, model.predict(xg).reshape(-1, 1), rtol=1e-5, atol=1e-3)


def test_mlflow_sklearn_and_xgboost_flavors_saved_with_save_model(cancer, pipeline, tmp_path):
    pytest.importorskip("mlflow")
    import mlflow.sklearn
    import mlflow.xgboost

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    x, y, xg, _ = cancer
    mlflow.sklearn.save_model(pipeline, str(tmp_path / "sk"), pip_requirements=["scikit-learn"])
    res = export_source(str(tmp_path / "sk"), name="sk", repository=tmp_path / "repo",
                        inputs=goldens_file(tmp_path / "g.npz", xg), register=False)
    assert_classifier_artifact(res, pipeline, xg)
    booster = xgb.XGBClassifier(n_estimators=20, max_depth=3).fit(x, y)
    mlflow.xgboost.save_model(booster, str(tmp_path / "xg"), input_example=xg[:16], pip_requirements=["xgboost"])
    res = export_source(str(tmp_path / "xg"), name="xg", repository=tmp_path / "repo", register=False)
    assert_classifier_artifact(res, booster, xg[:16])  # goldens: the logged input example


def test_a_wrong_task_or_a_wrong_feature_count_is_refused(cancer, pipeline, tmp_path):
    _, _, xg, _ = cancer
    joblib.dump(pipeline, tmp_path / "model.joblib")
    with pytest.raises(SourceError, match="is a classifier"):
        load_source(str(tmp_path / "model.joblib"), inputs=goldens_file(tmp_path / "g.npz", xg), task="regression")
    with pytest.raises(SourceError, match=r"\[rows, 30\]"):
        load_source(str(tmp_path / "model.joblib"), inputs=goldens_file(tmp_path / "h.npz", xg[:, :5]))
    with pytest.raises(SourceError, match="needs --inputs"):
        load_source(str(tmp_path / "model.joblib"))


def test_a_differing_label_fails_the_golden_check():
    """Labels are compared exactly: scores that still agree cannot hide a changed label."""
    ref = np.array([[0], [1], [1], [2]], dtype=np.int64)
    got = ref.copy()
    got[2] = 2
    report = goldens.check("classifier", {LABEL: ref}, {LABEL: got})
    assert report.verdict == goldens.FAIL and report.metrics["label_agreement"] == 0.75
    assert goldens.check("classifier", {LABEL: ref}, {LABEL: ref.copy()}).verdict == goldens.PASS


def test_unsupported_pipeline_step_is_one_line_naming_it_exit_2(cancer, tmp_path):
    x, y, xg, _ = cancer
    bad = Pipeline([("featurize", FunctionTransformer(np.log1p)),
                    ("clf", LogisticRegression(max_iter=2000))]).fit(x, y)
    joblib.dump(bad, tmp_path / "bad.joblib")
    repo = tmp_path / "repo"
    r = subprocess.run([sys.executable, "-m", "exporter", "export", "--source", str(tmp_path / "bad.joblib"),
                        "--name", "bad", "--repository", str(repo), "--inputs",
                        str(goldens_file(tmp_path / "g.npz", xg)), "--no-register"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if "featurize" in line]
    assert len(lines) == 1, text
    assert "step 'featurize' (FunctionTransformer) has no ONNX converter" in lines[0]
    assert not (repo / "bad_raw").exists()
