"""What ``exporter compile`` builds from and what it builds: the parent version, resolved and
checked (:class:`Parent`: its artifact, goldens and engine settings as served), and the variants
of it (:class:`Variant`; the built-ins ``ort_opt``, ``int8_dynamic``, ``fp16``,
``torch_compile``, ``tensorrt``, each with its speed floor). onnxruntime, onnx, torch and
TensorRT are imported inside the builds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build import goldens
from exporter.build.artifacts import sha256_file
from exporter.errors import ExporterError
from tritonguard.core import repository as repo_mod
from tritonguard.core.config import from_params, model_parameters
from tritonguard.models.engines import EngineConfig, tensorrt_available

VARIANT_NAMES = ("ort_opt", "int8_dynamic", "fp16", "torch_compile", "tensorrt")
MIN_SPEEDUP = {"ort_opt": 0.90, "torch_compile": 0.90, "int8_dynamic": 1.05, "fp16": 1.05, "tensorrt": 1.05}
DEFAULT_MIN_SPEEDUP = 1.0  # a variant given through the API without a floor of its own


class CompileError(ExporterError):
    """Bad input (unknown model, version or variant; a parent without goldens); nothing written."""


class Skip(Exception):
    """The variant does not apply to this parent or machine; the message says why."""


@dataclass(kw_only=True)
class Parent:
    """An exported version, resolved: where its artifact is and what judges a variant of it."""

    repository: Path
    model: str  # the guard: the registry's name for the model
    target: str  # the guard's target (``digits_raw``, the ensemble ``minilm_raw``)
    version: int
    manifest: dict[str, Any]  # the target's manifest (sha256, golden, task, parts)
    artifact: Path  # model.onnx / model.pt / model.plan in the artifact model's version folder
    art_model: str  # the model holding the artifact (the target, or the text model's encoder)
    engine_config: EngineConfig  # as the artifact model is served
    task: str
    in_names: list[str]  # artifact interface
    out_names: list[str]
    expected: dict[str, np.ndarray]  # golden reference outputs, public names
    feed: dict[str, np.ndarray]  # golden inputs at the artifact interface (tokenised for text)
    public: dict[str, str]  # artifact output -> public output
    max_batch_size: int
    tokenizer: str | None = None  # text models: the tokenizer model, and its max_length
    max_length: int | None = None

    @property
    def text(self) -> bool:
        return self.tokenizer is not None

    @property
    def models(self) -> list[str]:
        """Models that get the new version number, artifact model first."""
        if self.tokenizer is None:
            return [self.target]
        return [self.art_model, self.tokenizer, self.target]


@dataclass(kw_only=True)
class Variant:
    """``build(parent, folder)`` writes the artifact into ``folder`` and returns its settings;
    raising :class:`Skip` means "not applicable here", any other exception rejects it."""

    name: str
    build: Callable[[Parent, Path], dict[str, Any]]
    min_speedup: float = DEFAULT_MIN_SPEEDUP
    precision: str = "float32"  # compute precision: regression goldens use its tolerances


# -- resolving the parent ---------------------------------------------------------------------
def _config(repository: Path, model: str) -> dict[str, Any]:
    if not (repository / model / repo_mod.CONFIG).exists():
        raise CompileError(f"no model '{model}' in {repository}")
    try:
        return repo_mod.read_config(repository / model)
    except Exception as exc:  # noqa: BLE001 - a broken config is the user's to fix
        raise CompileError(f"{repository / model}/config.pbtxt cannot be read ({exc})") from None


def _guard_and_target(repository: Path, model: str) -> tuple[str, str]:
    """MODEL is a guard; its target's name is accepted too (then the guard in front of it)."""
    _config(repository, model)  # exists and reads, or a CompileError naming it
    with contextlib.suppress(Exception):
        found = repo_mod.guard_dir(repository, model)
        if found is not None:
            return model, found[1]["parameters"]["target"]["string_value"]
    for d in sorted(p for p in repository.iterdir() if (p / repo_mod.CONFIG).exists()):
        with contextlib.suppress(Exception):
            other = repo_mod.read_config(d)
            if other.get("backend") == "guard" and other["parameters"]["target"]["string_value"] == model:
                # the public name: the guard's, or the ensemble's it is a step of
                public = (other.get("parameters") or {}).get("serves_as", {}).get("string_value") or d.name
                return public, model
    raise CompileError(f"'{model}' is not a guard model and no guard in {repository} fronts it")


