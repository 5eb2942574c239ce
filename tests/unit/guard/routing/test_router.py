"""The real Router with in-process targets (no Triton): fused failures, task-judged comparisons,
labels, and goldens run at batch 1 and at the largest batch before any traffic."""

import time

import numpy as np
import pytest

from tritonguard.core import repository
from tritonguard.core.errors import TargetError
from tritonguard.guard import source
from tritonguard.guard.routing.config import RoutingConfig
from tritonguard.guard.routing.router import Router
from tritonguard.rollout.breaker import BreakerConfig
from tritonguard.rollout.state import Candidate
from tritonguard.rollout.stores import open_store
from tritonguard.rollout.validators import ValidatorConfig, ValidatorRegistry


class Metrics:
    def __init__(self):
        self.counts: dict[tuple, float] = {}
        self.gauges: dict[tuple, float] = {}

    def inc(self, family, n=1, **labels):
        key = (family, *sorted(labels.items()))
        self.counts[key] = self.counts.get(key, 0) + n

    def set(self, family, value, **labels):
        self.gauges[(family, *sorted(labels.items()))] = value

    def observe(self, family, value, **labels):
        pass

    def total(self, family, **labels):
        return sum(v for k, v in self.counts.items()
                   if k[0] == family and all((a, b) in k[1:] for a, b in labels.items()))


def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


class Linear:
    """A small real classifier: softmax(X @ W), with optional faults."""

    def __init__(self, w, *, max_rows=None, poison=None):
        self.w, self.max_rows, self.poison = w, max_rows, poison
        self.calls: list[int] = []

    def infer(self, inputs):
        x = inputs["X"]
        self.calls.append(len(x))
        if self.max_rows is not None and len(x) > self.max_rows:
            raise TargetError(f"seeded fault: {len(x)} rows > {self.max_rows}", "INTERNAL")
        if self.poison is not None and (x == self.poison).all(axis=1).any():
            raise TargetError("poisoned row", "INVALID_ARG")
        return {"P": softmax(x.astype(np.float64) @ self.w)}


W1 = np.random.default_rng(0).normal(size=(4, 3))
# a "retrain": other weights, nearly always the same decision on these inputs, other numbers
W2 = W1 * 1.5 + np.random.default_rng(1).normal(scale=0.05, size=(4, 3))


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "t").mkdir(parents=True)
    return r


def make(repo, targets, *, primary=1, candidate=None, share=1.0, judge=None, max_batch=0, goldens=None,
         latency=None, routing=None, present=None, make_target=None, **breaker):
    store = open_store("g", repo)

    def setup(s):
        s.primary = primary
        if candidate is not None:
            s.candidate = Candidate(candidate, share)
            if judge:
                s.judges[str(candidate)] = {"judge": judge}
        return s

    store.update(setup, by="test")
    for v in targets:
        d = repo / "t" / str(v)
        d.mkdir(parents=True, exist_ok=True)
        if goldens is not None:
            x = goldens
            np.savez(d / repository.GOLDENS, in__X=x, out__P=targets[v].infer({"X": x})["P"])
    metrics = Metrics()
    router = Router(guard="g", repo=repo, target="t", make_target=make_target or (lambda v: targets[v]),
                    output_names=["P"], present=present,
                    store=store, config=RoutingConfig(**{"reconcile_interval_s": 0, "poll_interval_s": 0, **(routing or {})}),
                    validator=ValidatorConfig(), registry=ValidatorRegistry(),
                    breaker=BreakerConfig(**{"min_requests": 20, "window": 200, **breaker}),
                    metrics=metrics, seed=0, max_batch=max_batch, latency=latency)
    return router, metrics


