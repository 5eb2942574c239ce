"""What can be exported, and how each kind of source becomes an :class:`ExportSpec`.

A source is one of
- ``package.module:function``: a callable returning an :class:`ExportSpec` (the examples);
- a local ``.onnx`` or ``.pt`` (TorchScript) file, with golden inputs from ``--inputs FILE.npz``;
- a fitted scikit-learn estimator or Pipeline saved with joblib (``.joblib``; a pickle: it must
  be trusted) or an XGBoost model saved as ``.json`` / ``.ubj``, converted to ONNX (skl2onnx,
  onnxmltools) and checked against the model's own predictions on ``--inputs FILE.npz``;
- an MLflow model URI (``models:/name@alias``, ``models:/name/version``, ``runs:/id/path``) of the
  ``pytorch``, ``onnx``, ``sklearn`` or ``xgboost`` flavor, or a local folder such a model was
  saved to (``mlflow.<flavor>.save_model``: an ``MLmodel`` file inside), with ``--inputs`` (or
  the input example logged with the model);
  the run's params, metrics, dataset inputs and git commit become the version's lineage;
- a local Hugging Face model folder (``config.json`` + tokenizer; loaded offline): a sequence
  classifier (``*ForSequenceClassification``) or else a sentence encoder, exported behind its
  tokenizer like ``examples.minilm``; golden sentences are built in or come from ``--inputs``
  (``.txt``, one per line, or ``.npz``).

One module per kind, behind :func:`load_source` (here, with the callable kind):
:mod:`.spec` (ExportSpec, TensorDef, TextFront, SourceError: what every kind becomes),
:mod:`.files` (``.onnx``, ``.pt``, ``.npz``), :mod:`.classical` (scikit-learn, XGBoost),
:mod:`.mlflow_models` and :mod:`.hf_folders`.
They import :mod:`exporter.errors` and :mod:`tritonguard.rollout.state` only; torch, onnx, MLflow
and transformers are imported inside the functions that load such a source.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from exporter.build.sources.classical import CLASSICAL_SUFFIXES, from_file
from exporter.build.sources.files import from_module, from_onnx, read_npz
from exporter.build.sources.hf_folders import HF_CONFIG, from_hf_dir, read_texts
from exporter.build.sources.mlflow_models import MLFLOW_SCHEMES, MLMODEL, from_mlflow
from exporter.build.sources.spec import TASKS, ExportSpec, SourceError


def load_source(source: str, *, inputs: Path | None = None, task: str | None = None,
                input_names: Sequence[str] = (), output_names: Sequence[str] = (),
                mlflow_uri: str | None = None) -> ExportSpec:
    """Turn a ``--source`` string (and the flags file sources need) into an ExportSpec.
    ``mlflow_uri``: the tracking/registry URI MLflow sources are read from (default
    ``$MLFLOW_TRACKING_URI``, else MLflow's own default)."""
    if source.startswith(MLFLOW_SCHEMES):
        # the flavor decides whether --task is needed (a classical model knows its own)
        return from_mlflow(source, inputs, task, input_names, output_names, tracking_uri=mlflow_uri)
    path = Path(source)
    if path.is_dir() and (path / MLMODEL).is_file():  # a model saved with mlflow.<flavor>.save_model
        return from_mlflow(str(path), inputs, task, input_names, output_names, tracking_uri=mlflow_uri)
    if path.is_dir():
        if not (path / HF_CONFIG).is_file():
            raise SourceError(f"{path} is a folder without {HF_CONFIG}: not a Hugging Face model folder")
        return from_hf_dir(path, texts=read_texts(inputs) if inputs is not None else None, task=task)
    if path.suffix in CLASSICAL_SUFFIXES:
        if not path.is_file():
            raise SourceError(f"{path} does not exist")
        return from_file(path, _need_inputs(source, inputs), task, input_names)
    if path.suffix in (".onnx", ".pt"):
        if not path.is_file():
            raise SourceError(f"{path} does not exist")
        goldens = _need_inputs(source, inputs)
        if path.suffix == ".onnx":
            return from_onnx(path, goldens, _need_task(source, task), input_names, output_names)
        import torch  # noqa: PLC0415 - defers a heavy import

        module = torch.jit.load(str(path), map_location="cpu").eval()
        return from_module(module, goldens, _need_task(source, task), input_names, output_names,
                            artifact_path=path)
    if ":" in source:
        return _from_callable(source)
    raise SourceError(f"unrecognised source {source!r}: expected package.module:function, "
                      "a .onnx/.pt/.joblib/.json/.ubj file, a Hugging Face model folder, or an MLflow models:/ or runs:/ URI")


def _need_inputs(source: str, inputs: Path | None) -> dict[str, np.ndarray]:
    if inputs is None:
        raise SourceError(f"source {source} needs --inputs FILE.npz (golden inputs)")
    return read_npz(inputs)


def _need_task(source: str, task: str | None) -> str:
    if task is None:
        raise SourceError(f"source {source} needs --task ({'|'.join(TASKS)})")
    return task


def _from_callable(source: str) -> ExportSpec:
    mod_name, _, func_name = source.partition(":")
    try:
        func = getattr(importlib.import_module(mod_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise SourceError(f"cannot load {source}: {exc}") from None
    spec = func()
    if not isinstance(spec, ExportSpec):
        raise SourceError(f"{source} returned {type(spec).__name__}, not an ExportSpec")
    return spec
