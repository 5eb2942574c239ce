import logging
import math
import multiprocessing
import os
import time
import uuid

import numpy as np
import pytest
from scipy import stats

from exporter.rollout.gates.latency import (
    _strata,
    hodges_lehmann,
    latency_gate,
    size_class,
    van_elteren,
)
from tests.conftest import REDIS_SERVER, RedisServer, _free_port
from tritonguard.rollout.latency import (
    MAGIC,
    CorruptBlob,
    FileLatencyLog,
    LatencyRecorder,
    LatencyUnavailable,
    RedisLatencyLog,
    Samples,
    decode,
    encode,
    open_latency_log,
    runtime_dir,
)

T0 = 1_700_000_000.0


# -- blobs -------------------------------------------------------------------------------------
def test_blob_round_trip_and_checks():
    s = Samples([T0, T0 + 1], [1, 8], [0.0003, 0.002])
    blob = encode(7, s)
    assert blob[:8] == MAGIC and len(blob) == 16 + 2 * 16 + 4
    back = decode(blob, 7)
    assert back.t.tolist() == [T0, T0 + 1] and back.rows.tolist() == [1, 8]
    assert back.seconds.tolist() == pytest.approx([0.0003, 0.002], rel=1e-6)  # float32
    assert len(decode(encode(3, Samples.empty()), 3)) == 0
    flipped = bytearray(blob)
    flipped[20] ^= 1
    for bad, message in [(blob[:-5], "truncated"), (blob[:10], "shorter"), (bytes(flipped), "checksum"),
                         (b"XXXXXXXX" + blob[8:], "magic")]:
        with pytest.raises(CorruptBlob, match=message):
            decode(bad, 7)
    with pytest.raises(CorruptBlob, match="written for version 7"):
        decode(blob, 8)


def test_samples_window_and_checks():
    s = Samples([T0 + 3, T0 + 1, T0 + 2], [1, 2, 3], [0.1, 0.2, 0.3])
    w = s.between(T0 + 1, T0 + 3)
    assert w.t.tolist() == [T0 + 1, T0 + 2] and w.rows.tolist() == [2, 3]
    assert len(s.between(T0 + 2)) == 2 and len(Samples.concat([s, s])) == 6
    with pytest.raises(ValueError, match="differ in length"):
        Samples([1.0], [1, 2], [0.1])


# -- the recorder and both sinks ----------------------------------------------------------------
class CountingLog(FileLatencyLog):
    """A real file log that also counts its writes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writes = []

    def write(self, version, writer, samples):
        self.writes.append((version, writer, len(samples)))
        super().write(version, writer, samples)


@pytest.fixture(params=["file", "redis"])
def sink_factory(request, tmp_path):
    """A factory of sinks onto one shared store: each call is another process's view of it."""
    if request.param == "file":
        return lambda: open_latency_log("digits_guard", tmp_path, url="")
    server = request.getfixturevalue("redis_server")
    guard = f"g{uuid.uuid4().hex[:8]}"
    return lambda: open_latency_log(guard, "/nonexistent", url=server.url)


def test_two_writers_are_gathered_and_windowed(sink_factory):
    a = LatencyRecorder(sink_factory(), writer_id="hostA:101")
    b = LatencyRecorder(sink_factory(), writer_id="hostB:202")
    for i in range(10):
        a.record(1, 8, 0.001 + i * 1e-5, T0 + i)
        b.record(1, 7, 0.002 + i * 1e-5, T0 + i + 0.5)
        b.record(2, 1, 0.003, T0 + i + 0.25)
    assert a.flush() and b.flush() and a.flush_errors == b.flush_errors == 0
    reader = sink_factory()
    v1 = reader.read(1)
    assert len(v1) == 20 and np.all(np.diff(v1.t) > 0)  # both writers, in time order
    assert sorted(set(v1.rows.tolist())) == [7, 8]
    assert v1.seconds[v1.rows == 8].tolist() == pytest.approx([0.001 + i * 1e-5 for i in range(10)], rel=1e-6)
    assert len(reader.read(2)) == 10 and len(reader.read(3)) == 0
    w = reader.read(1, since=T0 + 2, until=T0 + 4)  # since <= t < until
    assert w.t.tolist() == [T0 + 2, T0 + 2.5, T0 + 3, T0 + 3.5]
    # a writer's next flush replaces its blob, it does not add to it
    a.record(1, 8, 0.5, T0 + 100)
    assert a.flush()
    v1 = reader.read(1)
    assert len(v1) == 21 and v1.seconds[-1] == pytest.approx(0.5)


