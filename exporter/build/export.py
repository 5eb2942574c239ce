"""The export pipeline: source -> artifact -> golden check -> model repository.

Everything is staged in a temporary folder and checked first; the repository is touched only
after the golden check admits the artifact, and then only by adding new version folders (moved
in whole) and rewriting config.pbtxt files. Existing versions are never overwritten, and a
rewritten config.pbtxt keeps what the user set in it (:func:`exporter.build.layout.merge`): only the
interface, and what a model cannot be served correctly without, come from the export.

The golden check runs the artifact on the whole golden set, on a few rows one at a time and on
the rows tiled up to max_batch_size. A spec with an evaluation set also gets ``eval.npz`` and
its task score in the manifest (:mod:`exporter.build.evaluate`), and every version records how a
rollout should judge it (``judge``: ``task`` or ``equivalence``).

Models written for ``--name NAME``:
- plain model: ``NAME_raw`` (backend runtime, the artifact) and ``NAME`` (guard, in-process);
- text model: ``NAME_tokenizer`` + ``NAME_encoder`` joined by the ensemble ``NAME_raw``, and
  the public ``NAME``: an ensemble ``NAME_intake`` -> ``NAME_guard`` (guard, over BLS) that keeps
  a malformed BYTES request from failing the batch it lands in (:mod:`tritonguard.models.intake`).
  The three parts share one version number per export. A repository exported before the intake
  existed (``NAME`` itself the guard) is moved to this layout by its next export, settings and
  rollout state kept.

:func:`export_source` then registers the version in the MLflow model registry
(:mod:`exporter.records.registry`) as DRAFT, with the artifact hash, golden verdict and lineage. A
registry that fails or does not answer in time does not undo the export: the result carries
the error, and ``exporter promote`` registers the version later (registration is idempotent).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from exporter.errors import ExporterError
from exporter.build import artifacts

from exporter.build import goldens

from exporter.build import layout
from exporter.build.goldens import GoldenReport
from exporter.build.sources import (
    HF_CONFIG,
    JUDGES,
    MLFLOW_SCHEMES,
    ExportSpec,
    SourceError,
    load_source,
    read_npz,
    text_array,
)
from tritonguard.core import repository as repo_mod
from tritonguard.core.errors import ConfigError

from exporter.records.registry import default_uri, open_registry
from exporter.build.evaluate import EVAL, EvaluationError, evaluate, save_eval
from tritonguard.core.config import from_params, layered_parameters, model_parameters
from tritonguard.privacy.redaction import RedactionConfig, Redactor
from tritonguard.core.config import model_parameters
from tritonguard.guard.model import GuardConfig, check_signature
from tritonguard.core.tensors import ModelSignature
from tritonguard.guard.model import GuardConfig
from tritonguard.core.config import layered_parameters
from tritonguard.rollout.drift import REFERENCE_FILE, reference_from_inputs

FORMAT_VERSION = 1
LABELS = "labels"  # the array of an --inputs .npz that holds the evaluation labels
REGISTER_TIMEOUT_S = 60.0  # a registry that has not answered by then does not hold up the export
# Triton model names become folder names and URL path segments
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

Step = Callable[[str], AbstractContextManager]


class ExportError(ExporterError):
    """The export cannot proceed; nothing was written to the repository."""


class DuplicateArtifact(ExportError):
    """The new artifact is byte-identical (same sha256) to an existing version of the model:
    refused unless the export is forced; nothing was written."""

    def __init__(self, name: str, version: int, sha256: str, where: Path):
        self.name, self.version, self.sha256 = name, version, sha256
        super().__init__(f"{name} v{version} already holds this artifact (sha256 {sha256[:16]}…, {where}): "
                         f"nothing new to export. Use v{version}, or export again with --force "
                         f"(force=True) to add it as a new version judged by equivalence")


class GoldenCheckFailed(ExportError):
    def __init__(self, report: GoldenReport):
        self.report = report
        where = f" at batch {report.batch}" if report.batch is not None else ""
        if report.error:  # NaN/Inf, a shape mismatch: the figures would only say nan
            what = f": {report.error}"
        else:
            what = " (" + ", ".join(f"{k}={_fmt(v)}" for k, v in report.metrics.items()) + ")"
        super().__init__(f"golden check FAILED{where} on {report.n} samples{what}; nothing was written")


@dataclass
class ExportResult:
    name: str
    version: int
    models: list[str]  # every model folder written or rewritten, targets first
    artifact: Path  # in the repository
    sha256: str
    report: GoldenReport
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step
    registration: Any = None  # exporter.records.registry.ModelVersionInfo once registered
    registration_error: str | None = None  # why it was not (the export itself stands)
    registry_uri: str | None = None
    notices: list[str] = field(default_factory=list)  # settings kept from (or reset in) existing configs
    judge: str = "task"  # how a rollout judges this version: task | equivalence
    same_weights_as: int | None = None  # an earlier version with the same artifact sha256
    evaluation: dict[str, Any] | None = None  # {"metric", "value", "n", "sha256"} on the eval set


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


# roles that are not versioned targets: the guard and what serves it under the public name
_FRONT_ROLES = ("guard", "intake", "front")  # written in this order: the public name last


def model_names(name: str, text: bool) -> dict[str, str]:
    """Model name per role. ``front`` is the public name when the guard is behind an intake."""
    if text:
        return {"tokenizer": f"{name}_tokenizer", "encoder": f"{name}_encoder", "raw": f"{name}_raw",
                "front": name, **layout.front_names(name)}
    return {"raw": f"{name}_raw", "guard": name}


def next_version(repository: Path, models: Sequence[str]) -> int:
    return 1 + max((max(repo_mod.versions(repository / m), default=0) for m in models), default=0)


def export_source(source: str, *, name: str, repository: Path, fmt: str | None = None, opset: int = 17,
                  inputs: Path | None = None, task: str | None = None, input_names: Sequence[str] = (),
                  output_names: Sequence[str] = (), step: Step | None = None, native: bool = False,
                  mlflow_uri: str | None = None, register: bool = True,
                  register_timeout: float = REGISTER_TIMEOUT_S, judge: str | None = None,
                  force: bool = False, eval_path: Path | None = None) -> ExportResult:
    """Load ``source`` (see :mod:`exporter.build.sources`), export it, and register the new version
    (unless ``register`` is false; a registry failure is reported in the result, not raised).
    ``force``: export even when an existing version has the same artifact (see :func:`export`).
    An ``--inputs`` .npz with a ``labels`` array (file, MLflow and Hugging Face sources) also
    becomes the evaluation set: its input rows with those labels."""
    timings: dict[str, float] = {}
    with _timed(step, timings, "load source"), _without_labels(source, inputs) as (inputs, labels):
        spec = load_source(source, inputs=inputs, task=task, input_names=input_names, output_names=output_names,
                           mlflow_uri=mlflow_uri)
        if labels is not None:
            spec = _with_eval_labels(spec, labels)
        if eval_path is not None:
            spec = read_eval_file(eval_path, spec)
    try:
        result = export(spec, name=name, repository=repository, source=source, fmt=fmt, opset=opset, step=step,
                        native=native, judge=judge, force=force)
    except ConfigError as exc:  # a guard parameter in the existing config.pbtxt (or a layer) is wrong
        raise ExportError(str(exc)) from None
    result.timings = {**timings, **result.timings}
    if register:
        t0 = time.perf_counter()
        register_version(result, spec, Path(repository), timeout=register_timeout)
        result.timings["register"] = time.perf_counter() - t0
    return result


def register_version(result: ExportResult, spec: ExportSpec, repository: Path, *,
                     timeout: float = REGISTER_TIMEOUT_S) -> None:
    """Register ``result``'s version under the guard's name, in the registry beside the
    repository (or ``$MLFLOW_TRACKING_URI``); fills ``result.registration`` or
    ``result.registration_error``. Runs in a daemon thread so that a registry that hangs costs
    at most ``timeout`` seconds (register() is idempotent: a later ``promote`` registers a
    version whose registration did not finish)."""

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # no "creating tables" INFO lines
    uri = result.registry_uri = default_uri(repository)
    raw = model_names(result.name, spec.text is not None)["raw"]
    vdir = (repository / raw / str(result.version)).resolve()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            manifest = repo_mod.read_manifest(vdir)
            if manifest is None:
                raise ExportError(f"{vdir} has no manifest")
            box["info"] = open_registry(repository).register(result.name, result.version, manifest, spec.lineage(),
                                                 source=str(vdir))
        except Exception as exc:  # noqa: BLE001 - reported to the caller; the export stands
            lines = str(exc).strip().splitlines()
            box["error"] = f"{type(exc).__name__}: {lines[0][:500] if lines else ''}"

    worker = threading.Thread(target=work, name="tritonguard-register", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        result.registration_error = f"the registry {uri} did not answer within {timeout:g} s"
    elif "info" in box:
        result.registration = box["info"]
    else:
        result.registration_error = box.get("error", "unknown error")


def _takes_inputs(source: str) -> bool:
    """Whether ``load_source`` reads ``--inputs`` for this source (callables bring their own)."""
    path = Path(source)
    return source.startswith(MLFLOW_SCHEMES) or path.suffix in (".onnx", ".pt") or (path / HF_CONFIG).is_file()


@contextmanager
def _without_labels(source: str, inputs: Path | None) -> Iterator[tuple[Path | None, Any]]:
    """(inputs file for load_source, labels or None): an .npz holding ``labels`` is passed on
    without them (a copy in a temporary folder), so no source takes them for a model input."""
    if inputs is None or Path(inputs).suffix != ".npz" or not _takes_inputs(source):
        yield inputs, None
        return
    arrays = read_npz(Path(inputs))
    if LABELS not in arrays:
        yield inputs, None
        return
    labels = arrays.pop(LABELS)
    if not arrays:
        raise SourceError(f"{inputs} holds only '{LABELS}', no inputs")
    with tempfile.TemporaryDirectory(prefix="tritonguard-inputs-") as tmp:
        path = Path(tmp) / Path(inputs).name
        with open(path, "wb") as fh:
            np.savez(fh, **arrays)
        yield path, labels


def read_eval_file(path: Path, spec: ExportSpec) -> ExportSpec:
    """``spec`` with the evaluation set of ``--eval FILE``:

    - ``.npz``: the public inputs (``NAME`` or ``in__NAME``), optional ``labels`` and ``slices``;
    - ``.txt`` (text models): one text a line, no labels (compared, not scored);
    - ``.tsv`` (text models): ``query<TAB>positive`` a line: paired texts, scored as recall@k;
    - ``.jsonl`` (text models): ``{"text": ..., "positive": ..., "slice": ...}`` a line
      (``positive`` and ``slice`` optional, all rows alike)."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"--eval: {path} does not exist")
    names = [t.name for t in spec.public_inputs]
    suffix = path.suffix.lower()
    if suffix == ".npz":
        arrays = read_npz(path)
        labels, slices = arrays.pop(LABELS, None), arrays.pop("slices", None)
        inputs = {k.removeprefix("in__"): v for k, v in arrays.items() if not k.startswith("out__")}
        if set(inputs) != set(names):
            raise SourceError(f"--eval {path}: the model takes inputs {names}, the file holds {sorted(inputs)}")
        inputs = {k: (v.astype(object) if v.dtype.kind in "SU" else v) for k, v in inputs.items()}
        return replace(spec, eval_inputs=inputs, eval_labels=labels, eval_slices=slices)
    if spec.text is None:
        raise SourceError(f"--eval {path}: a {spec.task} model takes an .npz evaluation set "
                          "(its inputs, 'labels', optional 'slices')")
    texts, positives, slices = _eval_texts(path, suffix)
    if not texts:
        raise SourceError(f"--eval {path} holds no texts")
    return replace(spec, eval_inputs={names[0]: text_array(texts)},
                   eval_labels=None if positives is None else np.array([p.encode() for p in positives], dtype=object),
                   eval_slices=None if slices is None else np.array(slices, dtype=object))


