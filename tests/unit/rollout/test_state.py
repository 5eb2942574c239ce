import fcntl
import json
import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from filelock import Timeout

from tritonguard.core.store import file_lock
from tritonguard.rollout.state import (
    Arm,
    Candidate,
    RolloutState,
    StateConflict,
    StateError,
    StateUnavailable,
)
from tritonguard.rollout.stores import FileStateStore, RedisStateStore, open_store


def sample_state(**over) -> RolloutState:
    kw = dict(model="digits", revision=3, primary=1, candidate=Candidate(2, 0.1), shadow_share=0.05,
              previous_primary=None, default_response={"PROBS": [0.1] * 10},
              goldens={"2": {"verdict": "PASS", "metrics": {"agreement": 1.0}, "checked_at": 1.0}},
              breakers={"2": {"state": "closed"}}, updated_at=5.0, updated_by="test")
    kw.update(over)
    return RolloutState(**kw)


# -- the document --------------------------------------------------------------------------
def test_round_trip():
    s = sample_state()
    d = s.to_dict()
    assert d["format_version"] == 1 and d["primary"] == {"version": 1}
    assert d["candidate"] == {"version": 2, "share": 0.1}
    assert RolloutState.from_json(json.dumps(d)) == s
    assert RolloutState.from_dict(RolloutState(model="m").to_dict()) == RolloutState(model="m")


def test_route_versions_follow_the_chain():
    s = sample_state(previous_primary=1)
    assert s.route_versions() == [2, 1]
    assert [step for step, _ in s.chain()] == ["candidate", "primary", "previous_primary", "default"]
    s = sample_state(candidate=None, previous_primary=4, default_response=None,
                     fallback=["primary", "previous_primary", "default"])
    assert s.route_versions() == [1, 4]
    assert s.chain() == [("primary", 1), ("previous_primary", 4)]


def test_batch_masks():
    s = sample_state()
    u = np.array([0.0, 0.05, 0.099, 0.1, 0.5, 0.99])
    assert s.candidate_mask(u).tolist() == [True, True, True, False, False, False]
    assert s.shadow_mask(u).tolist() == [True, False, False, False, False, False]
    assert not sample_state(candidate=None).shadow_mask(u).any()


def test_abn_arms_take_consecutive_bands_and_round_trip():
    s = sample_state(candidate=None, arms=[Arm(2, 0.3), Arm(3, 0.2)])
    u = np.array([0.0, 0.29, 0.3, 0.49, 0.5, 0.99])
    assert s.arm_choice(u).tolist() == [2, 2, 3, 3, 0, 0]
    assert RolloutState.from_json(s.to_json()) == s
    assert s.to_dict()["arms"] == [{"version": 2, "weight": 0.3}, {"version": 3, "weight": 0.2}]
    assert not sample_state().arm_choice(u).any()  # no arms: everyone stays home
    # large batches follow the weights
    got = s.arm_choice(np.random.default_rng(0).random(100_000))
    assert abs((got == 2).mean() - 0.3) < 0.01 and abs((got == 3).mean() - 0.2) < 0.01


@pytest.mark.parametrize("arms, message", [
    ({"version": 2, "weight": 0.1}, "expected a list"),
    ([{"version": 2}], "arms\\[0\\].weight': required"),
    ([{"version": 2, "weight": 0}], "must be > 0"),
    ([{"version": 2, "weight": 1.2}], "not in \\[0, 1\\]"),
    ([{"version": 1, "weight": 0.2}], "is the primary"),
    ([{"version": 2, "weight": 0.2}, {"version": 2, "weight": 0.1}], "listed twice"),
    ([{"version": 2, "weight": 0.6}, {"version": 3, "weight": 0.5}], "sum to 1.1 > 1"),
    ([{"version": 2, "weight": 0.2}, {"version": 3, "weight": 0.2, "share": 1}], "arms\\[1\\].share': unknown"),
])
def test_abn_arms_are_validated(arms, message):
    d = sample_state(candidate=None).to_dict()
    d["arms"] = arms
    with pytest.raises(StateError, match=message):
        RolloutState.from_dict(d)