def drain(router, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not router.worker.jobs.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the job taken last may still be running


def rows(n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


def test_fused_failure_is_counted_against_the_version_and_trips_it(repo):
    v1 = Linear(W1)
    v2 = Linear(W1, max_rows=4)
    router, metrics = make(repo, {1: v1, 2: v2}, candidate=2, share=1.0)
    x = rows(6)
    got = router.infer({"X": x}, [1] * 6)
    # users see nothing: every request answered by v2 itself after the retries
    assert all(e is None for e in got.errors) and set(got.served_by) == {"t:2"}
    assert metrics.total("fused_failures", target_version="2") == 6
    assert metrics.total("target_errors", target_version="2") == 0
    for k in range(4):  # a few more failed batches trip the breaker on its own reason
        router.infer({"X": rows(6, k + 1)}, [1] * 6)
    trips = [k for k in metrics.counts if k[0] == "trips"]
    assert trips and ("reason", "fused_failures") in trips[0]
    assert router.breaker(2).state == "open"
    router.close()


def test_a_version_that_cannot_load_falls_back_to_the_primary(repo):
    from tritonguard.core.errors import ConfigError

    router, metrics = make(repo, {1: Linear(W1), 2: Linear(W1)}, candidate=2, share=1.0,
                           routing={"golden_check": False})
    loaded = router.make_target

    def make_target(v):
        if v == 2:  # as an in-process version whose artifact is gone
            raise ConfigError("artifact /repo/t/2/model.onnx does not exist")
        return loaded(v)

    router.make_target = make_target
    got = router.infer({"X": rows(3)}, [1] * 3)
    assert all(e is None for e in got.errors) and set(got.served_by) == {"t:1"}, got
    assert metrics.total("target_errors", target_version="2", code="UNAVAILABLE") == 3
    router.close()


def test_a_poisoned_request_is_not_a_fused_failure(repo):
    x = rows(6)
    v1 = Linear(W1, poison=x[2])
    router, metrics = make(repo, {1: v1})
    got = router.infer({"X": x}, [1] * 6)
    assert got.errors[2] is not None and str(got.errors[2]) == "poisoned row"
    assert [e is None for i, e in enumerate(got.errors) if i != 2] == [True] * 5
    assert metrics.total("fused_failures") == 0
    assert metrics.total("target_errors", target_version="1") == 1
    router.close()


@pytest.mark.parametrize("judge", ["task", "equivalence"])
def test_a_retrain_is_judged_on_its_answers_not_its_numbers(repo, judge):
    router, metrics = make(repo, {1: Linear(W1), 2: Linear(W2)}, candidate=2, share=1.0, judge=judge)
    x = rows(200, seed=3)
    same = (softmax(x @ W1).argmax(1) == softmax(x @ W2).argmax(1)).mean()
    assert same > 0.9  # the two versions mostly agree on the answer
    for k in range(0, 200, 8):
        router.infer({"X": x[k:k + 8]}, [1] * 8)
        drain(router)  # the comparison queue is bounded: let the worker keep up
    drain(router)
    verdicts = {k[1:]: v for k, v in metrics.counts.items() if k[0] == "compared"}
    if judge == "task":
        agree = metrics.total("compared", verdict="AGREE", target_version="2")
        disagree = metrics.total("compared", verdict="DISAGREE", target_version="2")
        assert agree + disagree == 200, verdicts
        assert disagree == pytest.approx(200 * (1 - same), abs=0.5)
        assert router.breaker(2).state == "closed"  # disagreement is for the gates, not a fault
    else:
        # numerically another model: the validator FAILs rows and the breaker trips
        assert metrics.total("compared", verdict="FAIL", target_version="2") > 0
        assert router.breaker(2).state == "open"
    router.close()


def test_comparisons_queued_before_a_promotion_are_dropped(repo):
    """A retrain's canary comparisons still queued when the rollout promotes it (and drops its
    task judge) must not be judged as a copy: that tripped the new primary's breaker."""
    router, metrics = make(repo, {1: Linear(W1), 2: Linear(W2)}, candidate=2, share=1.0, judge="task")

    def promote(s):
        s.primary, s.candidate = 2, None
        s.judges.pop("2", None)
        return s

    router.store.update(promote, by="test")
    router.refresh(router.clock(), wait=True)
    x = rows(64, seed=5)
    for k in range(0, 64, 8):  # what the worker finds in its queue after the promotion
        sub = {"X": x[k:k + 8]}
        router.comparator.compare("canary", 1, 2, sub, Linear(W2).infer(sub))
    assert metrics.total("compared") == 0
    assert router.breaker(2).state == "closed"
    router.close()


class Loading(Linear):
    """A target Triton has not loaded yet: UNAVAILABLE until ``ready`` is set."""

    ready = True  # while the test writes the goldens

    def infer(self, inputs):
        if not self.ready:
            raise TargetError("target 't_v1' failed: Model 't_v1' is not ready", "UNAVAILABLE")
        return super().infer(inputs)


def test_goldens_of_a_target_not_loaded_yet_are_not_a_stored_fail(repo):
    """A version whose target is still loading is not routable, but no FAIL is stored (that
    refused it for good, across restarts): the check runs again once the target answers."""
    target = Loading(W1)
    router, metrics = make(repo, {1: target}, goldens=rows(8, seed=9))
    target.ready = False
    now = [1000.0]
    router.clock = lambda: now[0]
    assert router.golden_verdict(1) == "FAIL"
    assert "1" not in router.state.goldens and "1" not in router.store.load().goldens
    assert metrics.total("goldens") == 0  # no FAIL counted (an alert would page on it)
    target.ready = True
    assert router.golden_verdict(1) == "FAIL"  # within the retry interval: not asked again
    now[0] += 3.0
    assert router.golden_verdict(1) == "PASS"
    assert router.store.load().goldens["1"]["verdict"] == "PASS"
    router.close()


def test_a_request_pinned_to_a_version_is_answered_by_it_or_fails(repo):
    """The ``version`` request parameter (reproducible batch scoring): the pinned version
    answers whatever the split says; a version not routed here, or a bad value, fails that
    request alone; a pinned version that fails does not fall back to another one."""
    x = rows(6, seed=11)
    router, metrics = make(repo, {1: Linear(W1), 2: Linear(W2, poison=x[5])}, candidate=2, share=0.0)
    got = router.infer({"X": x}, [1] * 6, pins=[2, None, 1, 7, 0, 2])
    assert got.served_by[:3] == ["t:2", "t:1", "t:1"]
    assert got.errors[3].code == "UNAVAILABLE" and "version 7 of 't' is not routed here" in str(got.errors[3])
    assert got.errors[4].code == "INVALID_ARG" and "positive integer" in str(got.errors[4])
    # v2 fails on this row: the client pinned v2, so it gets v2's error, not v1's answer
    assert got.errors[5] is not None and "pinned" in str(got.errors[5]) and got.served_by[5] == ""
    assert np.allclose(got.outputs["P"][0], softmax(x[:1].astype(np.float64) @ W2)[0], atol=1e-6)
    assert metrics.total("fallbacks") == 0
    router.close()


def test_routed_shares_are_gauges_that_drop_to_zero_when_a_role_ends(repo):
    router, metrics = make(repo, {1: Linear(W1), 2: Linear(W2)}, candidate=2, share=0.1)

    def share(version, role):
        return metrics.gauges.get(("route_share", ("role", role), ("target_version", str(version))))

    router.publish()
    assert share(1, "primary") == pytest.approx(0.9) and share(2, "candidate") == pytest.approx(0.1)

    def rollback(s):
        s.candidate = None
        return s

    router.store.update(rollback, by="test")
    router.refresh(router.clock(), wait=True)
    router.publish()
    # the candidate's series ends at 0 (a rollback alert needs to see it go), the primary has all
    assert share(2, "candidate") == 0.0 and share(1, "primary") == 1.0
    router.close()


def test_goldens_run_at_batch_1_and_at_the_largest_batch(repo):
    golden = rows(4, seed=7)
    # fine on the 4 golden rows at once, fails on the 16-row batch live traffic can make
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W1, max_rows=8)}, max_batch=16, goldens=golden)
    result = router.check_goldens(2)
    assert result["verdict"] == "FAIL"
    assert "batch 16" in result["metrics"]["error"] and "8" in result["metrics"]["error"]
    assert router.check_goldens(1)["verdict"] == "PASS"
    assert sorted(set(router._targets[1].calls)) == [1, 4, 16]
    router.close()


