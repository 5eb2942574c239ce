"""Sticky routing by ``routing_key``: a key's point in [0, 1) is the same in every process, the
candidate's band below its share keeps its keys as the share grows, the split follows the share,
and through the real route stage and router the same key lands on the same version.
``version=primary`` pins a request to the state's primary."""

import subprocess
import sys

import numpy as np

from tests.unit.guard.routing.test_router import W1, W2, Linear, make, repo, rows  # noqa: F401 - repo: fixture
from tritonguard.guard.pipeline import Batch
from tritonguard.guard.routing.sticky import apply_keys, has_keys, key_point
from tritonguard.guard.stages.route import RouteStage, pin_of
from tritonguard.guard.validation import BatchVerdict
from tritonguard.rollout.state import Candidate, RolloutState

KEYS = [f"customer-{i}" for i in range(10_000)]


def test_a_keys_point_is_the_same_in_another_process():
    """Another interpreter with another string-hash seed computes the same points (Python's own
    ``hash()`` would not)."""
    keys = ["customer-1", "", "ключ", "7"]
    code = ("import sys; from tritonguard.guard.routing.sticky import key_point; "
            "print(repr([key_point(k) for k in sys.argv[1:]]))")
    out = subprocess.run([sys.executable, "-c", code, *keys], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout
    assert eval(out) == [key_point(k) for k in keys]  # noqa: S307 - a list of floats we printed
    assert key_point(7) == key_point("7") and key_point(b"7") == key_point("7")
    points = [key_point(k) for k in KEYS]
    assert all(0.0 <= p < 1.0 for p in points) and len(set(points)) == len(points)


def test_keys_on_the_candidate_stay_on_it_as_its_share_grows():
    state = RolloutState(model="g", primary=1)
    u = np.array([key_point(k) for k in KEYS])
    before = np.zeros(len(KEYS), bool)
    for share in (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0):
        state.candidate = Candidate(2, share)
        now = state.candidate_mask(u)
        assert (now | ~before).all(), f"a key left the candidate when its share grew to {share}"
        assert now.sum() > before.sum() or share == 0.01
        before = now
    assert before.all()


def test_the_split_over_10k_keys_is_close_to_the_share():
    u = np.array([key_point(k) for k in KEYS])
    for share in (0.05, 0.3, 0.5):
        # binomial sd at 0.5 over 10k keys is 0.005: 0.02 is four of them
        assert abs((u < share).mean() - share) < 0.02, share


def test_apply_keys_replaces_only_the_draws_of_keyed_requests():
    params = [{"routing_key": "a"}, {}, {"routing_key": ""}, {"routing_key": 42}, {"version": "1"}]
    assert has_keys(params) and not has_keys([{}, {"version": "2"}, {"routing_key": ""}])
    draws = apply_keys(params, np.full(5, 0.999))
    assert draws.tolist() == [key_point("a"), 0.999, 0.999, key_point("42"), 0.999]


def _batch(params, x):
    n = len(params)
    return Batch(params=params, responses=[None] * n, route=list(range(n)), fused={"X": x}, sizes=[1] * n,
                 verdict=BatchVerdict(errors=[None] * n, fused={"X": x}, sizes=[1] * n, valid=list(range(n))))


def test_the_same_key_goes_to_the_same_version_through_the_route_stage(repo):  # noqa: F811
    """At a 50 % split, through the real route stage and router: a request with a key is
    answered by the version its key's point falls in, every time, however the batch is made;
    requests without a key are still split at random."""
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W1)}, candidate=2, share=0.5)  # equal: no trip
    stage = RouteStage(router)
    keys = [f"customer-{i}" for i in range(40)]
    want = {k: "t:2" if key_point(k) < 0.5 else "t:1" for k in keys}
    assert set(want.values()) == {"t:1", "t:2"}
    seen: dict[str, set[str]] = {k: set() for k in keys}
    rng = np.random.default_rng(3)
    unkeyed = set()
    for _ in range(10):
        order = rng.permutation(keys).tolist()
        params = [{"routing_key": k} for k in order] + [{}] * 20
        b = _batch(params, rows(len(params), seed=int(rng.integers(1000))))
        stage.run(b)
        for k, served in zip(order, b.routed.served_by, strict=False):
            seen[k].add(served)
        unkeyed |= set(b.routed.served_by[len(order):])
    assert {k: s for k, s in seen.items() if s != {want[k]}} == {}
    assert unkeyed == {"t:1", "t:2"}  # no key: a random draw, both versions
    router.close()


def test_version_primary_pins_a_request_to_the_states_primary(repo):  # noqa: F811
    assert pin_of({"version": "primary"}) == -1 and pin_of({"version": -1}) == 0 and pin_of({"version": 3}) == 3
    router, _ = make(repo, {1: Linear(W1), 2: Linear(W2)}, candidate=2, share=1.0)
    stage = RouteStage(router)
    b = _batch([{"version": "primary"}, {}, {"version": "primary", "routing_key": "x"}], rows(3, seed=5))
    stage.run(b)
    assert b.routed.served_by == ["t:1", "t:2", "t:1"] and b.routed.errors == [None] * 3
    router.close()
