"""Task-level evaluation of exported versions: a labelled evaluation set (``eval.npz``) beside a
version's goldens, the score of the version on it, and running any exported version offline.

Goldens say whether an artifact computes what its *source model* computes; the evaluation set
says how well the model does the *task*, which is what a rollout judges a new model on (a
re-export or compiled variant of the same weights is judged on equivalence instead).

``eval.npz`` in ``<repo>/<name>_raw/<version>/`` holds ``in__<NAME>`` per public input (BYTES as
fixed-width ``S`` arrays, as ``goldens.npz``: no pickles), and optionally ``labels`` (class ids
for a classifier, targets for a regressor, for an embedding model each row's paired positive
text: the query's document) and ``slices`` (a name per row, e.g. a segment, judged on its own).
Without ``labels`` it is an unlabelled evaluation set (texts only, say): rows to compare two
versions on, not to score them. Its :func:`eval_sha256` is recorded in the manifest's
``evaluation``, so a judge can tell whether two versions were scored on the same rows.

Versions run through :func:`exporter.build.goldens.artifact_runner`: the engine code the ``runtime``
backend serves with, and for text models the ``tokenizer`` backend's own encode().
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build import goldens
from exporter.build.artifacts import sha256_file
from exporter.build.sources.spec import TextFront
from exporter.errors import ExporterError
from tritonguard.core import repository as repo_mod

EVAL = "eval.npz"
LABELS = "labels"
SLICES = "slices"
METRICS = {"classifier": "accuracy", "regression": "mae"}  # top-1 accuracy; mean absolute error
RECALL_K = 10  # embeddings with paired texts: a query's positive among its k nearest documents


class EvaluationError(ExporterError):
    """The evaluation cannot be run: a missing version, bad labels, an artifact that fails."""


# -- eval.npz -----------------------------------------------------------------------------------
def _arrays(inputs: Mapping[str, np.ndarray], labels: np.ndarray | None,
            slices: np.ndarray | None = None) -> dict[str, np.ndarray]:
    out = {f"in__{k}": goldens.stored(v) for k, v in inputs.items()}
    if labels is not None:
        out[LABELS] = goldens.stored(labels)
    if slices is not None:
        out[SLICES] = goldens.stored(np.asarray([str(x).encode() for x in np.asarray(slices).reshape(-1)], dtype=object))
    return out


def eval_sha256(inputs: Mapping[str, np.ndarray], labels: np.ndarray | None,
                slices: np.ndarray | None = None) -> str:
    """SHA-256 over the evaluation set as ``eval.npz`` stores it: per array, in key order, its
    key, dtype, shape and bytes. Independent of the npz container (zip timestamps), so the
    set read back by :func:`load_eval` hashes to the same value."""
    h = hashlib.sha256()
    for key, arr in sorted(_arrays(inputs, labels, slices).items()):
        arr = np.ascontiguousarray(arr)
        h.update(f"{key}\0{arr.dtype.str}\0{arr.shape}\0".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def save_eval(path: Path, inputs: Mapping[str, np.ndarray], labels: np.ndarray | None,
              slices: np.ndarray | None = None) -> str:
    """Write ``eval.npz``; returns its :func:`eval_sha256`."""
    with open(path, "wb") as fh:
        np.savez(fh, **_arrays(inputs, labels, slices))
    return eval_sha256(inputs, labels, slices)


@dataclass
class EvalSet:
    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None  # None: an unlabelled evaluation set
    slices: np.ndarray | None  # str per row, or None


def load_eval_set(repository: Path, raw_model: str, version: int) -> EvalSet | None:
    """``raw_model`` v``version``'s ``eval.npz`` (None if it has none). BYTES come back as object
    arrays of bytes, as Triton clients send them; slices as str."""
    path = Path(repository) / raw_model / str(version) / EVAL
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise EvaluationError(f"cannot read {path}: {exc}") from None
    inputs = {k[4:]: (v.astype(object) if v.dtype.kind == "S" else v) for k, v in arrays.items()
              if k.startswith("in__")}
    if not inputs:
        raise EvaluationError(f"{path} has no 'in__<INPUT>' array")
    labels = arrays.get(LABELS)
    if labels is not None and labels.dtype.kind == "S":
        labels = labels.astype(object)
    slices = arrays.get(SLICES)
    if slices is not None:
        slices = np.asarray([x.decode() if isinstance(x, bytes) else str(x) for x in slices.reshape(-1)], dtype=object)
    return EvalSet(inputs, labels, slices)


def load_eval(repository: Path, raw_model: str, version: int) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """(inputs, labels) of ``raw_model`` v``version``'s labelled ``eval.npz``; None if it has none."""
    found = load_eval_set(repository, raw_model, version)
    if found is None:
        return None
    if found.labels is None:
        raise EvaluationError(f"{Path(repository) / raw_model / str(version) / EVAL} has no '{LABELS}' array")
    return found.inputs, found.labels