def _eval_texts(path: Path, suffix: str) -> tuple[list[str], list[str] | None, list[str] | None]:
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"--eval: cannot read {path}: {exc}") from None
    if suffix == ".txt":
        return lines, None, None
    if suffix == ".tsv":
        rows = [ln.split("\t") for ln in lines]
        if bad := [i + 1 for i, r in enumerate(rows) if len(r) != 2 or not all(x.strip() for x in r)]:
            raise SourceError(f"--eval {path}: line {bad[0]} is not 'query<TAB>positive'")
        return [r[0] for r in rows], [r[1] for r in rows], None
    if suffix != ".jsonl":
        raise SourceError(f"--eval {path}: expected .npz, .txt, .tsv or .jsonl")
    texts, pos, sl = [], [], []
    for i, ln in enumerate(lines, 1):
        try:
            row = json.loads(ln)
            texts.append(str(row["text"]))
        except (ValueError, KeyError, TypeError):
            raise SourceError(f"--eval {path}: line {i} is not a JSON object with 'text'") from None
        pos.append(row.get("positive"))
        sl.append(row.get("slice"))
    if any(p is None for p in pos) and not all(p is None for p in pos):
        raise SourceError(f"--eval {path}: 'positive' must be on every line or on none")
    return (texts, None if pos[0] is None else [str(p) for p in pos],
            None if all(x is None for x in sl) else [str(x or "") for x in sl])