def resolve(repository: Path, model: str, version: int) -> Parent:
    """The parent version, checked: it exists, its artifact matches its manifest, it has goldens."""

    repository = Path(repository)
    guard, target = _guard_and_target(repository, model)
    vdir = repository / target / str(version)
    manifest = repo_mod.read_manifest(vdir) if vdir.is_dir() else None
    if manifest is None:
        have = repo_mod.versions(repository / target)
        raise CompileError(f"'{guard}' has no version {version} (its target '{target}' has versions "
                           f"{have or 'none'}{'' if not vdir.is_dir() else '; that one has no manifest.json'})")
    if not (vdir / repo_mod.GOLDENS).exists():
        raise CompileError(f"'{target}' v{version} has no {repo_mod.GOLDENS}: without goldens no variant can be admitted")
    inputs, expected = goldens.load(vdir / repo_mod.GOLDENS)
    parts = manifest.get("parts") or {}
    if parts:  # a text model: the artifact lives in the encoder, the tokenizer runs first
        enc, tok = parts["encoder"], parts["tokenizer"]
        art_model, art_dir = enc["model"], repository / enc["model"] / str(enc["version"])
        art_manifest = repo_mod.read_manifest(art_dir) or {}
        tokenizer, max_length = tok["model"], int(tok["max_length"])
        tok_dir = repository / tokenizer / str(tok["version"]) / "tokenizer"
    else:
        art_model, art_dir, art_manifest, tokenizer, max_length, tok_dir = target, vdir, manifest, None, None, None
    artifact = art_dir / art_manifest.get("artifact", "")
    if not artifact.is_file():
        raise CompileError(f"'{art_model}' v{version}: artifact {artifact} is missing")
    sha = sha256_file(artifact)
    if sha != art_manifest.get("sha256"):
        raise CompileError(f"{artifact} does not match the sha256 in its manifest; refusing to compile a tampered parent")
    art_cfg = _config(repository, art_model)
    try:
        engine_config = from_params(EngineConfig, model_parameters(art_cfg), model=art_model)
    except Exception as exc:  # noqa: BLE001 - ConfigError/ValueError: the served config is broken
        raise CompileError(f"'{art_model}' config: {exc}") from None
    in_names = [t["name"] for t in art_manifest["inputs"]]
    out_names = [t["name"] for t in art_manifest["outputs"]]
    if tokenizer is not None:
        text_input = manifest["inputs"][0]["name"]
        feed = goldens.tokenize(tok_dir, inputs[text_input], max_length, in_names)
        public = {out_names[0]: manifest["outputs"][0]["name"]}
    else:
        feed = {n: inputs[n] for n in in_names}
        public = {n: n for n in out_names}
    return Parent(repository=repository, model=guard, target=target, version=version, manifest=manifest,
                  artifact=artifact, art_model=art_model, engine_config=engine_config,
                  task=manifest["task"], in_names=in_names, out_names=out_names, expected=expected,
                  feed=feed, public=public, max_batch_size=int(art_cfg.get("max_batch_size", 0)) or 64,
                  tokenizer=tokenizer, max_length=max_length)


# -- the variants -----------------------------------------------------------------------------
def _needs(parent: Parent, suffix: str, name: str) -> None:
    if parent.artifact.suffix != suffix:
        raise Skip(f"parent is {parent.artifact.name}, {name} needs model{suffix}")


def _ort_opt(parent: Parent, dest: Path) -> dict[str, Any]:
    """Offline graph optimisation. EXTENDED, not ALL: ALL adds layout rewrites (NCHWc) tuned to
    this CPU's instruction set, which must not be baked into an artifact served elsewhere."""
    _needs(parent, ".onnx", "ort_opt")
    import onnxruntime as ort  # noqa: PLC0415 - defers a heavy import

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(dest / "model.onnx")
    ort.InferenceSession(str(parent.artifact), sess_options=opts, providers=["CPUExecutionProvider"])
    return {"graph_optimization": "extended", "onnxruntime": ort.__version__}


