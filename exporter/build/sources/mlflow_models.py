"""MLflow sources: a model URI (``models:/name@alias``, ``models:/name/version``,
``runs:/id/path``, or a local folder saved with ``mlflow.<flavor>.save_model``) of the
``pytorch`` or ``onnx`` flavor, or the ``sklearn`` / ``xgboost``
flavor (converted like a ``.joblib`` / XGBoost file by :mod:`.classical`; the sklearn flavor
unpickles, so the store must be trusted), downloaded once into a private
folder; golden inputs from ``--inputs`` or the input example logged with the model; the
producing run's params, metrics, datasets and commit become the version's lineage. MLflow is
imported only when such a source is loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build.sources.classical import from_estimator
from exporter.build.sources.files import from_module, from_onnx, read_npz
from exporter.build.sources.spec import TASKS, ExportSpec, SourceError, eval_mode, first_line

log = logging.getLogger(__name__)
MLFLOW_SCHEMES = ("models:/", "runs:/")
MLMODEL = "MLmodel"  # the file that makes a folder an MLflow model


CLASSICAL_FLAVORS = ("sklearn", "xgboost")


def from_mlflow(uri: str, inputs: Path | None, task: str | None, input_names: Sequence[str],
                 output_names: Sequence[str], *, tracking_uri: str | None = None) -> ExportSpec:
    """An MLflow model (pytorch, onnx, sklearn or xgboost flavor), downloaded once into a private
    temp folder. ``task`` is required for pytorch and onnx; a classical model knows its own."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # stderr noise
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    try:
        import mlflow  # noqa: PLC0415 - costs seconds; only this branch needs it
        import mlflow.artifacts  # noqa: PLC0415 - defers a heavy import
        from mlflow.models import Model  # noqa: PLC0415 - defers a heavy import
    except ImportError:
        raise SourceError("MLflow sources need the `mlflow` package (pip install mlflow)") from None
    store = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    folder = not uri.startswith(MLFLOW_SCHEMES)  # a model saved with mlflow.<flavor>.save_model: no store
    db = _sqlite_file(store)
    if not folder and db is not None and not db.is_file():  # MLflow would create an empty store and say "not found"
        raise SourceError(f"cannot load {uri}: no MLflow store at {db} (pass --mlflow-uri or set "
                          "MLFLOW_TRACKING_URI)")
    local = Path(tempfile.mkdtemp(prefix="tritonguard-mlflow-"))
    atexit.register(shutil.rmtree, local, ignore_errors=True)  # the spec reads files from it later
    try:
        if folder:
            local = Path(shutil.copytree(uri, local / "model"))
        else:
            with _mlflow_store(store):
                local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(local),
                                                                 tracking_uri=store, registry_uri=store))
        if not (local / "MLmodel").is_file():
            raise SourceError(f"{uri} is not an MLflow model (no MLmodel file)")
        meta = Model.load(str(local))
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - MLflow raises many types; the message is what matters
        raise SourceError(f"cannot load {uri} from MLflow ({store}): {first_line(exc)}") from None
    classical = next((f for f in CLASSICAL_FLAVORS if f in meta.flavors), None)
    if classical is None and task is None:
        raise SourceError(f"source {uri} needs --task ({'|'.join(TASKS)})")
    arrays = read_npz(inputs) if inputs is not None else _input_example(uri, meta, local, input_names)
    if "onnx" in meta.flavors:
        spec = from_onnx(_single_file_onnx(local / meta.flavors["onnx"]["data"]), arrays, task,
                          input_names, output_names)
        if inputs is None:  # a JSON example comes back as float64/int64: the graph says what it takes
            spec.golden_inputs = _cast_example(spec.golden_inputs, {t.name: t.dtype for t in spec.inputs})
    elif "pytorch" in meta.flavors:
        if inputs is None and meta.signature is not None:
            arrays = _cast_example(arrays, dict(zip(arrays, meta.signature.inputs.input_types(), strict=False)))
        import mlflow.pytorch  # noqa: PLC0415 - defers a heavy import

        try:
            module = mlflow.pytorch.load_model(str(local), map_location="cpu")
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"cannot load the PyTorch model of {uri}: {first_line(exc)}") from None
        spec = from_module(eval_mode(module), arrays, task, input_names, output_names)
    elif classical is not None:
        spec = from_estimator(_load_classical(uri, classical, local), arrays, task, input_names, source=uri)
    else:
        raise SourceError(f"{uri} has the flavors {', '.join(sorted(meta.flavors))}; "
                          "MLflow sources must be `pytorch`, `onnx`, `sklearn` or `xgboost` models")
    if not folder:
        _mlflow_lineage(spec, meta, store)
    return spec