def _with_eval_labels(spec: ExportSpec, labels: Any) -> ExportSpec:
    """``spec`` with its golden input rows, labelled, as its evaluation set."""
    if len(labels) != spec.n_golden:
        raise SourceError(f"--inputs: '{LABELS}' has {len(labels)} rows, the inputs {spec.n_golden}")
    inputs = {t.name: spec.golden_inputs[t.name] for t in spec.public_inputs}
    return replace(spec, eval_inputs=inputs, eval_labels=labels)


def export(spec: ExportSpec, *, name: str, repository: Path, source: str, fmt: str | None = None,
           opset: int = 17, step: Step | None = None, native: bool = False,
           judge: str | None = None, force: bool = False) -> ExportResult:
    """Export ``spec`` as the next version of ``name``. ``judge`` (the CLI's ``--judge``) sets
    how a rollout judges it when the spec does not say; by default ``equivalence`` if an
    earlier version has the same artifact hash, else ``task``.

    An artifact whose sha256 equals an existing version's is refused with
    :class:`DuplicateArtifact` (raised as soon as the artifact is built, before the golden check
    and before anything is written), unless ``force``: then it becomes a new version, judged by
    ``equivalence`` (``same_weights_as`` in its manifest)."""
    if not _NAME.match(name):
        raise ExportError(f"invalid model name {name!r} (letters, digits, '_', '-', '.')")
    if judge not in (None, *JUDGES):
        raise ExportError(f"judge must be one of {', '.join(JUDGES)}, got {judge!r}")
    repository = Path(repository)
    fmt = fmt or artifacts.default_format(spec)
    text = spec.text is not None
    names = model_names(name, text)
    targets = [m for k, m in names.items() if k not in _FRONT_ROLES]
    version = next_version(repository, targets)
    art_model = names["encoder" if text else "raw"]
    if native and fmt != "onnx":
        raise ExportError("--native needs --format onnx (Triton's pytorch backend wants INPUT__0-style names)")
    configs = _configs(spec, names, native=native)  # cheap, and a spec the server would reject fails here
    _defer_to_lower_layers(configs[names["guard"]], repository)
    # an older layout is moved along with this export (and only if it lands)
    upgrades, upgraded = upgrade_plan(repository)
    planned = dict(upgrades)
    _check_existing(repository, configs, planned)
    configs, notices = _merge_existing(repository, configs, names, planned)
    notices = upgraded + notices
    timings: dict[str, float] = {}

    def timed(label: str):
        return _timed(step, timings, label)

    if text:  # PII never lands in goldens: they hold what the guard would pass on
        with timed("redact golden text"):
            spec = redact_golden_text(spec, repository, name)
    with tempfile.TemporaryDirectory(prefix="tritonguard-export-") as tmp:
        stage = Path(tmp)
        vdir = {m: stage / m / str(version) for m in targets}
        for d in vdir.values():
            d.mkdir(parents=True)
        with timed("reference outputs"), _step_errors("the source model failed on the golden inputs"):
            reference = artifacts.reference_outputs(spec)
        _check_reference(reference)
        with timed(f"export {fmt}"), _step_errors(f"export to {fmt} failed"):
            artifact = artifacts.build(spec, fmt, vdir[art_model], opset=opset)
            sha = artifacts.sha256_file(artifact)
        if not force:  # a re-export of the same weights: refused before the repository is touched
            same = repo_mod.version_with_artifact(repository / names["raw"], sha)
            if same is not None:
                raise DuplicateArtifact(name, same, sha, repository / names["raw"] / str(same))
        tok_dir = None
        if text:
            with timed("save tokenizer"), _step_errors("saving the tokenizer failed"):
                tok_dir = vdir[names["tokenizer"]] / "tokenizer"
                _save_tokenizer(spec.text.tokenizer_dir, tok_dir)
        with timed("golden check"):
            with _step_errors("the exported artifact cannot be loaded"):
                run = goldens.spec_runner(vdir[art_model], spec, tok_dir)
            try:
                report = goldens.check_batches(spec.task, spec.golden_inputs, reference, run,
                                               max_batch=spec.max_batch_size)
            except goldens.RunFailed as exc:
                raise ExportError(str(exc)) from None
        if not report.admitted:
            raise GoldenCheckFailed(report)
        evaluation = None
        if spec.eval_inputs is not None:
            with timed("evaluation"):
                evaluation = _evaluate(spec, run, vdir[names["raw"]])
        judged, same = _judge(spec, judge, repository, names["raw"], sha, notices)
        with timed("write repository"):
            goldens.save(vdir[names["raw"]] / repo_mod.GOLDENS, spec.golden_inputs, reference)
            _write_drift_reference(vdir[names["raw"]], spec.golden_inputs)
            common = {"task": spec.task, "source": source, "created": _now(), "golden": report.as_dict(),
                      "format": fmt, **({"opset": opset} if fmt == "onnx" else {})}
            judging = {"judge": judged, **({"same_weights_as": same} if same is not None else {}),
                       **({"evaluation": evaluation} if evaluation is not None else {})}
            _write_manifests(spec, names, version, vdir, artifact.name, sha, tok_dir, common, judging)
            _place([(vdir[m], repository / m / str(version)) for m in targets])
            fronts = [names[r] for r in _FRONT_ROLES if r in names]
            _apply(repository, [(m, c) for m, c in upgrades if m not in configs])
            for model in [*targets, *fronts]:  # targets first: the guard checks them when it loads
                layout.write(repository / model, configs[model])
            if text:  # this version's pinned ensemble, which the guard routes to
                pinned = layout.version_ensemble_name(names["raw"], version)
                layout.write(repository / pinned, {**layout.ensemble_config(
                    names["raw"], spec, names["tokenizer"], names["encoder"], pin=version), "name": pinned})
                (repository / pinned / "1").mkdir(parents=True, exist_ok=True)
            for model in fronts:
                if not repo_mod.versions(repository / model):
                    # Triton wants a version folder even for a model with no artifact
                    (repository / model / "1").mkdir(parents=True, exist_ok=True)
    return ExportResult(name=name, version=version, models=[*targets, *fronts],
                        artifact=repository / art_model / str(version) / artifact.name,
                        sha256=sha, report=report, timings=timings, notices=notices, judge=judged,
                        same_weights_as=same, evaluation=evaluation)


