"""The catalogue: every metric tritonguard exports on Triton's /metrics, in one place.

Names, help texts and buckets of the guard's families (:class:`tritonguard.triton.metrics.Metrics`
registers them), the stream guard's, the generator backend's, and ``exporter stream``'s (a Kafka
consumer serving its own port, not Triton's); the control plane (the rollout
gates, ``exporter status``), the dashboard and alert tests and the docs read them from here. A
new metric is added here first; ``tests/unit/core/test_catalogue.py`` checks that every family
has a panel and a line in docs/monitoring.md.
"""

from __future__ import annotations

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GUARD_COUNTERS = {
    "requests": ("tritonguard_requests_total", "Requests seen by the guard"),
    "rejects": ("tritonguard_rejects_total", "Requests rejected by the guard, by reason"),
    "target_errors": ("tritonguard_target_errors_total", "Target call failures, by status code"),
    "target_calls": ("tritonguard_target_calls_total", "Fused target calls (one per execute batch)"),
    "drops": ("tritonguard_metric_drops_total", "Metric observations dropped (queue full)"),
    "goldens": ("tritonguard_golden_checks_total", "Golden checks on this server, by target version and verdict"),
    "fallbacks": ("tritonguard_fallbacks_total", "Requests answered further down the fallback chain, by reason"),
    "served": ("tritonguard_served_total", "Requests answered, by the model version that served them"),
    "trips": ("tritonguard_breaker_trips_total", "Circuit breaker trips, by target version and reason"),
    "compared": ("tritonguard_compared_total", "Canary/shadow comparisons, by kind and validator verdict "
                 "(AGREE/DISAGREE for a version judged on the task)"),
    "fused_failures": ("tritonguard_fused_failures_total",
                       "Requests of fused target calls that failed while each request alone succeeded, by target version"),
    "labeled": ("tritonguard_labeled_total",
                "Requests that carried a ground-truth label, by the version that served them and whether it was right"),
    "compare_drops": ("tritonguard_compare_drops_total", "Comparisons dropped because the queue was full"),
    "cache": ("tritonguard_cache_lookups_total", "Cache lookups per batch row, by tier, result (hit/miss) and tenant"),
    "cache_errors": ("tritonguard_cache_errors_total", "Cache tier failures (the tier is then skipped for a backoff), by tier"),
    "cache_quarantined": ("tritonguard_cache_quarantined_total",
                          "Damaged cache files moved aside (the tier then starts empty), by tier"),
    "redactions": ("tritonguard_redactions_total", "PII spans redacted, by type, direction (input/output) and tenant"),
    "quota_rejects": ("tritonguard_quota_rejects_total", "Requests refused by a tenant quota (UNAVAILABLE), by tenant and reason"),
    "quota_degraded": ("tritonguard_quota_degraded_total",
                       "Requests judged by the host's own tenant quota because the fleet's quota store "
                       "(Redis, TRITONGUARD_STATE_URL) was unreachable"),
    "audit_drops": ("tritonguard_audit_drops_total", "Audit records lost: the writer's queue was full or a write failed"),
    "trace_spans": ("tritonguard_trace_spans_total",
                    "Guard trace spans, by outcome: exported, failed (the collector did not take them), "
                    "dropped (export queue full)"),
    "state_errors": ("tritonguard_state_errors_total",
                     "Rollout state reads that failed (file missing or corrupt, Redis unreachable); the last good state stays"),
    "compute_seconds": ("tritonguard_compute_seconds_total",
                        "Compute charged to answered requests, by target version (cache: cache hits), tenant and "
                        "part (guard: the guard's CPU seconds; target: wall seconds of the target calls)"),
    "cost": ("tritonguard_cost_total",
             "Cost of answered requests (compute times the cost.* prices, in their currency), by target version, tenant and part"),
    "cost_requests": ("tritonguard_cost_requests_total",
                      "Requests the cost meter charged, by the target version that answered (cache: cache hits) and tenant"),
}
GUARD_ZERO_AT_LOAD = ("requests", "target_calls", "drops", "compare_drops", "audit_drops", "state_errors")
GUARD_GAUGES = {
    "breaker_state": ("tritonguard_breaker_state", "Breaker per target version: 0 closed, 1 half-open, 2 open"),
    "route_share": ("tritonguard_route_share",
                    "Share of live traffic the rollout state routes to a target version, by role "
                    "(primary, candidate, arm; shadow: mirrored on top); 0 once the version lost the role"),
    "drift": ("tritonguard_input_drift_fraction", "Share of input features drifting (KS/PSI) on the primary"),
    "cache_degraded": ("tritonguard_cache_degraded", "1 while a cache tier is skipped after a failure (backoff), by tier"),
    "validator_score": ("tritonguard_validator_score",
                        "Latest canary/shadow validator figure per target version, by kind and figure (e.g. top1_agreement, min_cosine)"),
    "output_drift": ("tritonguard_output_drift_ewma",
                     "EWMA of the validator FAIL share on compared rows, per target version (trips at routing.output_drift_threshold)"),
    "drift_psi": ("tritonguard_input_drift_psi", "PSI of one monitored input feature, live window vs the version's reference"),
    "drift_ks": ("tritonguard_input_drift_ks", "KS statistic of one monitored input feature, live window vs the version's reference"),
    "cost_per_1k": ("tritonguard_cost_per_1k_requests",
                    "Cost of 1000 answered requests, by target version and tenant: a decaying average over cost.window_s"),
}

