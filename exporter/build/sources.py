"""What can be exported, and how each kind of source becomes an :class:`ExportSpec`.

A source is one of
- ``package.module:function``: a callable returning an :class:`ExportSpec` (the examples);
- a local ``.onnx`` or ``.pt`` (TorchScript) file, with golden inputs from ``--inputs FILE.npz``;
- an MLflow model URI (``models:/name@alias``, ``models:/name/version``, ``runs:/id/path``) of the
  ``pytorch`` or ``onnx`` flavor, with ``--inputs`` (or the input example logged with the model);
  the run's params, metrics, dataset inputs and git commit become the version's lineage;
- a local Hugging Face model folder (``config.json`` + tokenizer; loaded offline): a sequence
  classifier (``*ForSequenceClassification``) or else a sentence encoder, exported behind its
  tokenizer like ``examples.minilm``; golden sentences are built in or come from ``--inputs``
  (``.txt``, one per line, or ``.npz``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from exporter.errors import ExporterError
from tritonguard.rollout.state import JUDGES  # how a rollout compares a version with the one it replaces

if TYPE_CHECKING:  # torch is heavy: import it where a module is actually built or run
    import torch

log = logging.getLogger(__name__)

TASKS = ("classifier", "embedding", "regression")
MLFLOW_SCHEMES = ("models:/", "runs:/")
HF_CONFIG = "config.json"
HF_MAX_LENGTH = 512  # cap for models that state no limit of their own

# golden sentences for text models: varied lengths and scripts, so padding, truncation and
# multi-byte text all get exercised
GOLDEN_SENTENCES = [
    "Hello world.",
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Triton serves models over HTTP and gRPC.",
    "How do I reset my password?",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to points in a vector space where similar meanings lie close together.",
    "ok",
    "Stock markets fell sharply after the central bank raised interest rates by half a point.",
    "Das Wetter ist heute schön.",
    "Le chat dort sur le canapé.",
    "東京は日本の首都です。",
    "Please return the package within 30 days for a full refund, including the original receipt.",
    "42",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "She sells sea shells by the sea shore.",
    "Gradient descent updates the parameters in the direction that reduces the loss.",
    "I love this product! Five stars.",
    "Terrible service, would not recommend.",
    "The meeting has been moved to Thursday at 3 pm.",
    "emoji test 🙂🚀 and punctuation?!",
    " ".join(["A very long sentence that repeats itself to run past the maximum length."] * 30),
    "The mitochondria is the powerhouse of the cell.",
]


class SourceError(ExporterError):
    """The source cannot be loaded or does not describe an exportable model."""


@dataclass(kw_only=True)
class TensorDef:
    name: str
    dtype: str  # numpy dtype name: "float32", "int64", "object" (BYTES)
    dims: tuple[int, ...]  # per item, without the batch dim; -1 = dynamic

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


@dataclass(kw_only=True)
class TextFront:
    """A tokenizer in front of the artifact: the public input is text, not token ids."""

    tokenizer_dir: Path
    max_length: int = 256
    text_input: str = "TEXT"
    public_output: str  # e.g. "EMBEDDING", mapped from the artifact's (single) output


@dataclass(kw_only=True)
class ExportSpec:
    module: torch.nn.Module | None  # exported to ONNX (or TorchScript)
    artifact_path: Path | None = None  # file sources: the artifact itself
    inputs: list[TensorDef]  # artifact inputs
    outputs: list[TensorDef]  # artifact outputs
    golden_inputs: dict[str, np.ndarray]  # at the public interface (TEXT for text models)
    task: str  # classifier | embedding | regression
    max_batch_size: int = 64
    text: TextFront | None = None
    # source-model outputs at the public interface; None: run ``module`` (or the source file)
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    input_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    # lineage, recorded with the version in the model registry (empty / None: unknown)
    data_version: str | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    training_metrics: dict[str, float] = field(default_factory=dict)
    code_hash: str | None = None  # None: the registry records `git rev-parse HEAD` of the cwd
    # task-level judging: an evaluation set at the public interface (e.g. the held-out split),
    # its ground truth if known (class ids for a classifier, targets for a regressor, each row's
    # paired positive text for an embedding model; None: an unlabelled set, e.g. texts only),
    # and an optional slice name per row (judged on its own)
    eval_inputs: dict[str, np.ndarray] | None = None
    eval_labels: np.ndarray | None = None
    eval_slices: np.ndarray | None = None
    # how a rollout judges this version against the one it replaces: "task" (a new model: judged
    # on the task, non-inferiority) or "equivalence" (the same weights re-exported or compiled:
    # numerical tolerances). None: the exporter decides ("task" unless the artifact hash equals
    # an earlier version's)
    judge: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise SourceError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.module is None and self.artifact_path is None:
            raise SourceError("an ExportSpec needs a module or an artifact_path")
        if self.max_batch_size < 1:
            raise SourceError("max_batch_size must be >= 1 (the models are served with dynamic batching)")
        if not self.inputs or not self.outputs:
            raise SourceError("an ExportSpec needs at least one input and one output")
        if self.text is not None and len(self.outputs) != 1:
            raise SourceError("a text model maps exactly one artifact output to its public output")
        missing = {t.name for t in self.public_inputs} - set(self.golden_inputs)
        if missing:
            raise SourceError(f"golden_inputs lack {sorted(missing)}")
        rows = {len(v) for v in self.golden_inputs.values()}
        if len(rows) != 1 or 0 in rows:
            raise SourceError("golden inputs must share one non-zero batch size")
        if self.judge not in (None, *JUDGES):
            raise SourceError(f"judge must be one of {', '.join(JUDGES)}, got {self.judge!r}")
        if self.eval_inputs is None and (self.eval_labels is not None or self.eval_slices is not None):
            raise SourceError("eval_labels and eval_slices need eval_inputs")
        if self.eval_inputs is not None:
            n = {len(v) for v in self.eval_inputs.values()}
            n |= {len(x) for x in (self.eval_labels, self.eval_slices) if x is not None}
            if len(n) != 1 or 0 in n:
                raise SourceError("eval_inputs, eval_labels and eval_slices must share one non-zero number of rows")

    @property
    def public_inputs(self) -> list[TensorDef]:
        if self.text is None:
            return self.inputs
        return [TensorDef(name=self.text.text_input, dtype="object", dims=(1,))]

    @property
    def public_outputs(self) -> list[TensorDef]:
        if self.text is None:
            return self.outputs
        out = self.outputs[0]
        return [TensorDef(name=self.text.public_output, dtype=out.dtype, dims=out.dims)]

    @property
    def n_golden(self) -> int:
        return len(next(iter(self.golden_inputs.values())))

    def lineage(self) -> dict[str, Any]:
        """The lineage :meth:`exporter.records.registry.Registry.register` records (keys it fills in
        itself, code hash and parent version, are left out when unknown here)."""
        out: dict[str, Any] = {"data_version": self.data_version, "hyperparameters": dict(self.hyperparameters),
                               "metrics": dict(self.training_metrics)}
        if self.code_hash:
            out["code_hash"] = self.code_hash
        return out


def load_source(source: str, *, inputs: Path | None = None, task: str | None = None,
                input_names: Sequence[str] = (), output_names: Sequence[str] = (),
                mlflow_uri: str | None = None) -> ExportSpec:
    """Turn a ``--source`` string (and the flags file sources need) into an ExportSpec.
    ``mlflow_uri``: the tracking/registry URI MLflow sources are read from (default
    ``$MLFLOW_TRACKING_URI``, else MLflow's own default)."""
    if source.startswith(MLFLOW_SCHEMES):
        return _from_mlflow(source, inputs, _need_task(source, task), input_names, output_names,
                            tracking_uri=mlflow_uri)
    path = Path(source)
    if path.is_dir():
        if not (path / HF_CONFIG).is_file():
            raise SourceError(f"{path} is a folder without {HF_CONFIG}: not a Hugging Face model folder")
        return from_hf_dir(path, texts=read_texts(inputs) if inputs is not None else None, task=task)
    if path.suffix in (".onnx", ".pt"):
        if not path.is_file():
            raise SourceError(f"{path} does not exist")
        goldens = _need_inputs(source, inputs)
        if path.suffix == ".onnx":
            return _from_onnx(path, goldens, _need_task(source, task), input_names, output_names)
        import torch  # noqa: PLC0415

        module = torch.jit.load(str(path), map_location="cpu").eval()
        return _from_module(module, goldens, _need_task(source, task), input_names, output_names,
                            artifact_path=path)
    if ":" in source:
        return _from_callable(source)
    raise SourceError(f"unrecognised source {source!r}: expected package.module:function, "
                      "a .onnx/.pt file, a Hugging Face model folder, or an MLflow models:/ or runs:/ URI")


def _need_inputs(source: str, inputs: Path | None) -> dict[str, np.ndarray]:
    if inputs is None:
        raise SourceError(f"source {source} needs --inputs FILE.npz (golden inputs)")
    return read_npz(inputs)


def _need_task(source: str, task: str | None) -> str:
    if task is None:
        raise SourceError(f"source {source} needs --task ({'|'.join(TASKS)})")
    return task


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Golden inputs, keyed ``NAME`` or ``in__NAME``; ``out__NAME`` keys are reference outputs."""
    try:
        # no pickles: a golden file must not be able to run code
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from None


def _split_npz(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    ins = {k.removeprefix("in__"): v for k, v in arrays.items() if not k.startswith("out__")}
    outs = {k.removeprefix("out__"): v for k, v in arrays.items() if k.startswith("out__")}
    return ins, outs


def _rename(arrays: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    if not names:
        return arrays
    if len(names) != len(arrays):
        raise SourceError(f"{len(names)} input names for {len(arrays)} arrays in --inputs")
    return dict(zip(names, arrays.values(), strict=True))


def _stored_reference(outs: dict[str, np.ndarray]):
    """Reference outputs shipped in the npz (e.g. from the training framework)."""
    return (lambda _inputs: dict(outs)) if outs else None


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


def _from_onnx(path: Path, arrays: dict[str, np.ndarray], task: str, input_names: Sequence[str],
               output_names: Sequence[str]) -> ExportSpec:
    import onnx  # noqa: PLC0415
    from onnx.helper import tensor_dtype_to_np_dtype  # noqa: PLC0415

    graph = onnx.load(str(path), load_external_data=False).graph
    init = {i.name for i in graph.initializer}

    def defs(values) -> list[TensorDef]:
        out = []
        for v in values:
            t = v.type.tensor_type
            # first dim is the batch; symbolic or unknown dims become -1
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)[1:]
            out.append(TensorDef(name=v.name, dtype=str(tensor_dtype_to_np_dtype(t.elem_type)), dims=dims))
        return out

    ins_def = defs(v for v in graph.input if v.name not in init)
    outs_def = defs(graph.output)
    if output_names:
        outs_def = [o for o in outs_def if o.name in set(output_names)]
    ins, outs = _split_npz(arrays)
    ins = _rename(ins, input_names)
    reference = _stored_reference(outs)
    if reference is None:
        log.warning("%s: no out__* arrays in --inputs; the goldens record the file's own outputs", path)
    return ExportSpec(module=None, artifact_path=path, inputs=ins_def, outputs=outs_def,
                      golden_inputs=ins, task=task, reference=reference)


def _from_module(module: torch.nn.Module, arrays: dict[str, np.ndarray], task: str,
                 input_names: Sequence[str], output_names: Sequence[str], *,
                 artifact_path: Path | None = None) -> ExportSpec:
    """A module with no graph metadata: IO names from flags (or npz keys), dims from the goldens."""
    import torch  # noqa: PLC0415

    ins, outs = _split_npz(arrays)
    ins = _rename(ins, input_names)
    with torch.inference_mode():
        res = module(*[torch.from_numpy(np.ascontiguousarray(v)[:2]) for v in ins.values()])
    res = (res,) if isinstance(res, torch.Tensor) else tuple(res)
    names = list(output_names) or list(outs) or [f"OUTPUT__{i}" for i in range(len(res))]
    if len(names) != len(res):
        raise SourceError(f"{len(names)} output names for {len(res)} module outputs")
    return ExportSpec(
        module=module, artifact_path=artifact_path,
        inputs=[TensorDef(name=k, dtype=str(v.dtype), dims=tuple(v.shape[1:])) for k, v in ins.items()],
        outputs=[TensorDef(name=n, dtype=str(r.numpy().dtype), dims=tuple(r.shape[1:]))
                 for n, r in zip(names, res, strict=True)],
        golden_inputs=ins, task=task, reference=_stored_reference(outs))


def _from_mlflow(uri: str, inputs: Path | None, task: str, input_names: Sequence[str],
                 output_names: Sequence[str], *, tracking_uri: str | None = None) -> ExportSpec:
    """An MLflow model (pytorch or onnx flavor), downloaded once into a private temp folder."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # stderr noise
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    try:
        import mlflow  # noqa: PLC0415 - costs seconds; only this branch needs it
        import mlflow.artifacts  # noqa: PLC0415
        from mlflow.models import Model  # noqa: PLC0415
    except ImportError:
        raise SourceError("MLflow sources need the `mlflow` package (pip install mlflow)") from None
    store = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    db = _sqlite_file(store)
    if db is not None and not db.is_file():  # MLflow would create an empty store and say "not found"
        raise SourceError(f"cannot load {uri}: no MLflow store at {db} (pass --mlflow-uri or set "
                          "MLFLOW_TRACKING_URI)")
    local = Path(tempfile.mkdtemp(prefix="tritonguard-mlflow-"))
    atexit.register(shutil.rmtree, local, ignore_errors=True)  # the spec reads files from it later
    try:
        with _mlflow_store(store):
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(local),
                                                             tracking_uri=store, registry_uri=store))
        if not (local / "MLmodel").is_file():
            raise SourceError(f"{uri} is not an MLflow model (no MLmodel file)")
        meta = Model.load(str(local))
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - MLflow raises many types; the message is what matters
        raise SourceError(f"cannot load {uri} from MLflow ({store}): {_first_line(exc)}") from None
    arrays = read_npz(inputs) if inputs is not None else _input_example(uri, meta, local, input_names)
    if "onnx" in meta.flavors:
        spec = _from_onnx(_single_file_onnx(local / meta.flavors["onnx"]["data"]), arrays, task,
                          input_names, output_names)
        if inputs is None:  # a JSON example comes back as float64/int64: the graph says what it takes
            spec.golden_inputs = _cast_example(spec.golden_inputs, {t.name: t.dtype for t in spec.inputs})
    elif "pytorch" in meta.flavors:
        if inputs is None and meta.signature is not None:
            arrays = _cast_example(arrays, dict(zip(arrays, meta.signature.inputs.input_types(), strict=False)))
        import mlflow.pytorch  # noqa: PLC0415

        try:
            module = mlflow.pytorch.load_model(str(local), map_location="cpu")
        except Exception as exc:  # noqa: BLE001
            raise SourceError(f"cannot load the PyTorch model of {uri}: {_first_line(exc)}") from None
        spec = _from_module(eval_mode(module), arrays, task, input_names, output_names)
    else:
        raise SourceError(f"{uri} has the flavors {', '.join(sorted(meta.flavors))}; "
                          "MLflow sources must be `pytorch` or `onnx` models")
    _mlflow_lineage(spec, meta, store)
    return spec