def test_canary_comparisons_time_both_versions_on_the_same_rows(repo):
    """Paired timings: the candidate runs again beside the primary's re-run, in alternating
    order, so the latency gate compares the versions under the same load and warmth."""
    from tritonguard.rollout.latency import LatencyRecorder, open_latency_log, paired_key

    log = open_latency_log("g", repo, url="")
    recorder = LatencyRecorder(log)
    v1, v2 = Linear(W1), Linear(W2)
    router, _ = make(repo, {1: v1, 2: v2}, candidate=2, share=1.0, judge="task", latency=recorder)
    for k in range(6):
        router.infer({"X": rows(3, seed=k)}, [1, 1, 1])
        drain(router)
    router.close()
    cand, prim = log.read(paired_key(2, "candidate")), log.read(paired_key(2, "primary"))
    assert len(cand) == len(prim) == 6 and set(cand.rows.tolist()) == {3}
    assert (cand.t == prim.t).all()
    # every canary batch ran v2 twice (served + paired) and v1 once, on the same three rows
    assert v2.calls.count(3) == 12 and v1.calls.count(3) == 6
    # serving-path samples are kept apart from the pairs
    assert len(log.read(2)) == 6 and paired_key(2, "candidate") < 0


def test_paired_order_alternates_for_each_version_under_test(repo):
    """Two A/B/n arms whose comparisons interleave: each arm still runs first in exactly half of
    its pairs (one shared counter put one arm first every time, and its first-call cost read as
    a 1.2x slowdown)."""
    from tritonguard.rollout.latency import LatencyRecorder, open_latency_log

    order: list[int] = []

    class Logged(Linear):
        def __init__(self, version, w):
            super().__init__(w)
            self.version = version

        def infer(self, inputs):
            order.append(self.version)
            return super().infer(inputs)

    targets = {1: Logged(1, W1), 2: Logged(2, W2), 3: Logged(3, W2)}
    router, _ = make(repo, targets, latency=LatencyRecorder(open_latency_log("g", repo, url="")))
    x = {"X": rows(2)}
    for _ in range(4):
        for arm in (2, 3):
            router.comparator.paired_run(arm, 1, x)
    router.close()
    pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
    for arm in (2, 3):
        mine = [p for p in pairs if arm in p]
        assert len(mine) == 4 and sum(p[0] == arm for p in mine) == 2, pairs