def test_capacity_bounds_memory_and_store(sink_factory):
    rec = LatencyRecorder(sink_factory(), capacity=8, writer_id="h:1")
    for i in range(20):
        rec.record(4, 2, i / 1000, T0 + i)
    assert rec.flush()
    got = sink_factory().read(4)
    assert got.t.tolist() == [T0 + i for i in range(12, 20)]  # the latest 8, oldest first
    assert got.seconds.tolist() == pytest.approx([i / 1000 for i in range(12, 20)])
    sink = rec.sink
    if isinstance(sink, FileLatencyLog):
        size = sink.path(4, "h:1").stat().st_size
    else:
        size = sink.client.strlen(sink.key(4, "h:1"))
    assert size == 16 + 8 * 16 + 4


def test_only_changed_versions_are_flushed(tmp_path):
    sink = CountingLog(tmp_path / "g" / ".latency")
    rec = LatencyRecorder(sink, writer_id="h:1")
    rec.record(1, 4, 0.01, T0)
    rec.record(2, 1, 0.01, T0)
    assert rec.flush() and sorted(v for v, _, _ in sink.writes) == [1, 2]
    sink.writes.clear()
    assert rec.flush() and sink.writes == []  # nothing new: no I/O at all
    rec.record(2, 1, 0.02, T0 + 1)
    assert rec.flush() and sink.writes == [(2, "h:1", 2)]


def test_record_never_raises_and_counts_what_it_drops(tmp_path):
    rec = LatencyRecorder(open_latency_log("g", tmp_path, url=""), writer_id="h:1", max_versions=2)
    rec.record(1, 3, float("nan"), T0)
    rec.record(1, 0, 0.1, T0)
    rec.record(1, 3, -1.0, T0)
    rec.record(1, None, 0.1, T0)
    rec.record(1, 2**40, 0.1, T0)  # overflows the int32 rows column
    assert rec.dropped == 5
    rec.record(1, 3, 0.1, T0)
    rec.record(2, 3, 0.1, T0 + 1)
    rec.record(3, 3, 0.1, T0 + 2)  # a third version evicts the one idle longest (v1)
    assert sorted(rec._rings) == [2, 3] and rec.flush()
    assert len(rec.sink.read(1)) == 0 and len(rec.sink.read(3)) == 1


def test_file_layout_and_stale_writers_removed(tmp_path):
    rec = LatencyRecorder(open_latency_log("digits_guard", tmp_path, url=""), writer_id="node-1:42")
    rec.record(2, 1, 0.001, T0)
    assert rec.flush()
    root = runtime_dir(tmp_path) / "digits_guard" / "latency"
    blob = root / "v2" / "node-1_42.lat"
    assert blob.is_file() and not list(blob.parent.glob("*.tmp"))
    leftover = blob.parent / ".node-9_1.abc.tmp"  # a writer that died mid-write
    leftover.write_bytes(b"partial")
    fresh = FileLatencyLog(root)
    assert len(fresh.read(2)) == 1 and leftover.exists() and fresh.corrupt == 0
    later = FileLatencyLog(fresh.root, ttl_s=60, clock=lambda: time.time() + 61)
    assert len(later.read(2)) == 0
    assert not blob.exists() and not leftover.exists()


def test_corrupt_blob_is_skipped_and_counted(sink_factory, caplog):
    rec = LatencyRecorder(sink_factory(), writer_id="good:1")
    rec.record(5, 1, 0.004, T0)
    assert rec.flush()
    reader = sink_factory()
    good = encode(5, Samples([T0 + 1, T0 + 2], [1, 1], [0.1, 0.1]))
    if isinstance(reader, FileLatencyLog):
        (reader.root / "v5" / "bad_1.lat").write_bytes(good[:-9])
        (reader.root / "v5" / "bad_2.lat").write_bytes(b"\x00" * 64)
    else:
        for writer, blob in (("bad:1", good[:-9]), ("bad:2", b"\x00" * 64)):
            reader.client.set(reader.key(5, writer), blob)
            reader.client.sadd(reader.index(5), reader.key(5, writer))
    with caplog.at_level(logging.WARNING, logger="tritonguard.rollout.latency"):
        got = reader.read(5)
        assert got.t.tolist() == [T0] and reader.corrupt == 2
        reader.read(5)
    assert reader.corrupt == 4
    assert len([r for r in caplog.records if "skipped" in r.message]) == 2  # once per blob


