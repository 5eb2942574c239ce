"""What can be exported, and how each kind of source becomes an :class:`ExportSpec`.

A source is one of
- ``package.module:function``: a callable returning an :class:`ExportSpec` (the examples);
- a local ``.onnx`` or ``.pt`` (TorchScript) file, with golden inputs from ``--inputs FILE.npz``;
- an MLflow model URI (``models:/…``, ``runs:/…``) holding a PyTorch model, also with ``--inputs``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is heavy: import it where a module is actually built or run
    import torch

log = logging.getLogger(__name__)

TASKS = ("classifier", "embedding", "regression")
MLFLOW_SCHEMES = ("models:/", "runs:/")


class SourceError(Exception):
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


def load_source(source: str, *, inputs: Path | None = None, task: str | None = None,
                input_names: Sequence[str] = (), output_names: Sequence[str] = ()) -> ExportSpec:
    """Turn a ``--source`` string (and the flags file sources need) into an ExportSpec."""
    if source.startswith(MLFLOW_SCHEMES):
        return _from_mlflow(source, _need_inputs(source, inputs), _need_task(source, task),
                            input_names, output_names)
    path = Path(source)
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
                      "a .onnx/.pt file, or an MLflow models:/ or runs:/ URI")


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


def _from_mlflow(uri: str, arrays: dict[str, np.ndarray], task: str, input_names: Sequence[str],
                 output_names: Sequence[str]) -> ExportSpec:
    try:
        import mlflow.pytorch  # noqa: PLC0415 - costs seconds; only this branch needs it
    except ImportError:
        raise SourceError("MLflow sources need the `mlflow` package (pip install mlflow)") from None
    try:
        module = mlflow.pytorch.load_model(uri, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - MLflow raises many types; the message is what matters
        raise SourceError(f"cannot load {uri} from MLflow: {exc}") from None
    return _from_module(eval_mode(module), arrays, task, input_names, output_names)


def eval_mode(module: torch.nn.Module) -> torch.nn.Module:
    """``module.eval()``, except for modules that refuse it: MLflow's default PyTorch format
    (pt2) loads as a torch.export module, already in inference form, whose eval() raises."""
    try:
        return module.eval()
    except NotImplementedError:
        return module
