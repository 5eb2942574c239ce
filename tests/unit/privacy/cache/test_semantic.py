import logging
import threading
import zlib

import numpy as np
import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.privacy.cache.semantic import WARN_EVERY_S, Hit, SemanticCache, SemanticCacheConfig

DIM = 384
NEAR_A, NEAR_B = "Return the list of items", "return the list of items."
FAR = "What is the capital of France?"


def trigram_embed(texts):
    """A deterministic stand-in for minilm_raw: hashed character trigrams of the lower-cased text,
    as [n, DIM] float32 counts (deliberately not normalised: the cache must normalise)."""
    out = np.zeros((len(texts), DIM), np.float32)
    for i, text in enumerate(texts):
        t = f"  {text.lower()} "
        for j in range(len(t) - 2):
            out[i, zlib.crc32(t[j:j + 3].encode()) % DIM] += 1.0
    return out


def cosine(a, b):
    x, y = trigram_embed([a])[0], trigram_embed([b])[0]
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class CountingEmbed:
    def __init__(self, fn=trigram_embed):
        self.fn, self.calls = fn, 0

    def __call__(self, texts):
        self.calls += 1
        return self.fn(texts)


def make(embed=trigram_embed, clock=None, **params):
    cfg = from_params(SemanticCacheConfig, {"enabled": "true", **{k: str(v) for k, v in params.items()}},
                      section="semantic_cache", model="g")
    return SemanticCache(cfg, embed, clock=clock or Clock())


def test_fake_embedder_separates_near_duplicates_from_unrelated_prompts():
    # the premise of the tests below: near-duplicates clear the default threshold, unrelated ones do not
    assert cosine(NEAR_A, NEAR_B) > 0.92
    assert cosine(NEAR_A, FAR) < 0.5


def test_hit_above_threshold_and_miss_below():
    cache = make()
    assert cache.lookup("acme", NEAR_A, "k") is None  # empty
    assert cache.store("acme", NEAR_A, "k", "apples, pears")
    hit = cache.lookup("acme", NEAR_B, "k")
    assert isinstance(hit, Hit)
    assert hit.text == "apples, pears" and hit.prompt == NEAR_A
    assert hit.cosine == pytest.approx(cosine(NEAR_A, NEAR_B), abs=1e-5)
    assert cache.config.threshold <= hit.cosine <= 1.0
    assert cache.lookup("acme", FAR, "k") is None
    assert cache.stats["lookups"] == 3 and cache.stats["hits"] == 1 and cache.stats["misses"] == 2
    assert cache.hit_rate() == pytest.approx(1 / 3)


def test_threshold_is_the_cut():
    c = cosine(NEAR_A, NEAR_B)
    above, below = make(threshold=round(c - 0.01, 4)), make(threshold=round(c + 0.01, 4))
    for cache in (above, below):
        cache.store("acme", NEAR_A, "k", "answer")
    assert above.lookup("acme", NEAR_B, "k").text == "answer"
    assert below.lookup("acme", NEAR_B, "k") is None
    # threshold 1 still matches the identical prompt despite float32 rounding
    exact = make(threshold=1)
    exact.store("acme", NEAR_A, "k", "answer")
    assert exact.lookup("acme", NEAR_A, "k").cosine == pytest.approx(1.0, abs=1e-6)
    assert exact.lookup("acme", NEAR_B, "k") is None


def test_best_match_wins_and_ties_go_to_the_newest():
    cache = make(threshold=0.5)
    cache.store("acme", "return the list of all items please", "k", "far-ish")
    cache.store("acme", NEAR_A, "k", "closest")
    assert cache.lookup("acme", NEAR_B, "k").text == "closest"
    # two prompts with the very same embedding (case differs only): the newer answer wins
    tie = make()
    tie.store("acme", "Hello World", "k", "older")
    tie.store("acme", "hello world", "k", "newer")
    assert tie.size("acme") == 2
    assert tie.lookup("acme", "HELLO WORLD", "k").text == "newer"


def test_tenants_never_see_each_others_answers():
    cache = make()
    cache.store("acme", NEAR_A, "k", "acme's secret list")
    assert cache.lookup("globex", NEAR_A, "k") is None  # even the identical prompt
    assert cache.lookup("globex", NEAR_B, "k") is None
    assert cache.lookup("acme", NEAR_B, "k").text == "acme's secret list"
    cache.store("globex", NEAR_A, "k", "globex's list")
    assert cache.lookup("globex", NEAR_A, "k").text == "globex's list"
    assert cache.lookup("acme", NEAR_A, "k").text == "acme's secret list"
    assert cache.size("acme") == cache.size("globex") == 1 and cache.size() == 2


