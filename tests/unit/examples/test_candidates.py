"""examples.candidates: retrains are real retrains, worse is worse, the faults behave as named.

Every model is trained once for the whole module (examples.candidates and examples.faults cache
them), with one torch thread. No timings here: slow13/slow2 are checked for v1's outputs only;
their latency ratios are measured with examples.candidates.latency_ratios, outside the tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from examples import candidates, digits, faults
from exporter.build import artifacts
from exporter.build.errors import ExportError
from exporter.build.export import export
from tests.unit.examples.test_faults import _run  # the same runner as the faults' tests
from tritonguard.models.engines import EngineConfig, OnnxEngine

RETRAINS = tuple(candidates.RETRAIN_SEEDS)
CANDIDATES = (*RETRAINS, "worse", "raises_above_batch", "slow13", "slow2", "loose")


@pytest.fixture(scope="module")
def built():
    """Every candidate's spec, built once, and v1 (examples.digits:build's model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield {"v1": faults.base(), **{name: getattr(candidates, name)() for name in CANDIDATES}}
    finally:
        torch.set_num_threads(threads)



@pytest.fixture(scope="module")
def digits_data():
    return faults.load_all()


def _accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(probs.argmax(-1) == labels))


@pytest.fixture(scope="module")
def probs(built, digits_data):
    """Each trained model's probabilities on all 1797 images and on the held-out split."""
    x_te = digits.heldout()[0]
    return {name: (_run(built[name], digits_data[0]), _run(built[name], x_te))
            for name in ("v1", *RETRAINS, "worse")}


def test_specs_share_the_digits_contract_and_the_heldout_eval_set(built):
    x_te, y_te = digits.heldout()
    assert x_te.shape == (450, 8, 8) and x_te.dtype == np.float32 and y_te.shape == (450,)
    for name in CANDIDATES:
        spec = built[name]
        assert [t.as_dict() for t in spec.inputs] == [{"name": "IMAGE", "dtype": "float32", "dims": [8, 8]}], name
        assert [t.as_dict() for t in spec.outputs] == [{"name": "PROBS", "dtype": "float32", "dims": [10]}], name
        assert spec.task == "classifier" and spec.max_batch_size == 64, name
        assert spec.input_ranges == {"IMAGE": (0.0, 16.0)}, name
        rows = candidates.RAISE_ABOVE_ROWS if name == "raises_above_batch" else digits.N_GOLDEN
        assert spec.golden_inputs["IMAGE"].shape == (rows, 8, 8), name
        assert set(spec.eval_inputs) == {"IMAGE"}, name
        np.testing.assert_array_equal(spec.eval_inputs["IMAGE"], x_te)
        np.testing.assert_array_equal(spec.eval_labels, y_te)
        assert spec.judge == ("equivalence" if name == "loose" else None), name
        assert artifacts.default_format(spec) == "onnx", name


def test_the_heldout_split_does_not_depend_on_the_seed(built):
    """v1's split is heldout(); seed 1 trains on the rest (its recorded held-out accuracy is
    the one measured on heldout()) and evaluates on the same 450 images."""
    x_te, y_te = digits.heldout()
    _, v1_x, v1_y = faults.trained()
    np.testing.assert_array_equal(v1_x, x_te)
    np.testing.assert_array_equal(v1_y, y_te)
    spec = built["retrain"]
    assert spec.hyperparameters["seed"] == 1 and spec.training_metrics["n_heldout"] == 450
    assert spec.training_metrics["heldout_accuracy"] == _accuracy(_run(spec, x_te), y_te)


@pytest.mark.parametrize("name", RETRAINS)
def test_retrains_are_real_retrains_as_accurate_as_v1(name, built, probs, digits_data):
    labels = digits_data[1]
    y_te = digits.heldout()[1]
    (v1_all, v1_te), (all_, te) = probs["v1"], probs[name]
    assert built[name].hyperparameters["seed"] == candidates.RETRAIN_SEEDS[name]
    # other weights: many rows move by far more than the validator's 1e-4 tolerance
    assert np.mean(np.abs(all_ - v1_all).max(-1) > 1e-3) >= 0.1
    assert abs(_accuracy(te, y_te) - _accuracy(v1_te, y_te)) <= 0.01
    assert abs(_accuracy(all_, labels) - _accuracy(v1_all, labels)) <= 0.01
    assert np.mean(te.argmax(-1) == v1_te.argmax(-1)) >= 0.97


