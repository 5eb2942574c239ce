"""The rollout controller with simulated traffic and a fake clock: milliseconds per rollout.

The traffic simulator reads the real rollout state (the file or Redis hash the guards poll) to
split its requests, and produces cumulative guard counters the way the guards' metrics would.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from exporter.records.progress import ControllerError, ProgressUnavailable
from exporter.rollout.controller import RolloutController
from exporter.rollout.gates.readings import GuardReadings
from exporter.rollout.progress import ABORTED, DONE, PAUSED, ROLLED_BACK, RUNNING, RolloutConfig
from tritonguard.rollout.state import Arm, Candidate, StateError, StateUnavailable
from tritonguard.rollout.stores import open_store

LE = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)
MODEL = "digits"


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _shape(median: float) -> np.ndarray:
    """Share of requests at or below each bucket bound, for a lognormal latency."""
    x = np.random.default_rng(0).lognormal(math.log(median), 0.4, 20000)
    return np.array([(x <= le).mean() for le in LE])


class Traffic:
    """``rate`` requests per second since the last reading, split by the current state."""

    def __init__(self, store, clock, *, rate=100, cand_err=0.0, cand_ms=2.0, prim_ms=2.0):
        self.store, self.clock, self.rate, self.cand_err = store, clock, rate, cand_err
        self.shape = {"cand": _shape(cand_ms / 1000), "prim": _shape(prim_ms / 1000)}
        self.last = clock()
        self.served: dict[int, float] = {}
        self.errors: dict[int, float] = {}
        self.compared: dict[str, dict[str, float]] = {}
        self.latency: dict[int, np.ndarray] = {}
        self.calls = 0

    def _add(self, d, key, n):
        d[key] = d.get(key, 0.0) + n

    def __call__(self, primary: int, candidate: int) -> GuardReadings:
        self.calls += 1
        now, state = self.clock(), self.store.load()
        n = round(self.rate * (now - self.last))
        self.last = now
        share = state.candidate.share if state.candidate else 0.0
        shadow = state.shadow_share if state.candidate else 0.0
        n_c = round(n * share)
        n_p = n - n_c
        err = round(n_c * self.cand_err)
        self._add(self.served, candidate, n_c - err)
        self._add(self.errors, candidate, err)
        self._add(self.served, primary, n_p)
        canary = self.compared.setdefault("canary", {})
        self._add(canary, "PASS", n_c - err)
        mirrored = round(n_p * shadow)
        self._add(self.compared.setdefault("shadow", {}), "PASS", mirrored)
        for v, k, count in ((candidate, "cand", n_c - err), (primary, "prim", n_p)):
            self.latency[v] = self.latency.get(v, np.zeros(len(LE))) + np.round(count * self.shape[k])
        return GuardReadings(
            model=MODEL, primary=primary, candidate=candidate, served=dict(self.served),
            errors=dict(self.errors), compared={k: dict(v) for k, v in self.compared.items()},
            breaker_state=0, replicas=2,
            latency={v: dict(zip(LE, b.tolist(), strict=True)) for v, b in self.latency.items()})


def _forget(url: str) -> None:
    """Drop this module's keys (state and rollout progress of MODEL) left by an earlier test."""
    r = redis.Redis.from_url(url)
    r.delete(f"tritonguard:state:{MODEL}", *r.keys(f"tritonguard:rollout:{MODEL}*"))


@pytest.fixture(params=["file", "redis"])
def env(request, tmp_path, monkeypatch):
    """Every controller test runs twice: state and progress in files, and both in a real Redis."""
    monkeypatch.delenv("TRITONGUARD_STATE_URL", raising=False)
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        _forget(url)
        monkeypatch.setenv("TRITONGUARD_STATE_URL", url)
    clock = Clock()
    store = open_store(MODEL, tmp_path, clock=clock)
    store.update(lambda s: setattr(s, "primary", 1) or s)
    return tmp_path, clock, store


class Hooks:
    def __init__(self):
        self.steps, self.promoted, self.rolled_back = [], [], []

    def kwargs(self):
        return {"on_step": lambda i, share, rep: self.steps.append((i, share, rep)),
                "on_promote": self.promoted.append,
                "on_rollback": lambda v, why: self.rolled_back.append((v, why))}