# -- scoring ------------------------------------------------------------------------------------
def row_scores(task: str, output: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per row: 1.0 / 0.0 for a right / wrong top-1 class (classifier), the absolute error
    (regression, averaged over the output's elements). Paired per-row scores are what a
    non-inferiority test between two versions needs; :func:`score` is their mean."""
    if task not in METRICS:
        raise EvaluationError(f"task-level evaluation needs a classifier or a regressor, not a {task} model")
    output, labels = np.asarray(output), np.asarray(labels)
    n = len(output)
    if len(labels) != n:
        raise EvaluationError(f"{len(labels)} labels for {n} rows")
    if task == "classifier":
        ids = labels.reshape(n, -1)
        if ids.shape[1] != 1:
            raise EvaluationError(f"classifier labels must be one class id per row, got shape {list(labels.shape)}")
        ids = ids[:, 0]
        if ids.dtype.kind not in "iub" and not (ids.dtype.kind == "f" and np.all(ids == np.round(ids))):
            raise EvaluationError(f"classifier labels must be integer class ids, got {ids.dtype}")
        probs = output.reshape(n, -1)
        if len(ids) and (ids.min() < 0 or ids.max() >= probs.shape[1]):
            raise EvaluationError(f"labels hold class ids outside 0..{probs.shape[1] - 1} "
                                  f"(found {int(ids.min())}..{int(ids.max())})")
        return (probs.argmax(-1) == ids.astype(np.int64)).astype(np.float64)
    if labels.dtype.kind not in "iubf":
        raise EvaluationError(f"regression labels must be numbers, got {labels.dtype}")
    got, want = output.reshape(n, -1).astype(np.float64), labels.reshape(n, -1).astype(np.float64)
    if got.shape != want.shape:
        raise EvaluationError(f"regression labels have {want.shape[1]} values per row, the output {got.shape[1]}")
    return np.abs(got - want).mean(axis=1)


def score(task: str, output: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """``{"metric": "accuracy" | "mae", "value": float, "n": int}``."""
    rows = row_scores(task, output, labels)
    return {"metric": METRICS[task], "value": float(rows.mean()), "n": len(rows)}


def evaluate(run: goldens.Run, task: str, output: str, inputs: Mapping[str, np.ndarray], labels: np.ndarray | None,
             *, batch: int) -> dict[str, Any]:
    """Run ``run`` over the evaluation set in chunks of ``batch`` rows and score ``output``.
    NaN/Inf outputs are refused rather than scored: they would poison every comparison. An
    unlabelled set is only run (``{"metric": None, "n": rows}``); an embedding model's labels are
    each query's paired text, scored as recall@k over every paired text."""
    try:
        outputs = goldens.run_rows(run, inputs, batch)
    except goldens.RunFailed as exc:
        raise EvaluationError(str(exc).replace("golden run", "evaluation run", 1)) from None
    bad, rows = goldens.non_finite_rows({output: outputs[output]})
    if bad:
        raise EvaluationError(f"evaluation run at batch {batch}: {goldens.non_finite_message(bad, rows)}")
    if labels is None:
        return {"metric": None, "value": None, "n": len(outputs[output])}
    if task == "embedding":
        name = next(iter(inputs))
        docs = np.asarray(labels, dtype=object).reshape(-1, 1)
        if docs.dtype != object or len(docs) != len(outputs[output]):
            raise EvaluationError("an embedding model's labels are one paired text per row")
        try:
            doc_out = goldens.run_rows(run, {name: docs}, batch)[output]
        except goldens.RunFailed as exc:
            raise EvaluationError(str(exc).replace("golden run", "evaluation run (paired texts)", 1)) from None
        hits = recall_at_k(np.asarray(outputs[output], np.float64), np.asarray(doc_out, np.float64))
        return {"metric": f"recall@{RECALL_K}", "value": float(hits.mean()), "n": len(hits)}
    return score(task, outputs[output], labels)


# -- retrieval ----------------------------------------------------------------------------------
def recall_at_k(queries: np.ndarray, docs: np.ndarray, k: int = RECALL_K) -> np.ndarray:
    """Per query: whether its own document (same row of ``docs``) is among its ``k`` nearest by
    cosine over all documents."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    d = docs / np.linalg.norm(docs, axis=1, keepdims=True)
    sims = q @ d.T
    own = np.diag(sims)
    rank = (sims > own[:, None]).sum(axis=1)  # documents strictly closer than its own
    return rank < k


# -- running a version --------------------------------------------------------------------------
def _manifest(repository: Path, model: str, version: int) -> dict[str, Any]:
    manifest = repo_mod.read_manifest(repository / model / str(version))
    if manifest is None:
        have = repo_mod.versions(repository / model)
        raise EvaluationError(f"'{model}' has no version {version} with a manifest in {repository} "
                              f"(versions: {have or 'none'})")
    return manifest


def version_runner(repository: Path, raw_model: str, version: int) -> tuple[goldens.Run, dict[str, Any]]:
    """(run, manifest) for ``raw_model`` v``version``: its artifact loaded once, checked against
    the SHA-256 in its manifest. A text model (manifest ``parts``) runs its tokenizer version,
    then its encoder version."""
    repository = Path(repository)
    manifest = _manifest(repository, raw_model, version)
    parts = manifest.get("parts") or {}
    text = None
    try:
        if parts:
            enc, tok = parts["encoder"], parts["tokenizer"]
            art_dir = repository / enc["model"] / str(enc["version"])
            art_manifest = _manifest(repository, enc["model"], int(enc["version"]))
            text = TextFront(tokenizer_dir=repository / tok["model"] / str(tok["version"]) / "tokenizer",
                             max_length=int(tok["max_length"]), text_input=manifest["inputs"][0]["name"],
                             public_output=manifest["outputs"][0]["name"])
        else:
            art_dir, art_manifest = repository / raw_model / str(version), manifest
        artifact = Path(art_manifest["artifact"]).name
        in_names = [t["name"] for t in art_manifest["inputs"]]
        out_names = [t["name"] for t in art_manifest["outputs"]]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EvaluationError(f"'{raw_model}' v{version}: incomplete manifest ({type(exc).__name__}: {exc})") from None
    path = art_dir / artifact
    if not path.is_file():
        raise EvaluationError(f"'{raw_model}' v{version}: artifact {path} is missing")
    if art_manifest.get("sha256") and sha256_file(path) != art_manifest["sha256"]:
        raise EvaluationError(f"{path} does not match the sha256 in its manifest; refusing to evaluate it")
    try:
        run = goldens.artifact_runner(art_dir, in_names, out_names, text=text, artifact=artifact)
    except Exception as exc:  # noqa: BLE001 - engine and tokenizer loaders raise anything
        raise EvaluationError(f"'{raw_model}' v{version} cannot be loaded: {goldens.first_line(exc)}") from None
    return run, manifest


def run_version(repository: Path, raw_model: str, version: int, inputs: dict[str, np.ndarray], *,
                batch: int = 64) -> dict[str, np.ndarray]:
    """Public outputs of ``raw_model`` v``version`` on ``inputs`` (public inputs, e.g. from
    :func:`load_eval`), run offline in this process in chunks of ``batch`` rows."""
    if batch < 1:
        raise EvaluationError(f"batch must be >= 1, got {batch}")
    manifest = _manifest(Path(repository), raw_model, version)
    want = [t["name"] for t in manifest.get("inputs", [])]
    if missing := sorted(set(want) - set(inputs)):
        raise EvaluationError(f"'{raw_model}' v{version} takes inputs {want}; missing {missing}")
    feed = {n: np.asarray(inputs[n]) for n in want}
    rows = {len(v) if v.ndim else 0 for v in feed.values()}
    if len(rows) != 1 or 0 in rows:
        raise EvaluationError(f"inputs must share one non-zero number of rows, got {sorted(rows)}")
    run, _ = version_runner(repository, raw_model, version)
    try:
        return goldens.run_rows(run, feed, batch)
    except goldens.RunFailed as exc:
        raise EvaluationError(f"'{raw_model}' v{version}: {str(exc).replace('golden run', 'run', 1)}") from None
