"""The gates of a candidate judged on the task (a new model): its disagreement with the primary
against the operator's limit, and its accuracy on labels, overall and per class or slice.
"""

from __future__ import annotations

import math
from typing import Any

from exporter.rollout.gates.config import GateConfig
from exporter.rollout.gates.readings import GuardReadings
from exporter.rollout.gates.verdict import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    GateResult,
    information_look,
    spent_alpha,
    wilson,
    z_score,
)
from tritonguard.rollout.feedback import Tally


def disagreement_gate(compared: dict[str, float], look: int, cfg: GateConfig) -> GateResult:
    agree, dis = compared.get("AGREE", 0.0), compared.get("DISAGREE", 0.0)
    total = agree + dis
    limit = cfg.disagreement_limit if cfg.disagreement_limit is not None else cfg.max_disagreement
    # FAIL (a rollback) spends alpha over looks counted by information; PASS takes beta as it is:
    # a wrong PASS only moves the candidate to the next step, where a new window judges it on
    # more traffic, while a wrong FAIL rolls back a good model
    look = information_look(total, cfg.min_compared)
    alpha_k = spent_alpha(cfg.alpha, look)
    lo, _ = wilson(dis, total, z_score(alpha_k))
    _, hi = wilson(dis, total, z_score(cfg.beta))
    figures = {"compared": total, "disagree": dis, "disagreement": dis / total if total else None,
               "expected": cfg.expected_disagreement, "limit": limit, "limit_source": cfg.limit_source,
               "lower": lo, "upper": hi, "look": look, "alpha_k": alpha_k, "beta": cfg.beta}
    share = f"{dis:.0f}/{total:.0f}"
    if cfg.min_labels > 0 or not cfg.judge_disagreement:
        why = f"labels decide (min_labels {cfg.min_labels})" if cfg.min_labels > 0 else "the task metric decided offline"
        return GateResult(name="disagreement", verdict=SKIPPED, figures=figures, samples=int(total),
                          reason=f"reported, not judged: {why}; disagreement {share}")
    if total < cfg.min_compared:
        return GateResult(name="disagreement", verdict=INCONCLUSIVE, figures=figures, samples=int(total),
                          reason=f"{total:.0f} compared rows, need >= {cfg.min_compared}")
    if lo > limit:
        return GateResult(name="disagreement", verdict=FAIL, figures=figures, samples=int(total),
                          reason=f"disagrees with the primary on {share} rows (>= {lo:.2%} at alpha "
                                 f"{alpha_k:.2g}), limit {limit:.2%} ({cfg.limit_source})")
    if hi <= limit:
        return GateResult(name="disagreement", verdict=PASS, figures=figures, samples=int(total))
    return GateResult(name="disagreement", verdict=INCONCLUSIVE, figures=figures, samples=int(total),
                      reason=f"disagreement {share}, upper bound {hi:.2%} not yet below the limit {limit:.2%}")


def label_counts(w: GuardReadings, labels: Tally | None) -> dict[int, tuple[float, float]]:
    """version -> (right, labelled): the store's tally of the rollout when given (request labels
    and joined feedback), else the window's ``tritonguard_labeled_total`` (request labels only)."""
    if labels is not None:
        return {v: (float(labels.right.get(v, 0)), float(n)) for v, n in labels.total.items()}
    out = {}
    for v, d in w.labeled.items():
        out[v] = (d.get("true", 0.0), d.get("true", 0.0) + d.get("false", 0.0))
    return out


def diff_bounds(rc: float, nc: float, rp: float, np_: float, z: float) -> tuple[float, float, float]:
    """(difference, lower, upper) of accuracy candidate - primary, two independent samples; a
    half success and failure added to each side keeps the variance away from 0 at 100 %."""
    pc, pp = (rc + 0.5) / (nc + 1), (rp + 0.5) / (np_ + 1)
    diff = rc / nc - rp / np_
    se = math.sqrt(pc * (1 - pc) / (nc + 1) + pp * (1 - pp) / (np_ + 1))
    return diff, diff - z * se, diff + z * se