def _load_classical(uri: str, flavor: str, local: Path) -> Any:
    """The fitted estimator (sklearn flavor: unpickled) or XGBoost model of an MLflow model."""
    try:
        if flavor == "sklearn":
            import mlflow.sklearn  # noqa: PLC0415 - defers a heavy import

            return mlflow.sklearn.load_model(str(local))
        import mlflow.xgboost  # noqa: PLC0415 - defers a heavy import

        return mlflow.xgboost.load_model(str(local))
    except Exception as exc:  # noqa: BLE001 - MLflow and the unpickler raise anything
        raise SourceError(f"cannot load the {flavor} model of {uri}: {first_line(exc)}") from None


@contextlib.contextmanager
def _mlflow_store(uri: str) -> Iterator[None]:
    """Point MLflow's process-wide tracking and registry URIs at ``uri`` for a while: MLflow 3
    resolves ``models:/`` URIs (and a run's logged models) through them, whatever URI the call
    names. The setters also write ``MLFLOW_*_URI`` into the environment, which the registry
    reads later: both are put back."""
    import mlflow  # noqa: PLC0415 - defers a heavy import
    from mlflow.tracking._model_registry import utils as registry_utils  # noqa: PLC0415 - defers a heavy import
    from mlflow.tracking._tracking_service import utils as tracking_utils  # noqa: PLC0415 - defers a heavy import

    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    saved = getattr(tracking_utils, "_tracking_uri", None), getattr(registry_utils, "_registry_uri", None)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri = saved
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _sqlite_file(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _input_example(uri: str, meta: Any, local: Path, input_names: Sequence[str]) -> dict[str, np.ndarray]:
    """Golden inputs from the input example logged with the model, when --inputs is absent."""
    try:
        example = meta.load_input_example(str(local)) if meta.saved_input_example_info else None
    except Exception:  # noqa: BLE001
        example = None
    if hasattr(example, "to_numpy") and not isinstance(example, np.ndarray):  # a DataFrame (sklearn)
        example = np.asarray(example.to_numpy())
    if isinstance(example, np.ndarray):
        example = {(input_names[0] if input_names else "INPUT__0"): example}
    if not isinstance(example, dict) or not example or \
            not all(isinstance(v, np.ndarray) for v in example.values()):
        raise SourceError(f"source {uri} has no tensor input example: pass --inputs FILE.npz (golden inputs)")
    rows = len(next(iter(example.values())))
    log.warning("%s: golden inputs are the model's logged input example (%d rows); --inputs gives a "
                "stronger check", uri, rows)
    return {str(k): np.ascontiguousarray(v) for k, v in example.items()}


def _cast_example(arrays: dict[str, np.ndarray], dtypes: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name, arr in arrays.items():
        want = dtypes.get(name)
        try:
            want = np.dtype(want) if want is not None else None
        except TypeError:  # a non-numpy type in an MLflow signature (e.g. a string column)
            want = None
        cast = want is not None and arr.dtype != want and np.can_cast(arr.dtype, want, casting="same_kind")
        out[name] = arr.astype(want) if cast else arr
    return out


def _single_file_onnx(path: Path) -> Path:
    """MLflow saves ONNX weights as external data by default; the repository wants one file."""
    import onnx  # noqa: PLC0415 - defers a heavy import
    from onnx.external_data_helper import uses_external_data  # noqa: PLC0415 - defers a heavy import

    if not path.is_file():
        raise SourceError(f"the MLflow onnx model has no file {path.name}")
    head = onnx.load(str(path), load_external_data=False)
    if not any(uses_external_data(t) for t in head.graph.initializer):
        return path
    whole = path.with_name(path.stem + ".single.onnx")
    try:
        onnx.save_model(onnx.load(str(path)), str(whole), save_as_external_data=False)
    except ValueError as exc:  # protobuf's 2 GiB limit
        raise SourceError(f"{path.name} is too large for one ONNX file: {exc}") from None
    return whole


def _mlflow_lineage(spec: ExportSpec, meta: Any, store: str) -> None:
    """The producing run's params, metrics, datasets and commit (best effort: a model logged
    outside a run, or a run this store cannot read, simply has no lineage)."""
    if not meta.run_id:
        return
    try:
        from mlflow import MlflowClient  # noqa: PLC0415 - defers a heavy import

        run = MlflowClient(tracking_uri=store, registry_uri=store).get_run(meta.run_id)
    except Exception as exc:  # noqa: BLE001
        log.warning("no lineage from MLflow run %s: %s", meta.run_id, first_line(exc))
        return
    spec.hyperparameters = {**dict(run.data.params), **spec.hyperparameters}
    spec.training_metrics = {**dict(run.data.metrics), **spec.training_metrics}
    datasets = [f"{d.dataset.name}@{d.dataset.digest}" for d in (run.inputs.dataset_inputs if run.inputs else [])]
    data_version = ",".join(datasets) or run.data.tags.get("data_version") or run.data.params.get("data_version")
    spec.data_version = spec.data_version or data_version or None
    spec.code_hash = spec.code_hash or run.data.tags.get("mlflow.source.git.commit") or None
