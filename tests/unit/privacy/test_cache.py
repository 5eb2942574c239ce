import base64
import logging
import multiprocessing
import os
import signal
import sqlite3
import time
import uuid

import numpy as np
import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.privacy.cache.codec import decode_value, encode_value
from tritonguard.privacy.cache.config import CacheConfig, PrivacyMode, load_key
from tritonguard.privacy.cache.keys import cache_key, key_model, row_keys, split_rows
from tritonguard.privacy.cache.tiered import TieredCache
from tritonguard.privacy.cache.tiers import KEEP_QUARANTINED

KEY_HEX = "8f" * 32
ENV = {"TRITONGUARD_L2_ENCRYPTION_KEY": KEY_HEX}
MARKER = b"PLAINTEXT-MARKER-7f3a9c"


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def make(clock=None, environ=ENV, **params):
    params = {"enabled": "true", **{k: str(v) for k, v in params.items()}}
    cfg = from_params(CacheConfig, params, section="cache")
    return TieredCache(cfg, environ=environ, clock=clock or time.time)


def persisted(tmp_path, clock=None, **params):
    return make(clock, **{"privacy": "persisted_encrypted", "l2_path": tmp_path / "cache.db", **params})


def key(i, tenant="t1", model="m"):
    return cache_key(tenant, model, "sha1", {"X": np.array([[float(i)]], np.float32)}, ["Y"], {})


def val(i):
    return {"Y": np.array([[i, i + 1]], np.float32), "LABEL": np.array([[MARKER + str(i).encode()]], dtype=object)}


def same(a, b):
    return a is not None and a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# -- keys and values -----------------------------------------------------------------------
def test_key_is_unambiguous_and_canonical():
    k = lambda inputs, outputs=("Y",), params=None, tenant="t": cache_key(  # noqa: E731
        tenant, "m", "sha", inputs, list(outputs), params or {})
    b = lambda *xs: np.array(xs, dtype=object)  # noqa: E731
    assert k({"T": b(b"ab", b"c")}) != k({"T": b(b"a", b"bc")})
    assert k({"T": b("ab")}) == k({"T": b(b"ab")})
    assert k({"X": np.zeros(4, np.float32)}) != k({"X": np.zeros(4, np.int32)})
    assert k({"X": np.zeros((2, 2), np.float32)}) != k({"X": np.zeros(4, np.float32)})
    assert k({"A": np.zeros(1), "B": np.ones(1)}) == k({"B": np.ones(1), "A": np.zeros(1)})
    assert k({"A": np.zeros(1), "B": np.ones(1)}) != k({"A": np.ones(1), "B": np.zeros(1)})
    assert k({"X": np.zeros(1)}, ("Y", "Z")) == k({"X": np.zeros(1)}, ("Z", "Y"))
    assert k({"X": np.zeros(1)}, params={"a": 1, "b": 2}) == k({"X": np.zeros(1)}, params={"b": 2, "a": 1})
    assert k({"X": np.zeros(1)}, params={"a": 1}) != k({"X": np.zeros(1)}, params={"a": 2})
    assert k({"X": np.zeros(1)}, tenant="a") != k({"X": np.zeros(1)}, tenant="b")
    be = np.arange(3, dtype=">i4")
    assert k({"X": be}) == k({"X": be.astype("<i4")})
    assert key_model(key(1, model="digits")) == "digits"


def test_row_keys_match_single_row_requests():
    fused = {"X": np.arange(12, dtype=np.float32).reshape(4, 3),
             "T": np.array([[b"a"], [b"bb"], [b""], [b"a"]], dtype=object)}
    keys = row_keys("t", "m", "sha", fused, ["Y"], {"p": 1})
    assert len(keys) == 4 and len(set(keys)) == 4
    for i in range(4):
        assert keys[i] == cache_key("t", "m", "sha", {n: a[i:i + 1] for n, a in fused.items()}, ["Y"], {"p": 1})
    assert row_keys("t", "m", "sha", {}, ["Y"], {}) == []


