"""StreamRouter without Triton: the stream guard's version choice, goldens, breaker, fallback and
canary/shadow comparisons, over a real rollout state file and text functions standing in for
the versions (the served path is tests/functional/test_generation_rollout.py)."""

import json
import logging
import time
import zlib

import numpy as np
import pytest

from tests.unit.guard.routing.test_router import Metrics
from tritonguard.core.errors import TargetError
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.routing.stream import (
    StreamRouter,
    embedding_similarity,
    load_generation_goldens,
    trigram_cosine,
)
from tritonguard.rollout.breaker import BreakerConfig
from tritonguard.rollout.state import Candidate
from tritonguard.rollout.stores import open_store


def echo(prompt, sampling):
    """Version 1: a deterministic 'model'."""
    return prompt[::-1] + "|" + str(json.loads(sampling).get("max_tokens"))


def make(tmp_path, versions, *, candidate=None, share=1.0, shadow=0.0, judge=None, similarity=None, **breaker):
    repo = tmp_path / "repo"
    for v in versions:
        (repo / "lm" / str(v)).mkdir(parents=True, exist_ok=True)
    store = open_store("g", repo)

    def setup(s):
        s.primary = 1
        if candidate is not None:
            s.candidate = Candidate(candidate, share)
            s.shadow_share = shadow
            if judge:
                s.judges[str(candidate)] = {"judge": judge}
        return s

    store.update(setup)
    calls = []

    def run_text(version, prompt, sampling):
        calls.append((version, prompt))
        fn = versions[version]
        return fn(prompt, sampling)

    metrics = Metrics()
    cfg = {"min_requests": 5, "window": 20, "min_compared": 5, **breaker}
    router = StreamRouter(guard="g", repo=repo, target="lm", run_text=run_text, store=store,
                          config=RoutingConfig(reconcile_interval_s=0, poll_interval_s=0),
                          breaker=BreakerConfig(**cfg), metrics=metrics, seed=0, similarity=similarity)
    return router, metrics, calls, repo


def write_goldens(repo, version, cases):
    (repo / "lm" / str(version) / "goldens.json").write_text(json.dumps({"format_version": 1, "cases": cases}))