@contextmanager
def _step_errors(what: str) -> Iterator[None]:
    """Any exception of a step (torch's exporter, onnxruntime, a tokenizer) becomes one line
    naming the step; a SourceError already says what is wrong with the source."""
    try:
        yield
    except (ExportError, SourceError):
        raise
    except Exception as exc:  # noqa: BLE001 - the user gets the step and the first line, not a traceback
        raise ExportError(f"{what}: {goldens.first_line(exc)}") from None


def _check_reference(reference: dict) -> None:
    bad, rows = goldens.non_finite_rows(reference)
    if bad:
        raise ExportError(f"the source model's reference outputs hold NaN/Inf ({bad} of {rows} rows): "
                          "choose golden inputs it answers")


def _evaluate(spec: ExportSpec, run: goldens.Run, raw_dir: Path) -> dict[str, Any]:
    """Score the staged artifact on the spec's evaluation set and write ``eval.npz`` beside the
    goldens; returns the manifest's ``evaluation``."""

    output = spec.public_outputs[0].name
    try:
        result = evaluate(run, spec.task, output, spec.eval_inputs, spec.eval_labels, batch=spec.max_batch_size)
    except EvaluationError as exc:
        raise ExportError(f"evaluation set: {exc}") from None
    return {**result, "labelled": spec.eval_labels is not None,
            "sha256": save_eval(raw_dir / EVAL, spec.eval_inputs, spec.eval_labels, spec.eval_slices)}