def test_value_round_trip_without_pickle():
    value = {"F": np.random.rand(2, 3).astype(np.float16), "B": np.array([True, False]),
             "S": np.array([[b"x"], ["caf\u00e9"]], dtype=object), "Z": np.array(7, np.int64),
             "E": np.zeros((0, 4), np.float32)}
    out = decode_value(encode_value(value))
    assert out["S"].tolist() == [[b"x"], ["caf\u00e9".encode()]]
    value["S"] = out["S"]
    assert same(out, value) and all(a.dtype == value[n].dtype for n, a in out.items())
    assert not out["F"].flags.writeable
    with pytest.raises(TypeError):
        encode_value({"D": np.array(["2024-01-01"], dtype="datetime64[s]")})
    for bad in (b"", b"TGV1\x01\x00\x05", encode_value(value)[:-3]):
        with pytest.raises(ValueError):
            decode_value(bad)


# -- L1 ----------------------------------------------------------------------------------------
def test_l1_lru_and_ttl():
    clock = Clock()
    c = make(clock, l1_entries=2, l1_ttl_s=10)
    c.put_many([(key(1), val(1)), (key(2), val(2))])
    assert same(c.get_many([key(1)])[0], val(1))  # 1 is now most recent
    c.put_many([(key(3), val(3))])  # evicts 2
    assert [v is not None for v in c.get_many([key(1), key(2), key(3)])] == [True, False, True]
    clock.t += 11
    assert c.get_many([key(1), key(3)]) == [None, None]
    assert c.stats["l1_hits"] == 3 and c.stats["l1_misses"] == 3


def test_l1_values_are_isolated_from_caller_buffers():
    c = make()
    out = np.array([[1.0, 2.0]], np.float32)
    c.put_many([(key(1), {"Y": out})])
    out[:] = 0
    hit = c.get_many([key(1)])[0]["Y"]
    assert hit.tolist() == [[1.0, 2.0]] and not hit.flags.writeable


def test_privacy_modes(tmp_path, caplog):
    assert not make(privacy="hashes_only").enabled
    assert not make(enabled="false").enabled
    with caplog.at_level(logging.WARNING, logger="tritonguard.privacy.cache"):
        c = make(privacy="ephemeral", l2_path=tmp_path / "x.db")
    assert c.enabled and "ephemeral" in caplog.text and not (tmp_path / "x.db").exists()
    assert CacheConfig().mode is PrivacyMode.EPHEMERAL
    with pytest.raises(ConfigError, match="privacy"):
        make(privacy="plaintext")


# -- keys material -----------------------------------------------------------------------------
def test_encryption_key_required_and_checked(tmp_path):
    with pytest.raises(ConfigError, match="TRITONGUARD_L2_ENCRYPTION_KEY"):
        persisted(tmp_path, environ={})
    with pytest.raises(ConfigError, match="32-byte"):
        persisted(tmp_path, environ={"TRITONGUARD_L2_ENCRYPTION_KEY": "ab" * 16})
    with pytest.raises(ConfigError, match="32-byte"):
        persisted(tmp_path, environ={"TRITONGUARD_L2_ENCRYPTION_KEY": "x" * 32})
    raw = os.urandom(32)
    cfg = CacheConfig(privacy="persisted_encrypted", key_env="K")
    assert load_key(cfg, {"K": base64.b64encode(raw).decode()}) == raw
    assert load_key(cfg, {"K": raw.hex().upper() + "\n"}) == raw
    (tmp_path / "k.bin").write_bytes(raw)
    (tmp_path / "k.txt").write_text(raw.hex() + "\n")
    for f in ("k.bin", "k.txt"):
        assert load_key(CacheConfig(key_file=str(tmp_path / f)), {}) == raw


# -- L2 ----------------------------------------------------------------------------------------
def test_l2_round_trip_promotes_to_l1(tmp_path):
    persisted(tmp_path).put_many([(key(i), val(i)) for i in range(5)])
    c = persisted(tmp_path)  # a fresh process-local L1: hits must come from L2
    got = c.get_many([key(i) for i in range(6)])
    assert all(same(got[i], val(i)) for i in range(5)) and got[5] is None
    assert c.stats["l2_hits"] == 5 and c.stats["l2_misses"] == 1
    c.get_many([key(0)])
    assert c.stats["l1_hits"] == 1


