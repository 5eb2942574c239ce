import json

import numpy as np
import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.rollout.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig


def make(**kw) -> Breaker:
    return Breaker(BreakerConfig(**kw), name="digits:2")


def open_breaker(b: Breaker, now=0.0) -> None:
    b.trip(now, "manual", {"by": "test"})
    assert b.state == OPEN


def test_config_from_params_and_validation():
    cfg = from_params(BreakerConfig, {"window": "50", "latency_budget_ms": "12.5"}, section="breaker")
    assert cfg.window == 50 and cfg.latency_budget_ms == 12.5
    with pytest.raises(ConfigError, match="breaker.min_requests"):
        from_params(BreakerConfig, {"window": "10", "min_requests": "20"}, section="breaker")
    with pytest.raises(ConfigError, match="breaker.max_error_rate"):
        from_params(BreakerConfig, {"max_error_rate": "2"}, section="breaker")
    with pytest.raises(ConfigError, match="breaker.windw"):
        from_params(BreakerConfig, {"windw": "2"}, section="breaker")


def test_no_trip_below_min_requests():
    b = make(min_requests=20)
    assert b.record_batch(0.0, 19, errors=19, non_finite=19, latency_ms=1e6, verdicts=["FAIL"] * 19) is None
    assert b.state == CLOSED and b.allow(0.0)
    trip = b.record_batch(0.0, 1)
    assert trip is not None and trip.reason == "non_finite"


def test_trips_on_error_rate():
    b = make()
    assert b.record_batch(0.0, 100, errors=5) is None  # 5 % is the limit, not over it
    trip = b.record_batch(1.0, 10, errors=2)
    assert trip.reason == "error_rate"
    assert trip.figures == {"rate": pytest.approx(7 / 110), "count": 7, "window": 110, "limit": 0.05}
    assert b.state == OPEN and not b.allow(1.0) and trip.at == 1.0


def test_trips_on_any_non_finite_output():
    b = make()
    assert b.record_batch(0.0, 50) is None
    trip = b.record_batch(0.0, 8, non_finite=1)
    assert trip.reason == "non_finite" and trip.figures["count"] == 1 and trip.figures["window"] == 58


def test_trips_on_validator_fail_rate_after_min_compared():
    b = make(min_compared=10, max_fail_rate=0.1)
    assert b.record_batch(0.0, 30, verdicts=["FAIL"] * 5 + ["PASS"] * 4) is None  # 9 compared
    trip = b.record_batch(0.0, 1, verdicts=["MARGINAL"])
    assert trip.reason == "validator_fail"
    assert trip.figures["compared"] == 10 and trip.figures["count"] == 5 and trip.figures["rate"] == 0.5


def test_trips_on_latency_p95():
    b = make(latency_budget_ms=50.0)
    assert b.record_batch(0.0, 40, latency_ms=np.full(40, 10.0)) is None
    assert b.record_batch(0.0, 1, latency_ms=500.0) is None  # one slow request is under p95
    trip = b.record_batch(0.0, 10, latency_ms=80.0)
    assert trip.reason == "latency" and trip.figures["p95_ms"] > 50 and trip.figures["budget_ms"] == 50


def test_latency_off_by_default():
    b = make()
    assert b.record_batch(0.0, 100, latency_ms=1e9) is None


def test_window_slides():
    b = make(window=100, min_requests=20)
    b.record_batch(0.0, 100, errors=5)
    for _ in range(20):  # the old errors age out; 5 errors never over 100 requests at once
        assert b.record_batch(0.0, 10) is None
    assert b.window_counts()["errors"] == 0 and b.window_counts()["requests"] == 100
    b.record_batch(0.0, 250, errors=3)  # a batch larger than the window keeps its tail
    assert b.window_counts() == {"requests": 100, "errors": 0, "non_finite": 0, "fused": 0, "compared": 0,
                                 "fails": 0}


def test_fused_failures_trip_as_a_hard_fault():
    # a version that fails every fused call (rescued request by request) trips on its own reason,
    # even right after closing, when soft signals are shielded
    b = make(window=100, min_requests=20, min_on_s=60)
    b.close(0.0)
    assert b.record_batch(1.0, 10, fused=0) is None
    trip = b.record_batch(1.0, 10, fused=6)
    assert trip is not None and trip.reason == "fused_failures"
    assert trip.figures["count"] == 6 and trip.figures["limit"] == 0.05
    with pytest.raises(ValueError, match="fused"):
        make().record_batch(0.0, 2, fused=3)