def test_abn_arms_and_a_candidate_are_exclusive():
    d = sample_state().to_dict()
    d["arms"] = [{"version": 3, "weight": 0.2}]
    with pytest.raises(StateError, match="cannot run at once .*candidate v2"):
        RolloutState.from_dict(d)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d.update(revision="3"), "revision"),
    (lambda d: d.update(revision=True), "revision"),
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: d.pop("model"), "model"),
    (lambda d: d.update(primary={"version": 0}), "primary.version"),
    (lambda d: d.update(primary={"version": 1, "x": 1}), "primary.x"),
    (lambda d: d.update(candidate={"version": 2, "share": 1.5}), "candidate.share"),
    (lambda d: d.update(candidate={"version": 2}), "candidate.share"),
    (lambda d: d.update(shadow_share=float("nan")), "shadow_share"),
    (lambda d: d.update(fallback=["primary", "secondary"]), "fallback"),
    (lambda d: d.update(fallback=["candidate"]), "fallback"),
    (lambda d: d.update(default_response="nothing"), "default_response"),
    (lambda d: d.update(goldens={"2": {"verdict": "OK"}}), "goldens.2.verdict"),
    (lambda d: d.update(goldens={"v2": {"verdict": "PASS"}}), "goldens.v2"),
    (lambda d: d.update(breakers={"2": []}), "breakers.2"),
    (lambda d: d.update(updated_by=3), "updated_by"),
])
def test_strict_parsing_names_the_field(mutate, field):
    d = sample_state().to_dict()
    mutate(d)
    with pytest.raises(StateError, match=f"'{field}'"):
        RolloutState.from_dict(d)


def test_not_json():
    with pytest.raises(StateError, match="JSON"):
        RolloutState.from_json("{not json")


# -- file store ----------------------------------------------------------------------------
def set_share(share):
    def fn(s):
        s.candidate = Candidate(2, share)
    return fn


def test_file_store_update_and_load(tmp_path):
    store = open_store("digits", tmp_path, url="")
    assert isinstance(store, FileStateStore)
    assert store.path == tmp_path / "digits" / "rollout_state.json"
    assert store.load() is None and store.errors == 0
    s1 = store.update(set_share(0.1), by="cli")
    assert (s1.revision, s1.model, s1.updated_by) == (1, "digits", "cli")
    s2 = store.update(set_share(0.2), expected_revision=1)
    assert s2.revision == 2 and s2.candidate.share == 0.2
    with pytest.raises(StateConflict):
        store.update(set_share(0.3), expected_revision=1)
    assert FileStateStore(store.path).load() == s2
    assert not list(store.path.parent.glob("*.tmp"))


def test_invalid_update_is_not_written(tmp_path):
    store = FileStateStore(tmp_path / "m" / "rollout_state.json")
    store.update(set_share(0.1))
    with pytest.raises(StateError, match="candidate.share"):
        store.update(set_share(2.0))
    assert store.load().candidate.share == 0.1


def test_poll_hot_reload(tmp_path):
    path = tmp_path / "m" / "rollout_state.json"
    writer, reader = FileStateStore(path), FileStateStore(path)
    assert reader.poll(None) is None  # nothing written yet, no error
    writer.update(set_share(0.1))
    s = reader.poll(None)
    assert s.revision == 1
    assert reader.poll(1) is None  # unchanged: no re-read
    writer.update(set_share(0.5))
    s = reader.poll(1)
    assert s.revision == 2 and s.candidate.share == 0.5
    assert reader.errors == 0


def test_corrupt_or_missing_file_keeps_last_good(tmp_path, caplog):
    path = tmp_path / "m" / "rollout_state.json"
    store = FileStateStore(path)
    good = store.update(set_share(0.1))
    reader = FileStateStore(path)
    assert reader.load() == good
    path.write_text("{ truncated")
    with caplog.at_level("ERROR", logger="tritonguard.rollout.state"):
        assert reader.poll(None) == good
        assert reader.load() == good
        path.write_text('{"format_version": 1, "model": "m", "primary": {"version": 1}, "bogus": 1}')
        assert reader.poll(1) is None  # still the last good revision
    assert reader.errors == 3
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1  # logged once
    path.unlink()
    assert reader.load() == good and reader.errors == 4
    # a file that comes back good is picked up again
    FileStateStore(tmp_path / "x.json")  # unrelated store, no effect
    path.write_text(sample_state(model="m", revision=9).to_json())
    assert reader.poll(1).revision == 9


def test_corrupt_file_is_not_overwritten_by_update(tmp_path):
    path = tmp_path / "m" / "rollout_state.json"
    path.parent.mkdir()
    path.write_text("garbage")
    with pytest.raises(StateError):
        FileStateStore(path).update(set_share(0.1))
    assert path.read_text() == "garbage"


def test_update_breaker_keeps_routing(tmp_path):
    path = tmp_path / "m" / "rollout_state.json"
    a, b = FileStateStore(path), FileStateStore(path)
    a.update(set_share(0.1))
    b.load()
    a.update(set_share(0.4))  # b has not seen this one
    s = b.update_breaker(2, lambda d: {"state": "open", "n": (d or {}).get("n", 0) + 1})
    assert s.candidate.share == 0.4 and s.breakers["2"] == {"state": "open", "n": 1}
    s = b.update_breaker(2, lambda d: None)
    assert "2" not in s.breakers and s.revision == 4