def test_l2_ttl(tmp_path):
    clock = Clock()
    persisted(tmp_path, clock, l2_ttl_s=60).put_many([(key(1), val(1))])
    c = persisted(tmp_path, clock, l1_entries=0)
    assert c.get_many([key(1)])[0] is not None
    clock.t += 61
    assert c.get_many([key(1)]) == [None]


def test_l2_row_cap(tmp_path):
    clock = Clock()
    c = persisted(tmp_path, clock, l2_max_rows=100, l1_entries=0)
    for b in range(30):
        clock.t += 1
        c.put_many([(key(b * 10 + i), val(i)) for i in range(10)])
        rows = sqlite3.connect(tmp_path / "cache.db").execute("SELECT count(*) FROM entries").fetchone()[0]
        assert rows <= 100 + c._l2.trim_every
    c._l2.trim(clock())
    assert sqlite3.connect(tmp_path / "cache.db").execute("SELECT count(*) FROM entries").fetchone()[0] == 100
    got = c.get_many([key(i) for i in range(300)])
    assert all(v is None for v in got[:200]) and all(v is not None for v in got[200:])  # oldest went first


def test_l2_file_holds_no_plaintext(tmp_path):
    c = persisted(tmp_path)
    c.put_many([(key(i, tenant="tenant-secret"), val(i)) for i in range(50)])
    files = [p for p in tmp_path.iterdir() if p.name.startswith("cache.db")]
    assert any(p.name.endswith("-wal") for p in files)  # WAL mode
    for p in files:
        data = p.read_bytes()
        assert MARKER not in data and b"tenant-secret" not in data
        assert key(1, tenant="tenant-secret")[:32] not in data  # rows are stored under a keyed MAC
    assert oct((tmp_path / "cache.db").stat().st_mode & 0o777) == "0o600"


def test_tampered_ciphertext_is_a_miss(tmp_path):
    persisted(tmp_path).put_many([(key(1), val(1)), (key(2), val(2))])
    db = sqlite3.connect(tmp_path / "cache.db")
    (ct,) = db.execute("SELECT ct FROM entries LIMIT 1").fetchone()
    db.execute("UPDATE entries SET ct = ? WHERE ct = ?", (bytes([ct[0] ^ 1]) + ct[1:], ct))
    db.commit()
    c = persisted(tmp_path)
    got = c.get_many([key(1), key(2)])
    assert sum(v is None for v in got) == 1 and c.stats["corrupt"] == 1


# {"Y": float32 [[1, 2]]} as format 1 (the hand-written "TGV1" layout) wrote it
FORMAT_1 = (b"TGV1\x01\x00\x01\x00\x00\x03\x02Y<f4\x01\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00"
            b"\x00\x00\x00\x00\x00\x00\x80?\x00\x00\x00@")


def test_entry_of_an_older_format_is_a_miss(tmp_path):
    """Rows written before the msgpack format (still in L2/L3 until they expire) are misses,
    counted as corrupt, and the fresh answer replaces them."""
    c = persisted(tmp_path, l1_entries=0)
    sid, nonce = c._sid(key(1)), os.urandom(12)
    c._l2.put_many([(sid, "m", nonce, c._aead.encrypt(nonce, FORMAT_1, sid), time.time() + 60)], time.time())
    assert c.get_many([key(1)]) == [None] and c.stats["corrupt"] == 1
    c.put_many([(key(1), val(1))])
    assert same(c.get_many([key(1)])[0], val(1))


def _l2_worker(path, start, n):
    c = make(privacy="persisted_encrypted", l2_path=path, l1_entries=0)
    for b in range(start, start + n, 10):
        c.put_many([(key(i), val(i)) for i in range(b, b + 10)])
    return sum(v is not None for v in c.get_many([key(i) for i in range(1000, 1010)]))


def test_l2_shared_by_processes(tmp_path):
    path = str(tmp_path / "cache.db")
    persisted(tmp_path).put_many([(key(i), val(i)) for i in range(1000, 1010)])
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        seen = pool.starmap(_l2_worker, [(path, 0, 200), (path, 200, 200)])
    assert seen == [10, 10]  # each child read the parent's rows
    got = persisted(tmp_path).get_many([key(i) for i in range(400)])
    assert all(same(got[i], val(i)) for i in range(400))