def test_redis_layout_expiry_and_index(redis_server):
    guard = f"g{uuid.uuid4().hex[:8]}"
    sink = RedisLatencyLog(redis_server.url, guard, ttl_s=3600)
    for writer in ("hostA:1", "hostB:2"):
        rec = LatencyRecorder(sink, writer_id=writer)
        rec.record(3, 1, 0.001, T0)
        assert rec.flush()
    key = f"tritonguard:latency:{guard}:3:hostA:1"
    assert sink.client.exists(key) and 3590 < sink.client.ttl(key) <= 3600
    index = f"tritonguard:latency:{guard}:3"
    assert sink.client.smembers(index) == {key.encode(), key.replace("hostA:1", "hostB:2").encode()}
    assert 3590 < sink.client.ttl(index) <= 3600
    sink.client.delete(key)  # as if hostA:1's blob expired
    assert len(sink.read(3)) == 1
    assert sink.client.smembers(index) == {key.replace("hostA:1", "hostB:2").encode()}  # pruned


def _write_from_a_process(root: str, n: int) -> None:
    rec = LatencyRecorder(FileLatencyLog(root))  # default writer id: this host and pid
    for i in range(n):
        rec.record(1, 1, 0.001, T0 + i)
    os._exit(0 if rec.flush() else 1)


