"""Load and run a model artifact: ONNX (onnxruntime), TorchScript (torch), an AOTInductor package
(``model.pt2``, what ``exporter compile``'s torch_compile variant writes), TensorRT plan.

Shared by the ``runtime`` backend and by the guard's in-process placement, so there is one
inference code path whichever process runs it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonguard.core.errors import ConfigError

log = logging.getLogger(__name__)

ARTIFACTS = ("model.onnx", "model.pt", "model.pt2", "model.plan")
# what exporter compile builds model.pt2 for (-march=x86-64-v3); checked before loading, because
# code for a CPU level the host lacks dies of SIGILL, taking the model's process with it
X86_64_V3_FLAGS = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")


@dataclass(kw_only=True)
class EngineConfig:
    """``parameters`` of a ``runtime`` model (and ``runtime.*`` of an in-process guard)."""

    artifact: str = ""  # file in the version folder; default: the first of ARTIFACTS present
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    # onnxruntime busy-waits by default; on a shared CPU that steals cores from neighbours
    allow_spinning: bool = False
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    graph_optimization: str = "all"  # disable | basic | extended | all

    def __post_init__(self) -> None:
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ValueError("thread counts must be >= 0 (0 = library default)")
        if self.graph_optimization not in ("disable", "basic", "extended", "all"):
            raise ValueError(f"graph_optimization must be disable|basic|extended|all, got {self.graph_optimization!r}")


def find_artifact(version_dir: Path, name: str = "") -> Path:
    if name:
        path = version_dir / name
        if not path.exists():
            raise ConfigError(f"artifact {path} does not exist")
        return path
    for cand in ARTIFACTS:
        if (version_dir / cand).exists():
            return version_dir / cand
    raise ConfigError(f"no artifact ({', '.join(ARTIFACTS)}) in {version_dir}")


class Engine:
    """``run(inputs) -> outputs`` over one fused batch."""

    path: Path
    output_names: tuple[str, ...]

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError


class OnnxEngine(Engine):
    def __init__(self, path: Path, cfg: EngineConfig):
        import onnxruntime as ort  # noqa: PLC0415

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = cfg.intra_op_threads
        opts.inter_op_num_threads = cfg.inter_op_threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if cfg.allow_spinning else "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "1" if cfg.allow_spinning else "0")
        opts.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[cfg.graph_optimization]
        available = set(ort.get_available_providers())
        providers = [p for p in cfg.providers if p in available]
        if not providers:
            raise ConfigError(f"none of providers {cfg.providers} is available (have {sorted(available)})")
        self.path = path
        self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())

    def run(self, inputs, outputs=None):
        names = list(outputs or self.output_names)
        feed = {k: inputs[k] for k in self.input_names}
        return dict(zip(names, self.session.run(names, feed), strict=True))


class TorchScriptEngine(Engine):
    """TorchScript module called with inputs in config order; outputs in config order."""

    def __init__(self, path: Path, cfg: EngineConfig, input_names: Sequence[str], output_names: Sequence[str]):
        import torch  # noqa: PLC0415

        if cfg.intra_op_threads:
            torch.set_num_threads(cfg.intra_op_threads)
        self.torch = torch
        self.path = path
        self.module = self._load(torch, path)
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)

    def _load(self, torch, path: Path):
        return torch.jit.load(str(path), map_location="cpu").eval()

    def run(self, inputs, outputs=None):
        torch = self.torch
        with torch.inference_mode():
            res = self.module(*[torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in self.input_names])
        if isinstance(res, torch.Tensor):
            res = (res,)
        elif isinstance(res, dict):
            res = tuple(res[n] for n in self.output_names)
        got = dict(zip(self.output_names, (r.numpy() for r in res), strict=False))
        return {n: got[n] for n in (outputs or self.output_names)}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


class _DropIsaNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "AOTI_CPU_ISA" not in record.getMessage()


@contextlib.contextmanager
def _quiet_isa_notice():
    """torch warns when the package's vector ISA (AVX2: built portable on purpose) differs from
    the host's best (e.g. AVX512); the flags check above is what guards against a CPU too old."""
    logger, drop = logging.getLogger("torch.export.pt2_archive._package"), _DropIsaNotice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class AOTInductorEngine(TorchScriptEngine):
    """An AOTInductor package: inductor's C++ code and the weights, compiled ahead of time."""

    def _load(self, torch, path: Path):
        import platform  # noqa: PLC0415

        if platform.machine() in ("x86_64", "AMD64"):
            flags = _cpu_flags()
            missing = [f for f in X86_64_V3_FLAGS if flags and f not in flags]
            if missing:
                raise ConfigError(f"{path.name} is compiled for x86-64-v3; this CPU lacks {', '.join(missing)}")
        try:
            with _quiet_isa_notice():
                return torch._inductor.aoti_load_package(str(path))
        except Exception as exc:  # noqa: BLE001 - a package from another torch version, a truncated file
            raise ConfigError(f"{path.name}: torch {torch.__version__} cannot load this AOTInductor package: "
                              f"{type(exc).__name__}: {str(exc).strip()[:300]}") from None