def controller(env, traffic, hooks=None, **cfg):
    repo, clock, _ = env
    config = RolloutConfig(**{"dwell_s": 300, "interval_s": 30, **cfg})
    return RolloutController(MODEL, repo, traffic, config=config, store=open_store(MODEL, repo, clock=clock),
                             clock=clock, sleep=clock.sleep, **(hooks.kwargs() if hooks else {}))


def test_good_candidate_walks_every_step_to_promotion(env):
    repo, clock, store = env
    hooks = Hooks()
    c = controller(env, Traffic(store, clock), hooks)
    c.start(2)
    assert store.load().candidate == Candidate(2, 0.01)
    p = c.run(max_ticks=2000)
    assert p.status == DONE and p.reason.startswith("promoted; judged on: no offline judgement; validator agreement")
    assert [(i, share) for i, share, _ in hooks.steps] == [
        (0, 0.01), (1, 0.05), (2, 0.10), (3, 0.25), (4, 0.50), (5, 1.0)]
    assert all(rep.verdict == "PASS" for _, _, rep in hooks.steps[1:])
    assert hooks.promoted == [2] and hooks.rolled_back == []
    state = store.load()
    assert (state.primary, state.previous_primary, state.candidate) == (2, 1, None)
    # the 100 % step had no primary traffic: latency was judged against an earlier window's
    final = {g["name"]: g for g in p.last_report["gates"]}
    assert set(final) == {"error_rate", "breaker", "agreement", "latency"}
    assert all(g["verdict"] == "PASS" for g in final.values())
    assert final["latency"]["figures"]["primary_samples"] >= 100


def test_bad_candidate_rolls_back_at_the_first_step_with_enough_samples(env):
    repo, clock, store = env
    hooks = Hooks()
    traffic = Traffic(store, clock, cand_err=0.2)
    c = controller(env, traffic, hooks)
    c.start(2)
    p = c.run(max_ticks=200)
    assert p.status == ROLLED_BACK and p.step_index == 0
    assert "error_rate FAIL" in p.reason
    assert store.load().candidate is None and hooks.rolled_back[0][0] == 2
    # caught as soon as the SPRT had its evidence: a handful of looks, well before the dwell
    assert traffic.calls <= 5
    assert c.tick().status == ROLLED_BACK  # later ticks do nothing


def test_slow_candidate_rolls_back_on_latency(env):
    _, clock, store = env
    c = controller(env, Traffic(store, clock, rate=2000, cand_ms=5.0))
    c.start(2)
    p = c.run(max_ticks=200)
    assert p.status == ROLLED_BACK and "latency FAIL" in p.reason


def test_insufficient_traffic_holds_and_never_advances(env):
    _, clock, store = env
    hooks = Hooks()
    c = controller(env, Traffic(store, clock, rate=1), hooks)
    c.start(2)
    p = c.run(max_ticks=300)  # 2.5 hours of looks at ~0.3 candidate requests each
    assert p.status == RUNNING and p.step_index == 0
    assert p.last_report["verdict"] == "INCONCLUSIVE"
    assert store.load().candidate == Candidate(2, 0.01)
    assert len(hooks.steps) == 1 and not hooks.promoted and not hooks.rolled_back


def test_inconclusive_step_times_out_into_rollback_when_configured(env):
    _, clock, store = env
    c = controller(env, Traffic(store, clock, rate=1), max_step_s=3600)
    c.start(2)
    p = c.run(max_ticks=500)
    assert p.status == ROLLED_BACK and "max_step_s" in p.reason
    assert store.load().candidate is None


def test_dwell_is_respected(env):
    _, clock, store = env
    hooks = Hooks()
    entered = []
    c = controller(env, Traffic(store, clock, rate=5000), hooks, dwell_s=600)
    c.on_step = lambda i, share, rep: entered.append(clock())
    c.start(2)
    assert c.run(max_ticks=1000).status == DONE
    # 5k req/s passes every gate at the first look; only the dwell holds each step
    gaps = np.diff(entered)
    assert len(gaps) == 5 and all(g >= 600 for g in gaps) and all(g < 600 + 2 * 30 for g in gaps)


