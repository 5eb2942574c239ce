"""The evaluation set an export records: read from ``--eval FILE`` (``.npz``, ``.txt``,
``.tsv``, ``.jsonl``), or the golden inputs themselves when the ``--inputs`` .npz carries a
``labels`` array (then passed on to the source without it).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build.sources.classical import CLASSICAL_SUFFIXES
from exporter.build.sources.files import read_npz
from exporter.build.sources.hf_folders import HF_CONFIG, text_array
from exporter.build.sources.mlflow_models import MLFLOW_SCHEMES, MLMODEL
from exporter.build.sources.spec import ExportSpec, SourceError

LABELS = "labels"  # the array of an --inputs .npz that holds the evaluation labels


def _takes_inputs(source: str) -> bool:
    """Whether ``load_source`` reads ``--inputs`` for this source (callables bring their own)."""
    path = Path(source)
    return source.startswith(MLFLOW_SCHEMES) or path.suffix in (".onnx", ".pt", *CLASSICAL_SUFFIXES) \
        or (path / HF_CONFIG).is_file() or (path / MLMODEL).is_file()


@contextmanager
def without_labels(source: str, inputs: Path | None) -> Iterator[tuple[Path | None, Any]]:
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


def with_eval_labels(spec: ExportSpec, labels: Any) -> ExportSpec:
    """``spec`` with its golden input rows, labelled, as its evaluation set."""
    if len(labels) != spec.n_golden:
        raise SourceError(f"--inputs: '{LABELS}' has {len(labels)} rows, the inputs {spec.n_golden}")
    inputs = {t.name: spec.golden_inputs[t.name] for t in spec.public_inputs}
    return replace(spec, eval_inputs=inputs, eval_labels=labels)