def test_a_stale_breaker_write_does_not_erase_another_processs_newer_trip(repo):
    """Two guard processes share the breaker through the store. One tripped the candidate again
    (changed_at 100) while the other, not yet polled, still holds the older half-open state
    (changed_at 50) and records a probe: its write must not put the older state back."""
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W1)}, candidate=2, share=0.0, min_off_s=10)
    other = BreakerConfig(min_off_s=10)
    from tritonguard.rollout.breaker import Breaker  # noqa: PLC0415

    newer = Breaker(other, name="t:2")
    newer.trip(90.0, "manual")
    newer.wants_probe(100.0)
    newer.record_probe(100.0, ["FAIL"])  # reopened at 100
    router.breakers.share(2, newer.to_dict())
    stale = Breaker(other, name="t:2")
    stale.trip(40.0, "manual")
    assert stale.wants_probe(50.0)
    stale.record_probe(50.0, ["PASS"])
    router.breakers.share(2, stale.to_dict())
    doc = router.store.load().breakers["2"]
    assert doc["state"] == "open" and doc["changed_at"] == 100.0, doc
    # a newer change of its own still goes in
    stale.record_probe(120.0, ["PASS"] * 30)  # 120 - 40 >= min_off: probes close it at 120
    assert stale.state == "closed"
    router.breakers.share(2, stale.to_dict())
    assert router.store.load().breakers["2"]["state"] == "closed"
    router.close()


class Slow(Linear):
    """The same answers, ``extra_s`` slower per call."""

    def __init__(self, w, extra_s):
        super().__init__(w)
        self.extra_s = extra_s

    def infer(self, inputs):
        time.sleep(self.extra_s)
        return super().infer(inputs)


@pytest.mark.parametrize("share,tripped", [(0.1, False), (0.5, True)])
def test_latency_ratio_judges_a_version_only_at_a_share_that_keeps_it_warm(repo, share, tripped):
    """routing.latency_ratio trips a candidate slower than the primary, but not while it gets
    under routing.latency_min_share of the calls: a rarely called version runs cache-cold (an
    identical copy measured 2.1x the primary's p95 at a 15 % share), the rollout gate's rule too."""
    router, metrics = make(repo, {1: Linear(W1), 2: Slow(W1, 0.004)}, candidate=2, share=share,
                           routing={"latency_ratio": 2.0, "canary_compare": False})
    assert router.call_share(2) == pytest.approx(share) and router.call_share(1) == 1.0
    served = 0
    for k in range(120):  # 1 or 5 requests a batch on the candidate: >= 50 latencies each way
        served += router.infer({"X": rows(10, seed=k)}, [1] * 10).served_by.count("t:2")
        if router.breaker(2).state != "closed":
            break
    router.close()
    assert served >= 50, served  # enough samples that the ratio could have been judged
    trips = [dict(k[1:]) for k in metrics.counts if k[0] == "trips"]
    if tripped:
        assert router.breaker(2).state == "open" and trips == [{"reason": "latency", "target_version": "2"}], trips
    else:
        assert router.breaker(2).state == "closed" and trips == [], trips



