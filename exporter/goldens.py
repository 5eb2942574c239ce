"""Golden capture and the task-aware check that admits (or refuses) an exported artifact.

The exported artifact is run through the same engine code the ``runtime`` backend serves it
with (:func:`tritonguard.engines.load_engine`), and text through the same tokenizer call the
``tokenizer`` backend makes, so a PASS here speaks for what Triton will serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

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


@dataclass
class GoldenReport:
    verdict: str  # PASS | MARGINAL | FAIL
    metrics: dict[str, float | str] = field(default_factory=dict)
    n: int = 0

    @property
    def admitted(self) -> bool:
        return self.verdict != FAIL

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "metrics": self.metrics, "n": self.n}


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


CHECKS = {"classifier": check_classifier, "embedding": check_embedding, "regression": check_regression}


def check(task: str, reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]) -> GoldenReport:
    """Check every reference output; the worst verdict wins. Metrics are prefixed with the
    output name only when there are several outputs, so the common case reads plainly."""
    if not reference:
        return GoldenReport(FAIL, {"error": "no reference outputs"}, 0)
    reports = {}
    for name, ref in reference.items():
        if name not in actual:
            return GoldenReport(FAIL, {"error": f"artifact produced no output {name}"}, len(ref))
        reports[name] = CHECKS[task](np.asarray(ref), np.asarray(actual[name]))
    verdict = max((r.verdict for r in reports.values()), key=_ORDER.__getitem__)
    if len(reports) == 1:
        metrics = next(iter(reports.values())).metrics
    else:
        metrics = {f"{n}.{k}": v for n, r in reports.items() for k, v in r.metrics.items()}
    return GoldenReport(verdict, metrics, next(iter(reports.values())).n)


# -- running the artifact -------------------------------------------------------------------
def tokenize(tokenizer_dir: Path, texts: np.ndarray, max_length: int, output_names: list[str]) -> dict[str, np.ndarray]:
    """TEXT [N,1] -> token tensors, through the ``tokenizer`` backend's own encode()."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from tritonguard.tokenizer import TokenizerConfig, TokenizerModel  # noqa: PLC0415

    # encode() reads only these three attributes; borrowing it keeps one tokenisation code path
    backend = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(tokenizer_dir)),
                              config=TokenizerConfig(max_length=max_length), output_names=output_names)
    items = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
             for x in texts.reshape(len(texts), -1)[:, 0]]
    return TokenizerModel.encode(backend, items)  # type: ignore[arg-type]


def run_artifact(version_dir: Path, spec, tokenizer_dir: Path | None = None) -> dict[str, np.ndarray]:
    """Outputs of the artifact in ``version_dir`` at the spec's public interface."""
    from tritonguard.engines import EngineConfig, load_engine  # noqa: PLC0415

    in_names = [t.name for t in spec.inputs]
    out_names = [t.name for t in spec.outputs]
    # all cores: this is a one-off check, not serving, and the engine code path is the same
    engine = load_engine(version_dir, EngineConfig(intra_op_threads=0), in_names, out_names)
    if spec.text is None:
        return engine.run({n: spec.golden_inputs[n] for n in in_names}, out_names)
    text = spec.golden_inputs[spec.text.text_input]
    feed = tokenize(tokenizer_dir or spec.text.tokenizer_dir, text, spec.text.max_length, in_names)
    out = engine.run(feed, out_names)
    return {spec.text.public_output: out[out_names[0]]}


# -- goldens.npz ----------------------------------------------------------------------------
def save(path: Path, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
    """``in__NAME`` / ``out__NAME`` arrays. BYTES are stored as fixed-width bytes (``S``), not
    object arrays, so reading the file never needs ``allow_pickle`` (see :func:`load`)."""
    arrays = {}
    for prefix, group in (("in__", inputs), ("out__", outputs)):
        for name, arr in group.items():
            arr = np.asarray(arr)
            if arr.dtype == object:
                arr = np.array([x if isinstance(x, bytes) else str(x).encode() for x in arr.flat],
                               dtype=np.bytes_).reshape(arr.shape)
            arrays[prefix + name] = arr
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(inputs, outputs) from a goldens.npz: the guard reads the same files, so one reader."""
    from tritonguard.repository import load_goldens  # noqa: PLC0415

    return load_goldens(path)