def test_tenant_isolation(tmp_path):
    c = persisted(tmp_path)
    c.put_many([(key(1, tenant="a"), val(1))])
    assert key(1, tenant="a") != key(1, tenant="b")
    assert c.get_many([key(1, tenant="b")]) == [None]
    assert persisted(tmp_path).get_many([key(1, tenant="b"), key(1, tenant="a")])[0] is None


# -- L3 ----------------------------------------------------------------------------------------
# -- L2: a damaged file is quarantined, never a blocker -----------------------------------------
def _fill_and_checkpoint(path, n=200):
    """An L2 file holding ``n`` rows, all in the main file (no WAL left to mask the damage)."""
    make(privacy="persisted_encrypted", l2_path=path, l1_entries=0).put_many([(key(i), val(i)) for i in range(n)])
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def _damage(path, where):
    """Overwrite the first page (header and schema root) or every later page with garbage."""
    size = os.path.getsize(path)
    garbage = os.urandom(4096 if where == "first_page" else size - 4096)
    with open(path, "r+b") as f:
        f.seek(0 if where == "first_page" else 4096)
        f.write(garbage)
    return garbage


def _quarantined(path):
    """Quarantined main files beside ``path`` (their -wal/-shm companions left out)."""
    return sorted(p for p in path.parent.iterdir()
                  if p.name.startswith(path.name + ".corrupt-") and not p.name.endswith(("-wal", "-shm")))


def _works(c, keys=range(300, 305)):
    c.put_many([(key(i), val(i)) for i in keys])
    return all(same(v, val(i)) for i, v in zip(keys, c.get_many([key(i) for i in keys]), strict=True))


@pytest.mark.parametrize("where", ["first_page", "later_pages"])
def test_damaged_l2_file_is_quarantined_at_open(tmp_path, caplog, where):
    path = tmp_path / "cache.db"
    _fill_and_checkpoint(path)
    garbage = _damage(path, where)
    with caplog.at_level(logging.WARNING, logger="tritonguard.privacy.cache"):
        c = persisted(tmp_path, l1_entries=0)
    (bad,) = _quarantined(path)
    assert bad.name.startswith("cache.db.corrupt-") and bad.name.endswith(f"-{os.getpid()}")
    assert garbage in bad.read_bytes(), "moved aside as it was, not deleted"
    assert c.stats["l2_quarantined"] == 1
    reason = "not a database" if where == "first_page" else "malformed"  # later pages: found by quick_check
    assert str(path) in caplog.text and reason in caplog.text and bad.name in caplog.text
    assert c.get_many([key(1)]) == [None]  # starts empty
    assert _works(c) and _works(persisted(tmp_path, l1_entries=0), range(310, 312))
    assert len(_quarantined(path)) == 1, "a healthy file is left alone"


def test_l2_file_with_another_schema_is_quarantined(tmp_path, caplog):
    path = tmp_path / "cache.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE entries (key BLOB PRIMARY KEY, value BLOB)")
    db.commit()
    db.close()
    with caplog.at_level(logging.WARNING, logger="tritonguard.privacy.cache"):
        c = persisted(tmp_path)
    assert len(_quarantined(path)) == 1 and "unexpected schema" in caplog.text
    assert _works(c)


def test_quarantine_is_counted_in_the_stats_the_guard_publishes(tmp_path):
    """PrivacyStage turns ``stats['l2_quarantined']`` into tritonguard_cache_quarantined_total
    (asserted on the real server's /metrics in tests/functional/test_cache_corrupt.py)."""
    _fill_and_checkpoint(tmp_path / "cache.db")
    _damage(tmp_path / "cache.db", "first_page")
    c = persisted(tmp_path)
    assert c.stats["l2_quarantined"] == 1
    assert _works(c)


