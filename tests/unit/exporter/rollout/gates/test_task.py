"""Gates of a candidate judged on the task (a new model), fused failures in the error gate, and
the controller rolling back a candidate whose goldens fail on the server."""

from __future__ import annotations

import numpy as np
import pytest

from exporter.rollout.controller import RolloutController
from exporter.rollout.gates.config import GateConfig
from exporter.rollout.gates.evaluate import evaluate
from exporter.rollout.gates.readings import GuardReadings, parse
from exporter.rollout.gates.verdict import FAIL, INCONCLUSIVE, PASS, SKIPPED, wilson
from exporter.rollout.judge import Z95, parse_margin, upper_bound
from exporter.rollout.progress import ROLLED_BACK, RolloutConfig
from tritonguard.rollout.feedback import Tally
from tritonguard.rollout.stores import open_store


def reading(*, n=2000, disagree=0, fused=0, errors=0, labeled=None) -> GuardReadings:
    return GuardReadings(model="digits", primary=1, candidate=2, served={2: n - errors, 1: 10 * n},
                         errors={2: errors}, fused={2: fused},
                         compared={"canary": {"AGREE": n - disagree, "DISAGREE": disagree}},
                         labeled=labeled or {}, breaker_state=0, replicas=1)


TASK = GateConfig(judge="task", expected_disagreement=0.012, max_regression=0.005, latency=False)


def gate(report, name):
    return next(g for g in report.gates if g.name == name)


def test_a_retrain_as_good_passes_the_disagreement_gate_at_every_look():
    # live disagreement 0.3 % where the offline bound predicts 1.2 %: PASS, even at look 30
    for look in (1, 5, 30):
        report = evaluate(None, reading(n=2000, disagree=6), TASK, look=look)
        assert gate(report, "disagreement").verdict == PASS, gate(report, "disagreement")
        assert report.verdict == PASS
    # the agreement gate of the equivalence judge is not run for a task judge
    assert "agreement" not in {g.name for g in report.gates}


def test_a_candidate_that_disagrees_more_than_the_limit_fails():
    report = evaluate(None, reading(n=2000, disagree=80), TASK, look=3)  # 4 % vs the default 2 %
    g = gate(report, "disagreement")
    assert g.verdict == FAIL and report.verdict == FAIL
    assert "80/2000" in g.reason and "limit 2.00%" in g.reason and "genuine digits retrains" in g.reason


def test_without_labels_the_candidate_is_not_held_to_its_own_difference():
    # the reported defect: 64 unlabelled goldens measured 7.8 % (upper 15.2 %), which became the
    # live limit, and 5.9 % live disagreement passed at every step. The limit is the operator's now
    own = GateConfig(judge="task", expected_disagreement=0.1519, latency=False)
    report = evaluate(None, reading(n=1000, disagree=59), own, look=2)
    assert gate(report, "disagreement").verdict == FAIL, gate(report, "disagreement")
    # an operator who means it raises the limit, and the reason names where it came from
    raised = GateConfig(judge="task", disagreement_limit=0.10, limit_source="--max-disagreement", latency=False)
    g = gate(evaluate(None, reading(n=1000, disagree=59), raised, look=2), "disagreement")
    assert g.verdict == PASS and g.figures["limit_source"] == "--max-disagreement"


def test_pass_needs_the_upper_bound_below_the_limit_and_holds_in_between():
    cfg = GateConfig(judge="task", latency=False, min_compared=100)
    # 1.5 % on 200 rows: neither shown above 2 % nor below it
    g = gate(evaluate(None, reading(n=200, disagree=3), cfg), "disagreement")
    assert g.verdict == INCONCLUSIVE and "not yet below the limit 2.00%" in g.reason
    g = gate(evaluate(None, reading(n=20000, disagree=300), cfg), "disagreement")  # 1.5 % on 20,000
    assert g.verdict == PASS


def test_a_generator_judged_on_bits_per_char_has_its_disagreement_reported_not_judged():
    cfg = GateConfig(judge="task", latency=False, judge_disagreement=False)
    g = gate(evaluate(None, reading(n=500, disagree=450), cfg), "disagreement")
    assert g.verdict == SKIPPED and "the task metric decided offline" in g.reason and g.figures["disagree"] == 450


def test_disagreement_needs_its_minimum_rows_either_way():
    cfg = GateConfig(judge="task", min_compared=100, latency=False)
    assert gate(evaluate(None, reading(n=60, disagree=30), cfg), "disagreement").verdict == INCONCLUSIVE
    assert gate(evaluate(None, reading(n=60, disagree=0), cfg), "disagreement").verdict == INCONCLUSIVE


