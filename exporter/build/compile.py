"""``exporter compile``: optimised variants of an exported version, admitted only on evidence.

Each variant is built from the parent version's artifact in a temporary folder, run through the
same engine code the ``runtime`` backend serves it with, and judged on the parent's goldens
(the *source model's* reference outputs, so errors never accumulate along a lineage) by the
task-aware checks of :mod:`exporter.build.goldens`. Its speed is measured against the parent in the
same process, on the same inputs, with the target's own engine settings (threads, spinning,
graph optimisation), in interleaved rounds so machine noise hits both alike.

Admission rule: golden verdict PASS or MARGINAL (as for ``export``) **and** speed ratio
(parent time / variant time) >= the variant's floor
(:data:`exporter.build.variants.MIN_SPEEDUP`, or ``min_speedup`` for all). Variants that change the arithmetic (int8, fp16, TensorRT) must be faster by 5 %:
lower precision that buys nothing is only risk. ``ort_opt`` computes the same graph and only
has to be no slower beyond timing noise (0.90). An admitted variant becomes the next free
version of the target (staged, then moved in whole; text models also get their tokenizer
version and pinned ensemble ``<name>_raw_v<N>``), with lineage, golden report and speed in
its manifest, and is registered as DRAFT. A rejected one leaves nothing in the repository.

The parent and the variants themselves are :mod:`exporter.build.variants`; this module judges,
times and writes them.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build import goldens, layout
from exporter.build.artifacts import sha256_dir, sha256_file
from exporter.build.errors import ExportError
from exporter.build.staging import next_version, now_iso, place_versions
from exporter.build.variants import (
    CompileError,
    Parent,
    Skip,
    Variant,
    first_line,
    resolve,
    variants_from,
)
from exporter.records.registry import open_registry
from tritonguard.core import repository as repo_mod
from tritonguard.models.engines import ARTIFACTS, EngineConfig, load_engine

log = logging.getLogger(__name__)

ADMITTED, REJECTED, SKIPPED = "admitted", "rejected", "skipped"


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
                place_versions(moves)
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
                repo_mod.write_placeholder(repo / pinned / "1", pinned)
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
    common = {"version": version, "created": now_iso(), "golden": result.report.as_dict(), "format": fmt,
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
        raise CompileError(f"'{parent.art_model}' v{version} cannot be loaded here: {first_line(exc)}") from None
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
                result.reason = f"{stage} failed: {first_line(exc)}"
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
                        result.reason = f"write failed: {first_line(exc)}"
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
            r.registry = f"failed: {first_line(exc)}"
        return
    for r in admitted:
        try:
            r.registry = _register(registry, parent, r)
        except Exception as exc:  # noqa: BLE001 - promote registers again (idempotently) later
            log.warning("registering '%s' v%s failed: %s", parent.model, r.version, exc)
            r.registry = f"failed: {first_line(exc)}"


def environment() -> dict[str, str]:
    """Versions that decide what a variant is and how fast it runs (for --json)."""
    out = {"cpu_count": str(os.cpu_count())}
    for mod in ("onnxruntime", "onnx", "torch"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    return out