def test_retrains_differ_from_each_other(probs):
    for a, b in [(RETRAINS[0], RETRAINS[1]), (RETRAINS[1], RETRAINS[2])]:
        assert np.abs(probs[a][0] - probs[b][0]).max() > 0.1


def test_worse_is_a_few_points_worse(built, probs, digits_data):
    labels = digits_data[1]
    y_te = digits.heldout()[1]
    (v1_all, v1_te), (all_, te) = probs["v1"], probs["worse"]
    assert built["worse"].hyperparameters["epochs"] == candidates.WORSE_EPOCHS < digits.EPOCHS
    assert 0.02 <= _accuracy(v1_te, y_te) - _accuracy(te, y_te) <= 0.04
    assert 0.02 <= _accuracy(v1_all, labels) - _accuracy(all_, labels) <= 0.04


def test_raises_above_batch(built, digits_data, tmp_path):
    spec = built["raises_above_batch"]
    images = digits_data[0]
    v1 = faults.trained()[0]
    n = candidates.RAISE_ABOVE_ROWS
    with pytest.raises(RuntimeError, match="must match"):
        _run(spec, images[:n + 1])
    np.testing.assert_array_equal(_run(spec, images[:n]), _run(built["v1"], images[:n]))

    engine = OnnxEngine(candidates.raises_above_batch_artifact(tmp_path), EngineConfig())
    assert engine.path == tmp_path / "model.onnx"
    reference = candidates.run_in_chunks(spec.module, images[:64])
    np.testing.assert_allclose(reference, candidates.run_in_chunks(v1, images[:64], rows=64), atol=1e-6)
    for rows in range(1, n + 1):
        np.testing.assert_allclose(engine.run({"IMAGE": images[:rows]})["PROBS"], reference[:rows], atol=1e-5)
    golden = spec.golden_inputs["IMAGE"]
    np.testing.assert_allclose(engine.run({"IMAGE": golden})["PROBS"], _run(spec, golden), atol=1e-5)
    # onnxruntime raises its own Fail (an Exception, not a RuntimeError)
    for rows in (n + 1, 16, 64):
        with pytest.raises(Exception, match="broadcast"):
            engine.run({"IMAGE": images[:rows]})
    # the exporter also runs the goldens at the max batch size, so it refuses this version
    with pytest.raises(ExportError, match="broadcast"):
        export(spec, name="digits", repository=tmp_path / "repo", source="examples.candidates:raises_above_batch")


@pytest.mark.parametrize(("name", "shape"), [("slow13", candidates.SLOW13), ("slow2", candidates.SLOW2)])
def test_slow_candidates_give_v1_outputs(name, shape, built, digits_data, tmp_path):
    images = digits_data[0]
    spec = built[name]
    width, steps = shape
    assert spec.module.w.shape == (width, width) and spec.module.steps == steps
    v1_probs = _run(built["v1"], images)
    probs = _run(spec, images)
    np.testing.assert_array_equal(probs.argmax(-1), v1_probs.argmax(-1))
    assert np.abs(probs - v1_probs).max() <= 1e-6
    engine = OnnxEngine(artifacts.build(spec, "onnx", tmp_path), EngineConfig())
    np.testing.assert_allclose(engine.run({"IMAGE": images[:64]})["PROBS"], v1_probs[:64], atol=1e-5)


def test_loose_is_the_fault_marked_for_equivalence(built, digits_data):
    images = digits_data[0]
    fault = faults.loose()
    assert fault.judge == "equivalence" and fault.eval_inputs is None
    np.testing.assert_array_equal(_run(built["loose"], images), _run(fault, images))
    np.testing.assert_array_equal(built["loose"].golden_inputs["IMAGE"], fault.golden_inputs["IMAGE"])


def test_trained_candidates_export_with_their_lineage(built, tmp_path):
    """The exporter's golden check passes on the retrain and on the worse model."""
    retrain = export(built["retrain"], name="digits", repository=tmp_path, source="examples.candidates:retrain")
    assert retrain.version == 1 and retrain.report.verdict == "PASS"
    worse = export(built["worse"], name="digits", repository=tmp_path, source="examples.candidates:worse")
    assert worse.version == 2 and worse.report.verdict == "PASS"
    assert built["worse"].data_version == digits.data_version()
    assert built["worse"].training_metrics["heldout_accuracy"] < built["retrain"].training_metrics["heldout_accuracy"]