def test_params_key_must_match_exactly():
    cache = make()
    cache.store("acme", NEAR_A, "max_tokens=16;t=0", "short")
    assert cache.lookup("acme", NEAR_A, "max_tokens=64;t=0") is None
    assert cache.lookup("acme", NEAR_B, "max_tokens=16;t=0").text == "short"
    cache.store("acme", NEAR_A, "max_tokens=64;t=0", "long")
    assert cache.lookup("acme", NEAR_B, "max_tokens=64;t=0").text == "long"
    assert cache.lookup("acme", NEAR_B, "max_tokens=16;t=0").text == "short"
    assert cache.size("acme") == 2  # same prompt, two params keys: two entries


def test_ttl_expiry_with_injected_clock():
    clock = Clock()
    cache = make(clock=clock, ttl_s=60)
    cache.store("acme", NEAR_A, "k", "answer")
    clock.t += 30
    hit = cache.lookup("acme", NEAR_B, "k")
    assert hit.text == "answer" and hit.age_s == pytest.approx(30)
    clock.t += 29.9
    assert cache.lookup("acme", NEAR_B, "k") is not None  # a hit does not extend the TTL ...
    clock.t += 0.1
    assert cache.lookup("acme", NEAR_B, "k") is None  # ... which ends 60 s after the store
    assert cache.stats["expired"] == 1
    assert cache.size() == 0  # purged lazily by that lookup
    cache.store("acme", NEAR_A, "k", "fresh")
    assert cache.lookup("acme", NEAR_B, "k").text == "fresh"


def test_expired_entries_are_purged_by_a_store_too_and_do_not_count_as_evictions():
    clock = Clock()
    cache = make(clock=clock, ttl_s=10, max_entries_per_tenant=2)
    cache.store("acme", "alpha beta gamma", "k", "1")
    cache.store("acme", "delta epsilon zeta", "k", "2")
    clock.t += 11
    cache.store("acme", "eta theta iota", "k", "3")
    assert cache.size("acme") == 1
    assert cache.stats["expired"] == 2 and cache.stats["evictions"] == 0


def test_lru_eviction_keeps_the_bound():
    cache = make(max_entries_per_tenant=3)
    prompts = ["alpha beta gamma", "delta epsilon zeta", "eta theta iota", "kappa lambda mu"]
    for i, p in enumerate(prompts[:3]):
        cache.store("acme", p, "k", f"a{i}")
    assert cache.lookup("acme", prompts[0], "k").text == "a0"  # alpha is now the most recently used
    cache.store("acme", prompts[3], "k", "a3")  # evicts delta, the least recently used
    assert cache.size("acme") == 3 and cache.stats["evictions"] == 1
    assert cache.lookup("acme", prompts[1], "k") is None
    assert [cache.lookup("acme", p, "k").text for p in (prompts[0], prompts[2], prompts[3])] == ["a0", "a2", "a3"]
    for i in range(50):  # many more: the bound holds, per tenant, and another tenant is untouched
        cache.store("acme", f"filler prompt number {i} about topic {i * 7}", "k", str(i))
    cache.store("globex", prompts[0], "k", "g")
    assert cache.size("acme") == 3 and cache.size("globex") == 1
    assert cache._tenants["acme"].vecs.shape[0] <= 3  # the matrix never outgrows the bound
    assert cache.stats["evictions"] == 51


def test_same_prompt_and_params_key_replaces_its_entry():
    clock = Clock()
    cache = make(clock=clock, ttl_s=60)
    cache.store("acme", NEAR_A, "k", "old")
    clock.t += 50
    cache.store("acme", NEAR_A, "k", "new")
    assert cache.size("acme") == 1 and cache.stats["stores"] == 2 and cache.stats["evictions"] == 0
    clock.t += 20  # the first store's TTL has passed; the replacement's has not
    hit = cache.lookup("acme", NEAR_B, "k")
    assert hit.text == "new" and hit.age_s == pytest.approx(20)