def test_hysteresis_no_reclose_before_min_off():
    b = make(min_off_s=300, probes_to_close=3)
    open_breaker(b, now=0.0)
    for t in (1.0, 100.0, 299.0):
        assert not b.wants_probe(t)
        assert b.record_probe(t, ["PASS"] * 10) is None
        assert b.state == OPEN and not b.allow(t)
    assert b.record_batch(299.0, 100) is None and b.state == OPEN  # live batches don't judge it
    assert b.wants_probe(300.0) and b.state == HALF_OPEN and not b.allow(300.0)
    b.record_probe(301.0, ["PASS", "PASS"])
    assert b.state == HALF_OPEN
    b.record_probe(302.0, "PASS")
    assert b.state == CLOSED and b.allow(302.0) and not b.wants_probe(302.0)


def test_marginal_probes_do_not_count_and_fail_resets():
    b = make(min_off_s=10, probes_to_close=3)
    open_breaker(b)
    assert b.wants_probe(10.0)
    b.record_probe(10.0, ["PASS", "MARGINAL", "PASS", "MARGINAL", "MARGINAL"])
    assert b.state == HALF_OPEN and b.probes_passed == 2
    trip = b.record_probe(11.0, "FAIL")
    assert trip.reason == "validator_fail" and b.state == OPEN and b.opened_at == 11.0
    assert not b.wants_probe(20.0)  # the off timer restarted at 11
    assert b.wants_probe(21.0) and b.probes_passed == 0
    b.record_probe(21.0, ["PASS"] * 3)
    assert b.state == CLOSED
    open_breaker(b, now=100.0)
    b.wants_probe(200.0)
    with pytest.raises(ValueError, match="probe verdict"):
        b.record_probe(200.0, "OK")


def test_a_fail_anywhere_in_a_probe_batch_reopens_it_and_its_passes_do_not_count():
    """A probe batch is judged whole: 19 PASS rows already in, a batch of PASS x5 then FAIL must
    reopen the breaker, not close it on its first rows and drop the FAIL (a 23 %-NaN version came
    back that way in a CI run)."""
    b = make(min_off_s=10, probes_to_close=20)
    open_breaker(b)
    assert b.wants_probe(10.0)
    b.record_probe(10.0, ["PASS"] * 19)
    assert b.state == HALF_OPEN and b.probes_passed == 19
    trip = b.record_probe(11.0, np.array(["PASS"] * 5 + ["FAIL"]))
    assert trip is not None and trip.reason == "validator_fail" and b.state == OPEN
    assert trip.figures["probe_fails"] == 1 and trip.figures["probe_rows"] == 6
    assert not b.allow(11.0) and b.opened_at == 11.0
    # a clean batch counts all its PASS rows (numpy verdicts, as the validators give them)
    assert b.wants_probe(21.0)
    b.record_probe(21.0, np.array(["PASS"] * 12 + ["MARGINAL"] * 3))
    assert b.state == HALF_OPEN and b.probes_passed == 12
    b.record_probe(22.0, np.array(["PASS"] * 8))
    assert b.state == CLOSED
    # an unknown verdict is refused before anything is counted
    open_breaker(b, now=50.0)
    assert b.wants_probe(60.0)
    with pytest.raises(ValueError, match="probe verdict"):
        b.record_probe(60.0, ["PASS", "OK"])
    assert b.probes_passed == 0 and b.state == HALF_OPEN


def test_default_probes_keep_a_quarter_faulty_version_out():
    """The default probes_to_close: a version failing 25 % of rows passes a whole probe streak
    less than 1 % of the time (simulated over 2000 off periods, fixed seed)."""
    rng = np.random.default_rng(7)
    back = 0
    for _ in range(2000):
        b = make(min_off_s=0)
        open_breaker(b)
        for _ in range(100):  # probe batches of 4 rows until it closes or reopens
            b.wants_probe(0.0)
            rows = np.where(rng.random(4) < 0.25, "FAIL", "PASS")
            b.record_probe(0.0, rows)
            if b.state != HALF_OPEN:
                break
        back += b.state == CLOSED
    assert back / 2000 < 0.01, back


