"""Turning a spec into an artifact file (ONNX or TorchScript), its reference outputs, and hashes."""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path

import numpy as np

from exporter.build.goldens import tokenize
from exporter.build.sources.spec import ExportSpec, SourceError, eval_mode
from tritonguard.core.files import file_digest
from tritonguard.models.engines import EngineConfig, OnnxEngine

FORMATS = {"onnx": "model.onnx", "torchscript": "model.pt"}


def default_format(spec: ExportSpec) -> str:
    """Keep a file source's own format; export modules to ONNX (onnxruntime serves it fastest)."""
    if spec.artifact_path is not None and spec.artifact_path.suffix == ".pt":
        return "torchscript"
    return "onnx"


def sha256_file(path: Path) -> str:
    return file_digest(path)


def sha256_dir(path: Path) -> str:
    """One digest over a folder's files (relative names and contents, in sorted order)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + b"\0")
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _artifact_inputs(spec: ExportSpec, rows: int | None = None) -> dict[str, np.ndarray]:
    """Golden inputs at the artifact's interface (text is tokenised first)."""
    gi = spec.golden_inputs
    if rows is not None:
        gi = {k: v[:rows] for k, v in gi.items()}
    if spec.text is None:
        return {t.name: gi[t.name] for t in spec.inputs}

    return tokenize(spec.text.tokenizer_dir, gi[spec.text.text_input], spec.text.max_length,
                    [t.name for t in spec.inputs])


def _run_module(spec: ExportSpec, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch  # noqa: PLC0415 - defers a heavy import

    with torch.inference_mode():
        res = spec.module(*[torch.from_numpy(np.ascontiguousarray(feed[t.name])) for t in spec.inputs])
    if isinstance(res, dict):
        return {t.name: res[t.name].numpy() for t in spec.outputs}
    res = (res,) if isinstance(res, torch.Tensor) else tuple(res)
    if len(res) != len(spec.outputs):
        raise SourceError(f"the module returned {len(res)} outputs, the spec names {len(spec.outputs)}")
    return {t.name: r.numpy() for t, r in zip(spec.outputs, res, strict=True)}


def reference_outputs(spec: ExportSpec) -> dict[str, np.ndarray]:
    """The source model's outputs on the goldens, at the public interface."""
    if spec.reference is not None:
        out = spec.reference(dict(spec.golden_inputs))
    elif spec.module is not None:
        out = _run_module(spec, _artifact_inputs(spec))
        if spec.text is not None:
            out = {spec.text.public_output: out[spec.outputs[0].name]}
    else:  # a bare ONNX file with no stored outputs: the file is its own reference

        engine = OnnxEngine(spec.artifact_path, EngineConfig())
        out = engine.run(_artifact_inputs(spec), [t.name for t in spec.outputs])
    want = [t.name for t in spec.public_outputs]
    if missing := set(want) - set(out):
        raise SourceError(f"reference gave no outputs {sorted(missing)} (got {sorted(out)})")
    return {k: np.asarray(out[k]) for k in want}


def _dynamic_axes(spec: ExportSpec) -> dict[str, dict[int, str]]:
    axes = {}
    for t in [*spec.inputs, *spec.outputs]:
        axes[t.name] = {0: "batch", **{i + 1: f"{t.name}_{i + 1}" for i, d in enumerate(t.dims) if d == -1}}
    return axes


def build(spec: ExportSpec, fmt: str, dest_dir: Path, *, opset: int = 17) -> Path:
    """Write the artifact into ``dest_dir``; returns its path."""
    if fmt not in FORMATS:
        raise SourceError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    dest = dest_dir / FORMATS[fmt]
    dest_dir.mkdir(parents=True, exist_ok=True)
    src = spec.artifact_path
    if src is not None and src.suffix == dest.suffix:
        if fmt == "onnx":
            _refuse_external_data(src)
        shutil.copyfile(src, dest)
        return dest
    if spec.module is None:
        raise SourceError(f"{src} is an ONNX file; it cannot be served as {fmt}")
    import torch  # noqa: PLC0415 - defers a heavy import

    module = eval_mode(spec.module)
    # two rows: a batch of one lets the tracer fold the batch dim into constants
    example = tuple(torch.from_numpy(np.ascontiguousarray(v))
                    for v in _artifact_inputs(spec, rows=2).values())
    with warnings.catch_warnings():  # tracer/exporter chatter is not actionable for users
        warnings.simplefilter("ignore")
        if fmt == "onnx":
            # PRESERVE: eval_mode() already set inference mode, and torch.export modules (MLflow's
            # pt2 format) raise on the exporter's own train(False) call
            torch.onnx.export(module, example, str(dest), input_names=[t.name for t in spec.inputs],
                              output_names=[t.name for t in spec.outputs], opset_version=opset,
                              dynamic_axes=_dynamic_axes(spec), do_constant_folding=True, dynamo=False,
                              training=torch.onnx.TrainingMode.PRESERVE)
        else:
            scripted = module if isinstance(module, torch.jit.ScriptModule) else torch.jit.trace(
                module, example, check_trace=False)
            torch.jit.save(scripted, str(dest))
    return dest


def _refuse_external_data(path: Path) -> None:
    import onnx  # noqa: PLC0415 - defers a heavy import
    from onnx.external_data_helper import uses_external_data  # noqa: PLC0415 - defers a heavy import

    model = onnx.load(str(path), load_external_data=False)
    if any(uses_external_data(t) for t in model.graph.initializer):
        raise SourceError(f"{path} keeps its weights in external data files; save it as one file")