GUARD_HISTOGRAMS = {"latency": ("tritonguard_target_latency_seconds", "Latency of fused target calls", LATENCY_BUCKETS)}

# per-token latencies: 0.1 ms (a token of this model) .. 10 s (a long queue wait before the first)
GENERATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0, 10.0)
GENERATION_COUNTERS = {
    "gen_tokens": ("tritonguard_generation_tokens_total",
                   "Tokens of generation requests, by direction: in (prompt tokens prefilled, one per "
                   "character here), out (tokens generated)"),
    "gen_requests": ("tritonguard_generation_requests_total",
                     "Generation requests ended, by outcome: ok, cancelled, error, rejected (refused before "
                     "decoding: invalid input, queue full)"),
}
GENERATION_HISTOGRAMS = {
    "ttft": ("tritonguard_generation_ttft_seconds",
             "Time from execute() receiving a request to its first token sent (stream) or decided (whole text)",
             GENERATION_BUCKETS),
    "itl": ("tritonguard_generation_itl_seconds",
            "Inter-token latency between consecutive streamed tokens: per streamed request with at least two "
            "tokens, its mean (per token with parameter itl_per_token)", GENERATION_BUCKETS),
}
GENERATION_OUTCOMES = ("ok", "cancelled", "error", "rejected")
GENERATION_ZERO_AT_LOAD = (*(("gen_requests", {"outcome": o}) for o in GENERATION_OUTCOMES),
                *(("gen_tokens", {"direction": d}) for d in ("in", "out")))

# Triton /metrics of a stream guard (per model and version; counters also per tenant)
STREAM_OUTCOMES = ("ok", "rejected", "blocked", "cancelled", "target_error", "error")
STREAM_COUNTERS = {
    "stream_requests": ("tritonguard_stream_requests_total",
                        "Requests to a stream guard, by outcome (ok, rejected, blocked by a rail, cancelled, target_error, error) and tenant"),
    "stream_tokens": ("tritonguard_stream_tokens_total",
                      "Tokens through a stream guard, by direction (in: prompt characters, out: generated tokens) and tenant"),
    "stream_redactions": ("tritonguard_stream_redactions_total", "PII spans a stream guard redacted, by direction"),
    "stream_cache": ("tritonguard_stream_cache_lookups_total",
                     "Response cache lookups of deterministic generations, by result (hit, miss) and tenant"),
    "stream_semantic": ("tritonguard_stream_semantic_cache_lookups_total",
                        "Semantic cache lookups (semantic_cache.*), by result (hit, miss, skipped: prompt too long "
                        "or not deterministic under deterministic_only; error: the embedding failed) and tenant"),
    "similarity_errors": ("tritonguard_stream_similarity_errors_total",
                          "Sampled canary/shadow comparisons whose similarity.model embedding failed (the "
                          "sampled_similarity figure was then the character-trigram cosine)"),
}
STREAM_HISTOGRAMS = {
    "stream_ttft": ("tritonguard_stream_ttft_seconds",
                    "Time from a request's arrival to the first text sent to its client (hold-back included)",
                    GENERATION_BUCKETS),
    "stream_itl": ("tritonguard_stream_itl_seconds",
                   "Mean time between the pieces sent to one streamed request's client", GENERATION_BUCKETS),
}

# `exporter stream` (a Kafka consumer group, outside Triton): its own registry on --metrics-port,
# every series labelled with the model it scores (``model``, as Triton's own), so the dashboard's
# model picker follows it; exporter/stream/metrics.py registers exactly these
CONSUMER_LABELS = {
    "consumed": ("topic",), "produced": ("topic",), "dead_letters": ("topic", "code"), "retries": ("code",),
    "pauses": (), "paused": (), "inflight": (), "lag": ("topic", "partition"), "e2e": (),
}
CONSUMER_COUNTERS = {
    "consumed": ("tritonguard_stream_events_consumed_total",
                 "Events read from the input topic, by model and topic (its rate: events/s in)"),
    "produced": ("tritonguard_stream_results_produced_total",
                 "Results the broker acknowledged on the output topic, by model and topic (its rate: events/s out)"),
    "dead_letters": ("tritonguard_stream_dead_letters_total",
                     "Events acknowledged on the dead-letter topic, by model, topic and error code"),
    "retries": ("tritonguard_stream_retries_total",
                "Triton requests sent again after a transient error (UNAVAILABLE...), by model and code"),
    "pauses": ("tritonguard_stream_pauses_total",
               "Times the consumer paused its partitions because Triton was unavailable"),
}
CONSUMER_GAUGES = {
    "paused": ("tritonguard_stream_paused", "1 while the partitions are paused (Triton unavailable), else 0"),
    "inflight": ("tritonguard_stream_inflight", "Events read and not yet acknowledged on an output topic"),
    "lag": ("tritonguard_stream_consumer_lag",
            "Consumer lag: events not answered yet (high watermark minus the consumer's position, plus the events "
            "read ahead and not yet acknowledged), per assigned topic and partition"),
}
# event timestamp (the producer's clock) -> its result or dead letter acknowledged by the broker
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONSUMER_HISTOGRAMS = {
    "e2e": ("tritonguard_stream_e2e_latency_seconds",
            "End-to-end latency: event timestamp to its result or dead letter acknowledged by the broker",
            E2E_BUCKETS),
}


