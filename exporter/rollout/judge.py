"""How a rollout judges a candidate against the primary, decided before any traffic.

Two kinds of comparison (the candidate's manifest says which applies; ``promote --judge``
overrides):

- **equivalence**: the candidate is the primary's weights again (a compiled variant, a
  re-export). Its answers must match: the validator's tolerances, the agreement gate. Offline,
  its top-1 (classifier) disagreement with the primary on the evaluation set must not be above
  ``1 - min_agreement``.
- **task**: the candidate is a new model (another training run). Its numbers differ; what must
  hold is that it does the task no worse than the primary. Both versions run on the evaluation
  data (the candidate's ``eval.npz``, else the primary's, else the candidate's goldens):

  - **with labels** (class ids for a classifier, a paired positive text per query for an
    embedding model): a paired non-inferiority test (McNemar's discordant pairs, one-sided
    95 %) of accuracy, or of recall@k for embeddings, FAILs a candidate worse by more than
    ``max_regression``; a classifier is also judged per true class and per named slice
    (``slices`` in eval.npz) with ``max_slice_regression``, Bonferroni over the slices judged,
    so a candidate that halves the recall of a small class is stopped while the overall figure
    hides it. Only a labelled PASS lets the live disagreement limit widen to this pair's own
    offline disagreement (its upper bound plus ``max_regression``).
  - **without labels**: the candidate's difference from the primary (top-1 changes; for
    embeddings, rows whose cosine to the primary's is under ``min_cosine``) is held to a limit
    the operator owns, ``max_disagreement`` (:mod:`tritonguard.rollout.judging`), never to the
    candidate's own measured difference. FAIL when the difference's lower bound is above the
    limit (stopped before traffic, with the ways to go on), PASS when its upper bound is below,
    else INCONCLUSIVE: the live gates gather more rows against the same limit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exporter.build.evaluate import RECALL_K, load_eval_set, recall_at_k, run_version
from exporter.errors import BadInput, ExporterError
from exporter.rollout.gates.verdict import wilson as _wilson
from tritonguard.core import repository as repo_mod
from tritonguard.rollout.judging import SOURCES, JudgeConfig, default_source
from tritonguard.rollout.state import JUDGES
from tritonguard.rollout.validators import row_cosine

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
Z95 = 1.6448536269514722  # one-sided 95 %
GO_ON = ("to go on: give labels (export --inputs FILE.npz with a 'labels' array, or --eval), raise "
         "--max-disagreement on purpose, or judge live on labels (promote --min-labels N with labels "
         "sent as the 'label' request parameter or fed by `exporter feedback`)")


class JudgeError(ExporterError):
    """The comparison cannot be made (a version cannot be run, no data to run it on)."""


@dataclass(kw_only=True)
class OfflineJudgement:
    judge: str
    verdict: str  # PASS / FAIL / INCONCLUSIVE (INCONCLUSIVE: live gates decide)
    data: str  # which rows: "eval.npz of v2 (450 rows, labelled)", ...
    rows: int
    disagreement: float  # share of rows whose answer differs (classifier: top-1)
    expected_disagreement: float  # its one-sided 95 % upper bound
    cosine_floor: float | None = None  # embeddings: a row under it disagrees
    accuracy: dict[str, float] = field(default_factory=dict)  # "primary" / "candidate", labelled data
    metric: str = ""  # what accuracy measures: "accuracy", f"recall@{RECALL_K}"
    difference: float | None = None  # candidate - primary accuracy
    lower: float | None = None  # one-sided 95 % bounds of the difference
    upper: float | None = None
    max_regression: float = 0.005
    labelled: bool = False  # the verdict rests on labels
    limit: float | None = None  # the disagreement limit in force without labels (and live)
    limit_source: str = ""
    slices_failed: list[str] = field(default_factory=list)
    reason: str = ""
    # generation (exporter.rollout.generation): bits per char on the eval texts, "primary" / "candidate"
    bits_per_char: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def evidence(self) -> str:
        """What this judgement rests on, in a few words (promote's last line names it)."""
        if self.judge == "equivalence":
            return f"equivalence offline ({self.rows} rows)"
        if self.bits_per_char:
            return f"bits per char offline ({self.data})"
        if self.labelled:
            return f"labelled offline ({self.metric}, {self.rows} rows: {self.verdict})"
        return f"disagreement limit only offline ({self.rows} unlabelled rows: {self.verdict})"

    def summary(self) -> str:
        acc = ""
        if self.accuracy:
            acc = (f"; {self.metric or 'accuracy'} candidate {self.accuracy['candidate']:.2%} vs primary "
                   f"{self.accuracy['primary']:.2%} (difference {self.difference:+.2%}, 95 % bounds "
                   f"{self.lower:+.2%} .. {self.upper:+.2%}, margin -{self.max_regression:.2%})")
        cos = f"; cosine floor {self.cosine_floor:.4f}" if self.cosine_floor is not None else ""
        lim = f", limit {self.limit:.2%} ({self.limit_source})" if self.limit is not None else ""
        bpc = ""
        if self.bits_per_char:
            bpc = (f"; bits/char candidate {self.bits_per_char['candidate']:.4f} vs primary "
                   f"{self.bits_per_char['primary']:.4f}")
            if self.judge == "task":
                bpc += f" (margin +{self.max_regression:.1%} relative)"
        return (f"offline {self.judge} judgement {self.verdict} on {self.data}: disagreement "
                f"{self.disagreement:.2%} (upper {self.expected_disagreement:.2%}{lim}){cos}{acc}{bpc}"
                + (f" — {self.reason}" if self.reason else ""))


def parse_margin(text: str, flag: str = "--max-regression") -> float:
    """``0.5pp`` / ``0.5%`` -> 0.005; a bare number is a fraction (``0.005``)."""
    t = text.strip().lower()
    try:
        if t.endswith("pp") or t.endswith("%"):
            value = float(t.rstrip("p%").strip()) / 100
        else:
            value = float(t)
    except ValueError:
        raise BadInput(f"{flag} must look like 0.5pp, 0.5% or 0.005, got {text!r}") from None
    if not 0 <= value < 1:
        raise BadInput(f"{flag} must be between 0 and 100 pp, got {text!r}")
    return value


def manifest_judge(repository: Path, target: str, version: int) -> str:
    """What the candidate's manifest says (``judge``); a version exported before judges were
    recorded is judged on the task when its weights differ from every other version's."""
    manifest = repo_mod.read_manifest(Path(repository) / target / str(version)) or {}
    judge = manifest.get("judge")
    if judge in JUDGES:
        return judge
    same = repo_mod.version_with_artifact(Path(repository) / target, manifest.get("sha256", ""), exclude=version)
    return "task" if same is None else "equivalence"


def wilson(k: float, n: float, z: float = Z95) -> tuple[float, float]:

    return _wilson(k, n, z)


def upper_bound(k: int, n: int, z: float = Z95) -> float:
    """One-sided Wilson upper bound of a proportion ``k / n`` (1 with no rows)."""
    return wilson(k, n, z)[1]


@dataclass
class EvalData:
    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None
    slices: np.ndarray | None
    what: str


def _data(repository: Path, target: str, primary: int, candidate: int) -> EvalData:

    for v in (candidate, primary):
        found = load_eval_set(repository, target, v)
        if found is not None:
            n = len(next(iter(found.inputs.values())))
            kind = "labelled" if found.labels is not None else "no labels"
            return EvalData(found.inputs, found.labels, found.slices, f"eval.npz of v{v} ({n} rows, {kind})")
    path = Path(repository) / target / str(candidate) / repo_mod.GOLDENS
    if not path.exists():
        raise JudgeError(f"v{candidate} of '{target}' has neither eval.npz nor {repo_mod.GOLDENS}: "
                         "nothing to compare the versions on")
    inputs, _ = repo_mod.load_goldens(path)
    rows = len(next(iter(inputs.values())))
    return EvalData(inputs, None, None, f"goldens of v{candidate} ({rows} rows, no labels)")


def _mcnemar(right_p: np.ndarray, right_c: np.ndarray, z: float = Z95) -> tuple[float, float, float, int, int]:
    """(difference, lower, upper, lost, gained) of paired right/wrong rows, candidate - primary."""
    n = len(right_p)
    b = int((right_p & ~right_c).sum())  # the primary's right answers the candidate lost
    c = int((right_c & ~right_p).sum())  # and the other way round
    diff = (c - b) / n
    se = math.sqrt(max(b + c - (c - b) ** 2 / n, 0.0)) / n
    return diff, diff - z * se, diff + z * se, b, c


def slice_failures(right_p: np.ndarray, right_c: np.ndarray, groups: dict[str, np.ndarray], margin: float,
                   *, min_rows: int = 10, alpha: float = 0.05) -> list[str]:
    """Slices (name -> row mask) where the candidate's paired recall is below the primary's by
    more than ``margin`` at one-sided ``alpha`` spread over the slices judged (Bonferroni)."""
    from scipy import stats  # noqa: PLC0415 - only when labels exist

    judged = {name: m for name, m in groups.items() if int(m.sum()) >= min_rows}
    if not judged:
        return []
    z = float(stats.norm.isf(alpha / len(judged)))
    out = []
    for name, m in sorted(judged.items()):
        diff, _, upper, lost, gained = _mcnemar(right_p[m], right_c[m], z)
        if upper < -margin:
            out.append(f"{name}: recall {right_c[m].mean():.1%} vs primary {right_p[m].mean():.1%} on "
                       f"{int(m.sum())} rows (lost {lost}, gained {gained}; upper bound {upper:+.1%}, "
                       f"limit -{margin:.0%})")
    return out


def _embed(repository: Path, target: str, version: int, texts: np.ndarray, name: str, output: str) -> np.ndarray:

    col = np.asarray(texts, dtype=object).reshape(-1, 1)
    return np.asarray(run_version(repository, target, version, {name: col})[output], dtype=np.float64)


def judge_offline(repository: Path, target: str, primary: int, candidate: int, *, judge: str, task: str,
                  output: str, max_regression: float = 0.005, min_agreement: float = 0.99,
                  max_disagreement: float | None = None, limit_source: str = "",
                  min_cosine: float | None = None, max_slice_regression: float | None = None,
                  labels_live: bool = False) -> OfflineJudgement:
    """Run both versions on the evaluation data and judge the candidate (see the module doc).
    ``labels_live``: the rollout will be judged on live labels (``promote --min-labels``): an
    unlabelled disagreement above the limit does not stop it before traffic."""

    if judge not in JUDGES:
        raise ValueError(f"judge must be one of {', '.join(JUDGES)}, got {judge!r}")
    defaults = JudgeConfig()
    limit = defaults.max_disagreement if max_disagreement is None else max_disagreement
    if not limit_source or limit_source == SOURCES["max_disagreement"]:
        # the default's reason, in this task's own figures (judge_limits names the generic one)
        limit_source = default_source("max_disagreement", task)
    floor = defaults.min_cosine if min_cosine is None else min_cosine
    slice_margin = defaults.max_slice_regression if max_slice_regression is None else max_slice_regression
    repository = Path(repository)
    ev = _data(repository, target, primary, candidate)
    inputs, data = ev.inputs, ev.what
    outs = {}
    for who, v in (("primary", primary), ("candidate", candidate)):
        try:
            outs[who] = np.asarray(run_version(repository, target, v, inputs)[output], dtype=np.float64)
        except KeyError:
            raise JudgeError(f"'{target}' v{v} has no output {output!r} to compare") from None
        except Exception as exc:  # noqa: BLE001 - a version that cannot run
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            why = f"v{v} cannot run on {data}: {type(exc).__name__}: {first}"
            if who == "primary":  # nothing to compare against: the live gates alone decide
                raise JudgeError(why) from None
            rows = len(next(iter(inputs.values())))
            return OfflineJudgement(judge=judge, verdict=FAIL, data=data, rows=rows, disagreement=1.0,
                                    expected_disagreement=1.0, max_regression=max_regression, reason=why)
    out_p, out_c = outs["primary"], outs["candidate"]
    n = len(out_p)
    p2, c2 = out_p.reshape(n, -1), out_c.reshape(n, -1)
    finite = np.isfinite(c2).all(axis=1)
    cosine_floor = None
    if task == "embedding":
        cos = row_cosine(c2, p2)
        cosine_floor = floor if judge == "task" else None
        differ = cos < (floor if judge == "task" else 0.99)
    elif task == "classifier":
        differ = c2.argmax(axis=1) != p2.argmax(axis=1)
    else:
        differ = ~np.isclose(c2, p2, atol=1e-4, rtol=1e-4).all(axis=1)
    differ |= ~finite
    k = int(differ.sum())
    res = OfflineJudgement(judge=judge, verdict=PASS, data=data, rows=n, disagreement=k / n if n else 0.0,
                           expected_disagreement=upper_bound(k, n), cosine_floor=cosine_floor,
                           max_regression=max_regression)
    if not finite.all():
        res.verdict, res.reason = FAIL, f"NaN/Inf in the candidate's outputs on {int((~finite).sum())} of {n} rows"
        return res
    if judge == "equivalence":
        # the same weights must give the same answers: a lower bound above the allowed share fails
        allowed = 1 - min_agreement
        lower = max(0.0, k / n - Z95 * math.sqrt(max(k / n * (1 - k / n), 1e-12) / n)) if n else 0.0
        if k and lower > allowed:
            res.verdict = FAIL
            res.reason = (f"not equivalent: answers differ on {k}/{n} rows (>= {lower:.2%}), "
                          f"allowed {allowed:.2%}")
        return res
    res.limit, res.limit_source = limit, limit_source
    right = None
    if ev.labels is not None and task == "classifier":
        truth = np.asarray(ev.labels).reshape(-1)
        right = (p2.argmax(axis=1) == truth, c2.argmax(axis=1) == truth)
        res.metric = "accuracy"
    elif ev.labels is not None and task == "embedding":
        name = next(iter(inputs))
        docs = np.asarray(ev.labels, dtype=object).reshape(-1)
        try:
            dp = _embed(repository, target, primary, docs, name, output)
            dc = _embed(repository, target, candidate, docs, name, output)
        except Exception as exc:  # noqa: BLE001 - the paired texts could not be embedded
            raise JudgeError(f"cannot embed the evaluation set's paired texts: {type(exc).__name__}: {exc}") from None
        right = (recall_at_k(p2, dp), recall_at_k(c2, dc))
        res.metric = f"recall@{RECALL_K}"
    if right is not None:
        right_p, right_c = right
        res.labelled = True
        diff, lower, upper, lost, gained = _mcnemar(right_p, right_c)
        res.accuracy = {"primary": float(right_p.mean()), "candidate": float(right_c.mean())}
        res.difference, res.lower, res.upper = diff, lower, upper
        groups: dict[str, np.ndarray] = {}
        if task == "classifier":
            truth = np.asarray(ev.labels).reshape(-1)
            groups = {f"class {int(c)}": truth == c for c in np.unique(truth)}
        if ev.slices is not None:
            sl = np.asarray(ev.slices).reshape(-1).astype(str)
            groups.update({f"slice {name}": sl == name for name in np.unique(sl) if name})
        res.slices_failed = slice_failures(right_p, right_c, groups, slice_margin)
        if upper < -max_regression:
            res.verdict = FAIL
            res.reason = (f"worse on the task: the candidate lost {lost} of the primary's right answers and "
                          f"gained {gained}")
        elif res.slices_failed:
            res.verdict = FAIL
            res.reason = "worse on part of the data: " + "; ".join(res.slices_failed)
        elif lower > -max_regression:
            res.verdict = PASS
            # labels showed it no worse: its own difference is what live traffic should show
            res.limit = max(limit, res.expected_disagreement + max_regression)
            if res.limit > limit:
                res.limit_source = (f"this pair's labelled offline disagreement {res.expected_disagreement:.2%} "
                                    f"+ margin {max_regression:.2%}")
        else:
            res.verdict = INCONCLUSIVE
            res.reason = "too few rows to show non-inferiority offline; the live gates decide"
        return res
    # no labels: how different the candidate is, against a limit it did not set
    lo = wilson(k, n)[0] if n else 0.0
    what = "rows with a cosine under " + f"{floor:g}" if task == "embedding" else "answers differ"
    if lo > limit and not labels_live:
        res.verdict = FAIL
        res.reason = (f"no labels, and the candidate is more different than allowed: {what} on {k}/{n} rows "
                      f"(>= {lo:.2%}), limit {limit:.2%} ({limit_source}); {GO_ON}")
    elif lo > limit:
        res.verdict = INCONCLUSIVE
        res.reason = (f"no labels offline and {what} on {k}/{n} rows (>= {lo:.2%}, above the limit "
                      f"{limit:.2%}): judged live on labels")
    elif res.expected_disagreement <= limit:
        res.reason = f"no labels: judged on the disagreement limit {limit:.2%} only ({limit_source})"
    else:
        res.verdict = INCONCLUSIVE
        res.reason = (f"no labels: the live gates hold the candidate to the limit {limit:.2%} "
                      f"({limit_source}), not to its own difference")
    return res