@contextlib.contextmanager
def _mlflow_store(uri: str) -> Iterator[None]:
    """Point MLflow's process-wide tracking and registry URIs at ``uri`` for a while: MLflow 3
    resolves ``models:/`` URIs (and a run's logged models) through them, whatever URI the call
    names. The setters also write ``MLFLOW_*_URI`` into the environment, which the registry
    reads later: both are put back."""
    import mlflow  # noqa: PLC0415
    from mlflow.tracking._model_registry import utils as registry_utils  # noqa: PLC0415
    from mlflow.tracking._tracking_service import utils as tracking_utils  # noqa: PLC0415

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


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:500]


def _input_example(uri: str, meta: Any, local: Path, input_names: Sequence[str]) -> dict[str, np.ndarray]:
    """Golden inputs from the input example logged with the model, when --inputs is absent."""
    try:
        example = meta.load_input_example(str(local)) if meta.saved_input_example_info else None
    except Exception:  # noqa: BLE001
        example = None
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
    import onnx  # noqa: PLC0415
    from onnx.external_data_helper import uses_external_data  # noqa: PLC0415

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
        from mlflow import MlflowClient  # noqa: PLC0415

        run = MlflowClient(tracking_uri=store, registry_uri=store).get_run(meta.run_id)
    except Exception as exc:  # noqa: BLE001
        log.warning("no lineage from MLflow run %s: %s", meta.run_id, _first_line(exc))
        return
    spec.hyperparameters = {**dict(run.data.params), **spec.hyperparameters}
    spec.training_metrics = {**dict(run.data.metrics), **spec.training_metrics}
    datasets = [f"{d.dataset.name}@{d.dataset.digest}" for d in (run.inputs.dataset_inputs if run.inputs else [])]
    data_version = ",".join(datasets) or run.data.tags.get("data_version") or run.data.params.get("data_version")
    spec.data_version = spec.data_version or data_version or None
    spec.code_hash = spec.code_hash or run.data.tags.get("mlflow.source.git.commit") or None


