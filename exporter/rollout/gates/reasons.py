"""Verdict texts: the measured figure against the limit it failed, for goldens and breaker trips.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exporter.rollout.gates.verdict import PASS, SKIPPED
from tritonguard.rollout.validators import ValidatorConfig


# -- verdict texts: the measured figure against the limit it failed --------------------------------
def _g(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _output_reason(m: Mapping[str, Any], limits: Any, worst_only: bool) -> list[str]:
    """Figures of one output's golden comparison (a validator's metrics) against its limits."""
    mf = limits.marginal_factor
    parts: list[str] = []
    if "error" in m:
        return [f"error: {m['error']}"]
    if "agreement" in m and "max_abs_diff" in m and "atol" in m:  # classifier
        agree, diff, atol = float(m["agreement"]), float(m["max_abs_diff"]), float(m["atol"])
        if agree < 1 or not worst_only:
            parts.append(f"top-1 agreement {agree:.4g}" + (" < 1 (every row must agree)" if agree < 1 else ""))
        if diff > mf * atol:
            parts.append(f"max_abs_diff {diff:.3g} > {mf * atol:.3g} ({mf:g} x atol {atol:g})")
        elif diff > atol:
            parts.append(f"max_abs_diff {diff:.3g} > atol {atol:.3g} (MARGINAL up to {mf * atol:.3g})")
        elif not worst_only:
            parts.append(f"max_abs_diff {diff:.3g} <= atol {atol:.3g}")
    elif "max_tolerance_ratio" in m:  # regression / encoder
        ratio, diff = float(m["max_tolerance_ratio"]), float(m.get("max_abs_diff", float("nan")))
        tol = f"atol {_g(m.get('atol'))} + rtol {_g(m.get('rtol'))} x |ref|"
        if ratio > mf:
            parts.append(f"max_abs_diff {diff:.3g} is {ratio:.3g} x the tolerance ({tol}) > {mf:g} x")
        elif ratio > 1 or not worst_only:
            parts.append(f"max_abs_diff {diff:.3g} is {ratio:.3g} x the tolerance ({tol})"
                         + (f", MARGINAL up to {mf:g} x" if ratio > 1 else ", <= 1 x"))
    elif "min_cosine" in m:  # embedding
        cos = float(m["min_cosine"])
        if cos < limits.cosine_marginal:
            parts.append(f"min_cosine {cos:.6g} < {limits.cosine_marginal:g}")
        elif cos < limits.cosine_pass:
            parts.append(f"min_cosine {cos:.6g} < {limits.cosine_pass:g} (MARGINAL down to {limits.cosine_marginal:g})")
        elif not worst_only:
            parts.append(f"min_cosine {cos:.6g} >= {limits.cosine_pass:g}")
    elif "min_spearman" in m:  # reranker
        rho = float(m["min_spearman"])
        if rho < limits.spearman_marginal:
            parts.append(f"min_spearman {rho:.4g} < {limits.spearman_marginal:g}")
        elif rho < limits.spearman_pass:
            parts.append(f"min_spearman {rho:.4g} < {limits.spearman_pass:g} (MARGINAL down to "
                         f"{limits.spearman_marginal:g})")
        elif not worst_only:
            parts.append(f"min_spearman {rho:.4g} >= {limits.spearman_pass:g}")
    elif "exact_match_rate" in m:  # generation
        exact = float(m["exact_match_rate"])
        if exact < 1 or not worst_only:
            parts.append(f"exact_match_rate {exact:.4g}" + (" < 1" if exact < 1 else "")
                         + f", prefix_match_rate {_g(m.get('prefix_match_rate'))} (a row FAILs below "
                         f"{limits.prefix_marginal:g})")
    elif not worst_only or not parts:  # a custom validator's figures: shown as they are
        parts = [f"{k} {_g(v)}" for k, v in m.items() if k != "rows"]
    return parts


def golden_reason(result: Mapping[str, Any] | None, limits: Any = None) -> str:
    """``goldens FAIL: PROBS: max_abs_diff 0.031 > 0.001 (10 x atol 0.0001)``: a golden check
    result (``{"verdict", "metrics"}``, as the guards record it in the rollout state) with the
    figures that decided it against the validator's limits (``limits``: a
    :class:`tritonguard.rollout.validators.ValidatorConfig`, the guard's ``validator.*``; default ones
    when None). For PASS the main figures; for MARGINAL/FAIL only the ones past a limit."""

    limits = limits or ValidatorConfig()
    result = result or {}
    verdict = result.get("verdict") or "?"
    metrics = result.get("metrics") or {}
    worst_only = verdict not in (PASS, SKIPPED)
    parts: list[str] = []
    for name, m in metrics.items():
        if isinstance(m, Mapping):
            figures = _output_reason(m, limits, worst_only)
            if figures:
                parts.append(f"{name}: {', '.join(figures)}")
        elif name == "error":
            parts.append(f"error at {m}")
        else:
            parts.append(f"{name}: {m}")
    return f"goldens {verdict}" + (f": {'; '.join(parts)}" if parts else "")


_TRIP_TEXT = {"error_rate": "error rate", "non_finite": "NaN/Inf rate", "fused_failures": "fused failure rate",
              "validator_fail": "validator FAIL rate"}


def trip_reason(trip: Mapping[str, Any] | None) -> str:
    """``error_rate: 12.0% (24/200) > 5.0%``: a breaker trip (``{"reason", "figures"}``, the
    ``last_trip`` of a shared breaker document) with the figure that tripped it and its limit."""
    if not trip:
        return ""
    reason, f = trip.get("reason", "?"), dict(trip.get("figures") or {})
    if "probe" in f:
        return f"{reason}: a half-open probe was {f['probe']} after {f.get('probes_passed', 0)} passing"
    if reason in _TRIP_TEXT and "rate" in f and "limit" in f:
        of = f.get("window", f.get("compared"))
        count = f" ({f.get('count', '?'):.0f}/{of:.0f})" if isinstance(of, (int, float)) and \
            isinstance(f.get("count"), (int, float)) else ""
        return f"{reason}: {_TRIP_TEXT[reason]} {float(f['rate']):.1%}{count} > {float(f['limit']):.1%}"
    if reason == "latency" and "budget_ms" in f:
        return f"latency: p95 {float(f['p95_ms']):.3g} ms > budget {float(f['budget_ms']):.3g} ms"
    if reason == "latency" and "max_ratio" in f:
        return (f"latency: p95 {float(f['p95_ms']):.3g} ms = {float(f['ratio']):.3g} x the primary's "
                f"{float(f['primary_p95_ms']):.3g} ms > {float(f['max_ratio']):.3g} x")
    if reason == "drift" and "fail_share_ewma" in f:
        limit = f" > {float(f['limit']):.3g}" if "limit" in f else ""
        return f"drift: FAIL share EWMA {float(f['fail_share_ewma']):.3g}{limit} ({f.get('kind', '?')} rows)"
    return f"{reason}: " + ", ".join(f"{k} {_g(v)}" for k, v in f.items()) if f else str(reason)