class TensorRTEngine(Engine):
    """A serialized TensorRT engine run through torch CUDA buffers (TensorRT 10 tensor API).

    Needs a GPU and TensorRT; CI has neither, so only the import guard above is tested there.
    """

    def __init__(self, path: Path, input_names: Sequence[str], output_names: Sequence[str]):
        import tensorrt as trt  # noqa: PLC0415
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise ConfigError(f"{path.name}: TensorRT plans need a CUDA device, none is visible")
        self.trt, self.torch, self.path = trt, torch, path
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise ConfigError(f"{path.name}: TensorRT could not deserialize the plan (built for another GPU/version?)")
        self.context = self.engine.create_execution_context()
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)

    def run(self, inputs, outputs=None):
        torch, trt = self.torch, self.trt
        bufs = {}
        for n in self.input_names:
            t = torch.from_numpy(np.ascontiguousarray(inputs[n])).cuda()
            self.context.set_input_shape(n, tuple(t.shape))
            self.context.set_tensor_address(n, t.data_ptr())
            bufs[n] = t
        for n in self.output_names:
            shape = tuple(self.context.get_tensor_shape(n))
            dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(self.engine.get_tensor_dtype(n)))).dtype
            t = torch.empty(shape, dtype=dtype, device="cuda")
            self.context.set_tensor_address(n, t.data_ptr())
            bufs[n] = t
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"{self.path.name}: TensorRT execution failed")
        stream.synchronize()
        return {n: bufs[n].cpu().numpy() for n in (outputs or self.output_names)}


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def load_engine(version_dir: Path, cfg: EngineConfig, input_names: Sequence[str], output_names: Sequence[str]) -> Engine:
    path = find_artifact(version_dir, cfg.artifact)
    if path.suffix == ".onnx":
        engine: Engine = OnnxEngine(path, cfg)
        missing = set(input_names) - set(engine.input_names)  # type: ignore[attr-defined]
        if missing:
            raise ConfigError(f"{path.name} has no inputs {sorted(missing)} (graph inputs: {engine.input_names})")  # type: ignore[attr-defined]
        return engine
    if path.suffix == ".pt":
        return TorchScriptEngine(path, cfg, input_names, output_names)
    if path.suffix == ".pt2":
        return AOTInductorEngine(path, cfg, input_names, output_names)
    if path.suffix == ".plan":
        if not tensorrt_available():
            raise ConfigError(
                f"{path.name} is a TensorRT plan but the `tensorrt` Python package is not importable "
                "here; serve it from the NGC image (platform: tensorrt_plan) or install TensorRT on a GPU host"
            )
        return TensorRTEngine(path, input_names, output_names)
    raise ConfigError(f"unknown artifact type {path.name}")