def test_latency_ratio_ignores_a_candidate_whose_p95_moved_but_not_its_median(repo):
    """A few late calls lift a fast version's p95 far above the primary's (the good candidate's
    1.77x in CI: 0.246 against 0.139 ms); its median stays: no trip. Slower on most calls: a trip."""
    router, metrics = make(repo, {1: Linear(W1), 2: Linear(W1)}, candidate=2, share=0.5,
                           routing={"latency_ratio": 1.5, "canary_compare": False})
    now = router.clock()
    router.breaker(1).record_batch(now, 100, latency_ms=np.full(100, 0.139))
    spiky = np.r_[np.full(90, 0.139), np.full(10, 0.246)]  # 10 % late: the p95 is 1.77x
    b2 = router.breaker(2)
    b2.record_batch(now, 100, latency_ms=spiky)
    assert b2.latency_p95(50) > 1.5 * router.breaker(1).latency_p95(50)
    assert router.signals.latency_vs_primary(2, b2, now) is None and b2.state == "closed"  # noqa: SLF001
    b2.record_batch(now, 100, latency_ms=np.full(100, 0.246))  # now slower on every call
    trip = router.signals.latency_vs_primary(2, b2, now)  # noqa: SLF001
    router.close()
    assert trip is not None and trip.reason == "latency" and trip.figures["p50_ms"] > 1.25 * trip.figures["primary_p50_ms"]


def test_latency_ratio_does_not_judge_against_a_primary_that_serves_nothing(repo):
    """At a 100 % step the primary's latency window holds calls from an earlier, lighter step: a
    genuine retrain read 2.38x of it under load and was rolled back (the 200k stream scenario,
    2026-11-28). No comparison there, as the rollout's latency gate; at 50 % the same figures trip."""
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W1)}, candidate=2, share=1.0,
                     routing={"latency_ratio": 1.5, "canary_compare": False})
    now = router.clock()
    router.breaker(1).record_batch(now, 100, latency_ms=np.full(100, 0.957))  # before the step
    b2 = router.breaker(2)
    b2.record_batch(now, 100, latency_ms=np.full(100, 2.28))  # every request, under load
    assert router.signals.latency_vs_primary(2, b2, now) is None and b2.state == "closed"  # noqa: SLF001
    router.close()
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W1)}, candidate=2, share=0.5,
                     routing={"latency_ratio": 1.5, "canary_compare": False})
    router.breaker(1).record_batch(now, 100, latency_ms=np.full(100, 0.957))
    b2 = router.breaker(2)
    b2.record_batch(now, 100, latency_ms=np.full(100, 2.28))
    trip = router.signals.latency_vs_primary(2, b2, now)  # noqa: SLF001
    router.close()
    assert trip is not None and trip.reason == "latency"


def test_drift_monitor_is_built_at_load_and_scored_outside_the_serving_lock(repo, monkeypatch):
    """The primary's drift monitor (its reference read, scipy imported: about a second that used
    to stall a fresh guard's second request) exists when the router does; scoring runs on a copy
    of the window, without the lock the request path's update() takes."""
    import json

    from tritonguard.rollout import drift

    (repo / "t" / "1").mkdir(parents=True)
    ref = drift.reference_from_inputs({"X": rows(500, seed=3)})
    (repo / "t" / "1" / drift.REFERENCE_FILE).write_text(json.dumps(ref.to_dict()))
    router, metrics = make(repo, {1: Linear(W1)}, routing={"input_drift_interval_s": 0})
    try:
        monitor = router.signals._input_drift[1]
        assert router.signals._input_drift[0] == 1 and isinstance(monitor, drift.DriftMonitor)
        held = []
        scores = drift.DriftMonitor.scores

        def watched(self, live=None):
            held.append(router.signals._drift_lock.locked())
            return scores(self, live)

        monkeypatch.setattr(drift.DriftMonitor, "scores", watched)
        for k in range(3):
            router.infer({"X": rows(100, seed=10 + k)}, [1] * 100)
        drain(router)
        assert held and not any(held), held
        assert metrics.gauges.get(("drift", ("target_version", "1"))) is not None  # it was scored
    finally:
        router.close()