def test_live_labels_can_stop_a_worse_candidate_but_never_hold_one():
    worse = {2: {"true": 1900, "false": 100}, 1: {"true": 9950, "false": 50}}  # 95 % vs 99.5 %
    g = gate(evaluate(None, reading(labeled=worse), TASK), "labels")
    assert g.verdict == FAIL and "95.00%" in g.reason
    same = {2: {"true": 995, "false": 5}, 1: {"true": 9950, "false": 50}}
    assert gate(evaluate(None, reading(labeled=same), TASK), "labels").verdict in (PASS, SKIPPED)
    few = {2: {"true": 10}, 1: {"true": 10}}
    report = evaluate(None, reading(labeled=few), TASK)
    assert gate(report, "labels").verdict == SKIPPED and report.verdict == PASS


def _tally(**versions) -> Tally:
    """v<N>=(right, labelled[, {class: (right, n)}])"""
    t = Tally()
    for name, spec in versions.items():
        v = int(name[1:])
        t.right[v], t.total[v] = spec[0], spec[1]
        if len(spec) > 2:
            t.by_class[v] = {c: list(x) for c, x in spec[2].items()}
    t.origins = {"feedback": sum(x[1] for x in versions.values())}
    return t


def test_store_labels_replace_the_metrics_and_required_labels_hold_each_step():
    cfg = GateConfig(judge="task", latency=False, min_labels=400)
    # too few labels: the step waits and says so; disagreement is reported, not judged
    report = evaluate(None, reading(n=2000, disagree=300), cfg, labels=_tally(v2=(99, 100), v1=(990, 1000)))
    g = gate(report, "labels")
    assert g.verdict == INCONCLUSIVE and "waiting for labels: 100 / 1000" in g.reason and report.verdict == INCONCLUSIVE
    assert gate(report, "disagreement").verdict == SKIPPED and "labels decide" in gate(report, "disagreement").reason
    # as accurate on 5,000 labels a side: non-inferiority shown -> PASS, though 15 % of answers differ
    report = evaluate(None, reading(n=2000, disagree=300), cfg, labels=_tally(v2=(4960, 5000), v1=(4955, 5000)))
    assert gate(report, "labels").verdict == PASS and report.verdict == PASS
    # enough labels but no verdict yet: holds
    g = gate(evaluate(None, reading(), cfg, labels=_tally(v2=(495, 500), v1=(497, 500))), "labels")
    assert g.verdict == INCONCLUSIVE and "more labels" in g.reason
    # worse: FAIL
    g = gate(evaluate(None, reading(), cfg, labels=_tally(v2=(4700, 5000), v1=(4950, 5000))), "labels")
    assert g.verdict == FAIL and "94.00%" in g.reason


def test_a_class_that_lost_half_its_recall_fails_while_the_overall_figure_hides_it():
    # class 3 is 2 % of the labels; the candidate gets half of its rows wrong: overall -1 pp
    per_c = {str(c): (198, 200) for c in range(10) if c != 3} | {"3": (20, 40)}
    per_p = {str(c): (198, 200) for c in range(10) if c != 3} | {"3": (39, 40)}
    right_c, right_p = sum(x[0] for x in per_c.values()), sum(x[0] for x in per_p.values())
    cfg = GateConfig(judge="task", latency=False, max_regression=0.02)
    labels = _tally(v2=(right_c, 1840, per_c), v1=(right_p, 1840, per_p))
    g = gate(evaluate(None, reading(), cfg, labels=labels), "labels")
    assert g.verdict == FAIL and "class 3: recall 50.0%" in g.reason, g
    # a genuine retrain's classes move by a row or two: nothing fails
    per_c = {str(c): (197 + c % 3, 200) for c in range(10) if c != 3} | {"3": (38, 40)}
    labels = _tally(v2=(sum(x[0] for x in per_c.values()), 1840, per_c), v1=(right_p, 1840, per_p))
    assert gate(evaluate(None, reading(), cfg, labels=labels), "labels").verdict != FAIL


def test_fused_failures_count_as_errors_of_the_version():
    cfg = GateConfig(latency=False, min_agreement=None)
    clean = evaluate(None, reading(n=2000), cfg)
    assert gate(clean, "error_rate").verdict == PASS
    report = evaluate(None, reading(n=2000, fused=300), cfg)
    g = gate(report, "error_rate")
    assert g.verdict == FAIL and g.figures["errors"] == 300 and g.figures["fused_failures"] == 300


def test_fused_and_labeled_series_are_read_from_the_metrics_and_windowed():
    text = """\
tritonguard_fused_failures_total{model="digits",target_version="2",version="1"} 12
tritonguard_labeled_total{correct="true",model="digits",target_version="2",version="1"} 90
tritonguard_labeled_total{correct="false",model="digits",target_version="2",version="1"} 10
tritonguard_labeled_total{correct="true",model="digits",target_version="1",version="1"} 50
"""
    r = GuardReadings.from_scrapes([parse(text)], "digits", 1, 2)
    assert r.fused == {2: 12.0}
    assert r.labeled == {2: {"true": 90.0, "false": 10.0}, 1: {"true": 50.0}}
    again = GuardReadings.from_dict(r.to_dict())
    assert again.fused == r.fused and again.labeled == r.labeled