# -- Hugging Face model folders -----------------------------------------------------------------
def read_texts(path: Path) -> np.ndarray:
    """Golden sentences: a ``.txt`` file (one per line, blank lines skipped) or an ``.npz`` with
    one string array (``TEXT`` / ``in__TEXT``). Returns TEXT [N,1] of UTF-8 bytes."""
    if path.suffix == ".npz":
        ins, _ = _split_npz(read_npz(path))
        if len(ins) != 1:
            raise SourceError(f"{path}: a text model takes one input array, found {sorted(ins)}")
        values = next(iter(ins.values())).reshape(-1)
        if values.dtype.kind not in "SU":
            raise SourceError(f"{path}: the golden texts must be a string array, not {values.dtype}")
        items = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values.tolist()]
    else:
        try:
            items = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise SourceError(f"cannot read golden sentences from {path}: {exc}") from None
    if not items:
        raise SourceError(f"{path} holds no golden sentences")
    return text_array(items)


def text_array(items: Sequence[str]) -> np.ndarray:
    """Sentences as the TEXT tensor Triton sends: [N,1] object array of UTF-8 bytes."""
    return np.array([s.encode("utf-8") for s in items], dtype=object).reshape(-1, 1)


def _hf_head(config: Any, task: str | None) -> str:
    """``classifier``/``regression`` for a sequence-classification model, else ``embedding``."""
    archs = list(getattr(config, "architectures", None) or [])
    seq_cls = any(a.endswith("ForSequenceClassification") for a in archs)
    if task == "embedding" or (task is None and not seq_cls):
        return "embedding"  # a classifier's encoder also embeds: its base model, pooled
    if not seq_cls:
        raise SourceError(f"--task {task} needs a sequence-classification model; this one is "
                          f"{', '.join(archs) or 'an unnamed architecture'}")
    inferred = "regression" if config.num_labels == 1 or config.problem_type == "regression" else "classifier"
    if task is not None and task != inferred:
        raise SourceError(f"this model has {config.num_labels} label(s) ({config.problem_type or 'single-label'}): "
                          f"it is a {inferred}, not a {task}")
    return inferred


