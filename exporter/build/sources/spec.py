"""What every source becomes: :class:`ExportSpec` (the model, its artifact interface as
:class:`TensorDef` s, golden inputs, task, lineage, evaluation set and judge), with
:class:`TextFront` for a tokenizer in front, and :class:`SourceError` for a source that cannot
become one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from exporter.errors import ExporterError
from tritonguard.rollout.state import JUDGES  # how a rollout compares it with the one it replaces

if TYPE_CHECKING:  # torch is heavy: import it where a module is actually built or run
    import torch

TASKS = ("classifier", "embedding", "regression")


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


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:500]


def eval_mode(module: torch.nn.Module) -> torch.nn.Module:
    """``module.eval()``, except for modules that refuse it: MLflow's default PyTorch format
    (pt2) loads as a torch.export module, already in inference form, whose eval() raises."""
    try:
        return module.eval()
    except NotImplementedError:
        return module
