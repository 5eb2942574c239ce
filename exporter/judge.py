"""How a rollout judges a candidate against the primary, decided before any traffic.

Two kinds of comparison (the candidate's manifest says which applies; ``promote --judge``
overrides):

- **equivalence**: the candidate is the primary's weights again (a compiled variant, a
  re-export). Its answers must match: the validator's tolerances, the agreement gate. Offline,
  its top-1 (classifier) disagreement with the primary on the evaluation set must not be above
  ``1 - min_agreement``.
- **task**: the candidate is a new model (another training run). Its numbers differ; what must
  hold is that it does the task no worse than the primary, within ``max_regression``. Offline,
  both versions run on the evaluation set (the candidate's labelled ``eval.npz``, else the
  primary's, else the candidate's goldens without labels): with labels, a paired
  non-inferiority test of accuracy (McNemar's discordant pairs, one-sided 95 %) FAILs a
  candidate that is worse by more than the margin before it gets any traffic. The two
  versions' offline disagreement (its 95 % upper bound) is what live disagreement is then
  judged against by the rollout's ``disagreement`` gate; for embeddings, the per-row cosine
  floor below which a live row counts as disagreeing is the offline cosines' 1 % quantile.

Without labels anywhere (no eval set, no live ``label`` parameters), a task judge can only show
that the candidate behaves live as it did offline: whether it is as good must come from labels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard import repository as repo_mod
from tritonguard.state import JUDGES
from tritonguard.validators import row_cosine

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
Z95 = 1.6448536269514722  # one-sided 95 %
COSINE_QUANTILE = 0.01  # embeddings: the share of offline rows under the per-row floor


class JudgeError(Exception):
    """The comparison cannot be made (a version cannot be run, no data to run it on)."""


@dataclass(kw_only=True)
class OfflineJudgement:
    judge: str
    verdict: str  # PASS / FAIL / INCONCLUSIVE (INCONCLUSIVE: live gates decide)
    data: str  # which rows: "eval.npz of v2 (450 rows, labelled)", ...
    rows: int
    disagreement: float  # share of rows whose answer differs (classifier: top-1)
    expected_disagreement: float  # its one-sided 95 % upper bound: what live traffic is held to
    cosine_floor: float | None = None  # embeddings
    accuracy: dict[str, float] = field(default_factory=dict)  # "primary" / "candidate", labelled data
    difference: float | None = None  # candidate - primary accuracy
    lower: float | None = None  # one-sided 95 % bounds of the difference
    upper: float | None = None
    max_regression: float = 0.005
    reason: str = ""
    # generation (exporter.generation): bits per char on the eval texts, "primary" / "candidate"
    bits_per_char: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        acc = ""
        if self.accuracy:
            acc = (f"; accuracy v-candidate {self.accuracy['candidate']:.2%} vs primary "
                   f"{self.accuracy['primary']:.2%} (difference {self.difference:+.2%}, 95 % bounds "
                   f"{self.lower:+.2%} .. {self.upper:+.2%}, margin -{self.max_regression:.2%})")
        cos = f"; cosine floor {self.cosine_floor:.4f}" if self.cosine_floor is not None else ""
        bpc = ""
        if self.bits_per_char:
            bpc = (f"; bits/char candidate {self.bits_per_char['candidate']:.4f} vs primary "
                   f"{self.bits_per_char['primary']:.4f}")
            if self.judge == "task":
                bpc += f" (margin +{self.max_regression:.1%} relative)"
        return (f"offline {self.judge} judgement {self.verdict} on {self.data}: disagreement "
                f"{self.disagreement:.2%} (upper {self.expected_disagreement:.2%}){cos}{acc}{bpc}"
                + (f" — {self.reason}" if self.reason else ""))


def parse_margin(text: str) -> float:
    """``0.5pp`` / ``0.5%`` -> 0.005; a bare number is a fraction (``0.005``)."""
    t = text.strip().lower()
    try:
        if t.endswith("pp") or t.endswith("%"):
            value = float(t.rstrip("p%").strip()) / 100
        else:
            value = float(t)
    except ValueError:
        raise ValueError(f"--max-regression must look like 0.5pp, 0.5% or 0.005, got {text!r}") from None
    if not 0 <= value < 1:
        raise ValueError(f"--max-regression must be between 0 and 100 pp, got {text!r}")
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


def upper_bound(k: int, n: int, z: float = Z95) -> float:
    """One-sided Wilson upper bound of a proportion ``k / n`` (1 with no rows)."""
    from .gates import wilson  # noqa: PLC0415

    return wilson(k, n, z)[1]


def _data(repository: Path, target: str, primary: int, candidate: int) -> tuple[dict, np.ndarray | None, str]:
    from .evaluate import load_eval  # noqa: PLC0415

    for v in (candidate, primary):
        found = load_eval(repository, target, v)
        if found is not None:
            inputs, labels = found
            return inputs, labels, f"eval.npz of v{v} ({len(labels)} rows, labelled)"
    path = Path(repository) / target / str(candidate) / repo_mod.GOLDENS
    if not path.exists():
        raise JudgeError(f"v{candidate} of '{target}' has neither eval.npz nor {repo_mod.GOLDENS}: "
                         "nothing to compare the versions on")
    inputs, _ = repo_mod.load_goldens(path)
    rows = len(next(iter(inputs.values())))
    return inputs, None, f"goldens of v{candidate} ({rows} rows, no labels)"


def judge_offline(repository: Path, target: str, primary: int, candidate: int, *, judge: str, task: str,
                  output: str, max_regression: float = 0.005, min_agreement: float = 0.99) -> OfflineJudgement:
    """Run both versions on the evaluation data and judge the candidate (see the module doc)."""
    from .evaluate import run_version  # noqa: PLC0415

    if judge not in JUDGES:
        raise ValueError(f"judge must be one of {', '.join(JUDGES)}, got {judge!r}")
    inputs, labels, data = _data(Path(repository), target, primary, candidate)
    outs = {}
    for who, v in (("primary", primary), ("candidate", candidate)):
        try:
            outs[who] = np.asarray(run_version(Path(repository), target, v, inputs)[output], dtype=np.float64)
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
        cosine_floor = float(np.quantile(cos, COSINE_QUANTILE)) if judge == "task" else None
        differ = cos < (cosine_floor if cosine_floor is not None else 0.99)
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
    if labels is not None and task == "classifier":
        truth = np.asarray(labels).reshape(-1)
        right_p = p2.argmax(axis=1) == truth
        right_c = c2.argmax(axis=1) == truth
        b = int((right_p & ~right_c).sum())  # the primary's right answers the candidate lost
        c = int((right_c & ~right_p).sum())  # and the other way round
        diff = (c - b) / n
        se = math.sqrt(max(b + c - (c - b) ** 2 / n, 0.0)) / n
        res.accuracy = {"primary": float(right_p.mean()), "candidate": float(right_c.mean())}
        res.difference, res.lower, res.upper = diff, diff - Z95 * se, diff + Z95 * se
        if res.upper < -max_regression:
            res.verdict = FAIL
            res.reason = (f"worse on the task: the candidate lost {b} of the primary's right answers and "
                          f"gained {c}")
        elif res.lower > -max_regression:
            res.verdict = PASS
        else:
            res.verdict = INCONCLUSIVE
            res.reason = "too few rows to show non-inferiority offline; the live gates decide"
    else:
        res.verdict = INCONCLUSIVE
        res.reason = "no labels: the live gates hold the candidate to this disagreement"
    return res