@pytest.mark.parametrize("golden_check", [True, False])
def test_a_version_not_on_this_replica_yet_is_served_by_the_rest_and_counts_nothing(repo, golden_check):
    """Issue 39 item 2: the state names v2 before this replica has it (an object store, the
    guard's fetcher still downloading). Before, v2 was routed to at once: each request failed
    (no manifest here yet) and counted as a candidate target error (false rollbacks), or its
    golden check ran in that gap and stored FAIL for good. Now its share is served by the
    primary, nothing is counted, no golden check runs; once it is here it is routed to."""
    here = {1}
    targets = {1: Linear(W1), 2: Linear(W2)}
    (repo / "t" / "config.pbtxt").write_text('name: "t"\n')

    def make_target(version):  # as the guard's: a version without its manifest here is refused
        source.check_complete(repo, "t", version)
        return targets[version]

    router, metrics = make(repo, targets, candidate=2, share=1.0, goldens=rows(8, seed=3),
                           present=lambda v: v in here, make_target=make_target,
                           routing={"golden_check": golden_check})
    targets[2].calls.clear()  # make() ran it for its golden outputs
    for v in (1, 2):  # v1 exported and fetched; v2 on its way: its files, not yet its manifest
        if v in here:
            repository.write_placeholder(repo / "t" / str(v), "t")
    x = rows(8, seed=4)
    for _ in range(3):
        got = router.infer({"X": x}, [1] * 8)
        assert all(e is None for e in got.errors) and set(got.served_by) == {"t:1"}
    assert metrics.total("target_errors") == 0 and metrics.total("fallbacks") == 0
    assert metrics.total("goldens", target_version="2") == 0 and "2" not in router.store.load().goldens
    assert targets[2].calls == [] and router.breaker(2).state == "closed"
    # a request pinned to it: not routable here yet, said so; still no error of the version
    got = router.infer({"X": x[:1]}, [1], pins=[2])
    assert got.errors[0].code == "UNAVAILABLE" and "not fetched to this replica yet" in str(got.errors[0])
    assert metrics.total("target_errors") == 0
    # fetched and checked: routed to as the state says
    repository.write_placeholder(repo / "t" / "2", "t")
    here.add(2)
    got = router.infer({"X": x}, [1] * 8)
    assert all(e is None for e in got.errors) and set(got.served_by) == {"t:2"}
    assert metrics.total("target_errors") == 0
    if golden_check:
        assert router.store.load().goldens["2"]["verdict"] == "PASS"
    router.close()


class WrongOnMarked(Linear):
    """W1's answers, except on rows whose first value is above 10: those come back reversed."""

    def infer(self, inputs):
        out = super().infer(inputs)
        marked = inputs["X"][:, 0] > 10
        out["P"][marked] = out["P"][marked][:, ::-1]
        return out


def test_the_batch_that_trips_the_breaker_counts_in_the_fail_share_gauge(repo):
    """A candidate whose first wrong row trips its breaker (validator_fail) showed an output-drift
    FAIL share of 0: the tripping batch was left out of the average (test_rollout saw it: 1 FAIL in
    63 compared, gauge 0.0, 2026-11-29)."""
    router, metrics = make(repo, {1: Linear(W1), 2: WrongOnMarked(W1)}, candidate=2, share=1.0,
                           judge="equivalence", min_compared=20, max_fail_rate=0.015)
    for k in range(4):  # 32 rows compared, every one equal
        router.infer({"X": rows(8, seed=10 + k)}, [1] * 8)
        drain(router)
    assert router.breaker(2).state == "closed"
    assert metrics.gauges[("output_drift", ("target_version", "2"))] == 0.0
    x = rows(8, seed=20)
    x[3, 0] = 50.0  # one wrong answer in 40 compared: past 0.015
    router.infer({"X": x}, [1] * 8)
    drain(router)
    assert router.breaker(2).state == "open"
    assert any(k[0] == "trips" and ("reason", "validator_fail") in k for k in metrics.counts), metrics.counts
    assert metrics.gauges[("output_drift", ("target_version", "2"))] > 0
    router.close()
