"""examples.faults: each seeded fault has the property the guard tests rely on, and exports.

The base is trained once for the whole module (examples.faults caches it). No timings here:
slow() is checked for identical outputs only; its slowdown is measured outside the unit tests.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from examples import faults
from exporter.build import artifacts
from exporter.build.export import export
from tritonguard.models.engines import EngineConfig, OnnxEngine, TorchScriptEngine

# the raises fault is TorchScript, which torch now marks deprecated
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")

FAULTS = ("base", "good", "nan_subset", "accuracy_drop", "raises", "slow", "loose")


@pytest.fixture(scope="module")
def built():
    """Every fault's spec, built once; one torch thread (training is several times faster on
    small convolutions, and only this process's base is compared with)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield {name: getattr(faults, name)() for name in FAULTS}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits_data():
    return faults.load_all()


def _run(spec, images: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return spec.module(torch.from_numpy(np.ascontiguousarray(images))).numpy()


@pytest.fixture(scope="module")
def base_probs(built, digits_data):
    return _run(built["base"], digits_data[0])


def test_specs_share_the_digits_contract(built):
    for name, spec in built.items():
        assert [t.as_dict() for t in spec.inputs] == [{"name": "IMAGE", "dtype": "float32", "dims": [8, 8]}], name
        assert [t.as_dict() for t in spec.outputs] == [{"name": "PROBS", "dtype": "float32", "dims": [10]}], name
        assert spec.task == "classifier" and spec.max_batch_size == 64, name
        assert spec.input_ranges == {"IMAGE": (0.0, 16.0)}, name
        assert spec.golden_inputs["IMAGE"].shape == (64, 8, 8), name
        assert spec.golden_inputs["IMAGE"].dtype == np.float32, name
        assert artifacts.default_format(spec) == ("torchscript" if name == "raises" else "onnx"), name
        # loose stands for a numerically loose re-export; the others leave the judge to the exporter
        assert spec.judge == ("equivalence" if name == "loose" else None), name
        # the held-out split where the fault's outputs stay finite and it does not raise on it
        if name in ("base", "accuracy_drop", "slow"):
            assert spec.eval_inputs["IMAGE"].shape == (450, 8, 8) and spec.eval_labels.shape == (450,), name
        else:
            assert spec.eval_inputs is None and spec.eval_labels is None, name


def test_base_is_trained_once_per_process():
    assert faults.trained() is faults.trained()
    assert faults.trained.cache_info().misses == 1


def test_good_stays_within_validator_tolerance(built, digits_data, base_probs):
    probs = _run(built["good"], digits_data[0])
    assert np.mean(probs.argmax(-1) == base_probs.argmax(-1)) >= 0.995
    assert np.abs(probs - base_probs).max() <= 1e-4  # the classifier validator's float32 atol


def test_nan_subset(built, digits_data, base_probs):
    images = digits_data[0]
    probs = _run(built["nan_subset"], images)
    nan_rows = np.isnan(probs).any(-1)
    assert 0.15 <= nan_rows.mean() <= 0.4
    np.testing.assert_array_equal(nan_rows, faults.nan_trigger(images))
    assert np.isnan(probs[nan_rows]).all()
    np.testing.assert_allclose(probs[~nan_rows], base_probs[~nan_rows], atol=1e-6)
    assert not faults.nan_trigger(built["nan_subset"].golden_inputs["IMAGE"]).any()


def test_accuracy_drop(built, digits_data, base_probs):
    images, labels = digits_data
    probs = _run(built["accuracy_drop"], images)
    drop = np.mean(base_probs.argmax(-1) == labels) - np.mean(probs.argmax(-1) == labels)
    assert 0.03 <= drop <= 0.1
    changed = probs.argmax(-1) != base_probs.argmax(-1)
    assert set(base_probs.argmax(-1)[changed]) <= set(faults.SWAP_CLASSES)
    np.testing.assert_allclose(np.sort(probs, -1), np.sort(base_probs, -1), atol=1e-6)  # a swap


def test_raises_on_a_triggering_batch_only(built, digits_data, base_probs):
    spec = built["raises"]
    images = digits_data[0]
    trigger = faults.raise_trigger(images)
    assert 0.15 <= trigger.mean() <= 0.3
    engine = TorchScriptEngine(spec.artifact_path, EngineConfig(), ["IMAGE"], ["PROBS"])
    clean = images[~trigger][:16]
    batch = np.concatenate([clean[:7], images[trigger][:1], clean[7:]])  # one bad row is enough
    # a TorchScript raise surfaces as torch.jit.Error (an Exception, not a RuntimeError)
    with pytest.raises(Exception, match="seeded fault"):
        engine.run({"IMAGE": batch})
    with pytest.raises(Exception, match="seeded fault"):
        _run(spec, batch)
    golden = spec.golden_inputs["IMAGE"]
    assert not faults.raise_trigger(golden).any()
    np.testing.assert_allclose(engine.run({"IMAGE": golden})["PROBS"], _run(built["base"], golden), atol=1e-6)
    np.testing.assert_allclose(engine.run({"IMAGE": clean})["PROBS"], base_probs[~trigger][:16], atol=1e-6)


def test_slow_gives_the_base_outputs(built, digits_data, base_probs):
    module = built["slow"].module
    assert module.w.shape == (faults.SLOW_WIDTH, faults.SLOW_WIDTH) and module.steps == faults.SLOW_STEPS >= 4
    probs = _run(built["slow"], digits_data[0])
    np.testing.assert_array_equal(probs.argmax(-1), base_probs.argmax(-1))
    assert np.abs(probs - base_probs).max() <= 1e-6


def test_loose_flips_borderline_decisions_only(built, digits_data, base_probs):
    probs = _run(built["loose"], digits_data[0])
    flipped = probs.argmax(-1) != base_probs.argmax(-1)
    assert flipped.mean() >= 0.02
    assert np.abs(probs[~flipped] - base_probs[~flipped]).max() <= 1e-6
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    # each flip is the smallest possible move: top-1 and top-2 meet at their mean, then
    # LOOSE_PAST_TIE past it (no flip can move a row's probabilities by less than margin / 2)
    top2 = np.sort(base_probs[flipped], -1)[:, -2:]
    expected = (top2[:, 1] - top2[:, 0]) / 2 + faults.LOOSE_PAST_TIE
    np.testing.assert_allclose(np.abs(probs[flipped] - base_probs[flipped]).max(-1), expected, atol=1e-5)


def test_drifted_inputs_are_valid_but_shifted(digits_data):
    x = faults.drifted_inputs()
    assert x.shape == (512, 8, 8) and x.dtype == np.float32
    assert np.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 16.0
    assert x.mean() - digits_data[0].mean() > 2.0
    np.testing.assert_array_equal(x, faults.drifted_inputs())
    assert not np.array_equal(x, faults.drifted_inputs(seed=1))
    assert faults.drifted_inputs(n=2000).shape == (2000, 8, 8)


def test_faults_export_as_the_next_digits_versions(built, digits_data, tmp_path):
    """Each export runs the exporter's golden check (the faulty module is its own reference)."""
    images = digits_data[0]
    base = export(built["base"], name="digits", repository=tmp_path, source="examples.faults:base")
    assert base.version == 1
    nan = export(built["nan_subset"], name="digits", repository=tmp_path, source="examples.faults:nan_subset")
    assert nan.version == 2 and nan.report.verdict == "PASS"
    assert nan.artifact == tmp_path / "digits_raw" / "2" / "model.onnx"
    out = OnnxEngine(nan.artifact, EngineConfig()).run({"IMAGE": images})["PROBS"]
    np.testing.assert_array_equal(np.isnan(out).any(-1), faults.nan_trigger(images))

    # fmt=None: the raises spec's artifact_path makes the exporter pick TorchScript
    rai = export(built["raises"], name="digits", repository=tmp_path, source="examples.faults:raises")
    assert rai.version == 3 and rai.report.verdict == "PASS" and rai.artifact.name == "model.pt"
    manifest = json.loads((tmp_path / "digits_raw" / "3" / "manifest.json").read_text())
    assert manifest["format"] == "torchscript"
