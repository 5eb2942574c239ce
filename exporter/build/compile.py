"""``exporter compile``: optimised variants of an exported version, admitted only on evidence.

Each variant is built from the parent version's artifact in a temporary folder, run through the
same engine code the ``runtime`` backend serves it with, and judged on the parent's goldens
(the *source model's* reference outputs, so errors never accumulate along a lineage) by the
task-aware checks of :mod:`exporter.build.goldens`. Its speed is measured against the parent in the
same process, on the same inputs, with the target's own engine settings (threads, spinning,
graph optimisation), in interleaved rounds so machine noise hits both alike.

Admission rule: golden verdict PASS or MARGINAL (as for ``export``) **and** speed ratio
(parent time / variant time) >= the variant's floor (:data:`MIN_SPEEDUP`, or ``min_speedup``
for all). Variants that change the arithmetic (int8, fp16, TensorRT) must be faster by 5 %:
lower precision that buys nothing is only risk. ``ort_opt`` computes the same graph and only
has to be no slower beyond timing noise (0.90). An admitted variant becomes the next free
version of the target (staged, then moved in whole; text models also get their tokenizer
version and pinned ensemble ``<name>_raw_v<N>``), with lineage, golden report and speed in
its manifest, and is registered as DRAFT. A rejected one leaves nothing in the repository.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exporter.errors import ExporterError
from exporter.build import goldens

from exporter.build import layout
from exporter.build.artifacts import sha256_dir, sha256_file
from exporter.build.export import ExportError, _now, _place, next_version
from tritonguard.core import repository as repo_mod
from tritonguard.models.engines import ARTIFACTS, EngineConfig, load_engine

from tritonguard.core.config import from_params, model_parameters
from tritonguard.models.engines import tensorrt_available
from exporter.records.registry import open_registry

log = logging.getLogger(__name__)

ADMITTED, REJECTED, SKIPPED = "admitted", "rejected", "skipped"
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


@dataclass(kw_only=True)
class Timing:
    parent_ms: float  # median time of one pass over the golden inputs
    variant_ms: float
    ratio: float  # median over rounds of parent time / variant time in the same round
    rounds: int
    passes: int  # passes per engine per round
    batch_size: int
    rows: int

    def as_dict(self) -> dict[str, Any]:
        return {"ratio": round(self.ratio, 4), "parent_ms": round(self.parent_ms, 4),
                "variant_ms": round(self.variant_ms, 4), "rounds": self.rounds, "passes": self.passes,
                "batch_size": self.batch_size, "rows": self.rows}


@dataclass(kw_only=True)
class VariantResult:
    variant: str
    verdict: str  # admitted | rejected | skipped
    reason: str = ""
    report: goldens.GoldenReport | None = None
    timing: Timing | None = None
    min_speedup: float | None = None
    version: int | None = None
    sha256: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    registry: str = ""  # "DRAFT (MLflow version 3)", "off", or "failed: …"

    @property
    def speed_ratio(self) -> float | None:
        return self.timing.ratio if self.timing else None

    def as_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "verdict": self.verdict, "reason": self.reason,
                "version": self.version, "speed_ratio": None if self.timing is None else round(self.timing.ratio, 4),
                "min_speedup": self.min_speedup, "speed": self.timing.as_dict() if self.timing else None,
                "golden": self.report.as_dict() if self.report else None, "sha256": self.sha256,
                "settings": self.settings, "registry": self.registry}


class Progress:
    """Hooks for a progress display; the CLI draws rich bars, the library default is silent."""

    def start(self, variants: Sequence[str]) -> None: ...
    def step(self, variant: str, label: str) -> None: ...
    def timing(self, variant: str, done: int, total: int) -> None: ...
    def done(self, result: VariantResult) -> None: ...


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
    import onnxruntime as ort  # noqa: PLC0415

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
    import onnxruntime as ort  # noqa: PLC0415
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415

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
    import onnx  # noqa: PLC0415

    try:
        from onnxconverter_common import float16  # noqa: PLC0415
        converter = "onnxconverter_common"
    except ImportError:  # onnxruntime ships the same converter
        from onnxruntime.transformers import float16  # noqa: PLC0415
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
    import platform  # noqa: PLC0415
    import shutil as _shutil  # noqa: PLC0415

    import torch  # noqa: PLC0415

    if platform.machine() not in ("x86_64", "AMD64"):
        raise Skip(f"torch_compile builds portable x86-64-v3 code; this machine is {platform.machine()}")
    cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if _shutil.which(c)), None)
    if cxx is None:
        raise Skip("torch.compile (inductor) needs a C++ compiler: none of $CXX, g++, c++, clang++ found")
    from torch._export.converter import TS2EPConverter  # noqa: PLC0415
    from torch._inductor import config as inductor_config  # noqa: PLC0415

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
        raise Skip(f"torch.export cannot take the TorchScript model.pt: {_first_line(exc)}") from None
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
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


def _tensorrt(parent: Parent, dest: Path) -> dict[str, Any]:
    """ONNX -> serialized engine (model.plan) with one optimisation profile over the batch (and
    sequence) dims; fp16 kernels allowed where the GPU has them. Not run on our CPU machines."""
    if (why := _tensorrt_unavailable()) is not None:
        raise Skip(why)
    _needs(parent, ".onnx", "tensorrt")
    import tensorrt as trt  # noqa: PLC0415

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


# -- judging ----------------------------------------------------------------------------------
def _outputs(engine, parent: Parent, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = engine.run(feed, parent.out_names)
    return {parent.public[n]: out[n] for n in parent.out_names if n in parent.public}


def judge(parent: Parent, engine, precision: str = "float32") -> goldens.GoldenReport:
    actual = _outputs(engine, parent, parent.feed)
    if parent.task == "regression" and precision == "float16":
        # judged at the tolerances of the precision it computes in (its IO stays fp32)
        actual = {k: np.asarray(v).astype(np.float16) for k, v in actual.items()}
    return goldens.check(parent.task, parent.expected, actual)


def measure(parent: Parent, parent_engine, engine, *, batch_size: int = 8, rounds: int = 20,
            min_round_s: float = 0.05, budget_s: float = 20.0,
            on_round: Callable[[int, int], None] | None = None) -> Timing:
    """Median time of one pass over the golden inputs in ``batch_size`` chunks, per engine.

    Each round times both engines back to back, alternating which goes first, so load from
    neighbours hits both alike; the ratio is the median of the rounds' ratios. A round repeats the pass until it lasts ``min_round_s`` (sub-millisecond passes
    are mostly timer and scheduler noise). At least 5 rounds, then stop at ``budget_s``."""
    rows = len(next(iter(parent.feed.values())))
    batch_size = max(1, min(batch_size, parent.max_batch_size))
    chunks = [{n: np.ascontiguousarray(a[i:i + batch_size]) for n, a in parent.feed.items()}
              for i in range(0, rows, batch_size)]

    def timed(e, passes: int) -> float:
        t0 = time.perf_counter()
        for _ in range(passes):
            for c in chunks:
                e.run(c, parent.out_names)
        return (time.perf_counter() - t0) / passes

    # warm-up (first runs allocate and pick kernels), then size the rounds on the slower engine
    slowest = max(max(timed(parent_engine, 1), timed(engine, 1)) for _ in range(3))
    passes = max(1, min(1000, int(np.ceil(min_round_s / max(slowest, 1e-9)))))
    times: dict[int, list[float]] = {0: [], 1: []}
    deadline = time.monotonic() + budget_s
    for r in range(rounds):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            times[k].append(timed(parent_engine if k == 0 else engine, passes))
        if on_round:
            on_round(r + 1, rounds)
        if r + 1 >= 5 and time.monotonic() > deadline:
            break
    # paired: a burst of load from a neighbour slows both halves of a round, not the ratio
    ratio = statistics.median(p / max(v, 1e-12) for p, v in zip(times[0], times[1], strict=True))
    return Timing(parent_ms=statistics.median(times[0]) * 1e3, variant_ms=statistics.median(times[1]) * 1e3,
                  ratio=ratio, rounds=len(times[0]), passes=passes, batch_size=batch_size, rows=rows)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


# -- writing an admitted variant --------------------------------------------------------------
def _write_version(parent: Parent, variant: Variant, built: Path, result: VariantResult) -> int:
    """Stage the new version of every model the parent spans, move them in whole, then (text)
    write the pinned ensemble. Retries with the next number if another writer took this one."""
    repo = parent.repository
    artifact = next(p for p in built.iterdir() if p.is_file())
    for _attempt in range(3):
        version = next_version(repo, parent.models)
        with tempfile.TemporaryDirectory(prefix="tritonguard-compile-") as tmp:
            stage = Path(tmp)
            moves = _stage(parent, variant, artifact, result, version, stage)
            try:
                _place(moves)
            except ExportError:
                if any((repo / m / str(version)).exists() for m in parent.models):
                    continue  # a concurrent export/compile took the number: stage again
                raise
        if parent.text:  # the ensemble the guard routes this version to
            try:
                cfg = repo_mod.read_config(repo / parent.target)
                pinned = layout.version_ensemble_name(parent.target, version)
                for step in cfg["ensemble_scheduling"]["step"]:
                    step["model_version"] = version
                layout.write(repo / pinned, {**cfg, "name": pinned})
                (repo / pinned / "1").mkdir(parents=True, exist_ok=True)
            except BaseException:  # a version the guard cannot route to must not stay
                for _, dest in moves:
                    shutil.rmtree(dest, ignore_errors=True)
                raise
        return version
    raise ExportError(f"could not claim a free version of {parent.target} after 3 attempts")


def _stage(parent: Parent, variant: Variant, artifact: Path, result: VariantResult, version: int,
           stage: Path) -> list[tuple[Path, Path]]:
    repo, old = parent.repository, parent.version
    sha = result.sha256
    fmt = {".onnx": "onnx", ".pt": "torchscript", ".pt2": "aot_inductor", ".plan": "tensorrt_plan"}[artifact.suffix]
    lineage = {"parent_version": old, "parent_sha256": parent.manifest.get("sha256"),
               "variant": variant.name, "precision": variant.precision, "settings": result.settings}
    common = {"version": version, "created": _now(), "golden": result.report.as_dict(), "format": fmt,
              "lineage": lineage, "speed": {**result.timing.as_dict(), "min_speedup": result.min_speedup}}

    def manifest(model: str, **extra: Any) -> dict[str, Any]:
        doc = {**(repo_mod.read_manifest(repo / model / str(old)) or {}), **common, **extra}
        if fmt != "onnx":
            doc.pop("opset", None)
        doc.pop("evaluation", None)  # the parent's task score, not measured on this artifact
        return doc

    # the parent's weights, recompiled: a rollout judges it on equivalence with the parent
    judging = {"judge": "equivalence", "same_weights_as": old}

    dirs = {m: stage / m / str(version) for m in parent.models}
    for d in dirs.values():
        d.mkdir(parents=True)
    shutil.copy2(artifact, dirs[parent.art_model] / artifact.name)
    target_dir = repo / parent.target / str(old)
    for name in (repo_mod.GOLDENS, "drift_reference.json"):  # same inputs, same reference
        if (target_dir / name).exists():
            shutil.copy2(target_dir / name, dirs[parent.target] / name)
    if not parent.text:
        docs = {parent.target: manifest(parent.target, artifact=artifact.name, sha256=sha, **judging)}
    else:
        tok, enc = parent.tokenizer, parent.art_model
        shutil.copytree(repo / tok / str(old) / "tokenizer", dirs[tok] / "tokenizer")
        tok_sha = sha256_dir(dirs[tok] / "tokenizer")
        parts = json.loads(json.dumps(parent.manifest["parts"]))
        parts["tokenizer"].update(version=version, sha256=tok_sha)
        parts["encoder"].update(version=version, sha256=sha)
        docs = {enc: manifest(enc, artifact=artifact.name, sha256=sha),
                tok: manifest(tok, sha256=tok_sha),
                parent.target: manifest(parent.target, artifact=f"../../{enc}/{version}/{artifact.name}",
                                        sha256=sha, parts=parts, **judging)}
    for model, doc in docs.items():
        (dirs[model] / repo_mod.MANIFEST).write_text(json.dumps(doc, indent=2) + "\n")
    return [(dirs[m], repo / m / str(version)) for m in parent.models]


def _register(registry, parent: Parent, result: VariantResult) -> str:
    vdir = parent.repository / parent.target / str(result.version)
    manifest = repo_mod.read_manifest(vdir) or {}
    metrics = {"speed_ratio": round(result.timing.ratio, 4),
               **{k: v for k, v in result.report.metrics.items() if isinstance(v, float)}}
    lineage = {"parent_version": parent.version, "hyperparameters": {"variant": result.variant, **result.settings},
               "metrics": metrics, "data_version": parent.manifest.get("source")}
    info = registry.register(parent.model, result.version, manifest, lineage, source=str(vdir.resolve()))
    return f"{info.stage} (MLflow version {info.mlflow_version})"


# -- the command --------------------------------------------------------------------------------
def compile_model(repository: Path, model: str, version: int, variants: Iterable[str | Variant] | None = None, *,
                  min_speedup: float | None = None, batch_size: int = 8, rounds: int = 20,
                  timing_budget_s: float = 20.0, registry: Any = "default",
                  progress: Progress | None = None) -> tuple[Parent, list[VariantResult]]:
    """Build, judge and time each variant of ``model`` v``version``; write the admitted ones.

    ``registry``: ``"default"`` (MLflow beside the repository, :func:`exporter.records.registry.default_uri`),
    a :class:`exporter.records.registry.Registry`, or None (no registration). Raises CompileError on bad
    input before anything is built."""
    chosen = variants_from(variants)
    if len({v.name for v in chosen}) != len(chosen):
        raise CompileError("a variant is named twice")
    parent = resolve(Path(repository), model, version)
    try:  # the parent as served: every variant is timed against it
        parent_engine = load_engine(parent.artifact.parent, parent.engine_config, parent.in_names, parent.out_names)
    except Exception as exc:  # noqa: BLE001 - ConfigError, onnxruntime/torch load errors
        raise CompileError(f"'{parent.art_model}' v{version} cannot be loaded here: {_first_line(exc)}") from None
    progress = progress or Progress()
    progress.start([v.name for v in chosen])
    results: list[VariantResult] = []
    for variant in chosen:
        floor = variant.min_speedup if min_speedup is None else min_speedup
        result = VariantResult(variant=variant.name, verdict=REJECTED, min_speedup=floor)
        with tempfile.TemporaryDirectory(prefix=f"tritonguard-{variant.name}-") as tmp:
            built = Path(tmp)
            try:
                progress.step(variant.name, "build")
                result.settings = variant.build(parent, built) or {}
                files = [p for p in built.iterdir() if p.is_file()]
                if len(files) != 1 or files[0].name not in ARTIFACTS:
                    raise RuntimeError(f"the build left {sorted(p.name for p in files)}, not one artifact")
                result.sha256 = sha256_file(files[0])
                progress.step(variant.name, "goldens")
                cfg = EngineConfig(**{**vars(parent.engine_config), "artifact": ""})
                engine = load_engine(built, cfg, parent.in_names, parent.out_names)
                result.report = judge(parent, engine, variant.precision)
                progress.step(variant.name, "timing")
                result.timing = measure(parent, parent_engine, engine, batch_size=batch_size, rounds=rounds,
                                        budget_s=timing_budget_s,
                                        on_round=lambda d, t, n=variant.name: progress.timing(n, d, t))
                del engine
            except Skip as why:
                result.verdict, result.reason = SKIPPED, str(why)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot be built or run is rejected
                log.debug("variant %s failed", variant.name, exc_info=True)
                stage = "build" if result.sha256 is None else "run"
                result.reason = f"{stage} failed: {_first_line(exc)}"
            else:
                reasons = []
                if not result.report.admitted:  # the figures are in the report (agreement column)
                    reasons.append(f"goldens {result.report.verdict}")
                ratio = result.timing.ratio
                if ratio < floor:
                    what = "slower than parent" if ratio < 1.0 else "not faster enough"
                    reasons.append(f"{what} ({ratio:.2f}x < {floor:.2f}x)")
                if reasons:
                    result.reason = "; ".join(reasons)
                else:
                    progress.step(variant.name, "write")
                    try:
                        result.version = _write_version(parent, variant, built, result)
                    except Exception as exc:  # noqa: BLE001 - disk full, permissions: nothing stays
                        result.reason = f"write failed: {_first_line(exc)}"
                    else:
                        result.verdict = ADMITTED
                        result.reason = f"v{result.version} from v{parent.version}"
        results.append(result)
        progress.done(result)
    admitted = [r for r in results if r.verdict == ADMITTED]
    if registry is None:
        for r in admitted:
            r.registry = "off"
    elif admitted:
        _register_all(parent, admitted, registry)
    return parent, results


def _register_all(parent: Parent, admitted: list[VariantResult], registry: Any) -> None:
    try:
        if isinstance(registry, str):

            registry = open_registry(parent.repository)
    except Exception as exc:  # noqa: BLE001 - the versions are written and valid; say what failed
        for r in admitted:
            r.registry = f"failed: {_first_line(exc)}"
        return
    for r in admitted:
        try:
            r.registry = _register(registry, parent, r)
        except Exception as exc:  # noqa: BLE001 - promote registers again (idempotently) later
            log.warning("registering '%s' v%s failed: %s", parent.model, r.version, exc)
            r.registry = f"failed: {_first_line(exc)}"


def environment() -> dict[str, str]:
    """Versions that decide what a variant is and how fast it runs (for --json)."""
    out = {"cpu_count": str(os.cpu_count())}
    for mod in ("onnxruntime", "onnx", "torch"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    return out
