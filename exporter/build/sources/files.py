"""File sources: a local ``.onnx`` (interface read from the graph) or ``.pt`` (TorchScript;
interface from names given and the golden inputs), with golden inputs from an ``.npz``
(``NAME`` / ``in__NAME`` inputs, ``out__NAME`` reference outputs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from exporter.build.sources.spec import ExportSpec, SourceError, TensorDef

if TYPE_CHECKING:  # torch is heavy: import it where a module is actually built or run
    import torch

log = logging.getLogger(__name__)


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Golden inputs, keyed ``NAME`` or ``in__NAME``; ``out__NAME`` keys are reference outputs."""
    try:
        # no pickles: a golden file must not be able to run code
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from None


def split_npz(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
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


def from_onnx(path: Path, arrays: dict[str, np.ndarray], task: str, input_names: Sequence[str],
               output_names: Sequence[str]) -> ExportSpec:
    import onnx  # noqa: PLC0415 - defers a heavy import
    from onnx.helper import tensor_dtype_to_np_dtype  # noqa: PLC0415 - defers a heavy import

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
    ins, outs = split_npz(arrays)
    ins = _rename(ins, input_names)
    reference = _stored_reference(outs)
    if reference is None:
        log.warning("%s: no out__* arrays in --inputs; the goldens record the file's own outputs", path)
    return ExportSpec(module=None, artifact_path=path, inputs=ins_def, outputs=outs_def,
                      golden_inputs=ins, task=task, reference=reference)


def from_module(module: torch.nn.Module, arrays: dict[str, np.ndarray], task: str,
                 input_names: Sequence[str], output_names: Sequence[str], *,
                 artifact_path: Path | None = None) -> ExportSpec:
    """A module with no graph metadata: IO names from flags (or npz keys), dims from the goldens."""
    import torch  # noqa: PLC0415 - defers a heavy import

    ins, outs = split_npz(arrays)
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