class _QuietQuantizer(logging.Filter):
    """The quantiser logs on the root logger: an INFO line per tensor without calibration (all
    of them, by design of dynamic quantisation) and a generic "consider pre-processing" warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and "pre-processing before quantization" not in record.getMessage()


def _int8_dynamic(parent: Parent, dest: Path) -> dict[str, Any]:
    """Weights int8, activations quantised per batch at run time (no calibration data)."""
    _needs(parent, ".onnx", "int8_dynamic")
    import onnxruntime as ort  # noqa: PLC0415 - defers a heavy import
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415 - defers a heavy import

    noise = _QuietQuantizer()
    logging.getLogger().addFilter(noise)
    try:
        quantize_dynamic(str(parent.artifact), str(dest / "model.onnx"), weight_type=QuantType.QInt8)
    finally:
        logging.getLogger().removeFilter(noise)
    return {"weight_type": "QInt8", "activations": "dynamic uint8", "onnxruntime": ort.__version__}


def _fp16(parent: Parent, dest: Path) -> dict[str, Any]:
    """Weights and compute in fp16, inputs and outputs kept fp32 (the served config is unchanged)."""
    _needs(parent, ".onnx", "fp16")
    import onnx  # noqa: PLC0415 - defers a heavy import

    try:
        from onnxconverter_common import float16  # noqa: PLC0415 - defers a heavy import
        converter = "onnxconverter_common"
    except ImportError:  # onnxruntime ships the same converter
        from onnxruntime.transformers import float16  # noqa: PLC0415 - defers a heavy import
        converter = "onnxruntime.transformers.float16"
    with warnings.catch_warnings():  # "value truncated to fp16" per initializer: not actionable
        warnings.simplefilter("ignore")
        model = float16.convert_float_to_float16(onnx.load(str(parent.artifact)), keep_io_types=True)
    onnx.save(model, str(dest / "model.onnx"))
    return {"converter": converter, "keep_io_types": True}


def _torch_compile(parent: Parent, dest: Path) -> dict[str, Any]:
    """torch.compile's inductor, ahead of time (AOTInductor): the TorchScript parent becomes an
    ExportedProgram (batch dimension dynamic up to max_batch_size, -1 dims dynamic too), inductor
    compiles it to C++ and packages the shared library and weights as ``model.pt2``, which the
    runtime backend loads with ``torch._inductor.aoti_load_package``: no JIT compile at load, and
    what is served is what was judged here. Built for a portable CPU level (x86-64-v3: AVX2/FMA),
    not ``-march=native``, so the artifact runs on any such host, not only the one that built it."""
    _needs(parent, ".pt", "torch_compile")

    import torch  # noqa: PLC0415 - defers a heavy import

    if platform.machine() not in ("x86_64", "AMD64"):
        raise Skip(f"torch_compile builds portable x86-64-v3 code; this machine is {platform.machine()}")
    cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    if cxx is None:
        raise Skip("torch.compile (inductor) needs a C++ compiler: none of $CXX, g++, c++, clang++ found")
    from torch._export.converter import TS2EPConverter  # noqa: PLC0415 - defers a heavy import
    from torch._inductor import config as inductor_config  # noqa: PLC0415 - defers a heavy import

    module = torch.jit.load(str(parent.artifact), map_location="cpu").eval()
    rows = max(2, min(4, parent.max_batch_size))  # >= 2 rows: a batch of 1 would be specialised
    example = tuple(torch.from_numpy(np.ascontiguousarray(np.resize(parent.feed[n], (rows, *parent.feed[n].shape[1:]))))
                    for n in parent.in_names)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = TS2EPConverter(module, example).convert()
            batch = torch.export.Dim("batch", min=1, max=max(2, parent.max_batch_size))
            dims = _input_dims(parent)
            dynamic = tuple({0: batch, **{i + 1: torch.export.Dim(f"{n}_{i + 1}", min=1)
                                          for i, d in enumerate(dims.get(n, ())) if d == -1}}
                            for n in parent.in_names)
            program = torch.export.export(program.module(), example, dynamic_shapes=dynamic)
    except Exception as exc:  # noqa: BLE001 - whatever torch.export raises, the reason is the message
        raise Skip(f"torch.export cannot take the TorchScript model.pt: {first_line(exc)}") from None
    settings = {"backend": "inductor", "mode": "aot", "march": "x86-64-v3", "simdlen": 256, "cxx": cxx,
                "dynamic_batch": [1, max(2, parent.max_batch_size)]}
    # dynamic_threads: the kernels follow the serving process's thread count (intra_op_threads)
    # instead of baking in this machine's
    with inductor_config.patch({"cpp.march": settings["march"], "cpp.simdlen": settings["simdlen"],
                                "cpp.cxx": (None, cxx), "cpp.dynamic_threads": True}), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._inductor.aoti_compile_and_package(program, package_path=str(dest / "model.pt2"))
    return settings


def _input_dims(parent: Parent) -> dict[str, tuple[int, ...]]:
    art_manifest = repo_mod.read_manifest(parent.artifact.parent) or {}
    return {t["name"]: tuple(int(d) for d in t.get("dims", ())) for t in art_manifest.get("inputs", [])}


def _tensorrt_unavailable() -> str | None:
    if not tensorrt_available():
        return "TensorRT not importable"
    import torch  # noqa: PLC0415 - defers a heavy import

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


def _tensorrt(parent: Parent, dest: Path) -> dict[str, Any]:
    """ONNX -> serialized engine (model.plan) with one optimisation profile over the batch (and
    sequence) dims; fp16 kernels allowed where the GPU has them. Not run on our CPU machines."""
    if (why := _tensorrt_unavailable()) is not None:
        raise Skip(why)
    _needs(parent, ".onnx", "tensorrt")
    import tensorrt as trt  # noqa: PLC0415 - defers a heavy import

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(parent.artifact.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {parent.artifact.name}: {errors}")
    config = builder.create_builder_config()
    fp16 = bool(builder.platform_has_fast_fp16)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        seen = parent.feed[t.name].shape
        dims = []  # (min, opt, max) per axis
        for axis, d in enumerate(t.shape):
            if axis == 0:
                dims.append((1, min(8, parent.max_batch_size), parent.max_batch_size))
            elif d == -1:  # a sequence dim: up to the tokenizer's max_length
                dims.append((1, seen[axis], max(seen[axis], parent.max_length or seen[axis])))
            else:
                dims.append((d, d, d))
        profile.set_shape(t.name, *(tuple(x) for x in zip(*dims, strict=True)))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build an engine (see its log above)")
    (dest / "model.plan").write_bytes(bytes(plan))
    return {"fp16": fp16, "tensorrt": trt.__version__, "max_batch_size": parent.max_batch_size}


BUILTIN: dict[str, Variant] = {
    "ort_opt": Variant(name="ort_opt", build=_ort_opt, min_speedup=MIN_SPEEDUP["ort_opt"]),
    "int8_dynamic": Variant(name="int8_dynamic", build=_int8_dynamic, min_speedup=MIN_SPEEDUP["int8_dynamic"],
                            precision="int8"),
    "fp16": Variant(name="fp16", build=_fp16, min_speedup=MIN_SPEEDUP["fp16"], precision="float16"),
    "torch_compile": Variant(name="torch_compile", build=_torch_compile, min_speedup=MIN_SPEEDUP["torch_compile"]),
    "tensorrt": Variant(name="tensorrt", build=_tensorrt, min_speedup=MIN_SPEEDUP["tensorrt"], precision="float16"),
}


def variants_from(names: Iterable[str | Variant] | None) -> list[Variant]:
    """Names of built-ins (default: all of them) or :class:`Variant` objects."""
    if names is None:
        return list(BUILTIN.values())
    out = []
    for v in names:
        if isinstance(v, Variant):
            out.append(v)
        elif v in BUILTIN:
            out.append(BUILTIN[v])
        else:
            raise CompileError(f"unknown variant {v!r}; choose from {', '.join(VARIANT_NAMES)}")
    if not out:
        raise CompileError("no variants chosen")
    return out


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
