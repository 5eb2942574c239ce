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
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from exporter.build import artifacts, goldens, layout
from exporter.build.configs import (
    bls_target_policy,
    build_configs,
    check_existing,
    defer_to_lower_layers,
    guard_placement,
    merge_existing,
)
from exporter.build.errors import DuplicateArtifact, ExportError, GoldenCheckFailed
from exporter.build.eval_sets import read_eval_file, with_eval_labels, without_labels
from exporter.build.evaluate import EVAL, EvaluationError, evaluate, save_eval
from exporter.build.goldens import GoldenReport
from exporter.build.sources import load_source
from exporter.build.sources.spec import ExportSpec, SourceError
from exporter.build.staging import next_version, now_iso, place_versions
from exporter.build.upgrade import apply_plan, upgrade_plan
from exporter.records.registry import default_uri, open_registry
from exporter.records.remote import POLICY_FILE
from tritonguard.core import repository as repo_mod
from tritonguard.core.config import from_params, layered_parameters, model_parameters
from tritonguard.core.errors import ConfigError
from tritonguard.privacy.redaction import RedactionConfig, Redactor
from tritonguard.rollout.drift import REFERENCE_FILE, reference_from_inputs
from tritonguard.rollout.state import JUDGES

FORMAT_VERSION = 1
REGISTER_TIMEOUT_S = 60.0  # a registry that has not answered by then does not hold up the export
# Triton model names become folder names and URL path segments
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

Step = Callable[[str], AbstractContextManager]


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


# roles that are not versioned targets: the guard and what serves it under the public name
_FRONT_ROLES = ("guard", "intake", "front")  # written in this order: the public name last


def model_names(name: str, text: bool) -> dict[str, str]:
    """Model name per role. ``front`` is the public name when the guard is behind an intake."""
    if text:
        return {"tokenizer": f"{name}_tokenizer", "encoder": f"{name}_encoder", "raw": f"{name}_raw",
                "front": name, **layout.front_names(name)}
    return {"raw": f"{name}_raw", "guard": name}


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
    with _timed(step, timings, "load source"), without_labels(source, inputs) as (inputs, labels):
        spec = load_source(source, inputs=inputs, task=task, input_names=input_names, output_names=output_names,
                           mlflow_uri=mlflow_uri)
        if labels is not None:
            spec = with_eval_labels(spec, labels)
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
            registry = open_registry(repository)
            if not registry.versions(result.name):
                # a registry that starts after the model did (a copied repository, a registry added
                # later): the versions already here first, so MLflow's numbers follow ours
                for earlier in repo_mod.versions(vdir.parent):
                    edir = vdir.parent / str(earlier)
                    emanifest = repo_mod.read_manifest(edir) if earlier < result.version else None
                    if emanifest is not None:
                        registry.register(result.name, earlier, emanifest, {}, source=str(edir))
            box["info"] = registry.register(result.name, result.version, manifest, spec.lineage(), source=str(vdir))
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
    configs = build_configs(spec, names, native=native)  # cheap, and a spec the server would reject fails here
    defer_to_lower_layers(configs[names["guard"]], repository)
    # an older layout is moved along with this export (and only if it lands)
    upgrades, upgraded = upgrade_plan(repository)
    planned = dict(upgrades)
    check_existing(repository, configs, planned)
    configs, notices = merge_existing(repository, configs, names, planned)
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
            common = {"task": spec.task, "source": source, "created": now_iso(), "golden": report.as_dict(),
                      "format": fmt, **({"opset": opset} if fmt == "onnx" else {})}
            judging = {"judge": judged, **({"same_weights_as": same} if same is not None else {}),
                       **({"evaluation": evaluation} if evaluation is not None else {})}
            _write_manifests(spec, names, version, vdir, artifact.name, sha, tok_dir, common, judging)
            place_versions([(vdir[m], repository / m / str(version)) for m in targets])
            fronts = [names[r] for r in _FRONT_ROLES if r in names]
            apply_plan(repository, [(m, c) for m, c in upgrades if m not in configs])
            for model in [*targets, *fronts]:  # targets first: the guard checks them when it loads
                layout.write(repository / model, configs[model])
            if text:  # this version's pinned ensemble, which the guard routes to
                pinned = layout.version_ensemble_name(names["raw"], version)
                layout.write(repository / pinned, {**layout.ensemble_config(
                    names["raw"], spec, names["tokenizer"], names["encoder"], pin=version), "name": pinned})
                repo_mod.write_placeholder(repository / pinned / "1", pinned)
            else:
                _keep_policy(repository / names["raw"] / POLICY_FILE, guard_placement(configs[names["guard"]]))
            for model in fronts:
                if not repo_mod.versions(repository / model):
                    # Triton wants a version folder even for a model with no artifact, and an
                    # object store has no empty folders: a placeholder manifest makes it exist
                    repo_mod.write_placeholder(repository / model / "1", model)
    return ExportResult(name=name, version=version, models=[*targets, *fronts],
                        artifact=repository / art_model / str(version) / artifact.name,
                        sha256=sha, report=report, timings=timings, notices=notices, judge=judged,
                        same_weights_as=same, evaluation=evaluation)


def _keep_policy(kept: Path, placement: str) -> None:
    """A published repository's ``version_policy.json`` (its next publish pins the versions by it,
    not by config.pbtxt) upgraded as :func:`bls_target_policy` says: one kept from an older
    native export (``latest {num_versions: 1}``) would pin only the newest version, and a canary
    would lose its primary on every replica (issue 39 item 10)."""
    if not kept.is_file():
        return  # a local repository: config.pbtxt is the policy
    try:
        policy = json.loads(kept.read_text())
    except ValueError:
        return  # not ours to guess: the publish that reads it says what is wrong
    fixed = bls_target_policy(policy, placement)
    if fixed is not None:
        kept.write_text(json.dumps(fixed, sort_keys=True) + "\n")


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


def _save_tokenizer(src: Path, dest: Path) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415 - defers a heavy import

    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dest))


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


def _write_drift_reference(version_dir: Path, inputs: dict) -> None:
    """Per-feature input summaries the guard's drift monitor compares live traffic with."""
    ref = reference_from_inputs(inputs)
    if ref is not None:
        (version_dir / REFERENCE_FILE).write_text(json.dumps(ref.to_dict()))