def _bump(store_factory, m):
    store = store_factory()

    def inc(s):
        b = s.breakers.setdefault("1", {"n": 0})
        b["n"] += 1

    for _ in range(m):
        store.update(inc)


def _file_store(path):
    return FileStateStore(path)


def _redis_store(url, model):
    return RedisStateStore(url, model, socket_timeout=2.0)


def _run_procs(target, args, n):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=args) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)


def test_file_cas_under_multiprocessing(tmp_path):
    from functools import partial
    path = tmp_path / "m" / "rollout_state.json"
    n, m = 4, 25
    _run_procs(_bump, (partial(_file_store, path), m), n)
    s = FileStateStore(path).load()
    assert s.breakers["1"]["n"] == n * m and s.revision == n * m


# -- redis store ---------------------------------------------------------------------------
def test_redis_round_trip_and_poll(redis_server):
    model = f"m{uuid.uuid4().hex[:8]}"
    store = open_store(model, "/nonexistent", url=redis_server.url)
    assert isinstance(store, RedisStateStore)
    assert store.load() is None and store.poll(None) is None
    s1 = store.update(set_share(0.1), by="cli")
    reader = RedisStateStore(redis_server.url, model)
    assert reader.poll(None) == s1
    assert reader.poll(1) is None
    store.update(set_share(0.3))
    assert reader.poll(1).candidate.share == 0.3
    with pytest.raises(StateConflict):
        store.update(set_share(0.5), expected_revision=1)
    s = store.update_breaker("2", lambda d: {"state": "open"})
    assert s.breakers == {"2": {"state": "open"}} and s.candidate.share == 0.3


def test_redis_cas_under_multiprocessing(redis_server):
    from functools import partial
    model = f"m{uuid.uuid4().hex[:8]}"
    n, m = 4, 25
    _run_procs(_bump, (partial(_redis_store, redis_server.url, model), m), n)
    s = RedisStateStore(redis_server.url, model).load()
    assert s.breakers["1"]["n"] == n * m and s.revision == n * m


def test_redis_down_returns_last_known_quickly(redis_server):
    model = f"m{uuid.uuid4().hex[:8]}"
    clock = [0.0]
    store = RedisStateStore(redis_server.url, model, monotonic=lambda: clock[0])
    good = store.update(set_share(0.1))
    try:
        # hung server: the connection opens but replies never come
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        assert store.poll(None) == good
        assert time.perf_counter() - t0 < 0.3
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert store.errors == 1 and store._health.backoff == 5.0
        # backing off: no network at all, even though the server is back
        t0 = time.perf_counter()
        assert store.load() == good and store.poll(1) is None
        assert time.perf_counter() - t0 < 0.01
        with pytest.raises(StateUnavailable):
            store.update(set_share(0.2))
        # server gone: refused quickly, backoff doubles
        redis_server.stop()
        clock[0] = 5.0
        t0 = time.perf_counter()
        assert store.load() == good
        assert time.perf_counter() - t0 < 0.3
        assert store.errors == 2 and store._health.backoff == 10.0
        clock[0] = 1000.0
        for _ in range(5):
            store.load()
            clock[0] += 1000.0
        assert store._health.backoff == 60.0
    finally:
        # the session's shared server: leave it running for the tests after this one
        if redis_server.proc.poll() is None:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        redis_server.start()
    # reachable again: the store recovers (the new server is empty, so the last good one stays)
    clock[0] += 1000.0
    assert store.load() == good and store._health.backoff == 0.0
    assert store.update(set_share(0.2)).revision == 1


def test_open_store_reads_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONGUARD_STATE_URL", "redis://127.0.0.1:1/0")
    assert isinstance(open_store("m", tmp_path), RedisStateStore)
    monkeypatch.delenv("TRITONGUARD_STATE_URL")
    assert isinstance(open_store("m", Path(tmp_path)), FileStateStore)


def test_file_lock_is_an_flock_with_its_mode(tmp_path):
    """filelock-backed: excludes another holder (even in this process), interoperates with a plain
    ``fcntl.flock`` (processes still on the old code), keeps the file and its mode on release."""
    path = tmp_path / "x.lock"
    with file_lock(path, 0o600):
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        with pytest.raises(Timeout):
            file_lock(path).acquire(blocking=False)
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert path.exists()
    with file_lock(path):  # free again
        pass