def _judge(spec: ExportSpec, cli: str | None, repository: Path, raw: str, sha: str,
           notices: list[str]) -> tuple[str, int | None]:
    """(judge, same_weights_as): the spec's judge, else the CLI's, else ``equivalence`` when an
    earlier version of ``raw`` has this very artifact (its sha256), else ``task``."""
    same = repo_mod.version_with_artifact(repository / raw, sha)
    if spec.judge is not None:
        if cli is not None and cli != spec.judge:
            notices.append(f"judge: the source says '{spec.judge}'; --judge {cli} ignored")
        return spec.judge, same
    if cli is not None:
        return cli, same
    return ("equivalence" if same is not None else "task"), same


def redact_golden_text(spec: ExportSpec, repository: Path, guard: str) -> ExportSpec:
    """``spec`` with its BYTES golden inputs redacted as the guard serving ``guard`` redacts
    requests (its config.pbtxt where it exists, the guard step's of an ensemble ``guard`` too, else the same layers it reads: [tool.tritonguard],
    TRITONGUARD_* and the defaults). The reference outputs are then taken on the redacted text,
    which is what the model sees behind a guard (``redaction.model_sees_redacted``, default on);
    with redaction off, the goldens stay as given."""

    found = repo_mod.guard_dir(repository, guard)
    own = model_parameters(found[1]) if found else {}
    params = layered_parameters(own, repository)
    section = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("redaction.")}
    try:
        config = from_params(RedactionConfig, section, section="redaction", model=guard)
    except Exception as exc:  # noqa: BLE001 - a bad redaction setting stops the export, named
        raise ExportError(f"redaction settings for {guard}: {exc}") from None
    if not config.enabled:
        return spec
    redactor = Redactor(config)

    def redact(inputs: dict) -> dict:
        out = dict(inputs)
        for name, arr in inputs.items():
            if arr.dtype == object:
                out[name], _counts = redactor.redact_bytes_array(arr)
        return out

    # the evaluation set lands in the repository too, and is scored on what the model sees
    evals = None if spec.eval_inputs is None else redact(spec.eval_inputs)
    return replace(spec, golden_inputs=redact(spec.golden_inputs), eval_inputs=evals)


