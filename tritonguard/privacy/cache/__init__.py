"""The guards' response caches: the exact, tiered one (``cache.*``) and the semantic one
(``semantic_cache.*``, a stream guard's).

- :mod:`~tritonguard.privacy.cache.config`: ``CacheConfig``, ``PrivacyMode`` (``cache.privacy``),
  ``load_key`` (the AES key);
- :mod:`~tritonguard.privacy.cache.keys`: the key of a request, or of each row of a batch;
- :mod:`~tritonguard.privacy.cache.codec`: values as msgpack of the raw array bytes;
- :mod:`~tritonguard.privacy.cache.tiers`: L1 LRU, L2 SQLite (with quarantine of a damaged file),
  L3 Redis, and each tier's backoff;
- :mod:`~tritonguard.privacy.cache.tiered`: ``TieredCache``, lookups through the tiers with
  promotion, write-through, encryption, purge;
- :mod:`~tritonguard.privacy.cache.semantic`: ``SemanticCache``, answers to prompts close in
  meaning (sentence embeddings, per tenant).

Arrows: ``keys`` <- {``codec``, ``tiers``}; {``config``, ``keys``, ``codec``, ``tiers``} <-
``tiered``; ``semantic`` stands alone. May import :mod:`tritonguard.core` only. Nothing is
re-exported here: import a name from the module that defines it.
"""
