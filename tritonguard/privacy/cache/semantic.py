"""Semantic response cache of a stream guard: a prompt close in meaning to an earlier one gets its answer.

The exact cache (:mod:`tritonguard.privacy.cache.tiered`, the stream guard's ``cache.*``) answers only a
byte-identical deterministic request. This cache answers a *similar* one: each stored answer keeps
the sentence embedding of its (already PII-redacted) prompt, and a new prompt whose embedding has
a cosine similarity of at least ``semantic_cache.threshold`` with a stored one, for the same
tenant and the same sampling parameters, gets that stored answer instead of a new generation.

- **Opt-in** (``semantic_cache.enabled``, off by default): a semantic hit returns the answer to a
  *different* prompt. "Return the list of items" and "return the list of items." are the same
  question; "delete the file" and "do not delete the file" may also embed close together. Turn it
  on only for traffic where near-duplicates may share an answer, with a threshold tuned on it;
  ``semantic_cache.deterministic_only`` further limits it to greedy or seeded requests (a sampled
  request asks for a fresh draw every time).
- **Per tenant**: entries live in one store per tenant and a lookup only ever sees its own tenant's
  entries, so one tenant's answer (which may carry that tenant's data) is never served to
  another, however close the prompts are. Within a tenant an entry matches only the exact same
  ``params_key``, a string the caller builds from whatever must match exactly (max_tokens,
  temperature, top_p, seed, stream shape; and the target's artifact fingerprint, so a new
  checkpoint never answers from an older one's entries - or call :meth:`SemanticCache.clear`).
- **Threshold**: the cosine of the two L2-normalised embeddings, in (0, 1]; 1 matches (nearly)
  identical embeddings only. For all-MiniLM-L6-v2 paraphrases typically score 0.8-0.95 and
  case/punctuation variants above 0.95; the default 0.92 favours precision over hit rate.
- **Embeddings** come from a callable the guard injects, ``embed(list[str]) -> [n, dim]`` (in
  production a BLS call to ``semantic_cache.model``, ``minilm_raw``: TEXT BYTES [n,1] ->
  EMBEDDING float32 [n,384]). This module imports nothing of Triton. The vectors are normalised
  here (the embedder is not trusted); an embed call that raises, returns the wrong shape, or a
  non-finite or zero vector is a miss and counts in ``stats["errors"]``, never an exception to the
  caller (a warning is logged at most once a minute).
- **Bounded**: at most ``max_entries_per_tenant`` entries per tenant, least recently used (stored
  or hit) evicted first; entries expire ``ttl_s`` after they were stored (purged lazily, by the
  next lookup or store of that tenant); prompts over ``max_prompt_chars`` are neither looked up
  nor stored. Each entry costs ``4 * dim`` bytes of vector + about 210 of bookkeeping + its
  prompt and answer: about 1.8 KB + prompt + answer at dim 384 (see :class:`_TenantStore`). A
  lookup is one matrix-vector product over the tenant's ``[entries, dim]`` float32 matrix
  (1024 x 384: about 60 µs in all).
- **Thread-safe**: one lock around the stores; embed calls run outside it.

Typical use by a guard (one embed call per request; the miss's embedding is reused by the store)::

    vec = cache.embed(prompt)                              # None: embedding failed (counted)
    hit = cache.lookup(tenant, prompt, key, embedding=vec) if vec is not None else None
    if hit is None:
        text = generate(...)
        if vec is not None:
            cache.store(tenant, prompt, key, text, embedding=vec)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

WARN_EVERY_S = 60.0  # at most one warning about failing embeddings per minute
_MIN_NORM = 1e-12  # an embedding shorter than this is "zero": it has no direction to compare
_EPS = 1e-6  # float32 rounding: an identical prompt scores 0.9999999, and still meets threshold 1
_MIN_ROWS = 16  # a tenant's matrix starts this big and doubles, up to max_entries_per_tenant
STAT_KEYS = ("lookups", "hits", "misses", "stores", "evictions", "expired", "errors", "skipped")


@dataclass(kw_only=True)
class SemanticCacheConfig:
    """``semantic_cache.*`` parameters of a stream guard."""

    enabled: bool = False
    model: str = "minilm_raw"  # the embedding model, called through BLS
    input: str = "TEXT"  # its BYTES input [n, 1]
    output: str = "EMBEDDING"  # its FP32 output [n, dim]
    threshold: float = 0.92  # cosine similarity a hit needs, in (0, 1]
    max_entries_per_tenant: int = 1024
    ttl_s: float = 3600
    max_prompt_chars: int = 2048  # longer prompts are neither looked up nor stored
    deterministic_only: bool = False  # only greedy or seeded requests use it

    def __post_init__(self) -> None:
        for name in ("model", "input", "output"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"parameter 'semantic_cache.{name}' must not be empty")
        if not (0 < self.threshold <= 1):  # NaN fails too
            raise ValueError(f"parameter 'semantic_cache.threshold' must lie in (0, 1], got {self.threshold}")
        for name in ("max_entries_per_tenant", "max_prompt_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter 'semantic_cache.{name}' must be >= 1, got {getattr(self, name)}")
        if not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"parameter 'semantic_cache.ttl_s' must be a finite number > 0, got {self.ttl_s}")


@dataclass(frozen=True, slots=True)
class Hit:
    """A stored answer whose prompt is close to the one looked up."""

    text: str  # the stored answer
    cosine: float  # similarity of the two prompts' embeddings, >= threshold
    prompt: str  # the stored (redacted) prompt it answered
    age_s: float  # seconds since it was stored


class _TenantStore:
    """One tenant's entries: row ``i`` of ``vecs`` is a normalised embedding, ``pids[i]`` the id
    of its params_key (-1: a free row).

    Bytes per entry: ``4 * dim`` for the vector (1536 at dim 384) + 24 for pids/expires/seqs +
    the prompt and answer strings (49 + their length each, ASCII; the params_key string is shared
    with the caller's) + about 190 of bookkeeping (the LRU dict entry, its key tuple, three list
    slots): about 1.8 KB + prompt + answer, measured with tracemalloc at 1024 entries of dim 384.
    So the default bound (1024 entries, 2048-char prompts) is about 2 MB + the answers per tenant.
    The arrays grow by doubling (from 16 rows, never past ``max_entries_per_tenant``)."""

    __slots__ = ("dim", "vecs", "pids", "expires", "seqs", "prompts", "pkeys", "texts",
                 "lru", "free", "high", "pk_ids", "pk_refs", "next_pid")

    def __init__(self, dim: int):
        self.dim = dim
        self.vecs = np.zeros((0, dim), np.float32)
        self.pids = np.zeros(0, np.int64)
        self.expires = np.zeros(0, np.float64)
        self.seqs = np.zeros(0, np.int64)
        self.prompts: list[str] = []
        self.pkeys: list[str] = []
        self.texts: list[str] = []
        self.lru: OrderedDict[tuple[str, str], int] = OrderedDict()  # (params_key, prompt) -> row
        self.free: list[int] = []
        self.high = 0  # rows below it have been used
        self.pk_ids: dict[str, int] = {}
        self.pk_refs: dict[int, int] = {}  # params_key id -> entries using it
        self.next_pid = 0

    def _grow(self, limit: int) -> None:
        rows = min(max(_MIN_ROWS, 2 * len(self.pids)), limit)
        extra = rows - len(self.pids)
        self.vecs = np.concatenate([self.vecs, np.zeros((extra, self.dim), np.float32)])
        self.pids = np.concatenate([self.pids, np.full(extra, -1, np.int64)])
        self.expires = np.concatenate([self.expires, np.zeros(extra, np.float64)])
        self.seqs = np.concatenate([self.seqs, np.zeros(extra, np.int64)])
        self.prompts.extend([""] * extra)
        self.pkeys.extend([""] * extra)
        self.texts.extend([""] * extra)

    def row_for_new(self, limit: int) -> int:
        if self.free:
            return self.free.pop()
        if self.high == len(self.pids):
            self._grow(limit)
        self.high += 1
        return self.high - 1

    def add(self, key: tuple[str, str], limit: int) -> int:
        """A row for the new entry ``key`` = (params_key, prompt); the caller fills in the rest."""
        row = self.row_for_new(limit)
        pid = self.pk_ids.get(key[0])
        if pid is None:
            pid = self.pk_ids[key[0]] = self.next_pid
            self.next_pid += 1
            self.pk_refs[pid] = 0
        self.pk_refs[pid] += 1
        self.pids[row] = pid
        self.pkeys[row], self.prompts[row] = key
        self.lru[key] = row
        return row

    def remove(self, key: tuple[str, str]) -> None:
        row = self.lru.pop(key)
        pid = int(self.pids[row])
        self.pids[row] = -1
        self.prompts[row] = self.pkeys[row] = self.texts[row] = ""
        self.free.append(row)
        self.pk_refs[pid] -= 1
        if not self.pk_refs[pid]:
            del self.pk_refs[pid], self.pk_ids[key[0]]

    def purge_expired(self, now: float) -> int:
        rows = np.flatnonzero((self.pids[:self.high] >= 0) & (self.expires[:self.high] <= now))
        for row in rows:
            self.remove((self.pkeys[row], self.prompts[row]))
        return len(rows)


class SemanticCache:
    """Per-tenant semantic cache of generated answers; see the module's docstring.

    ``stats``: ``lookups`` (= ``hits`` + ``misses``: lookups that were attempted), ``stores``,
    ``evictions`` (LRU, past ``max_entries_per_tenant``), ``expired`` (purged past ``ttl_s``),
    ``errors`` (embed calls that raised or returned a wrong-shaped, non-finite or zero vector),
    ``skipped`` (lookups and stores not attempted: prompt too long, or not deterministic under
    ``deterministic_only``)."""

    def __init__(self, config: SemanticCacheConfig, embed: Callable[[list[str]], np.ndarray],
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._embed = embed
        self.clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantStore] = {}
        self._dim: int | None = None  # fixed by the first valid embedding
        self._seq = 0
        self._warned_at: float | None = None
        self._unlogged = 0
        self.stats: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)

    # -- embeddings -----------------------------------------------------------------------------
    def _count(self, **incs: int) -> None:
        with self._lock:
            for k, v in incs.items():
                self.stats[k] += v

    def _failed(self, why: str) -> None:
        now = self.clock()
        with self._lock:
            self.stats["errors"] += 1
            self._unlogged += 1
            if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
                return
            self._warned_at, n, self._unlogged = now, self._unlogged, 0
        log.warning("semantic cache: embedding with '%s' failed (%s); treated as a miss "
                    "(%d failure(s) since the last warning, at most one warning per %.0f s)",
                    self.config.model, why, n, WARN_EVERY_S)

    def normalise(self, vec: object) -> np.ndarray | None:
        """``vec`` ([dim] or [1, dim]) as a unit float32 vector; None (an error, counted and
        logged) when it is not numeric, of another shape or dimension, non-finite or zero."""
        try:
            arr = np.asarray(vec, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            self._failed(f"not a numeric array: {exc}")
            return None
        if arr.ndim == 2 and arr.shape[0] == 1:
            arr = arr[0]
        dim = self._dim
        if arr.ndim != 1 or arr.size == 0 or (dim is not None and arr.size != dim):
            self._failed(f"expected shape [1, {dim or 'dim'}], got {list(np.shape(vec))}")
            return None
        norm = float(np.linalg.norm(arr))
        if not math.isfinite(norm):
            self._failed("a non-finite embedding")
            return None
        if norm < _MIN_NORM:
            self._failed("a zero embedding")
            return None
        return (arr / norm).astype(np.float32)

    def embed(self, prompt: str) -> np.ndarray | None:
        """The normalised embedding of ``prompt`` (one call of the embed function, outside the
        lock); None when the call raises or returns something unusable (counted in ``errors``)."""
        try:
            arr = np.asarray(self._embed([prompt]), dtype=np.float64)
        except Exception as exc:  # a BLS error, a broken model, a ragged or non-numeric answer: a miss
            self._failed(f"{type(exc).__name__}: {exc}")
            return None
        if arr.ndim != 2 or arr.shape[0] != 1:  # one row for one prompt, not a bare vector
            self._failed(f"expected shape [1, dim] for one prompt, got {list(arr.shape)}")
            return None
        return self.normalise(arr)

    def _eligible(self, prompt: str, deterministic: bool) -> bool:
        return len(prompt) <= self.config.max_prompt_chars and (deterministic or not self.config.deterministic_only)

    # -- lookups and stores ---------------------------------------------------------------------
    def lookup(self, tenant: str, prompt: str, params_key: str, *, embedding: np.ndarray | None = None,
               deterministic: bool = False) -> Hit | None:
        """The best stored answer of ``tenant`` under exactly ``params_key`` whose prompt has a
        cosine >= threshold with ``prompt`` (ties: the newest), or None. ``embedding``: the
        prompt's, from :meth:`embed` (else it is computed here). ``deterministic``: whether the
        request is greedy or seeded (only those are looked up under ``deterministic_only``)."""
        if not self._eligible(prompt, deterministic):
            self._count(skipped=1)
            return None
        vec = self.embed(prompt) if embedding is None else self.normalise(embedding)
        with self._lock:
            self.stats["lookups"] += 1
            hit = None if vec is None else self._best(tenant, params_key, vec)
            self.stats["hits" if hit is not None else "misses"] += 1
            return hit

    def _best(self, tenant: str, params_key: str, vec: np.ndarray) -> Hit | None:
        store = self._tenants.get(tenant)
        if store is None or store.dim != len(vec):
            return None
        now = self.clock()
        self._purge(tenant, store, now)
        pid = store.pk_ids.get(params_key)
        if pid is None:
            return None
        n = store.high
        sims = store.vecs[:n] @ vec  # free rows and other params_keys are masked below
        sims[store.pids[:n] != pid] = -np.inf
        best = float(sims.max())
        if not best >= self.config.threshold - _EPS:
            return None
        rows = np.flatnonzero(sims == best)
        row = int(rows[np.argmax(store.seqs[rows])]) if len(rows) > 1 else int(rows[0])
        store.lru.move_to_end((params_key, store.prompts[row]))
        return Hit(text=store.texts[row], cosine=min(best, 1.0), prompt=store.prompts[row],
                   age_s=max(0.0, now - (store.expires[row] - self.config.ttl_s)))

    def _purge(self, tenant: str, store: _TenantStore, now: float) -> None:
        gone = store.purge_expired(now)
        if gone:
            self.stats["expired"] += gone
            if not store.lru:
                del self._tenants[tenant]

    def store(self, tenant: str, prompt: str, params_key: str, text: str, embedding: np.ndarray | None = None,
              *, deterministic: bool = False) -> bool:
        """Keep ``text`` as the answer to ``prompt`` for ``tenant`` under ``params_key``; the same
        prompt and params_key again replaces the entry. ``embedding``: the one :meth:`embed` gave
        for the lookup (else the prompt is embedded here). False when not stored (skipped, or the
        embedding failed)."""
        if not self._eligible(prompt, deterministic):
            self._count(skipped=1)
            return False
        vec = self.embed(prompt) if embedding is None else self.normalise(embedding)
        if vec is None:
            return False
        limit = self.config.max_entries_per_tenant
        with self._lock:
            if self._dim is None:
                self._dim = len(vec)
            elif len(vec) != self._dim:  # raced with another first store of another dimension
                self.stats["errors"] += 1
                return False
            now = self.clock()
            store = self._tenants.get(tenant)
            if store is not None:
                self._purge(tenant, store, now)
                store = self._tenants.get(tenant)
            if store is None:
                store = self._tenants[tenant] = _TenantStore(self._dim)
            key = (params_key, prompt)
            row = store.lru.get(key)
            if row is None:
                while len(store.lru) >= limit:
                    store.remove(next(iter(store.lru)))
                    self.stats["evictions"] += 1
                row = store.add(key, limit)
            else:
                store.lru.move_to_end(key)
            self._seq += 1
            store.vecs[row] = vec
            store.texts[row] = text
            store.expires[row] = now + self.config.ttl_s
            store.seqs[row] = self._seq
            self.stats["stores"] += 1
            return True

    # -- housekeeping ---------------------------------------------------------------------------
    def size(self, tenant: str | None = None) -> int:
        """Entries held (of ``tenant``), expired ones not purged yet included."""
        with self._lock:
            if tenant is not None:
                store = self._tenants.get(tenant)
                return len(store.lru) if store is not None else 0
            return sum(len(s.lru) for s in self._tenants.values())

    def clear(self, tenant: str | None = None) -> int:
        """Drop every entry (of ``tenant``), e.g. when the target's artifact changes; entries dropped."""
        with self._lock:
            if tenant is not None:
                store = self._tenants.pop(tenant, None)
                return len(store.lru) if store is not None else 0
            n = sum(len(s.lru) for s in self._tenants.values())
            self._tenants.clear()
            return n

    def hit_rate(self) -> float:
        """hits / lookups attempted (skipped ones not counted); 0.0 before the first."""
        with self._lock:
            n = self.stats["lookups"]
            return self.stats["hits"] / n if n else 0.0