@contextmanager
def _timed(step: Step | None, timings: dict[str, float], label: str) -> Iterator[None]:
    t0 = time.perf_counter()
    with (step(label) if step else nullcontext()):
        yield
    timings[label] = time.perf_counter() - t0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _save_tokenizer(src: Path, dest: Path) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415

    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dest))


def _configs(spec: ExportSpec, names: dict[str, str], native: bool = False) -> dict[str, dict]:
    """All config dicts, validated (protobuf schema and guard-vs-target contract) up front."""

    raw, guard = names["raw"], names["guard"]
    if spec.text is None:
        configs = {raw: layout.runtime_config(raw, spec, native=native)}
        # the guard runs a runtime artifact itself (no second hop); a native target needs BLS
        placement = "bls" if native else "inprocess"
    else:
        tok, enc = names["tokenizer"], names["encoder"]
        configs = {tok: layout.tokenizer_config(tok, spec),
                   enc: {**layout.runtime_config(enc, spec, threads=layout.ENCODER_THREADS, native=native),
                         "version_policy": layout.ALL_VERSIONS},
                   raw: layout.ensemble_config(raw, spec, tok, enc)}
        placement = "bls"  # an ensemble can only be reached through Triton
    configs[guard] = layout.guard_config(guard, spec, raw, placement=placement,
                                         serves_as=names.get("front", ""))
    if "front" in names:
        configs[names["intake"]] = layout.intake_config(names["intake"], configs[guard])
        configs[names["front"]] = layout.front_config(names["front"], configs[guard], names["intake"], guard)
    for cfg in configs.values():
        layout.render(cfg)
    sig = ModelSignature.from_config(configs[guard])
    try:
        check_signature(sig, ModelSignature.from_config(configs[raw]), raw)
        GuardConfig.from_parameters(model_parameters(configs[guard]), guard).validation.check_against(sig, guard)
    except Exception as exc:  # ConfigError: a spec the guard could not load
        raise ExportError(str(exc)) from None
    return configs


# what each kind of model keeps of its existing config.pbtxt (see layout.merge)
_OWNS = {"tokenizer": layout.TOKENIZER_OWNS, "encoder": layout.ENCODER_OWNS, "guard": layout.GUARD_OWNS,
         "intake": layout.INTAKE_OWNS, "front": layout.ENSEMBLE_OWNS}