def test_killed_mid_rollout_resumes_at_the_same_step(env):
    repo, clock, store = env
    traffic = Traffic(store, clock)
    first = controller(env, traffic)
    first.start(2)
    while first.status().step_index < 2:
        first.tick()
        clock.sleep(30)
    before = first.status()
    del first  # the process dies; only the files remain
    hooks = Hooks()
    # restarted with other settings: the rollout keeps the configuration it started with
    second = controller(env, traffic, hooks, dwell_s=0, steps=(50, 100))
    assert second.status() == before and before.config["dwell_s"] == 300
    p = second.resume(max_ticks=1)
    assert p.step_index == 2 and p.step_started_at == before.step_started_at
    assert p.look == before.look + 1  # the same window, judged against the same baseline
    starts = [p.step_started_at]
    while p.status == RUNNING:
        clock.sleep(30)
        p = second.resume(max_ticks=1)
        starts.append(p.step_started_at)
    assert p.status == DONE and hooks.promoted == [2] and p.steps == [1, 5, 10, 25, 50, 100]
    assert all(g >= 300 for g in np.diff(sorted(set(starts))))


def test_abort_rolls_back(env):
    _, clock, store = env
    hooks = Hooks()
    c = controller(env, Traffic(store, clock), hooks)
    c.start(2)
    c.run(max_ticks=20)
    p = controller(env, Traffic(store, clock)).abort("operator said so")  # from another process
    assert p.status == ABORTED and store.load().candidate is None
    assert c.tick().status == ABORTED
    with pytest.raises(ControllerError, match="resume"):
        c.resume()
    with pytest.raises(ControllerError, match="abort"):
        c.abort()


def test_pause_and_resume(env):
    _, clock, store = env
    c = controller(env, Traffic(store, clock))
    c.start(2)
    c.run(max_ticks=3)
    assert c.pause().status == PAUSED
    step = c.status().step_index
    c.tick()
    assert c.status().status == PAUSED and c.status().step_index == step
    assert c.resume(max_ticks=5000).status == DONE


def test_refused_promotion_pauses_with_the_candidate_in_place(env):
    _, clock, store = env

    def refuse(version):
        raise PermissionError("change freeze")

    c = controller(env, Traffic(store, clock))
    c.on_promote = refuse
    c.start(2)
    p = c.run(max_ticks=5000)
    assert p.status == PAUSED and "change freeze" in p.reason
    assert store.load().candidate == Candidate(2, 1.0) and store.load().primary == 1


def test_shadow_mode_mirrors_and_never_serves(env):
    _, clock, store = env
    shares = []
    c = controller(env, Traffic(store, clock), mode="shadow", steps=(10, 50, 100))
    c.on_step = lambda i, share, rep: shares.append((store.load().candidate.share, store.load().shadow_share))
    c.start(2)
    assert c.run(max_ticks=5000).status == DONE
    assert shares == [(0.0, 0.1), (0.0, 0.5), (0.0, 1.0)]
    assert store.load().primary == 2


def test_state_store_outage_holds_then_continues(env):
    repo, clock, store = env

    class Flaky:
        def __init__(self, inner):
            self.inner, self.failures = inner, 3

        def load(self):
            return self.inner.load()

        def update(self, fn, **kw):
            if self.inner.load().candidate is not None and self.failures:
                self.failures -= 1
                raise StateUnavailable("redis down")
            return self.inner.update(fn, **kw)

    c = controller(env, Traffic(store, clock))
    c.store = Flaky(c.store)
    c.start(2)
    assert c.run(max_ticks=5000).status == DONE and c.store.failures == 0


def test_candidate_removed_outside_the_controller_stops_it(env):
    _, clock, store = env
    hooks = Hooks()
    c = controller(env, Traffic(store, clock), hooks)
    c.start(2)
    store.update(lambda s: setattr(s, "candidate", None) or s)
    p = c.tick()
    assert p.status == ABORTED and "outside" in p.reason and hooks.rolled_back


def test_start_is_validated(env):
    repo, clock, store = env
    c = controller(env, Traffic(store, clock))
    with pytest.raises(ControllerError, match="already the primary"):
        c.start(1)
    c.start(2)
    with pytest.raises(ControllerError, match="abort it first"):
        c.start(3)
    store.update(lambda s: setattr(s, "primary", -1) or s)
    other = RolloutController("other", repo, Traffic(store, clock), clock=clock)
    with pytest.raises(ControllerError, match="primary"):
        other.start(2)


