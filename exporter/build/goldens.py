"""Golden capture and the task-aware check that admits (or refuses) an exported artifact.

The exported artifact is run through the same engine code the ``runtime`` backend serves it
with (:func:`tritonguard.models.engines.load_engine`), and text through the same tokenizer call the
``tokenizer`` backend makes, so a PASS here speaks for what Triton will serve.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from exporter.build.sources.spec import TextFront
from tritonguard.core.repository import load_goldens
from tritonguard.models.engines import EngineConfig, load_engine
from tritonguard.models.tokenizer import Tokenizer, TokenizerConfig, texts_of

PASS, MARGINAL, FAIL = "PASS", "MARGINAL", "FAIL"
_ORDER = {PASS: 0, MARGINAL: 1, FAIL: 2}

# classifier: top-1 agreement floor, and max |prob diff| for PASS / MARGINAL
CLS_AGREEMENT = 0.99
CLS_PROB_PASS, CLS_PROB_MARGINAL = 1e-3, 1e-2
# embedding: min cosine for PASS / MARGINAL
EMB_PASS, EMB_MARGINAL = 0.999, 0.99
# regression: (atol, rtol) by output dtype; MARGINAL within 10x of them
REG_TOL = {"float16": (1e-2, 1e-2), "bfloat16": (1e-2, 1e-2)}
REG_TOL_DEFAULT = (1e-4, 1e-4)
REG_MARGINAL_FACTOR = 10.0
# besides the whole golden set in one call, this many golden rows also run as batches of one,
# and the rows are tiled up to the target's max_batch_size: a model can break at either end
ONE_AT_A_TIME = 4

# public inputs -> public outputs, of one loaded artifact (see :func:`artifact_runner`)
Run = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class GoldenReport:
    verdict: str  # PASS | MARGINAL | FAIL
    metrics: dict[str, float | str] = field(default_factory=dict)
    n: int = 0
    batch: int | None = None  # the batch size these figures were taken at (None: not batched)
    batches: list[int] = field(default_factory=list)  # every batch size checked (check_batches)

    @property
    def admitted(self) -> bool:
        return self.verdict != FAIL

    @property
    def error(self) -> str | None:
        """Why there are no figures (NaN/Inf, a shape mismatch, a missing output), if so."""
        err = self.metrics.get("error")
        return err if isinstance(err, str) else None

    def as_dict(self) -> dict:
        out: dict = {"verdict": self.verdict, "metrics": self.metrics, "n": self.n}
        if self.batches:
            out["batches"] = list(self.batches)
        return out


class RunFailed(Exception):
    """Running the artifact raised at some batch size; the message names it."""

    def __init__(self, batch: int, exc: BaseException):
        self.batch = batch
        super().__init__(f"golden run at batch {batch} failed: {first_line(exc)}")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message: engines and tokenizers raise multi-line
    messages (with C++ stack frames) that are no use on a terminal."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].startswith(_TORCHSCRIPT_PREAMBLE):  # the error itself closes its traceback
        return lines[-1].strip()[:500]
    return lines[0][:500]


_TORCHSCRIPT_PREAMBLE = "The following operation failed in the TorchScript interpreter"


def non_finite_rows(outputs: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """(rows with NaN/Inf in any floating-point output, rows); rows are counted on the first
    output, and an output of another length (a shape error, reported elsewhere) is skipped."""
    arrays = [np.asarray(a) for a in outputs.values()]
    rows = len(arrays[0]) if arrays and arrays[0].ndim else 0
    bad = np.zeros(rows, dtype=bool)
    for arr in arrays:
        if rows and arr.ndim and len(arr) == rows and arr.dtype.kind in "fc":
            bad |= ~np.isfinite(arr.reshape(rows, -1)).all(axis=1)
    return int(bad.sum()), rows


def non_finite_message(bad: int, rows: int) -> str:
    return f"NaN/Inf in outputs ({bad} of {rows} rows)"


def _shape_fail(ref: np.ndarray, got: np.ndarray) -> GoldenReport | None:
    if ref.shape != got.shape:
        return GoldenReport(FAIL, {"error": f"shape {list(got.shape)} != reference {list(ref.shape)}"}, len(ref))
    return None


def _is_probs(x: np.ndarray) -> bool:
    return bool(x.min() >= 0 and np.allclose(x.sum(axis=-1), 1.0, atol=1e-3))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def check_classifier(ref: np.ndarray, got: np.ndarray) -> GoldenReport:
    """Compares probabilities; logits are softmaxed first. Which one the outputs are is read
    from the (fp32) reference alone, so a low-precision artifact cannot flip the decision."""
    if (bad := _shape_fail(ref, got)) is not None:
        return bad
    p_ref, p_got = ref.astype(np.float64), got.astype(np.float64)
    from_logits = not _is_probs(p_ref)
    if from_logits:
        p_ref, p_got = _softmax(p_ref), _softmax(p_got)
    agreement = float(np.mean(p_ref.argmax(-1) == p_got.argmax(-1)))
    diff = float(np.max(np.abs(p_ref - p_got)))
    if agreement >= CLS_AGREEMENT and diff <= CLS_PROB_PASS:
        verdict = PASS
    elif agreement >= CLS_AGREEMENT and diff <= CLS_PROB_MARGINAL:
        verdict = MARGINAL
    else:
        verdict = FAIL
    metrics: dict[str, float | str] = {"top1_agreement": agreement, "max_abs_prob_diff": diff}
    if from_logits:
        metrics["from_logits"] = "yes"
    return GoldenReport(verdict, metrics, len(ref))


def check_embedding(ref: np.ndarray, got: np.ndarray) -> GoldenReport:
    if (bad := _shape_fail(ref, got)) is not None:
        return bad
    a = ref.reshape(len(ref), -1).astype(np.float64)
    b = got.reshape(len(got), -1).astype(np.float64)
    # a zero vector has no direction: count it as cosine 0 rather than NaN
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cos = np.where(norms > 0, (a * b).sum(axis=1) / np.where(norms > 0, norms, 1.0), 0.0)
    min_cos = float(cos.min())
    verdict = PASS if min_cos >= EMB_PASS else MARGINAL if min_cos >= EMB_MARGINAL else FAIL
    return GoldenReport(verdict, {"min_cosine": min_cos, "mean_cosine": float(cos.mean()),
                                  "max_abs_diff": float(np.max(np.abs(a - b)))}, len(ref))


def check_regression(ref: np.ndarray, got: np.ndarray) -> GoldenReport:
    if (bad := _shape_fail(ref, got)) is not None:
        return bad
    atol, rtol = REG_TOL.get(str(got.dtype), REG_TOL_DEFAULT)
    a, b = ref.astype(np.float64), got.astype(np.float64)
    diff = np.abs(a - b)
    metrics = {"max_abs_diff": float(diff.max()),
               "max_rel_diff": float(np.max(diff / np.maximum(np.abs(a), 1e-12))),
               "atol": atol, "rtol": rtol}
    if np.allclose(b, a, atol=atol, rtol=rtol):
        verdict = PASS
    elif np.allclose(b, a, atol=atol * REG_MARGINAL_FACTOR, rtol=rtol * REG_MARGINAL_FACTOR):
        verdict = MARGINAL
    else:
        verdict = FAIL
    return GoldenReport(verdict, metrics, len(ref))


def check_labels(ref: np.ndarray, got: np.ndarray) -> GoldenReport:
    """Class labels (an integer output of a classifier, e.g. a scikit-learn model's LABEL):
    exactly equal, row by row; one differing label fails the check."""
    if (bad := _shape_fail(ref, got)) is not None:
        return bad
    agreement = float(np.mean(np.asarray(ref).reshape(len(ref), -1) == np.asarray(got).reshape(len(got), -1)))
    return GoldenReport(PASS if agreement == 1.0 else FAIL, {"label_agreement": agreement}, len(ref))


CHECKS = {"classifier": check_classifier, "embedding": check_embedding, "regression": check_regression}


def check(task: str, reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]) -> GoldenReport:
    """Check every reference output; the worst verdict wins. Metrics are prefixed with the
    output name only when there are several outputs, so the common case reads plainly."""
    if not reference:
        return GoldenReport(FAIL, {"error": "no reference outputs"}, 0)
    for name, ref in reference.items():
        if name not in actual:
            return GoldenReport(FAIL, {"error": f"artifact produced no output {name}"}, len(ref))
    # NaN/Inf would turn every figure into nan: say what it is instead
    bad, rows = non_finite_rows({name: actual[name] for name in reference})
    if bad:
        return GoldenReport(FAIL, {"error": non_finite_message(bad, rows), "non_finite_rows": bad},
                            len(next(iter(reference.values()))))
    reports = {}
    for name, ref in reference.items():
        ref = np.asarray(ref)
        # a classifier's integer output holds labels, not scores: compared exactly
        checker = check_labels if task == "classifier" and ref.dtype.kind in "iub" else CHECKS[task]
        reports[name] = checker(ref, np.asarray(actual[name]))
    verdict = max((r.verdict for r in reports.values()), key=_ORDER.__getitem__)
    if len(reports) == 1:
        metrics = next(iter(reports.values())).metrics
    else:
        metrics = {f"{n}.{k}": v for n, r in reports.items() for k, v in r.metrics.items()}
    return GoldenReport(verdict, metrics, next(iter(reports.values())).n)


# -- running the artifact -------------------------------------------------------------------
def _encoder(tokenizer_dir: Path, max_length: int, output_names: Sequence[str]) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """TEXT [N,1] -> token tensors, through the ``tokenizer`` backend's own encode(); the
    tokenizer is loaded once, so a runner can be called chunk after chunk."""
    tokenizer = Tokenizer(tokenizer_dir.parent, TokenizerConfig(tokenizer_dir=tokenizer_dir.name, max_length=max_length),
                          list(output_names))

    def encode(texts: np.ndarray) -> dict[str, np.ndarray]:
        return tokenizer.encode(texts_of(texts))

    return encode


def tokenize(tokenizer_dir: Path, texts: np.ndarray, max_length: int, output_names: list[str]) -> dict[str, np.ndarray]:
    """TEXT [N,1] -> token tensors, through the ``tokenizer`` backend's own encode()."""
    return _encoder(tokenizer_dir, max_length, output_names)(texts)


def artifact_runner(artifact_dir: Path, in_names: Sequence[str], out_names: Sequence[str], *,
                    text: TextFront | None = None, artifact: str = "") -> Run:
    """Load the artifact in ``artifact_dir`` once and return a function from public inputs to
    public outputs. ``text``: the tokenizer in front of it (its ``tokenizer_dir`` is the saved
    tokenizer folder) and the public names. Loading errors are raised here, run errors by the
    returned function."""

    in_names, out_names = list(in_names), list(out_names)
    # all cores: this is an offline run, not serving, and the engine code path is the same
    engine = load_engine(artifact_dir, EngineConfig(intra_op_threads=0, artifact=artifact), in_names, out_names)
    if text is None:
        return lambda inputs: engine.run({n: inputs[n] for n in in_names}, out_names)
    encode = _encoder(text.tokenizer_dir, text.max_length, in_names)

    def run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = engine.run(encode(np.asarray(inputs[text.text_input])), out_names)
        return {text.public_output: out[out_names[0]]}

    return run


def spec_runner(version_dir: Path, spec, tokenizer_dir: Path | None = None) -> Run:
    """:func:`artifact_runner` for the artifact ``spec`` was just exported to."""
    text = None
    if spec.text is not None:
        text = replace(spec.text, tokenizer_dir=tokenizer_dir or spec.text.tokenizer_dir)
    return artifact_runner(version_dir, [t.name for t in spec.inputs], [t.name for t in spec.outputs], text=text)


def run_artifact(version_dir: Path, spec, tokenizer_dir: Path | None = None) -> dict[str, np.ndarray]:
    """Outputs of the artifact in ``version_dir`` at the spec's public interface."""
    return spec_runner(version_dir, spec, tokenizer_dir)(spec.golden_inputs)


def run_rows(run: Run, inputs: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """``run`` over ``inputs`` in chunks of ``batch`` rows, outputs concatenated. Raises
    :class:`RunFailed` (naming the batch size) when a chunk raises or answers with a wrong
    number of rows."""
    rows = len(next(iter(inputs.values())))
    parts: list[dict[str, np.ndarray]] = []
    for start in range(0, rows, batch):
        chunk = {k: v[start:start + batch] for k, v in inputs.items()}
        want = len(next(iter(chunk.values())))
        try:
            out = run(chunk)
            for name, arr in out.items():
                if np.ndim(arr) == 0 or len(arr) != want:
                    raise ValueError(f"output {name} has {np.shape(arr)[:1] or 'no'} rows for a batch of {want}")
        except Exception as exc:  # noqa: BLE001 - engines raise anything; the caller gets one line
            raise RunFailed(batch, exc) from exc
        parts.append(out)
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}


def batch_plan(n: int, max_batch: int) -> list[tuple[int, np.ndarray]]:
    """(batch size, golden row indices) to check: the whole set in one call, the first
    :data:`ONE_AT_A_TIME` rows one by one, and the rows tiled up to ``max_batch``."""
    plan = [(n, np.arange(n))]
    if n > 1:
        plan.append((1, np.arange(min(n, ONE_AT_A_TIME))))
    if max_batch not in (1, n):
        plan.append((max_batch, np.arange(max_batch) % n))
    return plan


def check_batches(task: str, inputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], run: Run,
                  *, max_batch: int) -> GoldenReport:
    """The golden check at each batch size of :func:`batch_plan`, so a model that breaks only
    at batch 1 or only above some size is caught with a handful of goldens. Returns the worst
    report (the whole set's on a tie), its ``batch`` set; raises :class:`RunFailed`."""
    n = len(next(iter(inputs.values())))
    plan = batch_plan(n, max_batch)
    reports = []
    for batch, rows in plan:
        feed = {k: np.asarray(v)[rows] for k, v in inputs.items()}
        report = check(task, {k: np.asarray(v)[rows] for k, v in reference.items()}, run_rows(run, feed, batch))
        report.batch = batch
        reports.append(report)
    worst = max(reports, key=lambda r: _ORDER[r.verdict])  # max() keeps the first of equals
    worst.batches = [batch for batch, _ in plan]
    return worst


# -- goldens.npz ----------------------------------------------------------------------------
def save(path: Path, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
    """``in__NAME`` / ``out__NAME`` arrays. BYTES are stored as fixed-width bytes (``S``), not
    object arrays, so reading the file never needs ``allow_pickle`` (see :func:`load`)."""
    arrays = {prefix + name: stored(arr) for prefix, group in (("in__", inputs), ("out__", outputs))
              for name, arr in group.items()}
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def stored(arr: np.ndarray) -> np.ndarray:
    """An array as the .npz files hold it: BYTES (object) as fixed-width ``S``."""
    arr = np.asarray(arr)
    if arr.dtype == object:
        arr = np.array([x if isinstance(x, bytes) else str(x).encode() for x in arr.flat],
                       dtype=np.bytes_).reshape(arr.shape)
    return arr


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(inputs, outputs) from a goldens.npz: the guard reads the same files, so one reader."""

    return load_goldens(path)