@pytest.mark.parametrize("where", ["first_page", "later_pages"])
def test_l2_damaged_at_runtime_heals_once_then_backs_off(tmp_path, caplog, where):
    clock = Clock()
    path = tmp_path / "cache.db"
    c = persisted(tmp_path, clock, l1_entries=0)
    _fill_and_checkpoint(path)  # other connections wrote: c re-reads the file at its next read
    _damage(path, where)
    with caplog.at_level(logging.WARNING, logger="tritonguard.privacy.cache"):
        assert c.get_many([key(1), key(2)]) == [None, None]  # the error costs a miss, nothing more
    assert len(_quarantined(path)) == 1 and c.stats["l2_quarantined"] == 1
    assert c.stats["degraded"] == () and c.stats["l2_errors"] == 1, "healed: no backoff"
    assert _works(c) and _works(persisted(tmp_path, l1_entries=0), range(310, 312))
    # damaged again within HEAL_EVERY_S: no second quarantine, today's backoff instead
    _fill_and_checkpoint(path)
    _damage(path, "first_page")
    assert c.get_many([key(1)]) == [None]
    assert len(_quarantined(path)) == 1 and c.stats["degraded"] == ("l2",)
    clock.t += 61  # after the backoff and the rate limit: healed again
    assert c.get_many([key(1)]) == [None]
    assert len(_quarantined(path)) == 2 and c.stats["degraded"] == ()
    assert _works(c)