def test_margins_and_bounds():
    assert parse_margin("0.5pp") == pytest.approx(0.005)
    assert parse_margin("1%") == pytest.approx(0.01)
    assert parse_margin("0.002") == pytest.approx(0.002)
    with pytest.raises(ValueError, match="max-regression"):
        parse_margin("half a point")
    lo, hi = wilson(3, 450, Z95)
    assert lo < 3 / 450 < hi
    assert upper_bound(3, 450) == pytest.approx(hi, rel=1e-9)
    assert upper_bound(0, 450) > 0  # none seen is not none possible


def test_the_controller_rolls_back_a_candidate_whose_goldens_fail_on_the_server(tmp_path):
    repo = tmp_path / "repo"
    (repo / "digits").mkdir(parents=True)
    store = open_store("digits", repo)
    store.update(lambda s: (setattr(s, "primary", 1), s)[1], by="test")
    readings = lambda p, c: reading()  # noqa: E731 - traffic looks fine: only the goldens say no
    ctl = RolloutController("digits", repo, readings, store=store,
                            config=RolloutConfig(dwell_s=0, interval_s=1, gates=GateConfig(judge="task")))
    ctl.start(2)
    assert store.load().judges == {"2": {"judge": "task"}}

    def fail(s):
        s.goldens["2"] = {"verdict": "FAIL", "metrics": {"error": "batch 64: seeded"}, "checked_at": 0.0}
        return s

    store.update(fail, by="guard")
    p = ctl.tick()
    assert p.status == ROLLED_BACK and "goldens FAIL" in p.reason and "batch 64" in p.reason
    state = store.load()
    assert state.candidate is None and state.judges == {}


def test_judge_is_validated_in_the_state_document():
    from tritonguard.rollout.state import RolloutState, StateError

    d = RolloutState(model="m", primary=1).to_dict()
    d["judges"] = {"2": {"judge": "vibes"}}
    with pytest.raises(StateError, match="judges.2.judge"):
        RolloutState.from_dict(d)
    d["judges"] = {"2": {"judge": "task", "cosine": 0.93}}
    assert RolloutState.from_dict(d).judge_of(2) == {"judge": "task", "cosine": 0.93}
    assert RolloutState.from_dict(d).judge_of(3) == {"judge": "equivalence"}


def test_wilson_is_a_proper_interval():
    for k, n in ((0, 10), (5, 10), (10, 10), (1, 1000)):
        lo, hi = wilson(k, n, 1.96)
        assert 0 <= lo <= k / n <= hi <= 1
    assert np.isclose(wilson(0, 0, 1.96), (0.0, 1.0)).all()


def test_looks_count_by_information_not_by_clock():
    from exporter.rollout.gates.verdict import information_look

    assert [information_look(n, 60) for n in (0, 60, 120, 121, 240, 241, 480, 1000)] == [1, 1, 1, 2, 2, 3, 3, 5]
    # a retrain's 2 of 443 disagreeing rows against a 2.16 % limit: the bound no longer depends on
    # how many times the controller looked at the window
    r = reading(n=1000, disagree=4)
    cfg = GateConfig(judge="task", expected_disagreement=0.0166, max_regression=0.005, latency=False)
    assert gate(evaluate(None, r, cfg, look=1), "disagreement").verdict == PASS
    assert gate(evaluate(None, r, cfg, look=500), "disagreement").verdict == PASS


def test_latency_is_not_judged_below_its_share():
    from tritonguard.rollout.latency import Samples

    slow = Samples(t=np.arange(500.0), rows=np.ones(500), seconds=np.full(500, 2e-3))
    fast = Samples(t=np.arange(500.0), rows=np.ones(500), seconds=np.full(500, 1e-3))
    cfg = GateConfig(judge="task", expected_disagreement=0.01)
    low = evaluate(None, reading(), cfg, latency_samples=(slow, fast), share=0.05)
    assert gate(low, "latency").verdict == SKIPPED and "25%" in gate(low, "latency").reason
    high = evaluate(None, reading(), cfg, latency_samples=(slow, fast), share=0.25)
    assert gate(high, "latency").verdict == FAIL and high.verdict == FAIL


def test_latency_is_not_judged_at_100_percent():
    from tritonguard.rollout.latency import Samples

    slow = Samples(t=np.arange(500.0), rows=np.ones(500), seconds=np.full(500, 2e-3))
    old = Samples(t=np.arange(500.0), rows=np.ones(500), seconds=np.full(500, 1e-3))
    report = evaluate(None, reading(), GateConfig(judge="task", expected_disagreement=0.01),
                      latency_samples=(slow, old), share=1.0)
    assert gate(report, "latency").verdict == SKIPPED and "100 %" in gate(report, "latency").reason
