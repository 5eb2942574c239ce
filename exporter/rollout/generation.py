"""The offline judgement of a generative version (``task: generation``, e.g. ``tinylm`` from
``examples/generator.py``) against the primary, before any traffic.

Both versions' ``model.onnx`` run in process (onnxruntime on CPU, the ``generator`` backend's
own decoder: :func:`examples.generator.decoder`), never through a server.

- **Prompts**: the candidate's ``goldens.json`` prompts, then the first :data:`PROMPT_CHARS`
  characters of every text of the candidate's ``eval.json`` (else the primary's; without either
  the judgement cannot be made: :class:`JudgeError`). Each is decoded greedily
  (:data:`MAX_TOKENS` tokens) by both versions; ``disagreement`` is the share of prompts whose
  texts differ, ``expected_disagreement`` its one-sided 95 % upper bound.
- **equivalence** (the same weights re-exported): PASS while ``disagreement <= 1 -
  min_agreement``; else FAIL, naming the first prompt whose texts differ.
- **task** (another training run): bits per char of both versions on the eval texts
  (:func:`examples.generator.bits_per_char`, teacher-forced); FAIL when the candidate's is not
  finite or above the primary's by more than ``max_regression`` *relative* (0.03: at most 3 %
  more bits per char), else PASS. Greedy texts of two training runs differ almost always, so
  disagreement is recorded here for the live gates, not judged.
- **a version served at a URL** (declared in the target's ``endpoints.json``,
  :mod:`tritonguard.rollout.endpoints`: another runtime, e.g. vLLM): there is no artifact to run
  here, and running the server from the exporter would judge the exporter's view of it, not the
  guards'. The judgement is INCONCLUSIVE, and the live gates decide on what the guards measure
  through that server: its errors and stalls (breaker, error rate), its paired timings against
  the primary (latency) and the canary's comparisons (agreement; reported, not judged, for a task
  judge: another runtime writes other text).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from exporter.rollout.judge import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    JudgeError,
    OfflineJudgement,
    manifest_judge,
    upper_bound,
)
from tritonguard.core import repository as repo_mod
from tritonguard.generation.contract import SamplingParams
from tritonguard.generation.decoder import CharTokenizer
from tritonguard.rollout.endpoints import EndpointError, endpoint_of
from tritonguard.rollout.state import JUDGES

PROMPT_CHARS = 40
MAX_TOKENS = 48
EVAL_FILE, GOLDENS_FILE, VOCAB_FILE = "eval.json", "goldens.json", "vocab.json"
# the relative bits-per-char margin of a task judgement; measured on tinylm (docs/generation.md):
# honest retrains (another seed) are within ~1 % of each other, a run of 40 steps is ~40 % worse
MAX_REGRESSION = 0.03


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JudgeError(f"cannot read {what} {path}: {exc}") from None


def eval_data(repository: Path, target: str, primary: int, candidate: int) -> tuple[list[str], int]:
    """(eval texts, the version they came from): the candidate's eval.json, else the primary's."""
    for v in (candidate, primary):
        path = Path(repository) / target / str(v) / EVAL_FILE
        if path.exists():
            texts = (_read_json(path, "eval set") or {}).get("texts")
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
                raise JudgeError(f"{path}: expected {{'texts': [non-empty strings, ...]}}")
            return texts, v
    raise JudgeError(f"neither v{candidate} nor v{primary} of '{target}' has {EVAL_FILE}: "
                     "nothing to compare the versions on")


def golden_prompts(repository: Path, target: str, version: int) -> list[str]:
    path = Path(repository) / target / str(version) / GOLDENS_FILE
    if not path.exists():
        return []
    cases = (_read_json(path, "goldens") or {}).get("cases") or []
    return [c["prompt"] for c in cases if isinstance(c, dict) and isinstance(c.get("prompt"), str) and c["prompt"]]


def _artifact(repository: Path, target: str, version: int) -> tuple[Path, Any]:
    """(model.onnx, tokenizer) of one version; raises what reading them raises."""

    folder = Path(repository) / target / str(version)
    manifest = repo_mod.read_manifest(folder) or {}
    onnx = folder / manifest.get("artifact", "model.onnx")
    if not onnx.exists():
        raise FileNotFoundError(f"{onnx} does not exist")
    vocab = folder / VOCAB_FILE
    tok = CharTokenizer.from_dict(json.loads(vocab.read_text())) if vocab.exists() else CharTokenizer()
    return onnx, tok


def greedy_texts(onnx: Path, tokenizer: Any, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    """Greedy continuations of ``prompts``: prefilled one by one, advanced as one batch (the
    served model's way; a row's result does not depend on its neighbours)."""
    from examples.generator import decoder  # noqa: PLC0415

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return decoder(onnx, tokenizer).generate_many(prompts, [params] * len(prompts))


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "…")


def judge_generation(repository: Path, target: str, primary: int, candidate: int, *, judge: str,
                     max_regression: float = MAX_REGRESSION, min_agreement: float = 0.99) -> OfflineJudgement:
    """Judge generative version ``candidate`` of ``target`` against ``primary`` offline (see the
    module doc). ``max_regression`` is relative bits per char for ``task`` (0.03: the candidate
    may need at most 3 % more bits per char than the primary); ``min_agreement`` the share of
    identical greedy texts ``equivalence`` needs. Raises :class:`JudgeError` when there is no
    eval data or the primary cannot run; a candidate that cannot run FAILs."""
    from examples.generator import bits_per_char  # noqa: PLC0415

    if judge not in JUDGES:
        raise ValueError(f"judge must be one of {', '.join(JUDGES)}, got {judge!r}")
    repository = Path(repository)
    try:
        served_at = endpoint_of(repository / target, candidate)
    except EndpointError as exc:
        raise JudgeError(str(exc)) from None
    if served_at is not None:
        return OfflineJudgement(judge=judge, verdict=INCONCLUSIVE, data=f"v{candidate} is served at {served_at.url}",
                                rows=0, disagreement=0.0, expected_disagreement=1.0, max_regression=max_regression,
                                reason=f"v{candidate} is served at {served_at.url} (another runtime): no offline "
                                       "run; judged live on what the guards measure through it (errors, paired "
                                       "latency, canary comparisons)")
    texts, eval_from = eval_data(repository, target, primary, candidate)
    golden = list(dict.fromkeys(golden_prompts(repository, target, candidate)))
    prompts = list(dict.fromkeys(golden + [t[:PROMPT_CHARS] for t in texts]))
    data = (f"{len(prompts)} prompts ({len(golden)} of v{candidate}'s goldens, the rest from eval.json "
            f"of v{eval_from}), {len(texts)} eval texts")
    outs: dict[str, list[str]] = {}
    bpc: dict[str, float] = {}
    for who, v in (("primary", primary), ("candidate", candidate)):
        try:
            onnx, tok = _artifact(repository, target, v)
            outs[who] = greedy_texts(onnx, tok, prompts)
            bpc[who] = bits_per_char(onnx, texts, tok)[0]
        except Exception as exc:  # noqa: BLE001 - a version that cannot run
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            why = f"v{v} cannot run: {type(exc).__name__}: {first}"
            if who == "primary":
                raise JudgeError(why) from None
            return OfflineJudgement(judge=judge, verdict=FAIL, data=data, rows=len(prompts), disagreement=1.0,
                                    expected_disagreement=1.0, max_regression=max_regression, reason=why)
    n = len(prompts)
    differ = [i for i in range(n) if outs["primary"][i] != outs["candidate"][i]]
    k = len(differ)
    res = OfflineJudgement(judge=judge, verdict=PASS, data=data, rows=n, disagreement=k / n,
                           expected_disagreement=upper_bound(k, n), max_regression=max_regression,
                           bits_per_char=bpc)
    p_bpc, c_bpc = bpc["primary"], bpc["candidate"]
    if not math.isfinite(c_bpc):
        res.verdict, res.reason = FAIL, f"the candidate's bits per char is not finite ({c_bpc})"
        return res
    if judge == "equivalence":
        allowed = 1 - min_agreement
        if k / n > allowed:
            i = differ[0]
            res.verdict = FAIL
            res.reason = (f"not equivalent: greedy texts differ on {k}/{n} prompts (allowed {allowed:.2%}); "
                          f"first {prompts[i]!r}: primary {_short(outs['primary'][i])}, "
                          f"candidate {_short(outs['candidate'][i])}")
        return res
    if not math.isfinite(p_bpc):
        raise JudgeError(f"v{primary}'s bits per char is not finite ({p_bpc}): nothing to compare against")
    limit = p_bpc * (1 + max_regression)
    if c_bpc > limit:
        res.verdict = FAIL
        res.reason = (f"worse on the task: {c_bpc:.4f} bits per char vs the primary's {p_bpc:.4f} "
                      f"({c_bpc / p_bpc - 1:+.1%}, allowed +{max_regression:.1%})")
    else:
        res.reason = (f"{c_bpc:.4f} bits per char vs the primary's {p_bpc:.4f} ({c_bpc / p_bpc - 1:+.1%}, "
                      f"allowed +{max_regression:.1%})")
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m exporter.rollout.generation REPOSITORY TARGET PRIMARY CANDIDATE [--judge task]``:
    print the judgement; exit 0 on PASS, 1 on FAIL, 2 when it cannot be made (INCONCLUSIVE: a
    version served at a URL)."""
    import argparse  # noqa: PLC0415
    import sys  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m exporter.rollout.generation", description=judge_generation.__doc__.split("\n\n")[0])
    ap.add_argument("repository", type=Path)
    ap.add_argument("target")
    ap.add_argument("primary", type=int)
    ap.add_argument("candidate", type=int)
    ap.add_argument("--judge", choices=JUDGES, help="default: what the candidate's manifest says")
    ap.add_argument("--max-regression", type=float, default=MAX_REGRESSION, help="relative bits per char (0.03 = 3 %%)")
    ap.add_argument("--min-agreement", type=float, default=0.99)
    args = ap.parse_args(argv)

    judge = args.judge or manifest_judge(args.repository, args.target, args.candidate)
    try:
        res = judge_generation(args.repository, args.target, args.primary, args.candidate, judge=judge,
                               max_regression=args.max_regression, min_agreement=args.min_agreement)
    except JudgeError as exc:
        sys.stdout.write(f"no judgement: {exc}\n")
        return 2
    sys.stdout.write(res.summary() + "\n")
    return 0 if res.verdict == PASS else 2 if res.verdict == INCONCLUSIVE else 1


if __name__ == "__main__":
    raise SystemExit(main())