# a stream guard times a generation's target call to its first response under the guard's name
STREAM_LATENCY = {"latency": ("tritonguard_target_latency_seconds",
                              "Time from a generation's target call to the target's first response", GENERATION_BUCKETS)}

# the series the control plane reads (the rollout gates, exporter status)
SERVED = GUARD_COUNTERS["served"][0]
ERRORS = GUARD_COUNTERS["target_errors"][0]
REQUESTS = GUARD_COUNTERS["requests"][0]
REJECTS = GUARD_COUNTERS["rejects"][0]
FALLBACKS = GUARD_COUNTERS["fallbacks"][0]
BREAKER = GUARD_GAUGES["breaker_state"][0]
DRIFT = GUARD_GAUGES["drift"][0]
TRIPS = GUARD_COUNTERS["trips"][0]
COMPARED = GUARD_COUNTERS["compared"][0]
FUSED = GUARD_COUNTERS["fused_failures"][0]
LABELED = GUARD_COUNTERS["labeled"][0]
LATENCY = GUARD_HISTOGRAMS["latency"][0]
COST = GUARD_COUNTERS["cost"][0]
COMPUTE = GUARD_COUNTERS["compute_seconds"][0]
CHARGED = GUARD_COUNTERS["cost_requests"][0]
COST_PER_1K = GUARD_GAUGES["cost_per_1k"][0]


def families() -> dict[str, str]:
    """Every family tritonguard exports: name -> "counter" | "gauge" | "histogram"."""
    out: dict[str, str] = {}
    for kind, tables in (("counter", (GUARD_COUNTERS, STREAM_COUNTERS, GENERATION_COUNTERS, CONSUMER_COUNTERS)),
                         ("gauge", (GUARD_GAUGES, CONSUMER_GAUGES)),
                         ("histogram", (GUARD_HISTOGRAMS, STREAM_HISTOGRAMS, GENERATION_HISTOGRAMS,
                                        CONSUMER_HISTOGRAMS))):
        for table in tables:
            for entry in table.values():
                out[entry[0]] = kind
    return out


def guard_families() -> set[str]:
    """The families a request/response guard registers (each appears once it has a series)."""
    return {e[0] for t in (GUARD_COUNTERS, GUARD_GAUGES, GUARD_HISTOGRAMS) for e in t.values()}


def consumer_families() -> set[str]:
    """The families ``exporter stream`` serves on its own metrics port (not on Triton's)."""
    return {e[0] for t in (CONSUMER_COUNTERS, CONSUMER_GAUGES, CONSUMER_HISTOGRAMS) for e in t.values()}


def _rows() -> list[tuple[str, str, str, str]]:
    out = []
    for who, kind, tables in (("guard", "counter", (GUARD_COUNTERS,)), ("guard", "gauge", (GUARD_GAUGES,)),
                              ("guard", "histogram", (GUARD_HISTOGRAMS,)),
                              ("stream guard", "counter", (STREAM_COUNTERS,)),
                              ("stream guard", "histogram", (STREAM_HISTOGRAMS,)),
                              ("generator", "counter", (GENERATION_COUNTERS,)),
                              ("generator", "histogram", (GENERATION_HISTOGRAMS,)),
                              ("exporter stream", "counter", (CONSUMER_COUNTERS,)),
                              ("exporter stream", "gauge", (CONSUMER_GAUGES,)),
                              ("exporter stream", "histogram", (CONSUMER_HISTOGRAMS,))):
        for table in tables:
            for entry in table.values():
                out.append((entry[0], kind, who, entry[1]))
    return out


BEGIN, END = "<!-- catalogue: generated by python -m tritonguard.core.catalogue -->", "<!-- /catalogue -->"


def markdown() -> str:
    """The catalogue as the Markdown table docs/monitoring.md carries between its markers."""
    lines = [BEGIN, "", "| metric | type | exported by | what it counts |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {kind} | {who} | {doc.replace('|', '/')} |" for name, kind, who, doc in _rows()]
    return "\n".join([*lines, "", END])


def main(argv: list[str] | None = None) -> int:  # python -m tritonguard.core.catalogue [--write FILE]
    import sys  # noqa: PLC0415

    args = sys.argv[1:] if argv is None else argv
    table = markdown()
    if args[:1] == ["--write"] and len(args) == 2:
        from pathlib import Path  # noqa: PLC0415

        path = Path(args[1])
        text = path.read_text(encoding="utf-8")
        start, end = text.index(BEGIN), text.index(END) + len(END)
        path.write_text(text[:start] + table + text[end:], encoding="utf-8")
        return 0
    sys.stdout.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