def test_embedding_from_lookup_is_reused_by_store():
    embed = CountingEmbed()
    cache = make(embed=embed)
    vec = cache.embed(NEAR_A)
    assert vec.dtype == np.float32 and vec.shape == (DIM,)
    assert float(np.linalg.norm(vec)) == pytest.approx(1.0, abs=1e-6)  # normalised by the cache
    assert cache.lookup("acme", NEAR_A, "k", embedding=vec) is None
    assert cache.store("acme", NEAR_A, "k", "answer", embedding=vec)
    assert embed.calls == 1
    assert cache.lookup("acme", NEAR_B, "k").text == "answer"  # without one, lookup embeds itself
    assert embed.calls == 2


def test_embed_runs_outside_the_lock():
    held = []

    def embed(texts):
        held.append(cache._lock.locked())
        return trigram_embed(texts)

    cache = make(embed=embed)
    cache.store("acme", NEAR_A, "k", "answer")
    cache.lookup("acme", NEAR_B, "k")
    assert held == [False, False]


def _raises(texts):
    raise RuntimeError("BLS call to minilm_raw failed: model not ready")


@pytest.mark.parametrize("embed", [
    _raises,
    lambda texts: np.zeros((1, 7), np.float32) + 1,  # another dimension than the first embedding
    lambda texts: np.ones((2, DIM), np.float32),  # two rows for one prompt
    lambda texts: np.ones(DIM, np.float32),  # a bare vector, not [1, dim]
    lambda texts: np.ones((1, DIM, 1), np.float32),
    lambda texts: None,
    lambda texts: [["a", "b"]],  # not numeric
    lambda texts: [[1.0, 2.0], [3.0]],  # ragged
], ids=["raises", "other-dim", "two-rows", "1d", "3d", "none", "strings", "ragged"])
def test_embed_failures_and_bad_shapes_are_misses_and_counted(embed):
    switch = CountingEmbed()
    cache = make(embed=switch)
    cache.store("acme", NEAR_A, "k", "answer")  # a warm store: the failure must still be a miss
    switch.fn = embed
    assert cache.lookup("acme", NEAR_A, "k") is None
    assert cache.store("acme", NEAR_B, "k", "other") is False
    assert cache.stats["errors"] == 2
    assert cache.stats["lookups"] == 1 and cache.stats["misses"] == 1 and cache.stats["hits"] == 0
    assert cache.stats["stores"] == 1 and cache.size("acme") == 1
    switch.fn = trigram_embed  # and it recovers when the embedder does
    assert cache.lookup("acme", NEAR_B, "k").text == "answer"


@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0], ids=["nan", "inf", "zero"])
def test_non_finite_or_zero_embedding_is_a_counted_miss(bad):
    def embed(texts):
        out = trigram_embed(texts)
        if bad == 0.0:
            out[0] = 0.0
        else:
            out[0, 3] = bad
        return out

    cache = make(embed=embed)
    assert cache.embed(NEAR_A) is None
    assert cache.lookup("acme", NEAR_A, "k") is None
    assert cache.store("acme", NEAR_A, "k", "answer") is False
    # a caller-given embedding is checked the same way
    vec = np.zeros(DIM, np.float32) if bad == 0.0 else np.ones(DIM, np.float32)
    vec[3] = bad
    assert cache.store("acme", NEAR_A, "k", "answer", embedding=vec) is False
    assert cache.stats["errors"] == 4 and cache.stats["misses"] == 1 and cache.size() == 0


def test_huge_but_finite_embedding_is_normalised_not_rejected():
    cache = make(embed=lambda texts: trigram_embed(texts) * np.float32(1e30))
    assert cache.store("acme", NEAR_A, "k", "answer")
    assert cache.lookup("acme", NEAR_B, "k").text == "answer"
    assert cache.stats["errors"] == 0


