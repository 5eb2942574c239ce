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

from tritonguard.cache import (
    CacheConfig,
    PrivacyMode,
    TieredCache,
    cache_key,
    decode_value,
    encode_value,
    key_model,
    load_key,
    row_keys,
    split_rows,
)
from tritonguard.config import from_params
from tritonguard.errors import ConfigError

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
    with caplog.at_level(logging.WARNING, logger="tritonguard.cache"):
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