def drain(router, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not router.worker.jobs.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the job in hand


def test_primary_only_without_a_candidate(tmp_path):
    router, *_ = make(tmp_path, {1: echo})
    try:
        picks = {router.pick()[:2] for _ in range(50)}
        assert picks == {(1, "primary")}
    finally:
        router.close()


def test_candidate_share_is_honoured(tmp_path):
    router, *_ = make(tmp_path, {1: echo, 2: echo}, candidate=2, share=0.3)
    try:
        versions = [router.pick()[0] for _ in range(2000)]
        share = versions.count(2) / len(versions)
        assert 0.25 < share < 0.35, share
    finally:
        router.close()


def test_goldens_pass_fail_and_skip(tmp_path):
    cases = [{"prompt": "abc", "sampling": {"max_tokens": 4, "temperature": 0}, "text": "cba|4"},
             {"prompt": "xy", "sampling": {"max_tokens": 2, "temperature": 0}, "text": "yx|2"}]

    def drifted(prompt, sampling):
        return echo(prompt, sampling) if prompt != "xy" else "something else"

    router, metrics, _, repo = make(tmp_path, {1: echo, 2: drifted, 3: echo}, candidate=2)
    try:
        write_goldens(repo, 1, cases)
        write_goldens(repo, 2, cases)
        assert router.check_goldens(1)["verdict"] == "PASS"
        bad = router.check_goldens(2)
        assert bad["verdict"] == "FAIL"
        assert bad["metrics"]["exact_match_rate"] == 0.5
        assert bad["metrics"]["first_mismatch"]["prompt"] == "xy"
        assert router.check_goldens(3)["verdict"] == "SKIPPED"  # no goldens.json
        # a candidate that failed its goldens gets no traffic, and the verdict is shared
        assert {router.pick()[0] for _ in range(50)} == {1}
        assert open_store("g", repo).load().goldens["2"]["verdict"] == "FAIL"
    finally:
        router.close()


def test_goldens_of_an_unready_version_are_not_stored_as_fail(tmp_path):
    def unready(prompt, sampling):
        raise TargetError("Request for unknown model: 'lm' version 2 is not found", "NOT_FOUND")

    router, _, _, repo = make(tmp_path, {1: echo, 2: unready}, candidate=2)
    try:
        write_goldens(repo, 2, [{"prompt": "a", "sampling": {}, "text": "a|None"}])
        result = router.check_goldens(2)
        assert result["verdict"] == "FAIL" and result.get("unready")
        assert router.golden_verdict(2) == "FAIL"
        assert "2" not in open_store("g", repo).load().goldens  # checked again once it loads
    finally:
        router.close()


def test_unreadable_goldens_fail(tmp_path):
    router, _, _, repo = make(tmp_path, {1: echo})
    try:
        (repo / "lm" / "1" / "goldens.json").write_text('{"cases": [{"prompt": 1}]}')
        result = router.check_goldens(1)
        assert result["verdict"] == "FAIL" and "unreadable" in result["metrics"]["error"]
    finally:
        router.close()
    with pytest.raises(ValueError, match="case 0"):
        load_generation_goldens(repo / "lm" / "1" / "goldens.json")


def test_errors_trip_the_candidate_and_traffic_goes_home(tmp_path):
    router, metrics, *_ = make(tmp_path, {1: echo, 2: echo}, candidate=2, share=1.0)
    try:
        assert router.pick()[0] == 2
        for _ in range(6):
            router.record(2, ok=False, first_response_s=0.01, code="INTERNAL")
        assert router.breaker(2).state == "open"
        assert metrics.total("trips", target_version="2", reason="error_rate") == 1
        assert metrics.total("target_errors", target_version="2") == 6
        assert {router.pick()[0] for _ in range(20)} == {1}
    finally:
        router.close()


def test_non_finite_logits_trip_at_once(tmp_path):
    router, metrics, *_ = make(tmp_path, {1: echo, 2: echo}, candidate=2)
    try:
        for _ in range(4):
            router.record(2, ok=True, first_response_s=0.01)
        router.record(2, ok=False, first_response_s=0.01, non_finite=True)
        assert router.breaker(2).state == "open"
        assert metrics.total("trips", reason="non_finite") == 1
        assert metrics.total("target_errors", code="NON_FINITE") == 1
        assert metrics.total("served", served_by="lm:2") == 4
    finally:
        router.close()


def test_an_open_primary_breaker_degrades_service_it_does_not_end_it(tmp_path):
    router, *_ = make(tmp_path, {1: echo})
    try:
        router.breaker(1).trip(time.time(), "manual")
        assert not router.routable(1, time.time())
        assert router.pick()[:2] == (1, "fallback")  # the last resort: nothing else can answer
    finally:
        router.close()


def test_fallback_goes_down_the_chain(tmp_path):
    router, *_ = make(tmp_path, {1: echo, 2: echo}, candidate=2)
    try:
        assert router.next_version({2}) == 1  # the candidate failed before its first token
        assert router.next_version({1, 2}) is None  # nothing else to try
    finally:
        router.close()


def test_canary_compares_deterministic_texts(tmp_path):
    router, metrics, calls, _ = make(tmp_path, {1: echo, 2: echo}, candidate=2)
    try:
        router.after_served(2, 0.5, "hello", '{"max_tokens": 4}', echo("hello", '{"max_tokens": 4}'),
                            deterministic=True)
        router.after_served(2, 0.5, "other", '{"max_tokens": 4}', "not what v1 says", deterministic=True)
        router.after_served(2, 0.5, "sampled", '{"max_tokens": 4}', "x", deterministic=False)  # no canary
        drain(router)
        assert metrics.total("compared", kind="canary", verdict="PASS", target_version="2") == 1
        assert metrics.total("compared", kind="canary", verdict="FAIL", target_version="2") == 1
        assert [c for c in calls if c[0] == 1] == [(1, "hello"), (1, "other")]
    finally:
        router.close()


def test_task_judged_candidate_counts_agreement_and_never_trips_on_it(tmp_path):
    def retrain(prompt, sampling):
        return "different"

    router, metrics, *_ = make(tmp_path, {1: echo, 2: retrain}, candidate=2, share=0.0, shadow=1.0, judge="task")
    try:
        for i in range(30):
            router.after_served(1, 0.5, f"p{i}", '{"max_tokens": 4}', echo(f"p{i}", '{"max_tokens": 4}'),
                                deterministic=True)
        drain(router)
        assert metrics.total("compared", kind="shadow", verdict="DISAGREE", target_version="2") == 30
        assert router.breaker(2).state == "closed"
    finally:
        router.close()


def test_shadow_errors_count_against_the_candidate(tmp_path):
    def broken(prompt, sampling):
        raise TargetError("boom", "INTERNAL")

    router, metrics, *_ = make(tmp_path, {1: echo, 2: broken}, candidate=2, share=0.0, shadow=1.0)
    try:
        for i in range(10):
            router.after_served(1, 0.5, f"p{i}", "{}", "x", deterministic=False)
        drain(router)
        assert metrics.total("target_errors", target_version="2") >= 5
        assert router.breaker(2).state == "open"
    finally:
        router.close()


def test_sampled_shadow_publishes_similarity_not_a_verdict(tmp_path):
    router, metrics, *_ = make(tmp_path, {1: echo, 2: echo}, candidate=2, share=0.0, shadow=1.0)
    try:
        router.after_served(1, 0.5, "abc", "{}", echo("abc", "{}"), deterministic=False)
        drain(router)
        assert metrics.total("compared") == 0
        key = ("validator_score", ("figure", "sampled_similarity"), ("kind", "shadow"), ("target_version", "2"))
        assert metrics.gauges[key] == pytest.approx(1.0)
    finally:
        router.close()


def test_trigram_cosine():
    assert trigram_cosine("the string", "the string") == pytest.approx(1.0)
    assert trigram_cosine("", "") == 1.0
    assert trigram_cosine("abcdef", "uvwxyz") == 0.0
    assert 0 < trigram_cosine("return the list", "returns a list") < 1


# -- sampled_similarity by embedding (similarity.model) --------------------------------------------
SIMILARITY_KEY = ("validator_score", ("figure", "sampled_similarity"), ("kind", "shadow"), ("target_version", "2"))


def bag_of_words(texts):
    """A deterministic stand-in for minilm_raw: hashed word counts, [n, 64] float32 (not normalised)."""
    out = np.zeros((len(texts), 64), np.float32)
    for i, text in enumerate(texts):
        for word in text.split():
            out[i, zlib.crc32(word.encode()) % 64] += 1.0
    return out


class Embedder:
    def __init__(self, fn=bag_of_words):
        self.fn, self.calls = fn, []

    def __call__(self, texts):
        self.calls.append(list(texts))
        return self.fn(texts)


def reorder(prompt, sampling):
    """Version 2: the same words as the primary's answer, in another order."""
    return "blue green red"


def test_sampled_similarity_is_the_embedding_cosine_when_given(tmp_path):
    embed = Embedder()
    router, metrics, *_ = make(tmp_path, {1: echo, 2: reorder}, candidate=2, share=0.0, shadow=1.0,
                               similarity=embedding_similarity(embed))
    try:
        router.after_served(1, 0.5, "colours", "{}", "red green blue", deterministic=False)
        drain(router)
        # the same bag of words: cosine 1 by the embedder, 2/3 by character trigrams
        assert metrics.gauges[SIMILARITY_KEY] == pytest.approx(1.0)
        assert trigram_cosine("blue green red", "red green blue") < 0.7
        assert embed.calls == [["blue green red", "red green blue"]]  # one call, both texts
        assert metrics.total("similarity_errors") == 0 and metrics.total("compared") == 0
    finally:
        router.close()


def test_a_failing_embedding_falls_back_to_trigrams_and_counts(tmp_path, caplog):
    def unloaded(texts):
        raise TargetError("embedding model 'minilm_raw': model is not ready", "UNAVAILABLE")

    router, metrics, *_ = make(tmp_path, {1: echo, 2: reorder}, candidate=2, share=0.0, shadow=1.0,
                               similarity=embedding_similarity(unloaded))
    try:
        with caplog.at_level(logging.WARNING, logger="tritonguard.guard.routing.stream"):
            for _ in range(3):
                router.after_served(1, 0.5, "colours", "{}", "red green blue", deterministic=False)
                drain(router)
        assert metrics.gauges[SIMILARITY_KEY] == pytest.approx(trigram_cosine("blue green red", "red green blue"))
        assert metrics.total("similarity_errors") == 3
        warnings = [r for r in caplog.records if "sampled similarity" in r.getMessage()]
        assert len(warnings) == 1  # once a minute, not once a comparison
        assert router.breaker(2).state == "closed"  # an embedding failure says nothing about the candidate
    finally:
        router.close()


def test_embedding_similarity():
    embed = Embedder()
    sim = embedding_similarity(embed)
    assert sim("", "") == 1.0 and sim("", "a") == 0.0 and sim("a", "") == 0.0
    assert embed.calls == []  # empty texts never reach the model
    assert sim("a b", "b a") == pytest.approx(1.0)
    assert 0.0 <= sim("a b", "c d") < 1.0
    assert embedding_similarity(lambda t: np.array([[1.0, 0.0], [-2.0, 0.0]]))("x", "y") == -1.0
    assert embedding_similarity(lambda t: np.array([[1e-30, 0.0], [1.0, 0.0]]))("x", "y") == 0.0  # zero norm
    assert embedding_similarity(lambda t: np.array([[3.0, 4.0], [3.0, 4.0]], np.float32))("x", "y") == 1.0  # clipped
    with pytest.raises(ValueError):
        embedding_similarity(lambda t: np.zeros((1, 4)))("x", "y")  # not a batch of 2
    with pytest.raises(ValueError):
        embedding_similarity(lambda t: np.array([[np.nan, 1.0], [1.0, 1.0]]))("x", "y")


def test_the_latency_gate_gets_whole_generations_sized_by_their_tokens(tmp_path):
    """The breaker times a generation to its first response; the rollout's latency gate gets the
    whole call, with its tokens as the call's size (the gate compares equal sizes only). A call
    without a token, or a failed one, gives the gate nothing."""
    from tritonguard.rollout.latency import LatencyRecorder, open_latency_log

    router, metrics, *_ = make(tmp_path, {1: echo, 2: echo}, candidate=2, share=1.0)
    log = open_latency_log("g", tmp_path / "repo", url="")
    router.latency = LatencyRecorder(log)
    try:
        router.record(2, ok=True, first_response_s=0.004, call_s=0.050, tokens=12)
        router.record(2, ok=True, first_response_s=0.003, call_s=0.020, tokens=0)
        router.record(2, ok=False, first_response_s=0.003, call_s=0.020, tokens=5, code="INTERNAL")
        assert router.latency.flush()
        got = log.read(2)
        assert got.rows.tolist() == [12] and got.seconds.tolist() == pytest.approx([0.050])
        # the breaker's latency is the time to first response
        assert router.breaker(2).latency_p95(1) == pytest.approx(4.0, rel=0.01)
    finally:
        router.close()


# -- paired timings for the latency gate (issue 42 item 5) --------------------------------------
LOAD_PHASE_S = 0.3  # the stand-in machine load changes every this many seconds


def timed_version(per_token_s, tokens=10):
    """A version whose answer is ``tokens`` characters, each costing ``per_token_s`` times the
    machine's load when the call starts: 1x and 3x in alternating phases, as a neighbour's bursts
    would slow whatever runs then (both versions alike). One sleep a call: each sleep overshoots
    by the scheduler's delay on a busy machine, and that pulls any ratio towards 1."""

    def generate(prompt, sampling):
        load = 3.0 if int(time.monotonic() / LOAD_PHASE_S) % 2 else 1.0
        time.sleep(tokens * per_token_s * load)
        return ("x" * tokens + prompt)[:tokens]

    return generate


def paired_ratio(tmp_path, slowdown, pairs=24, per_token_s=0.003):
    """(gate result, calls) of ``pairs`` canary comparisons of a candidate ``slowdown`` times
    slower per token than the primary, timed by the comparison worker, judged by the rollout's
    latency gate at a 5 % tolerance (the functional test's)."""
    from exporter.rollout.gates.latency import latency_gate
    from tritonguard.rollout.latency import LatencyRecorder, open_latency_log, paired_key

    primary, cand = timed_version(per_token_s), timed_version(per_token_s * slowdown)
    router, metrics, calls, _ = make(tmp_path, {1: primary, 2: cand}, candidate=2, share=0.5)
    log = open_latency_log("g", tmp_path / "repo", url="")
    router.latency = LatencyRecorder(log)
    try:
        for i in range(pairs):
            prompt = f"p{i}"
            router.after_served(2, 0.1, prompt, '{"max_tokens": 10}', "x" * 10, deterministic=True)
            deadline = time.monotonic() + 30  # one pair at a time: the worker's job done, not only taken
            while metrics.total("compared", kind="canary") < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        assert router.latency.flush()
        got_c, got_p = log.read(paired_key(2, "candidate")), log.read(paired_key(2, "primary"))
        assert len(got_c) == len(got_p) == pairs, (len(got_c), len(got_p))
        assert set(got_c.rows.tolist()) == set(got_p.rows.tolist()) == {10}  # sized by the answer
        assert metrics.total("compared", kind="canary", verdict="PASS", target_version="2") == pairs
        return latency_gate(got_c, got_p, 1, tolerance=0.05, min_samples=10), calls
    finally:
        router.close()


def test_canary_times_candidate_and_primary_on_the_same_prompt_in_alternating_order(tmp_path):
    router, metrics, calls, _ = make(tmp_path, {1: echo, 2: echo}, candidate=2)
    from tritonguard.rollout.latency import LatencyRecorder, open_latency_log

    router.latency = LatencyRecorder(open_latency_log("g", tmp_path / "repo", url=""))
    try:
        for i in range(4):
            router.after_served(2, 0.5, f"q{i}", '{"max_tokens": 4}', echo(f"q{i}", '{"max_tokens": 4}'),
                                deterministic=True)
            drain(router)
        # each served canary: the same prompt run by both versions, back to back, order alternating
        assert calls == [(2, "q0"), (1, "q0"), (1, "q1"), (2, "q1"), (2, "q2"), (1, "q2"), (1, "q3"), (2, "q3")]
        assert metrics.total("compared", kind="canary", verdict="PASS", target_version="2") == 4
    finally:
        router.close()


def test_without_a_latency_log_the_canary_runs_only_the_primary(tmp_path):
    router, _, calls, _ = make(tmp_path, {1: echo, 2: echo}, candidate=2)
    try:
        router.after_served(2, 0.5, "q", '{"max_tokens": 4}', echo("q", '{"max_tokens": 4}'), deterministic=True)
        drain(router)
        assert calls == [(1, "q")]
    finally:
        router.close()


@pytest.mark.parametrize("slowdown", [1.16, 1.64])
def test_paired_timings_read_a_slower_generator_under_changing_load(tmp_path, slowdown):
    """The machine's load triples every other phase (both versions alike, as on a shared host);
    timed on paired prompts the gate's ratio still reads the build's slowdown, above the 5 %
    tolerance, and the gate never PASSes it. Real clock: only the ratio is asserted, with a
    margin for sleep overshoot (it adds to both sides and pulls the ratio towards 1)."""
    gate, _ = paired_ratio(tmp_path, slowdown)
    ratio = gate.figures["ratio"]
    print(f"slowdown {slowdown}: gate ratio {ratio:.3f}, {gate.verdict} ({gate.reason})")
    assert ratio >= 1.05, gate.figures
    assert ratio >= 1 + (slowdown - 1) / 2, gate.figures  # at least half of the slowdown is seen
    assert gate.verdict != "PASS", gate.figures


def test_paired_timings_read_equal_builds_as_equal_under_changing_load(tmp_path):
    gate, _ = paired_ratio(tmp_path, 1.0)
    print(f"equal builds: gate ratio {gate.figures['ratio']:.3f}, {gate.verdict}")
    assert 0.9 <= gate.figures["ratio"] <= 1.1, gate.figures
    assert gate.verdict != "FAIL", gate.figures


def test_paired_timings_drop_and_count_when_the_queue_is_full(tmp_path):
    """The comparisons stay off the client's path: a full queue drops a canary (counted), it
    never waits for the worker."""
    import threading

    gate = threading.Event()

    def blocked(prompt, sampling):
        gate.wait(10)
        return echo(prompt, sampling)

    router, metrics, _, _ = make(tmp_path, {1: blocked, 2: echo}, candidate=2)
    from tritonguard.rollout.latency import LatencyRecorder, open_latency_log

    router.latency = LatencyRecorder(open_latency_log("g", tmp_path / "repo", url=""))
    try:
        for i in range(router.worker.jobs.maxsize + 5):  # a queue that waited would hang here
            router.after_served(2, 0.5, f"q{i}", '{"max_tokens": 4}', "x", deterministic=True)
        assert router.worker.dropped >= 4
        assert metrics.total("compare_drops") == router.worker.dropped
    finally:
        gate.set()
        router.close()


# -- paired timings of two runtimes: one size for both halves (issue 42 item 4) ---------------------
def sized_version(per_char_s, chars):
    """A version answering ``chars`` characters, each costing ``per_char_s``."""

    def generate(prompt, sampling):
        time.sleep(chars * per_char_s)
        return ("ab cdefg " * chars)[:chars]

    return generate


def gated_pairs(tmp_path, primary, cand, pairs=16):
    """(the latency gate's result at a 5 % tolerance, candidate samples, primary samples) of
    ``pairs`` canary comparisons timed by the comparison worker; the candidate judged on the task
    (another runtime writes other text)."""
    from exporter.rollout.gates.latency import latency_gate
    from tritonguard.rollout.latency import LatencyRecorder, open_latency_log, paired_key

    router, metrics, _, repo = make(tmp_path, {1: primary, 2: cand}, candidate=2, share=0.5, judge="task")
    log = open_latency_log("g", repo, url="")
    router.latency = LatencyRecorder(log)
    try:
        for i in range(pairs):
            router.after_served(2, 0.1, f"p{i}", '{"max_tokens": 32}', cand(f"p{i}", ""), deterministic=True)
            deadline = time.monotonic() + 30  # one pair at a time
            while metrics.total("compared", kind="canary") < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        assert router.latency.flush()
        got_c, got_p = log.read(paired_key(2, "candidate")), log.read(paired_key(2, "primary"))
        assert len(got_c) == len(got_p) == pairs, (len(got_c), len(got_p))
        return latency_gate(got_c, got_p, 1, tolerance=0.05, min_samples=10), got_c, got_p
    finally:
        router.close()


@pytest.mark.parametrize("cand_chars", [10, 40])
def test_pairs_of_unequal_length_reach_the_gate_and_a_2x_slower_runtime_fails(tmp_path, cand_chars):
    """Two runtimes answer a prompt at different lengths: every pair still reaches the gate (both
    halves sized by the primary's answer; before, each half had its own length and no pair was
    comparable). A candidate 2x slower per character FAILs whether it answers half or twice as
    long: said less, its call is brought up to the primary's length (as timed, the half-length
    answer takes the primary's time and would pass); said more, it is taken as timed."""
    gate, got_c, got_p = gated_pairs(tmp_path, sized_version(0.001, 20), sized_version(0.002, cand_chars))
    print(f"candidate {cand_chars} chars: ratio {gate.figures['ratio']:.3f}, {gate.verdict}")
    assert set(got_c.rows.tolist()) == set(got_p.rows.tolist()) == {20}  # the primary's length
    assert gate.figures["comparable_candidate"] == gate.figures["comparable_primary"] == 16
    assert gate.verdict == "FAIL", gate.figures
    assert gate.figures["ratio"] >= 1.5, gate.figures


def test_a_candidate_of_equal_speed_that_answers_shorter_is_not_failed(tmp_path):
    """Brought up to the primary's length, a candidate of the same speed per character that says
    half as much reads as the primary (no fixed cost here), not 2x faster nor slower."""
    gate, *_ = gated_pairs(tmp_path, sized_version(0.001, 20), sized_version(0.001, 10))
    print(f"equal speed, half length: ratio {gate.figures['ratio']:.3f}, {gate.verdict}")
    assert gate.figures["comparable_candidate"] == 16
    assert 0.85 <= gate.figures["ratio"] <= 1.2, gate.figures
    assert gate.verdict != "FAIL", gate.figures


def test_a_url_versions_skipped_goldens_are_checked_and_logged_once(tmp_path, caplog):
    """A version served at a URL has no goldens by design: its SKIPPED is said once, at info, not
    warned again at every refresh. (The state keeps verdicts only, so a SKIPPED was never stored:
    each refresh that brought a new revision checked it again and logged "golden result for v7 not
    stored" and "has no goldens.json" at warning level.) A Triton version without goldens is still
    warned about, once."""
    from tritonguard.rollout.endpoints import Endpoint, declare

    router, metrics, calls, repo = make(tmp_path, {1: echo}, candidate=7, share=0.5)
    declare(repo / "lm", Endpoint(version=7, url="http://127.0.0.1:9/v1"))
    caplog.set_level(logging.DEBUG)
    try:
        for _ in range(5):
            open_store("g", repo).update(lambda s: s, by="another writer")  # a new revision
            router.refresh(router.clock(), wait=True)
            assert router.golden_verdict(7) == "SKIPPED" and router.golden_verdict(1) == "SKIPPED"
        assert router.state.revision >= 6
        # the guard's own records: DEBUG lets filelock's in too, whose paths are random (a run's
        # folder named tritonguard-lanes-sv7_dx9w once made its lines match "v7": run 34)
        ours = [r for r in caplog.records if r.name.startswith("tritonguard")]
        said = [(r.levelno, r.getMessage()) for r in ours if "v7" in r.getMessage()]
        assert said == [(logging.INFO, "stream guard g: lm v7 is served at a URL: no goldens.json by design; "
                                       "golden check SKIPPED")], said
        v1 = [r for r in ours if "v1" in r.getMessage() and "golden" in r.getMessage()]
        assert len(v1) == 1 and v1[0].levelno == logging.WARNING, [r.getMessage() for r in v1]
        assert not [r for r in caplog.records if "not stored" in r.getMessage()]
        assert metrics.total("goldens", target_version="7", verdict="SKIPPED") == 1
        assert calls == []  # nothing generated for it
        assert 7 in {router.pick()[0] for _ in range(50)}  # and it is routed: a skip refuses nothing
    finally:
        router.close()