def slice_failures_live(labels: Tally | None, cand: int, prim: int, alpha: float, cfg: GateConfig) -> list[str]:
    """Classes (by their true label) and named slices where the candidate lost more than
    ``max_slice_regression`` of the primary's recall, Bonferroni over the slices judged."""
    if labels is None:
        return []
    cells = []
    for kind, table in (("class", labels.by_class), ("slice", labels.by_slice)):
        c, p = table.get(cand, {}), table.get(prim, {})
        for name in sorted(set(c) & set(p)):
            (rc, nc), (rp, np_) = c[name], p[name]
            if nc >= cfg.min_slice_labels and np_ >= cfg.min_slice_labels:
                cells.append((kind, name, rc, nc, rp, np_))
    if not cells:
        return []
    z = z_score(alpha / len(cells))
    out = []
    for kind, name, rc, nc, rp, np_ in cells:
        diff, _, upper = diff_bounds(rc, nc, rp, np_, z)
        if upper < -cfg.max_slice_regression:
            out.append(f"{kind} {name}: recall {rc / nc:.1%} ({rc}/{nc}) vs primary {rp / np_:.1%} "
                       f"(upper bound {upper:+.1%}, limit -{cfg.max_slice_regression:.0%})")
    return out


def labels_gate(w: GuardReadings, look: int, cfg: GateConfig, labels: Tally | None = None) -> GateResult:
    counts = label_counts(w, labels)
    rc, nc = counts.get(w.candidate, (0.0, 0.0))
    rp, np_ = counts.get(w.primary, (0.0, 0.0))
    required = cfg.min_labels > 0
    need = cfg.min_labels if required else cfg.min_labeled
    figures: dict[str, Any] = {"candidate_labeled": nc, "primary_labeled": np_,
                               "candidate_accuracy": rc / nc if nc else None,
                               "primary_accuracy": rp / np_ if np_ else None, "max_regression": cfg.max_regression,
                               "required": required, "min_labels": need,
                               "origins": dict(labels.origins) if labels is not None else {"request": nc + np_}}
    waiting = GateResult(name="labels", verdict=INCONCLUSIVE if required else SKIPPED, figures=figures,
                         samples=int(nc), reason=f"waiting for labels: {nc:.0f} / {np_:.0f} labelled rows "
                                                 f"(candidate / primary), need >= {need} each")
    if nc < need or np_ < need:
        return waiting
    alpha_k = spent_alpha(cfg.alpha, information_look(min(nc, np_), need))
    diff, _, upper = diff_bounds(rc, nc, rp, np_, z_score(alpha_k))
    _, lower, _ = diff_bounds(rc, nc, rp, np_, z_score(cfg.beta))
    figures.update(difference=diff, upper=upper, lower=lower, alpha_k=alpha_k)
    if upper < -cfg.max_regression:
        return GateResult(name="labels", verdict=FAIL, figures=figures, samples=int(nc),
                          reason=f"accuracy on labels {rc / nc:.2%} vs primary {rp / np_:.2%}: worse by more "
                                 f"than {cfg.max_regression:.2%} (upper bound {upper:+.2%})")
    slices = slice_failures_live(labels, w.candidate, w.primary, alpha_k, cfg)
    figures["slices_failed"] = slices
    if slices:
        return GateResult(name="labels", verdict=FAIL, figures=figures, samples=int(nc),
                          reason="worse on part of the data: " + "; ".join(slices))
    if required:
        if lower > -cfg.max_regression:
            return GateResult(name="labels", verdict=PASS, figures=figures, samples=int(nc))
        return GateResult(name="labels", verdict=INCONCLUSIVE, figures=figures, samples=int(nc),
                          reason=f"accuracy {rc / nc:.2%} vs {rp / np_:.2%} on {nc:.0f} / {np_:.0f} labelled rows: "
                                 f"lower bound {lower:+.2%} not yet within -{cfg.max_regression:.2%}; more labels")
    return GateResult(name="labels", verdict=SKIPPED if upper < 0 else PASS, figures=figures, samples=int(nc),
                      reason="" if upper >= 0 else "not conclusive either way; does not hold the rollout")
