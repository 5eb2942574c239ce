"""Classical sources: a fitted scikit-learn estimator or Pipeline saved with joblib (``.joblib``)
and an XGBoost model saved as JSON / UBJ (``.json`` / ``.ubj``: an ``XGBClassifier``,
``XGBRegressor`` or raw ``Booster``), converted to ONNX with the converters made for them
(skl2onnx for scikit-learn, onnxmltools for XGBoost) and then served and rolled out like any
ONNX model. MLflow's ``sklearn`` and ``xgboost`` flavors come here too, through
:func:`from_estimator`.

The artifact's interface is the same for every such model, so a guard, a client and a rollout
treat them alike:

- input ``FEATURES``: float32 ``[batch, n_features]`` (dynamic batch);
- a classifier: ``PROBS`` float32 ``[batch, n_classes]`` (ZipMap disabled: a tensor, not a
  list of maps, so Triton serves it and the guard compares it) and ``LABEL`` int64
  ``[batch, 1]``; ``PROBS`` comes first, the output a rollout compares;
- a regressor: ``PREDICTION`` float32 ``[batch, 1]``.

The reference the golden check compares the artifact with is the ORIGINAL model's own
``predict_proba`` / ``predict`` on the golden rows (cast to float32, as the artifact sees
them): labels must match exactly, probabilities within the classifier tolerance of
:mod:`exporter.build.goldens`.

Opsets: ``{"": 15, "ai.onnx.ml": 3}``. onnxmltools 1.16's XGBoost converter goes no higher
than opset 15, and one opset for both kinds keeps them alike; Triton 2.51 (r24.10) ships
onnxruntime 1.19.2 (opsets up to 21, ``ai.onnx.ml`` up to 4) and the venv has onnxruntime
1.32, so the same file loads in both, in-process or ``--native``.

Loading a ``.joblib`` file runs code (it is a pickle), like ``torch.load``: export only files
you trust. XGBoost JSON/UBJ files are data and run nothing.
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build.sources.spec import ExportSpec, SourceError, TensorDef, first_line

log = logging.getLogger(__name__)

SKLEARN_SUFFIXES = (".joblib",)
XGBOOST_SUFFIXES = (".json", ".ubj")
CLASSICAL_SUFFIXES = SKLEARN_SUFFIXES + XGBOOST_SUFFIXES
FEATURES, PROBS, LABEL, PREDICTION = "FEATURES", "PROBS", "LABEL", "PREDICTION"
# see the module docstring: what onnxmltools 1.16 converts to and onnxruntime 1.19 (Triton 2.51) loads
TARGET_OPSET = 15
TARGET_OPSET_ML = 3


class UnsupportedStep(SourceError):
    """A pipeline step (or the model itself) that the ONNX converter cannot handle."""


def from_file(path: Path, arrays: dict[str, np.ndarray], task: str | None,
              input_names: Sequence[str] = ()) -> ExportSpec:
    """A ``.joblib`` scikit-learn model or a ``.json`` / ``.ubj`` XGBoost model."""
    if not path.is_file():
        raise SourceError(f"{path} does not exist")
    if path.suffix in SKLEARN_SUFFIXES:
        model = _load_joblib(path)
    else:
        model = _load_xgboost(path)
    return from_estimator(model, arrays, task, input_names, source=str(path))


def _load_joblib(path: Path) -> Any:
    try:
        import joblib  # noqa: PLC0415 - defers an import only this source needs
    except ImportError:
        raise SourceError("scikit-learn sources need `joblib` and `scikit-learn`") from None
    try:
        return joblib.load(path)  # a pickle: runs code, so the file must be trusted (module docstring)
    except Exception as exc:  # noqa: BLE001 - unpickling raises anything; one line says what
        raise SourceError(f"cannot load {path} with joblib: {first_line(exc)}") from None


def _load_xgboost(path: Path) -> Any:
    """The sklearn wrapper the file was saved from (XGBClassifier / XGBRegressor), else a raw
    Booster's objective decides which wrapper reads it: the wrapper gives ``predict_proba``
    and ``classes_`` for the reference."""
    try:
        import xgboost as xgb  # noqa: PLC0415 - defers a heavy import
    except ImportError:
        raise SourceError("XGBoost sources need the `xgboost` package") from None
    try:
        booster = xgb.Booster()
        booster.load_model(str(path))
        objective = json.loads(booster.save_config())["learner"]["objective"]["name"]
    except Exception as exc:  # noqa: BLE001 - XGBoostError, JSON errors: not an XGBoost model
        raise SourceError(f"{path} is not an XGBoost model: {first_line(exc)}") from None
    if objective.startswith(("binary:", "multi:")):
        wrapper = xgb.XGBClassifier()
    elif objective.startswith(("reg:", "count:", "survival:")):
        wrapper = xgb.XGBRegressor()
    else:  # rank:* and anything newer: no fixed tensor interface here
        raise UnsupportedStep(f"{path}: XGBoost objective {objective!r} is not supported "
                              "(binary:*, multi:*, reg:*, count:*, survival:* are)")
    try:
        wrapper.load_model(str(path))
    except Exception as exc:  # noqa: BLE001
        raise SourceError(f"cannot load {path} as {type(wrapper).__name__}: {first_line(exc)}") from None
    return wrapper


def from_estimator(model: Any, arrays: dict[str, np.ndarray], task: str | None,
                   input_names: Sequence[str] = (), *, source: str) -> ExportSpec:
    """A fitted scikit-learn estimator / Pipeline or an XGBoost model (sklearn wrapper or raw
    Booster) -> ONNX in a private temp folder, with the model itself as the reference."""
    kind = _kind(model)
    if kind == "booster":
        model = _wrap_booster(model, source)
        kind = "xgboost"
    is_classifier = _is_classifier(model)
    inferred = "classifier" if is_classifier else "regression"
    if task is not None and task != inferred:
        raise SourceError(f"{source} is a {'classifier' if is_classifier else 'regressor'} "
                          f"({type(model).__name__}); --task {task} does not fit it")
    n_features = _n_features(model, source)
    name = input_names[0] if input_names else FEATURES
    goldens = _golden_features(arrays, n_features, source)
    if is_classifier:
        classes = np.asarray(model.classes_)
        if classes.dtype.kind not in "iub":
            raise SourceError(f"{source}: class labels must be integers (got {classes.dtype} "
                              f"{classes[:3].tolist()}…); encode them as 0..{len(classes) - 1}")
    onx = _convert(model, kind, name, n_features)
    onx = _public_outputs(onx, is_classifier, len(model.classes_) if is_classifier else 0)
    folder = Path(tempfile.mkdtemp(prefix="tritonguard-classical-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the spec reads the file later
    path = folder / "model.onnx"
    path.write_bytes(onx.SerializeToString())
    if is_classifier:
        outputs = [TensorDef(name=PROBS, dtype="float32", dims=(len(model.classes_),)),
                   TensorDef(name=LABEL, dtype="int64", dims=(1,))]
    else:
        outputs = [TensorDef(name=PREDICTION, dtype="float32", dims=(1,))]
    return ExportSpec(module=None, artifact_path=path,
                      inputs=[TensorDef(name=name, dtype="float32", dims=(n_features,))],
                      outputs=outputs, golden_inputs={name: goldens}, task=inferred,
                      reference=_reference(model, name, is_classifier),
                      hyperparameters=_hyperparameters(model))


def _kind(model: Any) -> str:
    """``sklearn`` (an estimator or Pipeline, xgboost steps included), ``xgboost`` (a bare
    XGBClassifier / XGBRegressor) or ``booster`` (a raw xgboost.Booster)."""
    module = type(model).__module__
    if module.startswith("xgboost"):
        return "booster" if type(model).__name__ == "Booster" else "xgboost"
    if not hasattr(model, "predict"):
        raise SourceError(f"a {type(model).__name__} is not a fitted scikit-learn estimator or XGBoost model")
    return "sklearn"


def _wrap_booster(booster: Any, source: str) -> Any:
    """A raw Booster (MLflow's xgboost flavor may hold one) in the wrapper its objective needs."""
    folder = Path(tempfile.mkdtemp(prefix="tritonguard-xgb-"))
    try:
        path = folder / "booster.ubj"
        booster.save_model(str(path))
        return _load_xgboost(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _is_classifier(model: Any) -> bool:
    from sklearn.base import is_classifier  # noqa: PLC0415 - defers a heavy import

    if is_classifier(model):
        return True
    if not hasattr(model, "predict"):
        raise SourceError(f"a {type(model).__name__} has no predict(): not an estimator")
    return False


def _n_features(model: Any, source: str) -> int:
    n = getattr(model, "n_features_in_", None)
    if n is None:
        raise SourceError(f"{source}: {type(model).__name__} is not fitted (no n_features_in_)")
    return int(n)


def _golden_features(arrays: dict[str, np.ndarray], n_features: int, source: str) -> np.ndarray:
    """The one feature matrix of ``--inputs`` (any key; ``out__*`` keys are ignored: the
    reference is the model itself), as float32 ``[rows, n_features]``."""
    ins = {k: v for k, v in arrays.items() if not k.startswith("out__")}
    if len(ins) != 1:
        raise SourceError(f"source {source} takes one feature matrix in --inputs, got {sorted(ins) or 'none'}")
    x = np.asarray(next(iter(ins.values())))
    if x.ndim != 2 or x.shape[1] != n_features or x.dtype.kind not in "iubf":
        raise SourceError(f"source {source}: --inputs must be a numeric [rows, {n_features}] matrix, "
                          f"got {x.dtype} {list(x.shape)}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _reference(model: Any, name: str, is_classifier: bool) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """The original model's own predictions, on the rows as the artifact gets them (float32)."""

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = np.asarray(inputs[name], dtype=np.float32)
        if is_classifier:
            return {PROBS: np.asarray(model.predict_proba(x), dtype=np.float32),
                    LABEL: np.asarray(model.predict(x)).astype(np.int64).reshape(-1, 1)}
        return {PREDICTION: np.asarray(model.predict(x), dtype=np.float32).reshape(-1, 1)}

    return run


def _hyperparameters(model: Any) -> dict[str, Any]:
    """Lineage: the estimator's own shallow parameters (scalars only; a Pipeline's steps are
    named by class)."""
    try:
        params = model.get_params(deep=False)
    except Exception:  # noqa: BLE001 - lineage is best effort
        return {}
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, bool | int | float | str) or value is None:
            out[key] = value
        elif key == "steps":
            out[key] = ",".join(f"{n}={type(s).__name__}" for n, s in value)
    return out


# -- conversion -------------------------------------------------------------------------------
def _convert(model: Any, kind: str, name: str, n_features: int) -> Any:
    if kind == "xgboost":
        from onnxmltools import convert_xgboost  # noqa: PLC0415 - defers a heavy import
        from onnxmltools.convert.common.data_types import FloatTensorType  # noqa: PLC0415

        try:
            return convert_xgboost(model, initial_types=[(name, FloatTensorType([None, n_features]))],
                                   target_opset=TARGET_OPSET)
        except Exception as exc:  # noqa: BLE001 - the converter raises anything
            raise UnsupportedStep(f"{type(model).__name__} cannot be converted to ONNX: {first_line(exc)}") from None
    from skl2onnx import convert_sklearn  # noqa: PLC0415 - defers a heavy import
    from skl2onnx.common.data_types import FloatTensorType as SkFloat  # noqa: PLC0415

    _register_xgboost()
    _check_steps(model)
    options = {id(model): {"zipmap": False}} if _is_classifier(model) else None
    try:
        return convert_sklearn(model, initial_types=[(name, SkFloat([None, n_features]))], options=options,
                               target_opset={"": TARGET_OPSET, "ai.onnx.ml": TARGET_OPSET_ML})
    except Exception as exc:  # noqa: BLE001 - name the step the message is about, if any
        step = _step_named_in(model, str(exc))
        if step is not None and step[0]:
            raise UnsupportedStep(f"step {step[0]!r} ({type(step[1]).__name__}) cannot be converted to "
                                  f"ONNX: {first_line(exc)}") from None
        raise UnsupportedStep(f"{type(model).__name__} cannot be converted to ONNX: {first_line(exc)}") from None


def _steps(model: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, estimator) of every step, nested Pipelines / ColumnTransformers /
    FeatureUnions included; the model itself when it is none of those."""
    children: list[tuple[str, Any]] = []
    if hasattr(model, "steps"):
        children = list(model.steps)
    elif hasattr(model, "transformers"):  # ColumnTransformer: (name, est, columns)
        children = [(t[0], t[1]) for t in model.transformers]
    elif hasattr(model, "transformer_list"):  # FeatureUnion
        children = list(model.transformer_list)
    if not children:
        return [(prefix, model)]  # "": the model itself, not a step
    out = []
    for name, est in children:
        if est is None or isinstance(est, str):  # "passthrough", "drop"
            continue
        out += _steps(est, f"{prefix}.{name}" if prefix else name)
    return out


def _check_steps(model: Any) -> None:
    """Refuse, naming it, the first step skl2onnx has no converter for, before converting
    (its own errors name a class or a shape calculator, not the step)."""
    from skl2onnx._supported_operators import sklearn_operator_name_map  # noqa: PLC0415

    for name, est in _steps(model):
        cls = type(est)
        what = f"step {name!r} ({cls.__name__})" if name else cls.__name__
        if cls.__name__ == "FunctionTransformer" and getattr(est, "func", None) is not None:
            # an arbitrary Python function: only the identity converts
            raise UnsupportedStep(f"{what} has no ONNX converter: a Python function cannot be converted")
        if cls not in sklearn_operator_name_map:
            raise UnsupportedStep(f"{what} has no ONNX converter")


def _step_named_in(model: Any, message: str) -> tuple[str, Any] | None:
    for name, est in _steps(model):
        if type(est).__name__ in message:
            return name, est
    return None


_XGB_REGISTERED = False


def _register_xgboost() -> None:
    """Let skl2onnx convert XGBoost steps inside a scikit-learn Pipeline (onnxmltools' converter,
    registered as the onnxmltools documentation shows)."""
    global _XGB_REGISTERED  # noqa: PLW0603 - registering twice is harmless but wasteful
    if _XGB_REGISTERED:
        return
    try:
        from onnxmltools.convert.xgboost.operator_converters.XGBoost import convert_xgboost  # noqa: PLC0415
        from skl2onnx import update_registered_converter  # noqa: PLC0415
        from skl2onnx.common.shape_calculator import (  # noqa: PLC0415
            calculate_linear_classifier_output_shapes,
            calculate_linear_regressor_output_shapes,
        )
        from xgboost import XGBClassifier, XGBRegressor  # noqa: PLC0415
    except ImportError:
        return
    update_registered_converter(XGBClassifier, "XGBoostXGBClassifier", calculate_linear_classifier_output_shapes,
                                convert_xgboost, options={"nocl": [True, False], "zipmap": [True, False, "columns"]})
    update_registered_converter(XGBRegressor, "XGBoostXGBRegressor", calculate_linear_regressor_output_shapes,
                                convert_xgboost)
    _XGB_REGISTERED = True


def _public_outputs(onx: Any, is_classifier: bool, n_classes: int) -> Any:
    """The converters' outputs (``label`` / ``probabilities`` or ``variable``, in their order)
    renamed to the fixed interface: ``PROBS`` [N, C] float32 first, ``LABEL`` [N, 1] int64
    (Triton's batched outputs need a dim after the batch), or ``PREDICTION`` [N, 1] float32."""
    from onnx import TensorProto, checker, helper, numpy_helper  # noqa: PLC0415 - defers a heavy import

    graph = onx.graph
    produced = [o.name for o in graph.output]
    if is_classifier:
        if len(produced) != 2:
            raise SourceError(f"the converted classifier has outputs {produced}, expected a label and probabilities")
        label, probs = produced  # both converters: label first, probabilities second
        nodes = [helper.make_node("Identity", [probs], [PROBS], name="tritonguard_probs"),
                 helper.make_node("Reshape", [label, "tritonguard_col"], ["tritonguard_label"],
                                  name="tritonguard_label_col"),
                 helper.make_node("Cast", ["tritonguard_label"], [LABEL], to=TensorProto.INT64,
                                  name="tritonguard_label_int64")]
        outs = [helper.make_tensor_value_info(PROBS, TensorProto.FLOAT, ["N", n_classes]),
                helper.make_tensor_value_info(LABEL, TensorProto.INT64, ["N", 1])]
    else:
        if len(produced) != 1:
            raise SourceError(f"the converted regressor has outputs {produced}, expected one")
        nodes = [helper.make_node("Reshape", [produced[0], "tritonguard_col"], ["tritonguard_pred"],
                                  name="tritonguard_pred_col"),
                 helper.make_node("Cast", ["tritonguard_pred"], [PREDICTION], to=TensorProto.FLOAT,
                                  name="tritonguard_pred_float")]
        outs = [helper.make_tensor_value_info(PREDICTION, TensorProto.FLOAT, ["N", 1])]
    if not any(o.domain in ("", "ai.onnx") for o in onx.opset_import):  # XGBoost's graph: ai.onnx.ml only
        onx.opset_import.append(helper.make_opsetid("", TARGET_OPSET))
    graph.initializer.append(numpy_helper.from_array(np.array([-1, 1], dtype=np.int64), "tritonguard_col"))
    graph.node.extend(nodes)
    del graph.output[:]
    graph.output.extend(outs)
    inp = graph.input[0].type.tensor_type.shape.dim[0]
    inp.dim_param = "N"  # the batch dim, named like the outputs'
    try:
        checker.check_model(onx)
    except Exception as exc:  # noqa: BLE001
        raise SourceError(f"the converted model is not valid ONNX: {first_line(exc)}") from None
    return onx