def _merge_existing(repository: Path, configs: dict[str, dict], names: dict[str, str],
                    planned: dict[str, dict] | None = None) -> tuple[dict[str, dict], list[str]]:
    """``configs`` merged over the existing config.pbtxt files (user settings kept), and the
    notices of every value that differed. The merged guard is checked as the guard will check
    it at load, so kept settings that no longer fit (a range on a vanished input) fail here."""
    merged, notices = {}, []
    for role, model in names.items():
        path = repository / model / repo_mod.CONFIG
        existing = (planned or {}).get(model) or (
            repo_mod.read_config(repository / model) if path.exists() else None)  # readable: _check_existing
        if role == "raw":
            owns = layout.ENSEMBLE_OWNS if "tokenizer" in names else layout.RUNTIME_OWNS
        else:
            owns = _OWNS[role]
        merged[model], said = layout.merge(existing, configs[model], owns)
        notices += [f"{model}: {n}" for n in said]
    guard = names["guard"]
    try:
        for cfg in merged.values():
            layout.render(cfg)
        _check_guard(merged[guard], guard)
    except Exception as exc:  # noqa: BLE001 - ConfigError, or a protobuf ParseError on a kept field
        raise ExportError(f"the settings kept from {repository / guard}/{repo_mod.CONFIG} do not fit this "
                          f"export: {exc} (fix or remove them, then export again)") from None
    return merged, notices


def _check_guard(cfg: dict, guard: str) -> None:

    sig = ModelSignature.from_config(cfg)
    GuardConfig.from_parameters(model_parameters(cfg), guard).validation.check_against(sig, guard)


def _defer_to_lower_layers(guard: dict, repository: Path) -> None:
    """Drop the export's computed guard settings that the user already sets in a lower layer
    ([tool.tritonguard] or TRITONGUARD_*): config.pbtxt would otherwise override them."""

    if "validation.max_payload_bytes" in layered_parameters({}, repository):
        (guard.get("parameters") or {}).pop("validation.max_payload_bytes", None)