def test_failures_warn_at_most_once_a_minute(caplog):
    clock = Clock()
    cache = make(embed=_raises, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tritonguard.privacy.semantic_cache"):
        for _ in range(5):
            cache.lookup("acme", NEAR_A, "k")
        clock.t += WARN_EVERY_S - 1
        cache.lookup("acme", NEAR_A, "k")
        assert len(caplog.records) == 1
        clock.t += 1
        cache.lookup("acme", NEAR_A, "k")
    assert len(caplog.records) == 2
    assert "model not ready" in caplog.records[0].getMessage()
    assert "6 failure(s)" in caplog.records[1].getMessage()  # the 5 held back were counted, not lost
    assert cache.stats["errors"] == 7


def test_too_long_prompt_is_neither_looked_up_nor_stored():
    embed = CountingEmbed()
    cache = make(embed=embed, max_prompt_chars=30)
    long = "x" * 31
    assert cache.store("acme", long, "k", "answer") is False
    assert cache.lookup("acme", long, "k") is None
    assert embed.calls == 0  # not even embedded
    assert cache.stats["skipped"] == 2 and cache.stats["lookups"] == 0 and cache.size() == 0
    assert cache.store("acme", "x" * 30, "k", "answer")  # at the limit: fine
    assert cache.lookup("acme", "x" * 30, "k").text == "answer"


def test_deterministic_only():
    cache = make(deterministic_only="true")
    assert cache.store("acme", NEAR_A, "k", "answer") is False  # sampled: not stored
    assert cache.store("acme", NEAR_A, "k", "answer", deterministic=True)
    assert cache.lookup("acme", NEAR_B, "k") is None  # sampled: not looked up
    assert cache.lookup("acme", NEAR_B, "k", deterministic=True).text == "answer"
    assert cache.stats["skipped"] == 2 and cache.stats["lookups"] == 1
    # off (the default): sampled requests use it too
    anyone = make()
    anyone.store("acme", NEAR_A, "k", "answer")
    assert anyone.lookup("acme", NEAR_B, "k").text == "answer"


def test_clear():
    cache = make()
    cache.store("acme", NEAR_A, "k", "a")
    cache.store("globex", NEAR_A, "k", "g")
    assert cache.clear("acme") == 1
    assert cache.lookup("acme", NEAR_A, "k") is None
    assert cache.lookup("globex", NEAR_A, "k").text == "g"
    assert cache.clear() == 1 and cache.size() == 0


def test_concurrent_lookups_and_stores():
    cache = make(max_entries_per_tenant=20)
    n_threads, rounds = 8, 200
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def worker(w):
        try:
            start.wait()
            for i in range(rounds):
                tenant = f"t{(w + i) % 3}"
                prompt = f"question {i % 40} about subject {i % 7}"
                hit = cache.lookup(tenant, prompt, "k")
                if hit is not None:
                    assert hit.cosine >= cache.config.threshold - 1e-6
                    assert hit.text.startswith(f"{tenant}:")  # never another tenant's answer
                cache.store(tenant, prompt, "k", f"{tenant}:{prompt}")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    s = cache.stats
    total = n_threads * rounds
    assert s["lookups"] == total and s["hits"] + s["misses"] == total
    assert s["stores"] == total and s["errors"] == 0
    assert s["hits"] > 0
    for tenant in ("t0", "t1", "t2"):
        assert cache.size(tenant) == 20  # each saw 40 distinct prompts: full, never past the bound
        store = cache._tenants[tenant]
        assert len(store.lru) == int((store.pids[:store.high] >= 0).sum())  # rows and index agree
        assert store.high <= 20
    # each tenant evicted at least its 20 extra prompts; every entry held or evicted was a store
    assert s["evictions"] >= 3 * (40 - 20)
    assert cache.size() + s["evictions"] <= s["stores"]


def test_defaults():
    cfg = SemanticCacheConfig()
    assert (cfg.enabled, cfg.model, cfg.input, cfg.output) == (False, "minilm_raw", "TEXT", "EMBEDDING")
    assert (cfg.threshold, cfg.max_entries_per_tenant, cfg.ttl_s) == (0.92, 1024, 3600)
    assert (cfg.max_prompt_chars, cfg.deterministic_only) == (2048, False)
    parsed = from_params(SemanticCacheConfig, {"enabled": "true", "threshold": " 0.85 ", "ttl_s": "60"},
                         section="semantic_cache")
    assert parsed.enabled is True and parsed.threshold == 0.85 and parsed.ttl_s == 60.0


@pytest.mark.parametrize("key,value", [
    ("threshold", "0"),
    ("threshold", "1.01"),
    ("threshold", "-0.5"),
    ("threshold", "nan"),
    ("max_entries_per_tenant", "0"),
    ("ttl_s", "0"),
    ("ttl_s", "-5"),
    ("ttl_s", "inf"),
    ("max_prompt_chars", "0"),
    ("model", " "),
    ("input", ""),
    ("output", ""),
    ("threshold", "high"),  # wrong type: from_params names the key too
    ("max_entries_per_tenant", "1.5"),
    ("enabled", "maybe"),
])
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"semantic_cache\.{key}"):
        from_params(SemanticCacheConfig, {key: value}, section="semantic_cache", model="g")


def test_unknown_key_is_refused():
    with pytest.raises(ConfigError, match=r"semantic_cache\.treshold"):
        from_params(SemanticCacheConfig, {"treshold": "0.9"}, section="semantic_cache", model="g")