def _st_pooling(path: Path) -> tuple[str, bool]:
    """(pooling, normalise) from a sentence-transformers folder (``modules.json``); a plain
    encoder folder gets mean pooling + L2 normalisation, as ``examples.minilm``."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "mean", True
    try:
        modules = json.loads(modules_file.read_text())
        pool_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), None)
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        pool_cfg = json.loads((path / pool_dir / "config.json").read_text()) if pool_dir is not None else {}
    except (OSError, ValueError, AttributeError) as exc:
        raise SourceError(f"cannot read the sentence-transformers configuration of {path}: {exc}") from None
    modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
             for k, v in pool_cfg.items() if k.startswith("pooling_mode_") and v is True]
    if not modes:
        return "mean", normalize
    if modes not in (["mean"], ["cls"]):
        raise SourceError(f"{path}: pooling {'+'.join(modes)} is not supported (mean or cls)")
    return modes[0], normalize


def _hf_max_length(path: Path, tokenizer: Any, config: Any) -> int:
    st = path / "sentence_bert_config.json"
    if st.is_file():
        try:
            value = json.loads(st.read_text()).get("max_seq_length")
        except (OSError, ValueError):
            value = None
        if isinstance(value, int) and value > 0:
            return value
    limits = [HF_MAX_LENGTH, getattr(tokenizer, "model_max_length", None),
              getattr(config, "max_position_embeddings", None)]
    return min(v for v in limits if isinstance(v, int) and v > 0)


@functools.cache
def _hf_wrappers() -> tuple[type, type]:
    """nn.Module wrappers, defined on first use (this module does not import torch at import)."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    class PooledEncoder(nn.Module):
        """(input_ids, attention_mask) [N,S] int64 -> sentence_embedding [N,D]: the encoder's
        last hidden state, mean- (over the attention mask) or CLS-pooled, L2-normalised if asked."""

        def __init__(self, encoder: nn.Module, pooling: str = "mean", normalize: bool = True):
            super().__init__()
            self.encoder, self.pooling, self.normalize = encoder, pooling, normalize

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                # clamp: an all-padding row must give zeros, not NaN
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return nn.functional.normalize(pooled, p=2.0, dim=1) if self.normalize else pooled

    class SequenceClassifier(nn.Module):
        """(input_ids, attention_mask) -> probabilities (softmax; sigmoid for multi-label) or,
        for a one-label regression head, the score."""

        def __init__(self, model: nn.Module, activation: str):
            super().__init__()
            self.model, self.activation = model, activation

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
            if self.activation == "softmax":
                return torch.softmax(logits, dim=-1)
            return torch.sigmoid(logits) if self.activation == "sigmoid" else logits

    return PooledEncoder, SequenceClassifier