def test_start_refuses_while_an_abn_split_runs(env):
    repo, clock, store = env
    store.update(lambda s: setattr(s, "arms", [Arm(3, 0.2)]) or s)
    with pytest.raises(ControllerError, match="A/B/n split .*v3.*--arms none"):
        controller(env, Traffic(store, clock)).start(2)
    assert store.load().candidate is None


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": (5, 1)}, "increasing"),
    ({"steps": (0, 50)}, "increasing"),
    ({"mode": "canary"}, "mode"),
    ({"dwell_s": 600, "max_step_s": 60}, "max_step_s"),
])
def test_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


# -- progress in Redis: any host can watch, steer or take over a rollout ------------------------
DRIVER = r"""
import sys, time
from exporter.rollout.controller import RolloutController
from exporter.rollout.gates.readings import GuardReadings

def idle(primary, candidate):  # no traffic: every look is inconclusive and holds
    return GuardReadings(model="digits", primary=primary, candidate=candidate, breaker_state=0, replicas=1)

c = RolloutController("digits", sys.argv[1], idle, lease_s=1.0)
c.resume(max_ticks=10_000)  # bounded: stopped (killed, or by an abort) long before
"""


def _spawn_driver(repo, r) -> subprocess.Popen:
    """``rollout resume`` in another process; returns once it holds the driver lease."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    child = subprocess.Popen([sys.executable, "-c", DRIVER, str(repo)], env=env)
    deadline = time.monotonic() + 30
    while r.get(f"tritonguard:rollout:{MODEL}:driver") is None:
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            child.wait(timeout=10)
            pytest.fail(f"the driver never took the lease (exit {child.returncode})")
        time.sleep(0.05)
    return child


@pytest.fixture
def redis_env(tmp_path, monkeypatch, redis_server):
    _forget(redis_server.url)
    monkeypatch.setenv("TRITONGUARD_STATE_URL", redis_server.url)
    clock = Clock()
    store = open_store(MODEL, tmp_path, clock=clock)
    store.update(lambda s: setattr(s, "primary", 1) or s)
    return tmp_path, clock, store


def test_redis_progress_lives_in_the_store_and_any_host_sees_it(redis_env, redis_server, tmp_path_factory):
    repo, clock, store = redis_env
    c = controller(redis_env, Traffic(store, clock))
    c.start(2)
    c.run(max_ticks=40)
    assert not (repo / MODEL / "rollout_controller.json").exists(), "progress written locally, not to Redis"
    doc = json.loads(redis.Redis.from_url(redis_server.url).get(f"tritonguard:rollout:{MODEL}"))
    assert doc["candidate"] == 2 and doc["status"] == RUNNING and doc["step_index"] >= 1
    # another host: no files of this repository at all, only the Redis URL
    elsewhere = tmp_path_factory.mktemp("other-host")
    other = controller((elsewhere, clock, store), Traffic(store, clock))
    assert other.status() == c.status()
    assert other.resume(max_ticks=5000).status == DONE
    assert store.load().primary == 2 and c.status().status == DONE


def test_redis_driver_lease_excludes_others_and_lapses_when_the_driver_is_killed(redis_env, redis_server):
    repo, clock, store = redis_env
    controller(redis_env, Traffic(store, clock)).start(2)
    r = redis.Redis.from_url(redis_server.url)
    child = _spawn_driver(repo, r)
    try:
        time.sleep(1.5)  # longer than its lease: it is renewed, not just fresh
        second = controller(redis_env, Traffic(store, clock))
        with pytest.raises(ControllerError, match=rf"another process is driving .* pid {child.pid}"):
            second.resume(max_ticks=1)
        assert child.poll() is None, "the driver stopped by itself"
    finally:
        child.kill()  # SIGKILL: no cleanup runs, the lease must lapse by itself
        child.wait(timeout=10)
    killed = time.monotonic()
    assert r.get(f"tritonguard:rollout:{MODEL}:driver").decode().split(":")[1] == str(child.pid)
    while True:
        try:
            p = second.resume(max_ticks=1)
            break
        except ControllerError:
            assert time.monotonic() - killed < 5, "the dead driver's lease never lapsed"
            time.sleep(0.1)
    assert p.status == RUNNING and p.candidate == 2 and store.load().candidate is not None


def test_redis_progress_write_is_fenced_by_the_lock(redis_env):
    repo, clock, store = redis_env
    c = RolloutController(MODEL, repo, Traffic(store, clock), lease_s=0.3, clock=clock)
    c.start(2)
    before = c.status()
    with c.progress.lock() as lease:
        lease._stop.set()  # a stall: the lease is no longer renewed ...
        time.sleep(0.6)  # ... and lapses; someone else takes the lock meanwhile
        with RolloutController(MODEL, repo, None, lease_s=5).progress.lock():
            pass
        with pytest.raises(ControllerError, match="lapsed before the write"):
            c.progress.write('{"stale": true}')
    assert c.status() == before


def test_redis_unreachable_progress_is_a_state_outage(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    monkeypatch.setenv("TRITONGUARD_STATE_URL", f"redis://:secret@127.0.0.1:{port}/0")
    c = RolloutController(MODEL, tmp_path, None)
    with pytest.raises(ProgressUnavailable) as info:
        c.status()
    assert isinstance(info.value, StateError) and "secret" not in str(info.value)


def test_redis_abort_from_another_process_stops_a_live_driver(redis_env, redis_server):
    repo, clock, store = redis_env
    # looks every 50 ms (a rollout keeps the settings it started with, whoever resumes it)
    controller(redis_env, Traffic(store, clock), interval_s=0.05, dwell_s=0).start(2)
    r = redis.Redis.from_url(redis_server.url)
    child = _spawn_driver(repo, r)
    try:
        p = controller(redis_env, Traffic(store, clock)).abort("operator on another host")
        assert p.status == ABORTED and store.load().candidate is None
        assert child.wait(timeout=10) == 0  # its next look sees the abort and it stops
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert r.get(f"tritonguard:rollout:{MODEL}:driver") is None, "the driver left its lease behind"


# -- A/B/n: several arms with weights, each gated on its own ------------------------------------
class ArmTraffic:
    """``rate`` req/s since the last look, split by the state's arm weights (the primary answers
    the rest); per-version errors, canary comparisons and latency, as the guards label them."""

    def __init__(self, store, clock, *, rate=400, err=None, ms=None):
        self.store, self.clock, self.rate = store, clock, rate
        self.err, self.ms = err or {}, ms or {}
        self.last = clock()
        self.served: dict[int, float] = {}
        self.errors: dict[int, float] = {}
        self.compared: dict[int, float] = {}
        self.latency: dict[int, np.ndarray] = {}

    def _generate(self) -> None:
        now, state = self.clock(), self.store.load()
        n = self.rate * (now - self.last)
        self.last = now
        rest = n
        for arm in state.arms:
            k = round(n * arm.weight)
            rest -= k
            self._serve(arm.version, k)
        self._serve(state.primary, round(rest), compared=False)

    def _serve(self, v: int, k: int, compared: bool = True) -> None:
        bad = round(k * self.err.get(v, 0.0))
        self.served[v] = self.served.get(v, 0.0) + k - bad
        self.errors[v] = self.errors.get(v, 0.0) + bad
        if compared:
            self.compared[v] = self.compared.get(v, 0.0) + k - bad
        shape = _shape(self.ms.get(v, 2.0) / 1000)
        self.latency[v] = self.latency.get(v, np.zeros(len(LE))) + np.round((k - bad) * shape)

    def __call__(self, primary: int, arm: int) -> GuardReadings:
        if self.clock() > self.last:
            self._generate()
        vs = (primary, arm)
        return GuardReadings(
            model=MODEL, primary=primary, candidate=arm, breaker_state=0, replicas=1,
            served={v: self.served.get(v, 0.0) for v in vs}, errors={v: self.errors.get(v, 0.0) for v in vs},
            compared={"canary": {"PASS": self.compared.get(arm, 0.0)}},
            latency={v: dict(zip(LE, self.latency.get(v, np.zeros(len(LE))).tolist(), strict=True)) for v in vs})


def test_abn_good_arms_walk_every_step_and_stay_at_full_weight(env):
    _, clock, store = env
    hooks = Hooks()
    # weights whose full share reaches 25 %, so that latency is judged at the last steps too
    c = controller(env, ArmTraffic(store, clock), hooks, mode="abn", arms={2: 0.3, 3: 0.25})
    c.start()
    assert store.load().arms == [Arm(2, pytest.approx(0.003)), Arm(3, pytest.approx(0.0025))]
    p = c.run(max_ticks=5000)
    assert p.status == DONE and "route --arms none" in p.reason, p.reason
    assert [round(share, 2) for _, share, _ in hooks.steps] == [0.01, 0.05, 0.10, 0.25, 0.5, 1.0]
    state = store.load()
    assert state.arms == [Arm(2, pytest.approx(0.3)), Arm(3, pytest.approx(0.25))]
    assert state.primary == 1 and state.candidate is None and not hooks.promoted and not hooks.rolled_back
    assert {v: a["status"] for v, a in p.arms.items()} == {"2": RUNNING, "3": RUNNING}
    assert all(g["verdict"] == "PASS" for a in p.last_report["arms"].values() for g in a["gates"])


def test_abn_bad_arm_leaves_alone_and_the_others_go_on(env):
    _, clock, store = env
    hooks = Hooks()
    c = controller(env, ArmTraffic(store, clock, err={3: 0.2}), hooks, mode="abn", arms={2: 0.3, 3: 0.3})
    c.start()
    seen = []
    while c.status().status == RUNNING and len(seen) < 5000:
        p = c.tick()
        seen.append((p.step_index, [a.version for a in store.load().arms]))
        clock.sleep(30)
    p = c.status()
    assert p.status == DONE
    assert [v for v, _ in hooks.rolled_back] == [3] and "error_rate FAIL" in hooks.rolled_back[0][1]
    assert p.arms["3"]["status"] == ROLLED_BACK and p.arms["2"]["status"] == RUNNING
    # v3 left at the first step; v2 walked on alone
    gone = next(step for step, versions in seen if versions == [2])
    assert gone == 0 and store.load().arms == [Arm(2, pytest.approx(0.3))]


def test_abn_every_arm_failing_is_a_rollback(env):
    _, clock, store = env
    hooks = Hooks()
    c = controller(env, ArmTraffic(store, clock, err={2: 0.2, 3: 0.3}), hooks, mode="abn",
                   arms={2: 0.3, 3: 0.3})
    c.start()
    p = c.run(max_ticks=500)
    assert p.status == ROLLED_BACK and store.load().arms == []
    assert sorted(v for v, _ in hooks.rolled_back) == [2, 3]


def test_abn_abort_and_slow_arm(env):
    _, clock, store = env
    hooks = Hooks()
    # latency is judged once an arm's own share reaches 25 %: the slow arm's weight gets it there
    c = controller(env, ArmTraffic(store, clock, rate=4000, ms={3: 5.0}), hooks, mode="abn",
                   arms={2: 0.2, 3: 0.3})
    c.start()
    for _ in range(2000):  # latency is judged from the 25 % step on (a rarely called arm runs cold)
        p = c.tick()
        if p.arms["3"]["status"] != RUNNING or p.status != RUNNING:
            break
        clock.sleep(30)
    p = c.status()
    assert p.arms["3"]["status"] == ROLLED_BACK and "latency FAIL" in p.arms["3"]["reason"]
    assert p.steps[p.step_index] >= 25 and "latency SKIPPED" not in p.arms["3"]["reason"]
    p = controller(env, ArmTraffic(store, clock)).abort("experiment over")
    assert p.status == ABORTED and store.load().arms == [] and store.load().primary == 1
    assert [v for v, _ in hooks.rolled_back] == [3]  # the abort's hook ran in the other controller


def test_abn_start_is_validated(env):
    repo, clock, store = env
    with pytest.raises(ControllerError, match="rollout.arms"):
        controller(env, ArmTraffic(store, clock), mode="abn", arms={2: 0.3}).start(2)
    with pytest.raises(ControllerError, match="primary"):
        controller(env, ArmTraffic(store, clock), mode="abn", arms={1: 0.3}).start()
    store.update(lambda s: setattr(s, "candidate", Candidate(4, 0.1)) or s)
    with pytest.raises(ControllerError, match="candidate"):
        controller(env, ArmTraffic(store, clock), mode="abn", arms={2: 0.3}).start()
    assert store.load().arms == []


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "abn"}, "arms"),
    ({"mode": "abn", "arms": {2: 0.6, 3: 0.4}}, "summing below 1"),
    ({"mode": "abn", "arms": {2: 0.0}}, "in \\(0, 1\\)"),
    ({"mode": "split", "arms": {2: 0.3}}, "for mode 'abn'"),
])
def test_abn_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)