def test_processes_publish_separately_by_default(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_from_a_process, args=(str(tmp_path), 5 + k)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(list((tmp_path / "v1").glob("*.lat"))) == 2
    assert len(FileLatencyLog(tmp_path).read(1)) == 11


def test_background_flush_thread(tmp_path):
    rec = LatencyRecorder(open_latency_log("g", tmp_path, url=""), writer_id="h:1")
    rec.start(interval_s=0.02)
    try:
        rec.record(1, 2, 0.003, T0)
        deadline = time.monotonic() + 5
        while not len(rec.sink.read(1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(rec.sink.read(1)) == 1
    finally:
        rec.close()
    rec.record(1, 2, 0.003, T0 + 1)  # after close: still recorded, published by the next flush
    assert len(rec.sink.read(1)) == 1 and rec.flush() and len(rec.sink.read(1)) == 2


@pytest.mark.skipif(not REDIS_SERVER, reason="redis-server is not installed (apt-get install redis-server)")
def test_redis_down_flush_false_read_raises_then_recovers(tmp_path):
    nobody = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    rec = LatencyRecorder(open_latency_log("g", tmp_path, url=nobody), writer_id="h:1")
    rec.record(1, 1, 0.001, T0)
    t0 = time.perf_counter()
    assert rec.flush() is False and rec.flush() is False
    assert rec.flush_errors == 2 and time.perf_counter() - t0 < 2
    with pytest.raises(LatencyUnavailable, match="ConnectionError"):
        rec.sink.read(1)
    # our own server, stopped and started by its PID: samples kept through the outage get out
    server = RedisServer(tmp_path)
    server.start()
    try:
        rec = LatencyRecorder(RedisLatencyLog(server.url, "g"), writer_id="h:1")
        rec.record(1, 1, 0.001, T0)
        server.stop()
        rec.record(1, 1, 0.002, T0 + 1)
        assert rec.flush() is False and rec.flush_errors == 1
        with pytest.raises(LatencyUnavailable):
            rec.sink.read(1)
        server.start()
        assert rec.flush() is True
        assert rec.sink.read(1).t.tolist() == [T0, T0 + 1]
    finally:
        server.stop()


def test_open_latency_log_chooses_like_the_state_store(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONGUARD_STATE_URL", "redis://127.0.0.1:1/0")
    log_ = open_latency_log("m", tmp_path)
    assert isinstance(log_, RedisLatencyLog) and log_.prefix == "tritonguard:latency:m:"
    monkeypatch.delenv("TRITONGUARD_STATE_URL")
    log_ = open_latency_log("m", tmp_path)
    assert isinstance(log_, FileLatencyLog) and log_.root == runtime_dir(tmp_path) / "m" / "latency"
    assert not (tmp_path / "m").exists()  # nothing in the repository


def test_latency_files_stay_out_of_the_repository(monkeypatch, tmp_path):
    home = tmp_path / "home"
    monkeypatch.setenv("TRITONGUARD_HOME", str(home))
    repo = tmp_path / "repo"
    (repo / "g").mkdir(parents=True)
    rec = LatencyRecorder(open_latency_log("g", repo, url=""), writer_id="h:1")
    rec.record(1, 1, 0.002, T0)
    assert rec.flush()
    assert [p.name for p in (repo / "g").iterdir()] == []
    written = list(home.rglob("*.lat"))
    assert len(written) == 1 and written[0].is_relative_to(home / "run")
    # the controller, naming the same repository another way (a symlink), reads the same samples
    (tmp_path / "link").symlink_to(repo)
    assert len(open_latency_log("g", tmp_path / "link", url="").read(1)) == 1


# -- the gate --------------------------------------------------------------------------------
SIGMA = 0.3


def traffic(seed: int, batches: int, *, base: float, slow: float = 1.0, share: float = 0.01,
            quiet: float = 0.2) -> tuple[Samples, Samples]:
    """Fused calls of a split: a guard batch of B rows sends Binomial(B, share) rows to the
    candidate and the rest to the primary, one call each. Busy batches hold ~8 rows; a ``quiet``
    share hold one. Latency = base * (1 + 0.1 * rows) * lognormal(0, SIGMA), times ``slow`` for
    the candidate. Batch i ends at T0 + i."""
    rng = np.random.default_rng(seed)
    b = 1 + rng.poisson(np.where(rng.random(batches) < quiet, 0, 7))
    k = rng.binomial(b, share)
    m = b - k
    t = T0 + np.arange(batches, dtype=np.float64)

    def calls(rows, mask, factor):
        r = rows[mask]
        return Samples(t[mask], r, base * factor * (1 + 0.1 * r) * np.exp(rng.normal(0, SIGMA, len(r))))

    return calls(k, k > 0, slow), calls(m, m > 0, 1.0)


def looks(cand: Samples, prim: Samples, batches_per_look: int, n_looks: int):
    """The gate at each look of a growing window."""
    for k in range(1, n_looks + 1):
        until = T0 + k * batches_per_look
        yield latency_gate(cand.between(T0, until), prim.between(T0, until), k)


@pytest.mark.parametrize("base", [0.3e-3, 30e-3])
def test_a_13x_slower_candidate_fails_within_a_few_hundred_calls(base):
    cand, prim = traffic(1, 20 * 500, base=base, slow=1.3)
    for gate in looks(cand, prim, 500, 20):  # ~33 candidate calls a look
        if gate.verdict == "FAIL":
            break
        assert gate.verdict == "INCONCLUSIVE"  # it may wait for samples, never PASS a 1.3x
    assert gate.verdict == "FAIL" and gate.name == "latency"
    assert gate.figures["comparable_candidate"] <= 300
    assert 1.2 < gate.figures["ratio"] < 1.4 and gate.figures["p"] < gate.figures["alpha_k"]
    assert gate.figures["strata"][0]["rows"] == "1"
    assert gate.figures["candidate_p50_s"] < gate.figures["primary_p50_s"]  # pooled, it looks faster
    # which is what an unstratified comparison would judge on
    ones = latency_gate(Samples(cand.t, np.ones(len(cand)), cand.seconds),
                        Samples(prim.t, np.ones(len(prim)), prim.seconds), 1)
    assert ones.verdict == "PASS" and ones.figures["ratio"] < 1


def test_b_same_speed_at_smaller_sub_batches_passes_under_repeated_looks():
    """200 seeded rollouts, 10 looks each. Under H0 the alpha spending alone bounds the chance of
    any FAIL over all looks by alpha = 0.05; FAIL also needs a ratio > 1.15, which at >= 100
    calls a side is > 4 standard errors of the Hodges-Lehmann estimate (0.3 * sqrt(pi / 3) *
    sqrt(1/100 + 1/n2) ~ 0.032 in log), P < 1e-5 a look: the expected count in 2000 looks is
    below 0.02, so any FAIL here is a bug."""
    fails, passed, ratios = 0, 0, []
    for seed in range(200):
        cand, prim = traffic(1000 + seed, 10 * 1000, base=0.3e-3)
        assert np.median(cand.rows) == 1 and np.median(prim.rows) >= 7
        verdicts = [g.verdict for g in looks(cand, prim, 1000, 10)]
        fails += verdicts.count("FAIL")
        passed += verdicts[-1] == "PASS"
        ratios.append(latency_gate(cand, prim, 10).figures["ratio"])
    assert fails == 0
    assert passed == 200  # by the 10th look every rollout has enough comparable calls
    assert abs(np.median(ratios) - 1) < 0.02


def test_c_too_few_comparable_calls_is_inconclusive():
    cand, prim = traffic(2, 800, base=0.3e-3, slow=2.0)
    gate = latency_gate(cand, prim, 1)
    assert len(cand) < 100 and gate.verdict == "INCONCLUSIVE" and "need >= 100" in gate.reason
    # plenty of calls, but none of a size the other side served: nothing comparable
    rng = np.random.default_rng(0)
    ones = Samples(np.zeros(500), np.ones(500), np.exp(rng.normal(0, SIGMA, 500)) * 2)
    eights = Samples(np.zeros(5000), np.full(5000, 8), np.exp(rng.normal(0, SIGMA, 5000)))
    gate = latency_gate(ones, eights, 1)
    assert gate.verdict == "INCONCLUSIVE" and gate.samples == 0
    assert "candidate 1-1 rows, primary 8-8" in gate.reason
    assert latency_gate(Samples.empty(), Samples.empty(), 1).verdict == "INCONCLUSIVE"


@pytest.mark.parametrize("base", [0.3e-3, 30e-3])
def test_d_a_2x_slower_candidate_fails(base):
    cand, prim = traffic(3, 4000, base=base, slow=2.0)
    gate = latency_gate(cand, prim, 5)
    assert gate.verdict == "FAIL" and 1.8 < gate.figures["ratio"] < 2.2
    assert "2" in gate.reason and gate.figures["candidate_p99_s"] > 0


def test_direction_both_also_fails_a_faster_candidate():
    cand, prim = traffic(4, 4000, base=30e-3, slow=0.6)
    assert latency_gate(cand, prim, 1).verdict == "PASS"
    gate = latency_gate(cand, prim, 1, direction="both")
    assert gate.verdict == "FAIL" and gate.figures["ratio"] < 0.7
    with pytest.raises(ValueError, match="direction"):
        latency_gate(cand, prim, 1, direction="decrease")


def test_within_tolerance_passes_even_when_significant():
    cand, prim = traffic(5, 40_000, base=30e-3, slow=1.08, share=0.05)
    gate = latency_gate(cand, prim, 1)
    assert gate.figures["p_slower"] < 1e-6 and gate.figures["p"] > 0.5 and 1.03 < gate.figures["ratio"] < 1.13 and gate.verdict == "PASS"


def generations(seed: int, n: int, slow: float = 1.0) -> tuple[Samples, Samples]:
    """Whole generations of 8-23 tokens (the size class), n a side: time grows with tokens."""
    rng = np.random.default_rng(seed)

    def calls(factor: float) -> Samples:
        tokens = rng.integers(8, 24, n)
        return Samples(np.zeros(n), tokens, 2e-3 * factor * tokens * np.exp(rng.normal(0, SIGMA, n)))

    return calls(slow), calls(1.0)


def test_pass_needs_evidence_that_the_candidate_is_within_the_tolerance():
    """PASS is a claim as well: the candidate's upper confidence bound (at beta) is below
    1 + tolerance. A window too small to tell is INCONCLUSIVE (the controller holds); it used to
    PASS whenever the slowdown was not yet significant, and a 1.27x slower generation build was
    promoted through a 50 % step on ~30 calls a side at tolerance 0.05."""
    # equal speed: 30 calls a side cannot show "below 1.05x"; 3000 can
    small = latency_gate(*generations(1, 30), 1, tolerance=0.05, min_samples=20)
    assert small.verdict == "INCONCLUSIVE" and "not yet shown below 1.05x" in small.reason
    assert small.figures["p_within"] >= 0.10
    big = latency_gate(*generations(1, 3000), 1, tolerance=0.05, min_samples=20)
    assert big.verdict == "PASS" and big.figures["p_within"] < 0.10 and 0.97 < big.figures["ratio"] < 1.03
    # 1.2x slower, 30 calls a side, judged at looks 1 to 10 of the step: never PASS
    verdicts = {"PASS": 0, "FAIL": 0, "INCONCLUSIVE": 0}
    for seed in range(100):
        cand, prim = generations(100 + seed, 30, slow=1.2)
        for look in (1, 3, 10):
            verdicts[latency_gate(cand, prim, look, tolerance=0.05, min_samples=20).verdict] += 1
    assert verdicts["PASS"] == 0, verdicts
    # the windows the old rule passed: not significant at the spent alpha, now held instead
    assert verdicts["INCONCLUSIVE"] > 30 and verdicts["FAIL"] > 30, verdicts


def test_a_build_within_the_tolerance_is_not_failed_by_noise_over_repeated_looks():
    """FAIL is the shifted test (the candidate's latencies over 1 + tolerance still slower at
    alpha_k), not "point estimate over 1 + tolerance AND slower than 1x": with the old rule a
    1.08x build at tolerance 0.15, looked at every 40 calls up to 400, was failed in 43 of 200
    simulated rollouts (a re-export under live generation traffic failed so on CI, ratio 1.26 on
    39 calls a side). A 1.3x one must still fail."""
    def rollout(seed: int, slow: float) -> bool:
        cand, prim = generations(seed, 400, slow=slow)
        for k in range(1, 11):
            n = 40 * k
            window = [Samples(s.t[:n], s.rows[:n], s.seconds[:n]) for s in (cand, prim)]
            if latency_gate(*window, k, tolerance=0.15, min_samples=30).verdict == "FAIL":
                return True
        return False

    assert sum(rollout(seed, 1.08) for seed in range(60)) == 0
    assert sum(rollout(seed, 1.0) for seed in range(60)) == 0
    assert sum(rollout(1000 + seed, 1.3) for seed in range(30)) >= 28


def test_direction_both_passes_only_within_both_bounds():
    cand, prim = generations(7, 3000)
    assert latency_gate(cand, prim, 1, direction="both").verdict == "PASS"
    cand, prim = generations(8, 25, slow=0.85)  # faster, too few calls to FAIL or to bound it
    gate = latency_gate(cand, prim, 1, direction="both", min_samples=20)
    assert gate.verdict == "INCONCLUSIVE" and "between 0.87x and 1.15x" in gate.reason


def compute_bound(seed: int, share: float, slow: float = 1.0) -> tuple[Samples, Samples]:
    """A model whose time is proportional to rows, guard batches of ~16 rows."""
    rng = np.random.default_rng(seed)
    b = 1 + rng.poisson(15, 3000)
    k = rng.binomial(b, share)
    m = b - k
    cr, pr = k[k > 0], m[m > 0]
    return (Samples(np.zeros(len(cr)), cr, 1e-3 * slow * cr * np.exp(rng.normal(0, SIGMA, len(cr)))),
            Samples(np.zeros(len(pr)), pr, 1e-3 * pr * np.exp(rng.normal(0, SIGMA, len(pr)))))


def test_size_classes_are_narrow_enough_for_a_compute_bound_model():
    assert size_class(np.array([1, 2, 3, 4, 5, 8, 31, 32, 33, 34, 63, 64, 67, 68])).tolist() == \
        [1, 2, 3, 4, 5, 8, 31, 32, 32, 34, 62, 64, 64, 68]
    assert size_class(np.array([1, 2, 3, 4, 5, 7, 8]), bits=1).tolist() == [1, 2, 2, 4, 4, 4, 8]
    # at a 75 % step the candidate holds the bigger calls of each class: log2 classes read that
    # as a slowdown, and at 25 % they hide a real one; classes of <= 1/16 do neither
    cand, prim = compute_bound(0, 0.75)
    assert latency_gate(cand, prim, 1, stratum_bits=1).verdict == "FAIL"
    assert latency_gate(cand, prim, 1).verdict == "PASS"
    cand, prim = compute_bound(0, 0.25, slow=1.3)
    assert latency_gate(cand, prim, 1, stratum_bits=1).verdict == "PASS"
    assert latency_gate(cand, prim, 1).verdict == "FAIL"


def test_statistics_match_their_definitions():
    rng = np.random.default_rng(7)
    x = np.exp(rng.normal(0.1, SIGMA, 60))
    y = np.exp(rng.normal(0.0, SIGMA, 90))
    one = _strata(Samples(np.zeros(60), np.ones(60), x), Samples(np.zeros(90), np.ones(90), y),
                  5, 20_000, rng)
    z = van_elteren(one)  # one class: plain Mann-Whitney U
    mw = stats.mannwhitneyu(np.log(x.astype(np.float32).astype(np.float64)),
                            np.log(y.astype(np.float32).astype(np.float64)),
                            alternative="greater", method="asymptotic", use_continuity=False)
    assert stats.norm.sf(z) == pytest.approx(mw.pvalue, rel=1e-9)
    # two classes: the pooled Hodges-Lehmann is the median of the within-class differences only
    x2, y2 = rng.normal(5, 1, 30), rng.normal(4, 1, 40)
    two = _strata(Samples(np.zeros(90), np.r_[np.ones(60), np.full(30, 8)], np.exp(np.r_[np.log(x), x2])),
                  Samples(np.zeros(130), np.r_[np.ones(90), np.full(40, 8)], np.exp(np.r_[np.log(y), y2])),
                  5, 20_000, rng)
    diffs = np.concatenate([np.subtract.outer(s.x, s.y).ravel() for s in two])
    assert len(diffs) == 60 * 90 + 30 * 40
    assert hodges_lehmann(two) == pytest.approx(np.sort(diffs)[math.ceil(len(diffs) / 2) - 1], abs=1e-8)


def test_large_windows_are_subsampled_and_fast():
    rng = np.random.default_rng(8)
    n = 100_000
    cand = Samples(np.zeros(n), rng.integers(1, 9, n), 1e-3 * np.exp(rng.normal(np.log(1.3), SIGMA, n)))
    prim = Samples(np.zeros(n), rng.integers(1, 9, n), 1e-3 * np.exp(rng.normal(0, SIGMA, n)))
    t0 = time.perf_counter()
    gate = latency_gate(cand, prim, 1, max_per_stratum=5_000)
    assert time.perf_counter() - t0 < 5
    assert gate.verdict == "FAIL" and gate.figures["comparable_candidate"] == n
    assert 1.25 < gate.figures["ratio"] < 1.35 and len(gate.figures["strata"]) == 8


def test_fail_needs_p_below_the_alpha_spent_at_this_look():
    rng = np.random.default_rng(9)
    cand = Samples(np.zeros(20), np.ones(20), np.exp(rng.normal(np.log(1.5), SIGMA, 20)))
    prim = Samples(np.zeros(20), np.ones(20), np.exp(rng.normal(0, SIGMA, 20)))
    first = latency_gate(cand, prim, 1, min_samples=20)
    p = first.figures["p"]
    assert first.verdict == "FAIL" and first.figures["alpha_k"] == pytest.approx(0.05 * 6 / math.pi**2)
    late = math.ceil(math.sqrt(0.05 * 6 / (math.pi**2 * p))) + 1  # the first look with alpha_k < p
    gate = latency_gate(cand, prim, late, min_samples=20)
    # too late a look to FAIL on this p, and a 1.5x candidate is not shown within 1.15x: it holds
    assert gate.verdict == "INCONCLUSIVE" and gate.figures["p"] == p and gate.figures["alpha_k"] < p
    assert "not yet shown below 1.15x" in gate.reason and gate.figures["p_within"] > 0.10
    assert latency_gate(cand, prim, late - 2, min_samples=20).verdict == "FAIL"