def from_hf_dir(path: Path, *, texts: np.ndarray | None = None, task: str | None = None,
                max_length: int | None = None) -> ExportSpec:
    """A local Hugging Face model folder (offline) as a text model: tokenizer -> artifact.
    Golden inputs: ``texts`` (TEXT [N,1]) or :data:`GOLDEN_SENTENCES`; the reference embeds
    them one at a time with the torch model, unpadded, as a user would."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    if task is not None and task not in TASKS:
        raise SourceError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    try:
        import torch  # noqa: PLC0415
        from transformers import (  # noqa: PLC0415
            AutoConfig,
            AutoModel,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )
    except ImportError:
        raise SourceError("Hugging Face sources need the `transformers` package") from None
    try:
        config = AutoConfig.from_pretrained(str(path))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError…
        raise SourceError(f"cannot load {path} as a Hugging Face model: {_first_line(exc)}") from None
    head = _hf_head(config, task)
    PooledEncoder, SequenceClassifier = _hf_wrappers()  # noqa: N806
    try:
        # eager attention: the implementation the ONNX export recipe was verified with
        if head == "embedding":
            pooling, normalize = _st_pooling(path)
            base = AutoModel.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32)
            module = PooledEncoder(base, pooling, normalize)
            out_name, public = "sentence_embedding", "EMBEDDING"
        else:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(path), attn_implementation="eager", dtype=torch.float32)
            activation = ("identity" if head == "regression" else
                          "sigmoid" if config.problem_type == "multi_label_classification" else "softmax")
            module = SequenceClassifier(model, activation)
            out_name, public = ("score", "SCORE") if head == "regression" else ("probabilities", "PROBS")
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise SourceError(f"cannot load the model in {path}: {_first_line(exc)}") from None
    module = module.eval()
    max_length = max_length or _hf_max_length(path, tokenizer, config)
    texts = text_array(GOLDEN_SENTENCES) if texts is None else texts

    def embed(items: Sequence[str]) -> np.ndarray:
        with torch.inference_mode():
            enc = tokenizer(list(items), truncation=True, max_length=max_length, return_tensors="pt",
                            padding=True)
            return module(enc["input_ids"], enc["attention_mask"]).numpy()

    def reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The torch model, one sentence at a time: no padding at all."""
        items = [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in inputs["TEXT"].reshape(-1)]
        return {public: np.concatenate([embed([t]) for t in items]).astype(np.float32)}

    try:
        dims = tuple(embed(["dims probe"]).shape[1:])
    except Exception as exc:  # noqa: BLE001 - e.g. an encoder-decoder model with no last_hidden_state
        raise SourceError(f"cannot run the model in {path} as a {head} on text: {_first_line(exc)}") from None
    return ExportSpec(
        module=module,
        inputs=[TensorDef(name="input_ids", dtype="int64", dims=(-1,)),
                TensorDef(name="attention_mask", dtype="int64", dims=(-1,))],
        outputs=[TensorDef(name=out_name, dtype="float32", dims=dims)],
        golden_inputs={"TEXT": texts}, task=head, max_batch_size=64,
        text=TextFront(tokenizer_dir=path, max_length=max_length, public_output=public),
        reference=reference,
    )


def eval_mode(module: torch.nn.Module) -> torch.nn.Module:
    """``module.eval()``, except for modules that refuse it: MLflow's default PyTorch format
    (pt2) loads as a torch.export module, already in inference form, whose eval() raises."""
    try:
        return module.eval()
    except NotImplementedError:
        return module