def upgrade_plan(repository: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """What :func:`upgrade_layout` would write: ``[(model, config)]`` and one line per guard moved."""
    repository = Path(repository)
    if not repository.is_dir():
        return [], []
    writes: list[tuple[str, dict]] = []
    moved = []
    for model_dir in sorted(p for p in repository.iterdir() if (p / repo_mod.CONFIG).exists()):
        try:
            cfg = repo_mod.read_config(model_dir)
        except Exception:  # noqa: BLE001, S112 - not ours to fix here; the export that needs it says so
            continue
        params = cfg.get("parameters") or {}
        if cfg.get("backend") != "guard" or "serves_as" in params or not layout.needs_intake(cfg):
            continue
        name = model_dir.name
        fronts = layout.front_names(name)
        for role in ("guard", "intake"):
            if (repository / fronts[role]).exists():
                raise ExportError(f"cannot move guard '{name}' behind its intake: {repository / fronts[role]} "
                                  "already exists (rename or remove it)")
        guard = {**cfg, "name": fronts["guard"], "parameters": {**params, "serves_as": {"string_value": name}}}
        plan = [(fronts["guard"], guard), (fronts["intake"], layout.intake_config(fronts["intake"], cfg)),
                (name, layout.front_config(name, cfg, fronts["intake"], fronts["guard"]))]
        for _model, config in plan:
            layout.render(config)
        writes += plan  # the steps first: the public name changes last
        moved.append(f"{name}: now the ensemble {fronts['intake']} -> {fronts['guard']} "
                     f"(the guard's settings and rollout state kept)")
    return writes, moved


def upgrade_layout(repository: Path) -> list[str]:
    """Move every guard with a BYTES input that is still the public model itself (exported
    before the intake existed) behind an intake: ``NAME`` becomes the ensemble ``NAME_intake`` ->
    ``NAME_guard``; the guard keeps every setting and, serving as ``NAME``, its rollout state,
    latency samples and audit anchors (they stay in ``NAME/``). No version is added. Returns one
    line per model moved. A running server serves the new layout once the models are loaded again
    (a restart does it)."""
    writes, moved = upgrade_plan(repository)
    _apply(Path(repository), writes)
    return moved


def _apply(repository: Path, writes: list[tuple[str, dict]]) -> None:
    for model, config in writes:
        layout.write(repository / model, config)
        (repository / model / "1").mkdir(parents=True, exist_ok=True)


def _kind(cfg: dict) -> str:
    return cfg.get("backend") or cfg.get("platform") or "?"


def _check_existing(repository: Path, configs: dict[str, dict], planned: dict[str, dict] | None = None) -> None:
    """Refuse to turn an existing model into another kind (e.g. a runtime model into an
    ensemble, or a target into a guard): its old versions would no longer match its config.
    ``planned``: configs :func:`upgrade_plan` will write (they count as the existing ones)."""
    for model, cfg in configs.items():
        if model in (planned or {}):
            if _kind(planned[model]) != _kind(cfg):
                raise ExportError(f"model '{model}' would be '{_kind(planned[model])}' after the layout "
                                  f"upgrade; this export would make it '{_kind(cfg)}' (choose another --name)")
            continue
        if not (repository / model / repo_mod.CONFIG).exists():
            continue
        try:
            old = _kind(repo_mod.read_config(repository / model))
        except Exception as exc:  # noqa: BLE001 - a broken config must be fixed by hand, not overwritten
            raise ExportError(f"{repository / model}/config.pbtxt cannot be read ({exc})") from None
        if old != _kind(cfg):
            raise ExportError(f"model '{model}' already exists as '{old}'; this export would make it "
                              f"'{_kind(cfg)}' (choose another --name)")


def _write_manifests(spec: ExportSpec, names: dict[str, str], version: int, vdir: dict[str, Path],
                     artifact: str, sha: str, tok_dir: Path | None, common: dict, judging: dict) -> None:
    """Every model's manifest; ``judging`` (judge, same_weights_as, evaluation) goes to the raw
    model, the one a rollout routes between."""
    def write(model: str, body: dict) -> None:
        doc = {"format_version": FORMAT_VERSION, "name": model, "version": version, **body}
        (vdir[model] / repo_mod.MANIFEST).write_text(json.dumps(doc, indent=2) + "\n")

    public = {"inputs": [t.as_dict() for t in spec.public_inputs],
              "outputs": [t.as_dict() for t in spec.public_outputs]}
    if spec.text is None:
        write(names["raw"], {"artifact": artifact, "sha256": sha, **common, **public, **judging})
        return
    tok, enc, raw = names["tokenizer"], names["encoder"], names["raw"]
    tok_sha = artifacts.sha256_dir(tok_dir)
    write(raw, {"artifact": f"../../{enc}/{version}/{artifact}", "sha256": sha, **common, **public,
                "parts": {"tokenizer": {"model": tok, "version": version, "sha256": tok_sha,
                                        "max_length": spec.text.max_length},
                          "encoder": {"model": enc, "version": version, "sha256": sha}}, **judging})
    write(enc, {"artifact": artifact, "sha256": sha, **common, "part_of": raw,
                "inputs": [t.as_dict() for t in spec.inputs], "outputs": [t.as_dict() for t in spec.outputs]})
    write(tok, {"artifact": "tokenizer", "sha256": tok_sha, **common, "part_of": raw,
                "max_length": spec.text.max_length, "inputs": public["inputs"],
                "outputs": [t.as_dict() for t in spec.inputs]})


def _place(moves: list[tuple[Path, Path]]) -> None:
    """Move staged version folders into the repository, all or none."""
    for _, dest in moves:
        if dest.exists():
            raise ExportError(f"{dest} already exists; versions are never overwritten")
    placed: list[Path] = []
    try:
        for src, dest in moves:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _move_dir(src, dest)
            placed.append(dest)
    except BaseException:
        for d in placed:
            shutil.rmtree(d, ignore_errors=True)
        raise


def _move_dir(src: Path, dest: Path) -> None:
    try:
        os.rename(src, dest)
        return
    except OSError:
        pass  # another filesystem (EXDEV): copy beside the target, then rename in one step
    # a hidden, non-numeric name: Triton never takes it for a version while it fills up
    partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(src, partial)
        os.rename(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_drift_reference(version_dir: Path, inputs: dict) -> None:
    """Per-feature input summaries the guard's drift monitor compares live traffic with."""
    import json  # noqa: PLC0415


    ref = reference_from_inputs(inputs)
    if ref is not None:
        (version_dir / REFERENCE_FILE).write_text(json.dumps(ref.to_dict()))
