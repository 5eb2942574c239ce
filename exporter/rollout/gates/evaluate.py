"""One look at a rollout's window: every gate on the readings between two looks (the error rate,
the validator agreement or, for a task judge, the disagreement and labels gates, the breaker,
latency from exact samples or histogram buckets, cost), and the look's verdict: FAIL if any gate
fails, INCONCLUSIVE (hold) if any cannot decide, PASS otherwise; SKIPPED gates count for neither."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from exporter.rollout.gates.config import GateConfig
from exporter.rollout.gates.latency import latency_gate
from exporter.rollout.gates.readings import CHARGED, Buckets, GuardReadings, le_label, window
from exporter.rollout.gates.stats import (
    bucket_samples,
    mann_whitney,
    quantile,
    weighted_median,
    welch,
)
from exporter.rollout.gates.task import disagreement_gate, labels_gate
from exporter.rollout.gates.verdict import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIPPED,
    GateReport,
    GateResult,
    spent_alpha,
    sprt,
)
from tritonguard.rollout.feedback import Tally


def _error_gate(n: float, errors: float, primary: dict, cfg: GateConfig) -> GateResult:
    figures = {"requests": n, "errors": errors, "rate": errors / n if n else None,
               "p0": cfg.ok_error_rate, "p1": cfg.max_error_rate, **primary}
    verdict, llr = sprt(errors, n, cfg.ok_error_rate, cfg.max_error_rate, cfg.alpha, cfg.beta)
    figures.update(llr=llr, fail_at=math.log(1 / cfg.alpha), pass_at=math.log(cfg.beta))
    if verdict == PASS and n < cfg.min_requests:
        verdict = INCONCLUSIVE
    rate = f"{errors / n:.2%} ({errors:.0f}/{n:.0f})" if n else "n/a (0 requests)"
    reason = {FAIL: f"error rate {rate} > limit {cfg.max_error_rate:.2%} (SPRT: log LR {llr:.2f} >= "
                    f"{math.log(1 / cfg.alpha):.2f})",
              INCONCLUSIVE: f"error rate {rate}, limit {cfg.max_error_rate:.2%}: {n:.0f} requests, need >= "
                            f"{cfg.min_requests} and a decisive SPRT",
              PASS: ""}[verdict]
    return GateResult(name="error_rate", verdict=verdict, figures=figures, samples=int(n), reason=reason)


def _agreement_gate(compared: dict[str, float], cfg: GateConfig) -> GateResult:
    total = sum(compared.values())
    agree = sum(v for k, v in compared.items() if k in cfg.agree_verdicts)
    p1 = 1 - cfg.min_agreement
    verdict, llr = sprt(total - agree, total, p1 / 2, p1, cfg.alpha, cfg.beta)
    if verdict != INCONCLUSIVE and total < cfg.min_compared:  # early decisions need their sample
        verdict = INCONCLUSIVE
    figures = {"compared": total, "agree": agree, "agreement": agree / total if total else None,
               "min_agreement": cfg.min_agreement, "llr": llr, "by_verdict": compared}
    share = f"{agree / total:.2%} ({agree:.0f}/{total:.0f})" if total else "n/a (0 compared rows)"
    reason = {FAIL: f"agreement {share} < limit {cfg.min_agreement:.2%} (SPRT: log LR {llr:.2f} >= "
                    f"{math.log(1 / cfg.alpha):.2f})",
              INCONCLUSIVE: f"agreement {share}, limit {cfg.min_agreement:.2%}: {total:.0f} compared rows, "
                            f"need >= {cfg.min_compared} and a decisive SPRT",
              PASS: ""}[verdict]
    return GateResult(name="agreement", verdict=verdict, figures=figures, samples=int(total), reason=reason)


BREAKER_NAMES = {0: "closed", 1: "half-open", 2: "open"}


def _breaker_gate(after: GuardReadings, trips: float) -> GateResult:
    figures = {"state": after.breaker_state, "trips": trips}
    if trips > 0 or (after.breaker_state or 0) > 0:
        state = BREAKER_NAMES.get(after.breaker_state or 0, str(after.breaker_state))
        return GateResult(name="breaker", verdict=FAIL, figures=figures,
                          reason=f"breaker {state}, {trips:.0f} trip{'s' if trips != 1 else ''} in the window "
                                 "(limit: closed, 0 trips)")
    if after.breaker_state is None:
        return GateResult(name="breaker", verdict=INCONCLUSIVE, figures=figures,
                          reason="the candidate's breaker state is not reported")
    return GateResult(name="breaker", verdict=PASS, figures=figures)


def _cost_gate(w: GuardReadings, share: float | None, cfg: GateConfig) -> GateResult:
    cand, prim = w.candidate, w.primary
    nc, np_ = w.charged.get(cand, 0.0), w.charged.get(prim, 0.0)
    priced = all(sum(w.cost.get(v, {}).values()) > 0 for v in (cand, prim))
    sums, unit = (w.cost, "cost") if priced else (w.compute, "compute seconds")
    guard = sum(sums.get(v, {}).get("guard", 0.0) for v in (cand, prim))
    tc, tp = sums.get(cand, {}).get("target", 0.0), sums.get(prim, {}).get("target", 0.0)
    # per request: the pooled guard part (the same code for both) plus the version's own calls
    g = guard / (nc + np_) if nc + np_ else 0.0
    pc, pp = (g + tc / nc if nc else 0.0), (g + tp / np_ if np_ else 0.0)
    limit = cfg.max_cost_increase or 0.0
    figures: dict[str, Any] = {"basis": unit, "candidate_requests": nc, "primary_requests": np_,
                               "guard_per_request": g if nc + np_ else None,
                               "candidate_target_per_request": tc / nc if nc else None,
                               "primary_target_per_request": tp / np_ if np_ else None,
                               "candidate_per_request": pc if nc else None,
                               "primary_per_request": pp if np_ else None,
                               "max_increase": limit, "share": share}
    if share is not None and share < cfg.cost_min_share:
        return GateResult(name="cost", verdict=SKIPPED, figures=figures, samples=int(nc),
                          reason=f"judged from {cfg.cost_min_share:.0%} of traffic (now {share:.0%}): a smaller "
                                 "share gets smaller sub-batches, whose fixed per-call cost weighs more per request")
    if share is not None and share >= 1.0:
        return GateResult(name="cost", verdict=SKIPPED, figures=figures, samples=int(nc),
                          reason="at 100 % the primary serves no requests to compare with")
    if nc < cfg.min_requests or np_ < cfg.min_requests:
        why = "" if nc or np_ else f" (no {CHARGED}: is the guard's cost meter on, cost.enabled?)"
        return GateResult(name="cost", verdict=INCONCLUSIVE, figures=figures, samples=int(nc),
                          reason=f"{nc:.0f} candidate / {np_:.0f} primary requests charged, need >= "
                                 f"{cfg.min_requests} each{why}")
    if tc <= 0 or tp <= 0:
        return GateResult(name="cost", verdict=INCONCLUSIVE, figures=figures, samples=int(nc),
                          reason=f"no target {unit} measured for v{cand if tc <= 0 else prim}")
    ratio = pc / pp
    figures["ratio"] = ratio
    per_1k = (f"{1000 * pc:.3g} vs {1000 * pp:.3g} per 1k requests, of which guard {1000 * g:.3g}"
              + ("" if priced else " (compute s)"))
    if ratio - 1 > limit:
        return GateResult(name="cost", verdict=FAIL, figures=figures, samples=int(nc),
                          reason=f"costs {ratio:.2f}x the primary per request ({per_1k}): +{ratio - 1:.0%} > "
                                 f"limit +{limit:.0%}")
    return GateResult(name="cost", verdict=PASS, figures=figures, samples=int(nc),
                      reason=f"{ratio:.2f}x the primary per request ({per_1k})")


def _latency_gate(cand: Buckets, prim: Buckets, look: int, cfg: GateConfig) -> GateResult:
    cm, cc = bucket_samples(cand)
    pm, pc = bucket_samples(prim)
    nc, np_ = int(cc.sum()), int(pc.sum())
    alpha_k = spent_alpha(cfg.alpha, look)
    figures: dict[str, Any] = {"candidate_samples": nc, "primary_samples": np_, "alpha_k": alpha_k,
                               "candidate_p99_s": quantile(cand, 0.99), "primary_p99_s": quantile(prim, 0.99)}
    if nc < cfg.min_latency_samples or np_ < cfg.min_latency_samples:
        return GateResult(name="latency", verdict=INCONCLUSIVE, figures=figures, samples=nc,
                          reason=f"{nc} candidate / {np_} primary latency samples, "
                                 f"need >= {cfg.min_latency_samples} each")
    prim_median = weighted_median(pm, pc)
    # Hodges-Lehmann: the median of all pairwise differences, weighted by bucket pair counts
    shift = weighted_median(np.subtract.outer(cm, pm).ravel(), np.outer(cc, pc).ravel())
    both = cfg.latency_direction == "both"
    p = mann_whitney(cm, cc, pm, pc, "two-sided" if both else "greater")
    allowed = cfg.latency_tolerance * abs(prim_median)
    figures.update(hodges_lehmann_s=shift, primary_median_s=prim_median, allowed_shift_s=allowed,
                   mann_whitney_p=p, welch_p=welch(cm, cc, pm, pc))
    sm, sc = bucket_samples(cand, parts=8)
    qm, qc = bucket_samples(prim, parts=8)
    # FAIL needs evidence that the shift exceeds the allowance: the candidate's latencies less the
    # allowed shift are still slower than the primary's at alpha_k (and, "both", those plus it
    # still faster; each side at alpha_k / 2). Noise around a shift within the allowance does not
    # fail a build, as it did when FAIL was "point estimate over the allowance AND p(shift > 0)".
    p_over = mann_whitney(sm - allowed, sc, qm, qc, "greater")
    if both:
        p_over = min(1.0, 2 * min(p_over, mann_whitney(sm + allowed, sc, qm, qc, "less")))
    # PASS needs evidence that the shift is within the allowance: the candidate's latencies less
    # the allowed shift are faster than the primary's at beta (and, "both", more plus slower)
    p_within = mann_whitney(sm - allowed, sc, qm, qc, "less")
    if both:
        p_within = max(p_within, mann_whitney(sm + allowed, sc, qm, qc, "greater"))
    figures["p_within"] = p_within
    figures["p_over"] = p_over
    if p_over < alpha_k:
        return GateResult(name="latency", verdict=FAIL, figures=figures, samples=nc,
                          reason=f"shift {shift * 1000:.3g} ms > {allowed * 1000:.3g} ms, "
                                 f"p={p_over:.2g} < {alpha_k:.2g}")
    if p_within < cfg.beta:
        return GateResult(name="latency", verdict=PASS, figures=figures, samples=nc)
    return GateResult(name="latency", verdict=INCONCLUSIVE, figures=figures, samples=nc,
                      reason=f"shift {shift * 1000:.3g} ms on {nc}/{np_} samples, not yet shown within "
                             f"{allowed * 1000:.3g} ms (p={p_within:.2g}, need < {cfg.beta:.2g})")


def evaluate(before: GuardReadings | None, after: GuardReadings, config: GateConfig | None = None,
             *, look: int = 1, mode: str = "split",
             primary_reference: Buckets | None = None, latency_samples: tuple[Any, Any] | None = None,
             share: float | None = None, labels: Tally | None = None) -> GateReport:
    """Judge the window between two readings (``before`` None: since the counters started).

    ``look`` numbers the looks at this window (1, 2, ...) for the latency test's alpha spending.
    ``mode="shadow"``: candidate requests are its mirrored (compared) rows and the latency gate
    is not run (the guard times shadow calls off the serving path, so they are not comparable).
    ``primary_reference``: primary buckets to compare against when the primary served too few
    in this window (at a 100 % step it serves none). ``latency_samples``: (candidate, primary)
    exact per-call latencies of the window (:class:`tritonguard.rollout.latency.Samples`, kept in the
    store by the guards); when given, the latency gate judges those
    (:func:`exporter.rollout.gates.latency.latency_gate`) instead of histogram buckets. ``share``: the
    candidate's traffic share at this step; below ``latency_min_share`` latency is not judged.
    ``labels``: labelled rows per version since the rollout began, from the store
    (:func:`tritonguard.rollout.feedback.tally`); without it the labels gate reads the window's metrics."""
    cfg = config or GateConfig()
    if mode not in ("split", "shadow"):
        raise ValueError(f"mode must be 'split' or 'shadow', got {mode!r}")
    if before is not None and before.source != after.source:
        return GateReport(verdict=INCONCLUSIVE, look=look, reset=True, gates=[GateResult(
            name="data", verdict=INCONCLUSIVE, reason=f"the readings' source changed ({before.source or 'metrics pages'} "
            f"-> {after.source or 'metrics pages'}): the window starts again")])
    w = window(before, after)
    values = [*w.served.values(), *w.errors.values(), *w.fused.values(), w.trips,
              *w.charged.values(), *(x for d in (*w.cost.values(), *w.compute.values()) for x in d.values()),
              *(x for d in w.labeled.values() for x in d.values()),
              *(x for d in (*w.compared.values(), *w.latency.values()) for x in d.values())]
    if any(x < 0 for x in values):
        return GateReport(verdict=INCONCLUSIVE, look=look, reset=True, gates=[GateResult(
            name="data", verdict=INCONCLUSIVE, reason="a counter went backwards (a guard restarted?)")])
    cand, prim = after.candidate, after.primary
    gates: list[GateResult] = []
    missing = [p for p in after.problems if "latency" not in p]
    if before is not None and (before.candidate, before.primary) != (cand, prim):
        missing.append("readings compare different versions")
    if missing:
        gates.append(GateResult(name="data", verdict=INCONCLUSIVE, reason="; ".join(missing)))
    compared: dict[str, float] = {}
    for verdicts in w.compared.values():
        for verdict, value in verdicts.items():
            compared[verdict] = compared.get(verdict, 0.0) + value
    # a request of a fused call that failed is a failure of the version, even though the guard
    # rescued it by retrying it alone; it was counted as served too, so it is not added twice
    fused = w.fused.get(cand, 0.0)
    errors = w.errors.get(cand, 0.0)
    answered = w.served.get(cand, 0.0) if mode == "split" else sum(w.compared.get("shadow", {}).values())
    pn = w.served.get(prim, 0.0) + w.errors.get(prim, 0.0)
    primary = {"primary_requests": pn, "primary_rate": w.errors.get(prim, 0.0) / pn if pn else None,
               "fused_failures": fused}
    gates.append(_error_gate(answered + errors, min(errors + fused, answered + errors), primary, cfg))
    gates.append(_breaker_gate(after, w.trips))
    if cfg.judge == "task":
        gates.append(disagreement_gate(compared, look, cfg))
        gates.append(labels_gate(w, look, cfg, labels))
    elif cfg.min_agreement is not None:
        gates.append(_agreement_gate(compared, cfg))
    used_primary = None
    if mode == "split" and cfg.latency and share is not None and share < cfg.latency_min_share:
        gates.append(GateResult(name="latency", verdict=SKIPPED,
                                reason=f"judged from {cfg.latency_min_share:.0%} of traffic (now {share:.0%}): a "
                                       "rarely called version runs cache-cold"))
    elif mode == "split" and cfg.latency and latency_samples is not None and share is not None and share >= 1.0:
        # the primary serves nothing here: its only samples are from earlier windows, at another
        # load (an identical retrain measured 1.15x "slower" against them); judged at the steps before
        gates.append(GateResult(name="latency", verdict=SKIPPED,
                                reason="at 100 % the primary serves no calls to compare with at the same load"))
    elif mode == "split" and cfg.latency and latency_samples is not None:

        gates.append(latency_gate(*latency_samples, look, alpha=cfg.alpha, beta=cfg.beta, tolerance=cfg.latency_tolerance,
                                  min_samples=cfg.min_latency_samples, direction=cfg.latency_direction))
    elif mode == "split" and cfg.latency:
        prim_lat = w.latency.get(prim, {})
        if max(prim_lat.values(), default=0) < cfg.min_latency_samples and primary_reference:
            prim_lat = primary_reference
        gate = _latency_gate(w.latency.get(cand, {}), prim_lat, look, cfg)
        if gate.verdict == INCONCLUSIVE:
            gate.reason = "; ".join([gate.reason, *(p for p in after.problems if "latency" in p)])
        gates.append(gate)
        used_primary = {le_label(k): v for k, v in prim_lat.items()}
    if mode == "split" and cfg.max_cost_increase is not None:
        gates.append(_cost_gate(w, share, cfg))
    verdicts = {g.verdict for g in gates} - {SKIPPED}
    verdict = FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    return GateReport(verdict=verdict, gates=gates, look=look, primary_latency=used_primary)