def test_locked_l2_is_transient_not_quarantined(tmp_path):
    c = persisted(tmp_path, l1_entries=0)
    c.put_many([(key(1), val(1))])
    other = sqlite3.connect(tmp_path / "cache.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # holds the one writer's lock
    try:
        c.put_many([(key(2), val(2))])  # "database is locked" after the busy timeout
        assert c.stats["l2_errors"] == 1 and c.stats["degraded"] == ("l2",)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert _quarantined(tmp_path / "cache.db") == [] and c.stats["l2_quarantined"] == 0


def test_peer_follows_a_file_another_process_quarantined(tmp_path):
    path = tmp_path / "cache.db"
    a = persisted(tmp_path, l1_entries=0, l2_max_rows=10)  # trims (and checks its file) every 16 writes
    b = persisted(tmp_path, l1_entries=0)
    assert b._l2.heal(sqlite3.DatabaseError("database disk image is malformed"))
    assert len(_quarantined(path)) == 1
    a.put_many([(key(i), val(i)) for i in range(16)])  # the trim notices the move and reopens
    assert _works(b, range(400, 402))
    assert all(v is not None for v in a.get_many([key(i) for i in range(400, 402)])), "a and b share the fresh file"


def test_at_most_a_few_quarantined_files_are_kept(tmp_path, caplog):
    path = tmp_path / "cache.db"
    for _ in range(KEEP_QUARANTINED + 2):
        path.write_bytes(os.urandom(8192))
        persisted(tmp_path).close()
    assert len(_quarantined(path)) == KEEP_QUARANTINED
    assert caplog.text.count("deleted the oldest quarantined file") == 2


def _open_damaged(path, barrier, out):
    barrier.wait()  # both processes open the damaged file at the same moment
    c = make(privacy="persisted_encrypted", l2_path=path, l1_entries=0)
    mine = [key(500 + os.getpid() % 1000 * 10 + i) for i in range(3)]
    c.put_many([(k, val(1)) for k in mine])
    out.put((c.stats["l2_quarantined"], [k.hex() for k in mine]))


def test_two_processes_opening_a_damaged_file_quarantine_it_once(tmp_path):
    path = tmp_path / "cache.db"
    _fill_and_checkpoint(path)
    _damage(path, "first_page")
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_damaged, args=(str(path), barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(q for q, _ in results) == [0, 1]
    assert len(_quarantined(path)) == 1
    written = [bytes.fromhex(k) for _, keys in results for k in keys]
    assert all(v is not None for v in persisted(tmp_path).get_many(written)), "both wrote to the one fresh file"


def redis_cache(redis_server, clock=None, **params):
    return make(clock, privacy="persisted_encrypted", l3_url=redis_server.url, **params)


@pytest.fixture
def prefix():
    return f"tg-test-{uuid.uuid4().hex[:8]}:"


def test_l3_round_trip_encrypted(redis_server, prefix):
    import redis

    redis_cache(redis_server, l3_prefix=prefix).put_many([(key(i), val(i)) for i in range(3)])
    c = redis_cache(redis_server, l3_prefix=prefix)
    got = c.get_many([key(i) for i in range(4)])
    assert all(same(got[i], val(i)) for i in range(3)) and got[3] is None
    assert c.stats["l3_hits"] == 3 and c.stats["l3_misses"] == 1
    r = redis.Redis.from_url(redis_server.url)
    names = r.keys(prefix + "*")
    assert len(names) == 3 and all(n.startswith(f"{prefix}m:".encode()) for n in names)
    assert all(MARKER not in r.get(n) for n in names) and 0 < r.ttl(names[0]) <= 3600


def test_l3_hit_promotes_to_l2_and_l1(redis_server, prefix, tmp_path):
    redis_cache(redis_server, l3_prefix=prefix).put_many([(key(1), val(1))])
    c = redis_cache(redis_server, l3_prefix=prefix, l2_path=tmp_path / "c.db")
    assert c.get_many([key(1)])[0] is not None and c.stats["l3_hits"] == 1
    c.get_many([key(1)])
    assert c.stats["l1_hits"] == 1
    assert persisted(tmp_path, l2_path=tmp_path / "c.db").get_many([key(1)])[0] is not None


def test_redis_outage_degrades_fast_and_recovers(redis_server, prefix):
    clock = Clock(time.time())
    c = redis_cache(redis_server, clock, l3_prefix=prefix, l1_entries=0)
    c.put_many([(key(1), val(1))])
    assert c.get_many([key(1)])[0] is not None
    redis_server.stop()
    try:
        for i in range(5):
            t0 = time.perf_counter()
            assert c.get_many([key(1), key(2)]) == [None, None]
            t1 = time.perf_counter()
            c.put_many([(key(i), val(i))])
            assert t1 - t0 < 0.2 and time.perf_counter() - t1 < 0.2
        assert c.stats["degraded"] == ("l3",) and c.stats["l3_errors"] == 1  # skipped while backing off
        clock.t += 6
        c.get_many([key(1)])  # the retry after the backoff fails again: backoff doubles
        assert c.stats["l3_errors"] == 2 and c._health["l3"].backoff == 10
    finally:
        redis_server.start()
    clock.t += 11
    c.put_many([(key(1), val(1))])
    assert c.stats["degraded"] == ()
    assert same(c.get_many([key(1)])[0], val(1))


def test_hung_redis_costs_one_timeout(redis_server, prefix):
    clock = Clock(time.time())
    c = redis_cache(redis_server, clock, l3_prefix=prefix, l1_entries=0, l3_timeout_ms=50)
    c.put_many([(key(1), val(1))])
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        t0 = time.perf_counter()
        assert c.get_many([key(1)]) == [None]
        assert 0.04 < time.perf_counter() - t0 < 0.2
        t0 = time.perf_counter()
        assert c.get_many([key(1)]) == [None]  # skipped while degraded: no second timeout
        assert time.perf_counter() - t0 < 0.01
        assert c.stats["degraded"] == ("l3",)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_purge_by_model_on_all_tiers(redis_server, prefix, tmp_path):
    c = redis_cache(redis_server, l3_prefix=prefix, l2_path=tmp_path / "c.db")
    a = [key(i, model="a") for i in range(3)]
    b = [key(i, model="b") for i in range(2)]
    c.put_many([(k, val(0)) for k in a + b])
    assert c.purge("a") == {"l1": 3, "l2": 3, "l3": 3}
    assert c.get_many(a) == [None] * 3
    fresh = redis_cache(redis_server, l3_prefix=prefix, l2_path=tmp_path / "c.db")
    assert all(v is not None for v in fresh.get_many(b))
    assert c.purge() == {"l1": 2, "l2": 2, "l3": 2}
    assert redis_cache(redis_server, l3_prefix=prefix).get_many(b) == [None, None]


def test_split_rows():
    rows = split_rows({"Y": np.arange(6).reshape(3, 2)}, 3)
    assert [r["Y"].tolist() for r in rows] == [[[0, 1]], [[2, 3]], [[4, 5]]]