def test_min_on_suppresses_latency_but_not_nan():
    b = make(min_off_s=10, probes_to_close=1, min_on_s=60, latency_budget_ms=5.0)
    open_breaker(b)
    b.wants_probe(10.0)
    b.record_probe(10.0, "PASS")
    assert b.state == CLOSED and b.closed_at == 10.0
    # slow and failing validator during min_on_s: tolerated
    assert b.record_batch(20.0, 50, latency_ms=100.0, verdicts=["FAIL"] * 50) is None
    assert b.state == CLOSED
    trip = b.record_batch(30.0, 1, non_finite=1)
    assert trip.reason == "non_finite"
    # after min_on_s the same latency trips
    b.wants_probe(40.0)
    b.record_probe(40.0, "PASS")
    b.record_batch(50.0, 50, latency_ms=100.0)
    assert b.state == CLOSED
    assert b.record_batch(100.0, 1, latency_ms=100.0).reason == "latency"


def test_error_rate_is_critical_during_min_on():
    b = make(min_off_s=0, probes_to_close=1, min_on_s=60)
    open_breaker(b)
    b.wants_probe(0.0)
    b.record_probe(0.0, "PASS")
    assert b.record_batch(1.0, 20, errors=5).reason == "error_rate"


def test_external_trip():
    b = make()
    trip = b.trip(5.0, "drift", {"fraction": 0.8})
    assert trip.reason == "drift" and b.last_trip == trip and b.trips == 1
    with pytest.raises(ValueError, match="unknown trip reason"):
        b.trip(5.0, "bored")


def test_serialisation_round_trip():
    b = make(min_off_s=10)
    b.record_batch(0.0, 30, errors=1)
    b.trip(3.0, "drift", {"fraction": 0.75})
    b.wants_probe(13.0)
    b.record_probe(13.0, "PASS")
    d = json.loads(json.dumps(b.to_dict()))
    assert d["state"] == HALF_OPEN and d["probes_passed"] == 1 and d["last_trip"]["reason"] == "drift"
    c = Breaker.from_dict(d, b.config)
    assert c.to_dict() == b.to_dict()
    # another process adopts newer shared state only, keeping its own window
    other = make(min_off_s=10)
    other.record_batch(0.0, 5, errors=1)
    assert other.adopt(d) and other.state == HALF_OPEN and other.window_counts()["requests"] == 0
    assert not other.adopt({**d, "changed_at": 1.0})
    with pytest.raises(ValueError):
        other.adopt({**d, "state": "ajar", "changed_at": 99.0})


def test_record_batch_validates_counts():
    with pytest.raises(ValueError, match="errors"):
        make().record_batch(0.0, 2, errors=3)


def test_ring_counts_match_a_rescan():
    from tritonguard.rollout.breaker import _Ring
    rng = np.random.default_rng(0)
    ring = _Ring(50, np.bool_)
    for _ in range(300):
        ring.push(rng.random(int(rng.integers(0, 120))) < 0.3)
        assert ring.nonzero == np.count_nonzero(ring.values()) and ring.count <= 50
        if rng.random() < 0.05:
            ring.clear()
            assert ring.nonzero == 0 and ring.count == 0


def test_push_flags_keeps_the_ring_as_push_does():
    """The all-zero fast path of ``push_flags`` (no array, the position only) leaves the same
    window and counts as pushing the flags as an array, through wrap-arounds and batches larger
    than the ring."""
    import numpy as np

    from tritonguard.rollout.breaker import _Ring

    rng = np.random.default_rng(5)
    fast, slow = _Ring(50, bool), _Ring(50, bool)
    for _ in range(400):
        n = int(rng.integers(0, 80))
        ones = int(rng.integers(0, n + 1)) if rng.random() < 0.2 else 0
        fast.push_flags(n, ones)
        slow.push(np.arange(n) < ones)
        assert (fast.pos, fast.count, fast.nonzero) == (slow.pos, slow.count, slow.nonzero)
        assert (fast.buf == slow.buf).all()
        assert fast.nonzero == int(np.count_nonzero(fast.buf))
