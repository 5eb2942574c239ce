"""The ``guard`` backend in front of a decoupled generative model (the vLLM backend's contract).

A decoupled guard model (``model_transaction_policy { decoupled: true }``, the inputs
``text_input``, ``stream``, ``sampling_parameters``, ``exclude_input_in_output`` and the output
``text_output``) checks each request, redacts PII in the prompt, streams the target's answer
through a BLS decoupled call and redacts PII in the answer *across token boundaries*:

- ``execute()`` only validates, resolves the tenant, admits it (``tenancy.quotas``, the token
  budget ``tokens.*``) and redacts the prompt; every refusal is a final error response at once.
  The generation itself runs on a bounded pool of worker threads (``max_in_flight``), so
  ``execute()`` returns at once and one long stream never holds up the next request.
- :class:`StreamRedactor` holds back the tail of the answer that may still grow into a PII match
  (with the built-in recognizers: the word being written and the short or digit-bearing words
  right before it; with custom patterns: the last ``redaction.holdback_chars`` characters), at
  most ``redaction.holdback_chars``; text is released when no match can still reach into it, and
  flushed at the end, so an e-mail or a phone number split over single-character tokens is still
  redacted.
- A client cancel (``request.is_cancelled()``, polled every ``cancel_poll_ms``) stops the
  forwarding and cancels the BLS stream where python_backend offers ``ResponseIterator.cancel()``
  (r25.01 and later). python_backend 24.10 (Triton 2.51) has no way to cancel a BLS stream:
  the worker then reads the target's remaining responses and drops them (bounded by the
  ``max_tokens`` the guard forwarded), and logs it.

Metrics on Triton's /metrics: ``tritonguard_stream_requests_total`` (by outcome and tenant),
``tritonguard_stream_tokens_total`` (in/out, by tenant), ``tritonguard_stream_redactions_total``,
and the histograms ``tritonguard_stream_ttft_seconds`` (hold-back included) and
``tritonguard_stream_itl_seconds`` (one mean per streamed request).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import triton
from .audit import AuditConfig, AuditLog, digest, load_audit_key, open_anchor_store
from .breaker import BreakerConfig
from .cache import CacheConfig, TieredCache
from .config import from_params, model_parameters, split_parameters
from .errors import ConfigError, InvalidInput, QuotaExceeded, TargetError, TritonGuardError
from .generator import (
    GENERATION_BUCKETS,
    INPUTS,
    OUTPUT,
    SAMPLING_KEYS,
    SamplingParams,
    TritonSink,
    parse_sampling,
    read_contract,
    safe_send,
)
from .latency import recorder_for
from .local_generator import (
    CODE_NUMBERS,
    END,
    LocalGenerator,
    LocalResponse,
    LocalStream,
    queued_batches,
)
from .privacy import AuditedMetrics, audit_file
from .redaction import RedactionConfig, Redactor
from .routing import RoutingConfig
from .semantic_cache import SemanticCache, SemanticCacheConfig
from .state import open_store
from .stream_routing import NON_FINITE, StreamRouter, embedding_similarity
from .tenancy import QuotaManager, TenancyConfig, TenantLabels, TenantResolver

log = logging.getLogger(__name__)

# pb_utils.TritonError integer codes -> names (python_backend pb_error.h order)
_CODE_NAMES = {number: name for name, number in CODE_NUMBERS.items()}
SECTIONS = ("", "validation", "redaction", "tenancy", "tokens", "cache", "semantic_cache", "routing", "breaker",
            "audit", "similarity")
# Long enough for every built-in at its usual length: an IPv6 with an embedded IPv4 (45), an
# IBAN with spaces (42), an international phone number (<= 40), and e-mails up to 64 characters.
DEFAULT_HOLDBACK = 64

# Triton /metrics of a stream guard (per model and version; counters also per tenant)
OUTCOMES = ("ok", "rejected", "cancelled", "target_error", "error")
COUNTERS = {
    "stream_requests": ("tritonguard_stream_requests_total",
                        "Requests to a stream guard, by outcome (ok, rejected, cancelled, target_error, error) and tenant"),
    "stream_tokens": ("tritonguard_stream_tokens_total",
                      "Tokens through a stream guard, by direction (in: prompt characters, out: generated tokens) and tenant"),
    "stream_redactions": ("tritonguard_stream_redactions_total", "PII spans a stream guard redacted, by direction"),
    "stream_cache": ("tritonguard_stream_cache_lookups_total",
                     "Response cache lookups of deterministic generations, by result (hit, miss) and tenant"),
    "stream_semantic": ("tritonguard_stream_semantic_cache_lookups_total",
                        "Semantic cache lookups (semantic_cache.*), by result (hit, miss, skipped: prompt too long "
                        "or not deterministic under deterministic_only; error: the embedding failed) and tenant"),
    "similarity_errors": ("tritonguard_stream_similarity_errors_total",
                          "Sampled canary/shadow comparisons whose similarity.model embedding failed (the "
                          "sampled_similarity figure was then the character-trigram cosine)"),
}
HISTOGRAMS = {
    "stream_ttft": ("tritonguard_stream_ttft_seconds",
                    "Time from a request's arrival to the first text sent to its client (hold-back included)",
                    GENERATION_BUCKETS),
    "stream_itl": ("tritonguard_stream_itl_seconds",
                   "Mean time between the pieces sent to one streamed request's client", GENERATION_BUCKETS),
}


# -- config -------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class StreamGuardConfig:
    """Top-level ``parameters`` of a decoupled guard."""

    target: str = ""
    target_version: int = -1
    # bls: the target is called through Triton (any decoupled model: vLLM, TensorRT-LLM, ...);
    # inprocess: a `generator`-backend target's versions run in this process (no second hop per
    # token; tritonguard.local_generator)
    placement: str = "bls"
    max_in_flight: int = 32  # generations in flight in this instance (worker threads)
    cancel_poll_ms: int = 50
    # the longest wait for the target's next response; past it the client gets UNAVAILABLE (a
    # target that died or failed mid-stream: python_backend 24.10 does not always deliver a
    # decoupled target's error response to a BLS caller, and its iterator has no timeout)
    target_idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("parameter 'target' (the generator model's name) is required")
        if self.max_in_flight < 1:
            raise ValueError(f"parameter 'max_in_flight' must be >= 1, got {self.max_in_flight}")
        if self.cancel_poll_ms < 0:
            raise ValueError(f"parameter 'cancel_poll_ms' must be >= 0, got {self.cancel_poll_ms}")
        if self.placement not in ("bls", "inprocess"):
            raise ValueError(f"parameter 'placement' must be bls or inprocess, got {self.placement!r}")
        if not self.target_idle_timeout_s > 0:
            raise ValueError(f"parameter 'target_idle_timeout_s' must be > 0, got {self.target_idle_timeout_s}")


@dataclass(kw_only=True)
class StreamValidationConfig:
    """``validation.*``: what a request may ask for."""

    max_prompt_chars: int = 8192
    max_tokens: int = 256  # cap on sampling_parameters.max_tokens (forwarded to the target)
    default_max_tokens: int = 16
    max_temperature: float = 2.0
    sampling_keys: tuple[str, ...] = SAMPLING_KEYS  # keys a client may send

    def __post_init__(self) -> None:
        for name in ("max_prompt_chars", "max_tokens", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter 'validation.{name}' must be >= 1, got {getattr(self, name)}")
        if not (self.max_temperature >= 0 and math.isfinite(self.max_temperature)):
            raise ValueError(f"parameter 'validation.max_temperature' must be a finite number >= 0, "
                             f"got {self.max_temperature}")
        unknown = sorted(set(self.sampling_keys) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"parameter 'validation.sampling_keys': unknown {', '.join(unknown)} "
                             f"(supported: {', '.join(SAMPLING_KEYS)})")
        self.sampling_keys = tuple(self.sampling_keys)


@dataclass(kw_only=True)
class TokenBudgetConfig:
    """``tokens.*``: each tenant's generation budget (0 = unlimited)."""

    per_minute: int = 0  # generated tokens per minute, a token bucket of one minute's worth
    max_in_flight: int = 0  # generations in flight per tenant

    def __post_init__(self) -> None:
        if self.per_minute < 0 or self.max_in_flight < 0:
            raise ValueError("parameters 'tokens.per_minute' and 'tokens.max_in_flight' must be >= 0")


@dataclass(kw_only=True)
class SimilarityConfig:
    """``similarity.*``: how two sampled texts of a canary/shadow comparison are compared (the
    ``sampled_similarity`` figure)."""

    model: str = ""  # an embedding model called through BLS (e.g. minilm_raw); "": character-trigram cosine
    input: str = "TEXT"  # its BYTES input [n, 1]
    output: str = "EMBEDDING"  # its FP32 output [n, dim]

    def __post_init__(self) -> None:
        self.model = self.model.strip()
        for name in ("input", "output"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"parameter 'similarity.{name}' must not be empty")


@dataclass
class StreamGuardSettings:
    guard: StreamGuardConfig
    validation: StreamValidationConfig
    redaction: RedactionConfig
    holdback_chars: int
    tenancy: TenancyConfig
    tokens: TokenBudgetConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    semantic: SemanticCacheConfig = field(default_factory=SemanticCacheConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    similarity: SimilarityConfig = field(default_factory=SimilarityConfig)


def parse_settings(params: Mapping[str, str], *, model: str = "?") -> StreamGuardSettings:
    """config.pbtxt ``parameters`` -> settings; any unknown key or bad value raises ConfigError
    naming the key."""
    groups = split_parameters(params, SECTIONS, model=model)
    red = dict(groups["redaction"])
    raw_holdback = red.pop("holdback_chars", str(DEFAULT_HOLDBACK))
    try:
        holdback = int(raw_holdback.strip())
    except ValueError:
        raise ConfigError(f"model '{model}': parameter 'redaction.holdback_chars': expected an integer, "
                          f"got {raw_holdback!r}") from None
    if not 0 <= holdback <= 4096:
        raise ConfigError(f"model '{model}': parameter 'redaction.holdback_chars' must lie in 0..4096, got {holdback}")
    red.setdefault("redact_outputs", "true")  # the point of a stream guard; may be turned off
    return StreamGuardSettings(
        guard=from_params(StreamGuardConfig, groups[""], model=model),
        validation=from_params(StreamValidationConfig, groups["validation"], section="validation", model=model),
        redaction=from_params(RedactionConfig, red, section="redaction", model=model),
        holdback_chars=holdback,
        tenancy=from_params(TenancyConfig, groups["tenancy"], section="tenancy", model=model),
        tokens=from_params(TokenBudgetConfig, groups["tokens"], section="tokens", model=model),
        cache=from_params(CacheConfig, groups["cache"], section="cache", model=model),
        semantic=from_params(SemanticCacheConfig, groups["semantic_cache"], section="semantic_cache", model=model),
        routing=from_params(RoutingConfig, groups["routing"], section="routing", model=model),
        breaker=from_params(BreakerConfig, groups["breaker"], section="breaker", model=model),
        audit=from_params(AuditConfig, groups["audit"], section="audit", model=model),
        similarity=from_params(SimilarityConfig, groups["similarity"], section="similarity", model=model),
    )


# -- response cache -----------------------------------------------------------------------------
def target_fingerprint(version_dir: Path) -> str | None:
    """SHA-256 over the files of the target's version folder (names and contents): answers are
    cached per exact artifact, so a new checkpoint never answers from an older one's entries."""
    if not version_dir.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(x for x in version_dir.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(version_dir)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def cache_key(guard: str, fingerprint: str, gen: Generation) -> bytes | None:
    """The key of a deterministic generation (greedy, or seeded), None for any other: tenant,
    guard, the target's artifact, the prompt as the target sees it, every sampling parameter and
    the output shape (stream, prompt included or not)."""
    p = gen.params
    if not (p.greedy or p.seed is not None):
        return None
    material = json.dumps([gen.tenant, guard, fingerprint, gen.prompt, p.max_tokens, p.temperature, p.top_p,
                           p.seed, gen.stream, gen.exclude], separators=(",", ":"))
    return hashlib.sha256(b"tritonguard-stream\0" + material.encode()).digest()


def replay_pieces(text: str) -> list[str]:
    """A cached streamed answer, sent again as a stream: a piece per word (its trailing space)."""
    pieces, start = [], 0
    for i, ch in enumerate(text):
        if ch.isspace() and i + 1 < len(text) and not text[i + 1].isspace():
            pieces.append(text[start:i + 1])
            start = i + 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces


# -- redaction across token boundaries ----------------------------------------------------------
class StreamRedactor:
    """Redacts a text that arrives in pieces, releasing it as early as is safe.

    The last ``holdback`` characters are kept back (with built-ins only: just the :attr:`TAIL`
    that may still grow into a match, at most ``holdback``), and so is any match that reaches
    into them (it may still grow). Everything before that is final: a match of at most ``holdback``
    characters that starts there already lies whole in the buffer, with the character after it
    (its look-ahead) too. The output equals :meth:`Redactor.redact_batch` of the whole text for
    every match of at most ``holdback`` characters; a longer one is redacted from the point it
    was still held back.
    """

    CONTEXT = 8  # released characters kept for look-behinds at the buffer's start
    # Where a built-in match may still be growing: every built-in match is one run of non-space
    # characters, or groups joined by single spaces (phone and card numbers, IBANs) where each
    # group holds a digit or is 1-4 letters and digits. With built-ins only, the buffer's tail
    # that has this shape is held back (at most ``holdback`` characters), not the whole window:
    # plain prose is released a word behind, not ``holdback`` characters behind.
    TAIL = re.compile(r"(?<!\S)(?:(?>[^\s]*[0-9][^\s]*|[A-Za-z0-9]{1,4}) )*+[^\s]*\Z")

    def __init__(self, redactor: Redactor, holdback: int) -> None:
        self.redactor, self.holdback = redactor, holdback
        # custom patterns (redaction.pattern.*) may match anything: they keep the fixed window
        self.tail = self.TAIL if redactor.active and not redactor.config.pattern else None
        self.pattern = redactor._pattern if redactor.active else None  # noqa: SLF001 - spans, not text
        self.context = ""  # the last original characters released (for look-behinds)
        self.consumed = 0  # where in ``context`` the scan resumes (after the last candidate)
        self.pending = ""  # original text not released yet
        self.counts: dict[str, int] = {}
        self.released = 0  # characters of original text released

    def _candidates(self, text: str, pos: int) -> list[tuple[int, int, int, str | None]]:
        """Matches of ``text`` from ``pos`` on (look-behinds see the context before it):
        (start, end, end of the redacted part, label or None where the check rejected it), as
        :meth:`Redactor._redact` decides them (checksums, partial keeps)."""
        r = self.redactor
        out = []
        for m in self.pattern.finditer(text, pos):  # type: ignore[union-attr]
            group = m.lastgroup
            check = r._checks.get(group)  # noqa: SLF001
            keep = check(m.group()) if check is not None else len(m.group())
            out.append((m.start(), m.end(), m.start() + keep, r._group[group] if keep else None))  # noqa: SLF001
        return out

    def _release(self, final: bool) -> str:
        if self.pattern is None:
            out, self.pending = self.pending, ""
            self.released += len(out)
            return out
        text = self.context + self.pending
        off = len(self.context)
        if final:
            cut = len(text)
        elif self.tail is not None:
            tail = self.tail.search(text, off)
            cut = max(len(text) - self.holdback, tail.start() if tail is not None else off, off)
            if cut <= off:
                return ""
        else:
            if len(self.pending) <= self.holdback:
                return ""
            cut = len(text) - self.holdback
        out: list[str] = []
        pos = off
        # The scan goes on after the last candidate, as re.sub's does. A match may start at the
        # context's first character, whose own look-behind is gone: that errs towards redacting
        # (a match longer than the window is still cut off where it was held back).
        consumed = self.consumed
        for start, end, keep_end, name in self._candidates(text, consumed):
            if start >= cut or (not final and end > cut):
                cut = max(min(cut, start), off)  # may still grow or change: keep it back whole
                break
            consumed = end
            if name is None or keep_end <= off:
                continue  # rejected by its check, or redacted already
            start = max(start, off)  # began before the buffer (longer than holdback): redact what is left
            out.append(text[pos:start])
            out.append(self.redactor._labels[name])  # noqa: SLF001
            self.counts[name] = self.counts.get(name, 0) + 1
            pos = keep_end
        if pos < cut:
            out.append(text[pos:cut])
        self.released += cut - off
        base = max(0, cut - self.CONTEXT)
        self.context = text[base:cut]
        self.consumed = max(0, min(consumed, cut) - base)
        self.pending = text[cut:]
        return "".join(out)

    def feed(self, piece: str) -> str:
        """Add ``piece``; returns the text that is now safe to send (often '')."""
        self.pending += piece
        return self._release(final=False)

    def flush(self) -> str:
        """The rest, redacted: call once at the end of the stream."""
        return self._release(final=True)


# -- per-tenant token budget --------------------------------------------------------------------
class TokenBudget:
    """Per tenant: a bucket of ``per_minute`` tokens refilled continuously, and a cap on
    generations in flight. A request is admitted while the bucket is positive; the tokens it
    generates are charged as they stream (the bucket may go negative: the last admitted request
    finishes, the next ones wait for the refill). Thread-safe, per process."""

    def __init__(self, config: TokenBudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.rate = config.per_minute / 60.0
        self._lock = threading.Lock()
        self._balance: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, stamp)
        self._in_flight: dict[str, int] = {}
        self.rejected = 0

    @property
    def limited(self) -> bool:
        return bool(self.config.per_minute or self.config.max_in_flight)

    def _refill(self, tenant: str, now: float) -> float:
        tokens, stamp = self._balance.get(tenant, (float(self.config.per_minute), now))
        tokens = min(float(self.config.per_minute), tokens + (now - stamp) * self.rate)
        self._balance[tenant] = (tokens, now)
        return tokens

    def admit(self, tenant: str) -> str | None:
        """None if admitted (then :meth:`release` it once), else why not, with retry advice."""
        if not self.limited:
            return None
        with self._lock:
            cap = self.config.max_in_flight
            n = self._in_flight.get(tenant, 0)
            if cap and n >= cap:
                self.rejected += 1
                return (f"tenant '{tenant}' has {n} generations in flight (tokens.max_in_flight {cap}); "
                        "retry after 500 ms")
            if self.config.per_minute:
                tokens = self._refill(tenant, self.clock())
                if tokens < 1:
                    self.rejected += 1
                    retry = max(1, math.ceil((1 - tokens) / self.rate * 1000))
                    return (f"tenant '{tenant}' used its token budget of {self.config.per_minute} tokens/minute; "
                            f"retry after {retry} ms")
            self._in_flight[tenant] = n + 1
        return None

    def charge(self, tenant: str, tokens: int) -> None:
        if not self.config.per_minute or tokens <= 0:
            return
        with self._lock:
            left = self._refill(tenant, self.clock())
            self._balance[tenant] = (left - tokens, self._balance[tenant][1])

    def release(self, tenant: str) -> None:
        if not self.limited:
            return
        with self._lock:
            n = self._in_flight.get(tenant, 0)
            if n <= 1:
                self._in_flight.pop(tenant, None)
            else:
                self._in_flight[tenant] = n - 1

    def balance(self, tenant: str) -> float:
        with self._lock:
            return self._refill(tenant, self.clock()) if self.config.per_minute else math.inf


# -- request parsing ----------------------------------------------------------------------------
@dataclass
class Generation:
    """One admitted request on its way to the target."""

    prompt: str  # as the target gets it (redacted unless model_sees_redacted=false)
    params: SamplingParams
    stream: bool
    exclude: bool | None  # exclude_input_in_output as the client sent it (None: absent)
    sampling_keys: tuple[str, ...] = ()  # keys the client set, forwarded
    tenant: str = ""
    request: Any = None
    sender: Any = None
    quota_admitted: bool = False
    received: float = field(default_factory=time.perf_counter)
    first_sent: float | None = None  # when the client got its first text
    last_sent: float | None = None
    pieces_sent: int = 0
    cache_key: bytes | None = None  # a deterministic generation's response-cache key
    sent: list[str] = field(default_factory=list)  # pieces sent, kept only to fill the caches
    semantic: tuple[str, Any] | None = None  # (params key, prompt embedding) of a semantic-cache miss
    served_by: str = ""  # "<target>:<version>", "cache" or "semantic_cache" (the audit record)
    redacted_in: int = 0
    redacted_out: int = 0
    fallback: bool = False
    tokens_out: int = 0


def parse_generation(inputs: Mapping[str, np.ndarray], cfg: StreamValidationConfig) -> Generation:
    """Inputs -> :class:`Generation` (prompt not redacted yet); every broken rule raises
    :class:`InvalidInput` naming the input and the rule."""
    prompt, stream, exclude, raw_sp = read_contract(inputs, max_prompt_chars=cfg.max_prompt_chars,
                                                    limit_name="validation.max_prompt_chars")
    if not prompt.strip():
        raise InvalidInput("text_input", "non-empty", "the prompt is only white space")
    params = parse_sampling(raw_sp, max_tokens_cap=cfg.max_tokens, default_max_tokens=cfg.default_max_tokens,
                            cap_name="the guard's validation.max_tokens")
    keys = params.given
    refused = [k for k in keys if k not in cfg.sampling_keys]
    if refused:
        raise InvalidInput("sampling_parameters", "allowed keys",
                           f"key '{refused[0]}' is not allowed here (validation.sampling_keys: "
                           f"{', '.join(cfg.sampling_keys) or 'none'})")
    if params.temperature > cfg.max_temperature:
        raise InvalidInput("sampling_parameters", "key 'temperature'",
                           f"must be at most {cfg.max_temperature:g} (validation.max_temperature), "
                           f"got {params.temperature:g}")
    return Generation(prompt, params, stream, exclude, keys)


def target_sampling(gen: Generation) -> str:
    """The sampling JSON the target gets: the client's keys, normalised, and always max_tokens
    (so the target never falls back to a default above the guard's cap)."""
    out: dict[str, Any] = {"max_tokens": gen.params.max_tokens}
    for key in gen.sampling_keys:
        if key != "max_tokens":
            out[key] = getattr(gen.params, key)
    return json.dumps(out)


# -- the Triton model ---------------------------------------------------------------------------
class TargetStalled(Exception):
    """The target sent nothing for ``target_idle_timeout_s``."""


RETIRE_S = 5.0  # how long a finished BLS response iterator is kept (StreamGuardModel._retire)
# At most this many expired iterators are freed per retirement (one per finished generation):
# after a pause of over 5 s every retired iterator expired together and was freed in one go, each
# with its per-token responses. In rounds of c=8 streaming that alternate between two BLS guards
# and other models (each guard idle between its rounds), the guard's stub froze for good at the
# 2nd round three times out of three; with the frees spread out, at the 33rd. It still froze:
# see docs/stream-guard.md (py-spy: threads in exec() and in an iterator's destructor blocked on
# native locks, the GIL not released; a python_backend 24.10 defect, not fixed here).
RETIRE_FREE_PER_CALL = 2


def watched(responses: Any, idle_s: float, name: str = "") -> Any:
    """The target's responses, read on a thread of their own, in lists: each list is the next
    response (waited for at most ``idle_s``, else :class:`TargetStalled`) and every one that had
    arrived behind it. A worker that falls behind its target then forwards several tokens as one
    piece (one client response instead of several), and one that keeps up forwards them one by
    one. The reader thread of a stalled stream stays blocked in python_backend's iterator (it has
    no timeout); it is a daemon and holds no lock."""
    q: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            for r in responses:
                q.put(r)
        except Exception as exc:  # noqa: BLE001 - handed to the worker, which fails the request
            q.put(exc)
        finally:
            q.put(END)

    threading.Thread(target=read, name=f"bls-read-{name}", daemon=True).start()
    return queued_batches(q, idle_s, TargetStalled)


class _TargetFailed(Exception):
    """The target failed or stalled on one generation (nothing of it sent to the client)."""

    def __init__(self, code: str, message: str, client_message: str, first_response_s: float | None,
                 tokens: int, *, stalled: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.client_message = code, message, client_message
        self.first_response_s, self.tokens, self.stalled = first_response_s, tokens, stalled


def _text_of(tensor: Any) -> str:
    return b"".join(bytes(x) for x in tensor.as_numpy().reshape(-1)).decode("utf-8", "replace")


def _code_name(err: Any) -> str:
    """A target error's status name (a pb_utils.TritonError or an in-process one)."""
    return _CODE_NAMES.get(err.code(), "INTERNAL") if hasattr(err, "code") else "INTERNAL"


def _response_text(resp: Any) -> str | None:
    """The text of one target response (a BLS response's ``text_output``, or an in-process one's)."""
    if isinstance(resp, LocalResponse):
        return resp.text
    tensor = triton.pb().get_output_tensor_by_name(resp, OUTPUT)
    return None if tensor is None else _text_of(tensor)


class StreamGuardModel:
    """``initialize`` / ``execute`` / ``finalize`` of a decoupled guard (see the module doc)."""

    def initialize(self, args: dict[str, str]) -> None:
        triton.setup_logging()
        cfg = triton.model_config(args)
        self.name = args["model_name"]
        if not (cfg.get("model_transaction_policy") or {}).get("decoupled"):
            raise ConfigError(f"model '{self.name}': the stream guard needs model_transaction_policy {{ decoupled: true }}")
        names = {i["name"] for i in cfg.get("input", [])}
        if "text_input" not in names or OUTPUT not in {o["name"] for o in cfg.get("output", [])}:
            raise ConfigError(f"model '{self.name}': a stream guard needs input 'text_input' and output "
                              f"'{OUTPUT}' (the vLLM backend's contract)")
        self.settings = s = parse_settings(model_parameters(cfg), model=self.name)
        self.target, self.version = s.guard.target, s.guard.target_version
        if self.target == self.name:
            raise ConfigError(f"model '{self.name}': parameter 'target' names the guard itself")
        self.inputs = tuple(n for n in INPUTS if n in names)
        self.redactor = Redactor(s.redaction)
        self.tenants = TenantResolver(s.tenancy)
        self.quotas = QuotaManager(s.tenancy) if s.tenancy.quotas else None
        self.budget = TokenBudget(s.tokens)
        self.cancel_poll_s = s.guard.cancel_poll_ms / 1000
        self.pool = ThreadPoolExecutor(s.guard.max_in_flight, thread_name_prefix=f"stream-{self.name}")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.stats = {"requests": 0, "rejected": 0, "ok": 0, "cancelled": 0, "target_errors": 0,
                      "errors": 0, "redacted_in": 0, "redacted_out": 0, "tokens": 0,
                      "cache_hits": 0}
        self.repo = repo = Path(args["model_repository"]).parent
        self.local = LocalGenerator(repo, self.target, guard=self.name) if s.guard.placement == "inprocess" else None
        self.cache: TieredCache | None = None
        self._fingerprints: dict[int, str | None] = {}  # target version -> its artifact's SHA-256
        if s.cache.enabled:
            self.cache = cache = TieredCache(s.cache)
            if not cache.enabled:
                self.cache = None
        # counters and histograms go through the in-process Metrics (flushed by its own thread):
        # no IPC on a worker's per-token path. The rollout families are the batch guard's, so the
        # rollout's gates read a stream guard as they read any guard
        self.label = TenantLabels()
        self.metrics = triton.Metrics(
            self.name, args.get("model_version", "1"), counters={**triton.Metrics.FAMILIES, **COUNTERS},
            gauges=triton.Metrics.GAUGES,
            histograms={"latency": ("tritonguard_target_latency_seconds",
                                    "Time from a generation's target call to the target's first response",
                                    GENERATION_BUCKETS), **HISTOGRAMS},
            zero_at_load=[*(("stream_requests", {"outcome": o, "tenant": s.tenancy.default}) for o in OUTCOMES),
                          "state_errors", "compare_drops", *(["similarity_errors"] if s.similarity.model else [])])
        self.semantic: SemanticCache | None = None
        if s.semantic.enabled:
            if s.semantic.model in (self.name, self.target):
                raise ConfigError(f"model '{self.name}': parameter 'semantic_cache.model' must name an embedding "
                                  f"model, not '{s.semantic.model}'")
            self.semantic = SemanticCache(s.semantic, self._embed)
        similarity = None  # sampled_similarity of canary/shadow texts: the trigram cosine
        if s.similarity.model:
            if s.similarity.model in (self.name, self.target):
                raise ConfigError(f"model '{self.name}': parameter 'similarity.model' must name an embedding "
                                  f"model, not '{s.similarity.model}'")
            similarity = embedding_similarity(functools.partial(self._embed, cfg=s.similarity))
        self._retired: collections.deque = collections.deque(maxlen=65536)
        self._retired_lock = threading.Lock()
        # one record per request (refusals included) on a hash-chained log, written off the path
        path = audit_file(s.audit.path, model=self.name, instance=args.get("model_instance_name", self.name),
                          instances=triton.instance_count(cfg))
        self.audit: AuditLog | None = None
        self._audit_key: bytes | None = None
        self._audit_dropped = 0
        if path:
            self.audit = AuditLog(dataclasses.replace(s.audit, path=path), anchors=open_anchor_store(self.name, repo))
            self._audit_key = load_audit_key(s.audit.key_env)
        self._served = False  # goldens over BLS wait for the first request (none in initialize())
        # version choice, goldens, breakers, fallback, canary and shadow: the rollout state in the
        # store that `exporter route/promote/rollback` write (tritonguard.stream_routing)
        self.router = StreamRouter(guard=self.name, repo=repo, target=self.target, run_text=self._run_text,
                                   store=open_store(self.name, repo), config=s.routing, breaker=s.breaker,
                                   metrics=AuditedMetrics(self.metrics, self.audit, self.name) if self.audit
                                   else self.metrics, pin=self.version, ready=lambda _v: self._served,
                                   latency=recorder_for(self.name, repo), similarity=similarity)
        log.info("stream guard %s -> %s: max_tokens %d, holdback %d chars, redaction %s, max_in_flight %d",
                 self.name, self.target, s.validation.max_tokens, s.holdback_chars,
                 "on" if self.redactor.active else "off", s.guard.max_in_flight)

    def _fingerprint(self, version: int) -> str | None:
        """The artifact fingerprint the cache keys ``version``'s answers on (None: not cached,
        e.g. a target outside this repository)."""
        if version not in self._fingerprints:
            fp = target_fingerprint(self.repo / self.target / str(version)) if version > 0 else None
            if fp is None:
                log.warning("stream guard %s: %s v%d is not in %s: its answers are not cached (the cache keys "
                            "on the target's artifact)", self.name, self.target, version, self.repo)
            self._fingerprints[version] = fp
        return self._fingerprints[version]

    def _embed(self, texts: list[str], cfg: SemanticCacheConfig | SimilarityConfig | None = None) -> np.ndarray:
        """Sentence embeddings of ``texts`` [n, dim] from ``cfg.model`` (its ``cfg.input`` BYTES
        [n, 1] -> ``cfg.output``; BLS, not decoupled); by default ``semantic_cache.model``."""
        cfg = self.settings.semantic if cfg is None else cfg
        p = triton.pb()
        data = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
        resp = p.InferenceRequest(model_name=cfg.model, inputs=[p.Tensor(cfg.input, data)],
                                  requested_output_names=[cfg.output]).exec()
        if resp.has_error():
            raise TargetError(f"embedding model '{cfg.model}': {resp.error().message()}")
        return p.get_output_tensor_by_name(resp, cfg.output).as_numpy()

    def _semantic_key(self, gen: Generation, version: int, sampling: str) -> str:
        """What a semantic hit must share with the request: the artifact answering, the shape of
        the answer and the sampling parameters the target gets (``sampling``)."""
        return json.dumps([self._fingerprint(version), gen.stream, bool(gen.exclude), sampling])

    # -- execute thread: checks only -------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        self._served = True
        for request in requests:
            try:
                sender = TritonSink(request, request.get_response_sender())
            except Exception:  # noqa: BLE001
                log.exception("stream guard %s: no response sender", self.name)
                continue
            self.stats["requests"] += 1
            try:
                gen = self._admit(request)
            except TritonGuardError as exc:
                self._outcome(None, "rejected")
                self._audit_refusal(exc)
                safe_send(sender.fail, str(exc), exc.code)
                continue
            except Exception as exc:  # noqa: BLE001 - never a traceback to the client
                log.exception("stream guard %s: request rejected", self.name)
                self._outcome(None, "rejected")
                safe_send(sender.fail, f"model '{self.name}' cannot read the request: {type(exc).__name__}", "INTERNAL")
                continue
            gen.request, gen.sender = request, sender
            try:
                self.pool.submit(self._run, gen)
            except Exception:  # noqa: BLE001 - pool shut down (unloading)
                self._done(gen)
                safe_send(sender.fail, f"model '{self.name}' is unloading", "UNAVAILABLE")
        return None

    def _admit(self, request: Any) -> Generation:
        gen = parse_generation(triton.request_inputs(request, self.inputs), self.settings.validation)
        tenants, errors = self.tenants.resolve_tenants([triton.request_parameters(request)])
        if errors[0] is not None:
            raise errors[0]
        gen.tenant = tenant = tenants[0] or self.settings.tenancy.default
        with self._lock:
            if self.in_flight >= self.settings.guard.max_in_flight:
                raise QuotaExceeded(f"model '{self.name}' has {self.in_flight} generations in flight "
                                    f"(max_in_flight); retry after 200 ms")
            self.in_flight += 1
        try:
            if self.quotas is not None:
                why = self.quotas.admit([tenant])[0]
                if why is not None:
                    raise QuotaExceeded(why)
                gen.quota_admitted = True
            why = self.budget.admit(tenant)
            if why is not None:
                raise QuotaExceeded(why)
        except BaseException:
            self._release_admission(gen)
            raise
        if self.redactor.active and self.settings.redaction.model_sees_redacted:
            (red,), counts = self.redactor.redact_batch([gen.prompt])
            if counts:
                gen.prompt = red
                gen.redacted_in = sum(counts.values())
                self.stats["redacted_in"] += gen.redacted_in
                self.metrics.inc("stream_redactions", sum(counts.values()), direction="input")
        self.metrics.inc("stream_tokens", len(gen.prompt), direction="in", tenant=self.label(gen.tenant))
        return gen

    def _release_admission(self, gen: Generation) -> None:
        if gen.quota_admitted and self.quotas is not None:
            self.quotas.release([gen.tenant])
            gen.quota_admitted = False
        with self._lock:
            self.in_flight -= 1

    def _outcome(self, gen: Generation | None, outcome: str) -> None:
        """One request ended: its in-process count, its outcome counter, and (ok) its timings."""
        key = {"target_error": "target_errors", "error": "errors"}.get(outcome, outcome)
        self.stats[key] += 1
        tenant = gen.tenant if gen is not None else self.settings.tenancy.default
        self.metrics.inc("stream_requests", 1, outcome=outcome, tenant=self.label(tenant))
        if gen is not None and self.audit is not None:
            self._audit_generation(gen, outcome)
        if gen is not None and gen.first_sent is not None:
            self.metrics.observe("stream_ttft", gen.first_sent - gen.received)
            if gen.pieces_sent >= 2 and gen.last_sent is not None:
                self.metrics.observe("stream_itl", (gen.last_sent - gen.first_sent) / (gen.pieces_sent - 1))

    def _audit_refusal(self, exc: TritonGuardError) -> None:
        if self.audit is None:
            return
        if isinstance(exc, QuotaExceeded):
            self.audit.record("quota_reject", model=self.name, reason=str(exc)[:200])
        else:
            self.audit.record("reject", model=self.name, rule=getattr(exc, "rule", type(exc).__name__),
                              input=getattr(exc, "input_name", ""))
        self._audit_drops()

    def _audit_generation(self, gen: Generation, outcome: str) -> None:
        """One record per generation that was admitted: who answered, how it ended, what it cost;
        the prompt only as a digest (keyed with the audit key when one is set) of its redacted form."""
        assert self.audit is not None
        self.audit.record("generation", tenant=gen.tenant, model=self.name,
                          request=digest(gen.prompt, self._audit_key), served_by=gen.served_by, status=outcome,
                          stream=gen.stream, tokens_out=gen.tokens_out, redacted_in=gen.redacted_in,
                          redacted_out=gen.redacted_out, fallback=gen.fallback)
        self._audit_drops()

    def _audit_drops(self) -> None:
        if self.audit is not None and self.audit.dropped > self._audit_dropped:
            self.metrics.inc("audit_drops", self.audit.dropped - self._audit_dropped)
            self._audit_dropped = self.audit.dropped

    def _charge(self, gen: Generation, tokens: int) -> None:
        gen.tokens_out += tokens
        self.budget.charge(gen.tenant, tokens)
        if tokens:
            self.metrics.inc("stream_tokens", tokens, direction="out", tenant=self.label(gen.tenant))

    @staticmethod
    def _sent(gen: Generation) -> None:
        now = time.perf_counter()
        if gen.first_sent is None:
            gen.first_sent = now
        gen.last_sent = now
        gen.pieces_sent += 1

    def _done(self, gen: Generation) -> None:
        self.budget.release(gen.tenant)
        self._release_admission(gen)

    # -- worker threads: one generation each -----------------------------------------------
    def _bls(self, version: int, prompt: str, stream: bool, sampling: str, exclude: bool | None,
             request: Any = None) -> Any:
        if self.local is not None:
            return self.local.open(version, prompt, stream, sampling, exclude)
        p = triton.pb()
        tensors = [p.Tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_)),
                   p.Tensor("stream", np.array([stream], dtype=bool)),
                   p.Tensor("sampling_parameters", np.array([sampling.encode()], dtype=np.object_))]
        if exclude is not None:
            tensors.append(p.Tensor("exclude_input_in_output", np.array([exclude], dtype=bool)))
        kwargs: dict[str, Any] = {"model_name": self.target, "model_version": int(version),
                                  "inputs": tensors, "requested_output_names": [OUTPUT]}
        if request is not None:
            try:
                kwargs["trace"] = request.trace()
            except Exception:  # noqa: BLE001 - tracing is optional
                pass
        return p.InferenceRequest(**kwargs).exec(decoupled=True)

    def _batches(self, responses: Any) -> Any:
        idle = self.settings.guard.target_idle_timeout_s
        if isinstance(responses, LocalStream):
            return responses.batches(idle, TargetStalled)
        return watched(responses, idle, self.name)

    def _retire(self, responses: Any) -> None:
        """Keep a finished BLS response iterator alive for ``RETIRE_S`` more seconds before it is
        freed. python_backend 24.10 frees an iterator's native state while its stub may still be
        handling that stream's last message: under concurrent BLS streams (measured: a shadow or
        canary call next to live traffic) the guard's stub, or tritonserver, then died within
        about 10 s ('double free or corruption', 'malloc(): unaligned fastbin chunk'); with
        retired iterators kept a few seconds, none did in 60 s runs of the same traffic."""
        if isinstance(responses, LocalStream):
            return  # nothing of python_backend's in it
        now = time.monotonic()
        freed = []
        with self._retired_lock:
            self._retired.append((now, responses))
            # a few at a time (RETIRE_FREE_PER_CALL)
            while (len(freed) < RETIRE_FREE_PER_CALL and self._retired
                   and now - self._retired[0][0] > RETIRE_S):
                freed.append(self._retired.popleft())
        del freed  # the native frees happen here, outside the lock

    def _run_text(self, version: int, prompt: str, sampling: str) -> str:
        """``version``'s whole answer, prompt excluded (goldens, canary and shadow runs)."""
        responses = self._bls(version, prompt, False, sampling, True)
        texts: list[str] = []
        try:
            for batch in self._batches(responses):
                for resp in batch:
                    if resp.has_error():
                        err = resp.error()
                        raise TargetError(err.message(), _code_name(err))
                    text = _response_text(resp)
                    if text is not None:
                        texts.append(text)
        except TargetStalled as exc:
            raise TargetError(f"target '{self.target}' v{version}: {exc}", "UNAVAILABLE") from None
        finally:
            self._retire(responses)
        return "".join(texts)

    def _run(self, gen: Generation) -> None:
        try:
            self._generate(gen)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
            log.exception("stream guard %s: generation failed", self.name)
            self._outcome(gen, "error")
            if not gen.sender.closed:
                safe_send(gen.sender.fail, f"model '{self.name}': generation failed ({type(exc).__name__})", "INTERNAL")
        finally:
            self._done(gen)

    def _replay(self, gen: Generation, text: str) -> None:
        """A cached answer, sent as it was the first time: streamed a word per piece, or whole."""
        if gen.stream:
            for piece in replay_pieces(text):
                gen.sender.piece(piece)
                self._sent(gen)
            gen.sender.finish(None)
        else:
            gen.sender.finish(text)
            self._sent(gen)
        self.stats["cache_hits"] += 1
        gen.served_by = gen.served_by or "cache"
        self._outcome(gen, "ok")

    def _stop_target(self, responses: Any, it: Any, why: str) -> None:
        """Cancel the BLS stream where python_backend can; else read and drop the rest."""
        if isinstance(responses, LocalStream):
            responses.cancel()  # the engine stops decoding it at its next step
            log.debug("stream guard %s: %s; in-process generation stopped", self.name, why)
            return
        cancel = getattr(responses, "cancel", None)
        if cancel is not None:
            try:
                cancel()
                log.info("stream guard %s: %s; target stream cancelled", self.name, why)
                return
            except Exception:  # noqa: BLE001
                log.warning("stream guard %s: cancelling the target stream failed", self.name, exc_info=True)
        t0, dropped = time.perf_counter(), 0
        try:
            for _ in it:
                dropped += 1
        except TargetStalled:
            log.warning("stream guard %s: %s; the target then stalled while its rest was drained", self.name, why)
            return
        if dropped:
            log.info("stream guard %s: %s; this python_backend cannot cancel a BLS stream, drained %d target "
                     "responses in %.0f ms", self.name, why, dropped, (time.perf_counter() - t0) * 1000)

    def _generate(self, gen: Generation) -> None:
        version, role, draw = self.router.pick()
        if version is None:
            self._outcome(gen, "target_error")
            safe_send(gen.sender.fail, f"no healthy version of '{self.target}' can answer (breakers open or "
                      "goldens failed); retry later", "UNAVAILABLE")
            return
        key = None
        if self.cache is not None and role == "primary":  # a canary's answers are not the ones cached
            fp = self._fingerprint(version)
            key = cache_key(self.name, fp, gen) if fp else None
        if key is not None:
            try:
                hit = self.cache.get_many([key])[0]  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - a cache failure costs a miss, never the request
                log.exception("stream guard %s: cache lookup failed", self.name)
                hit = None
            self.metrics.inc("stream_cache", 1, result="hit" if hit is not None else "miss",
                             tenant=self.label(gen.tenant))
            if hit is not None:
                self._replay(gen, bytes(hit[OUTPUT].reshape(-1)[0]).decode("utf-8"))
                return
        gen.cache_key = key
        sampling = target_sampling(gen)
        if self.semantic is not None and role == "primary" and self._semantic_lookup(gen, version, sampling):
            return
        tried: set[int] = set()
        while True:
            tried.add(version)
            gen.served_by = f"{self.target}:{version}"
            t0 = time.perf_counter()
            responses = self._bls(version, gen.prompt, gen.stream, sampling, gen.exclude, gen.request)
            it = self._batches(responses)
            try:
                done = self._forward(gen, version, responses, it, t0)
            except _TargetFailed as failed:
                client_error = failed.code == "INVALID_ARG"  # the request's fault, not the version's
                if not client_error:
                    self.router.record(version, ok=False, first_response_s=failed.first_response_s,
                                       non_finite=NON_FINITE in failed.message, code=failed.code)
                if not client_error and gen.pieces_sent == 0:
                    # nothing reached the client yet: the next version down the chain answers
                    nxt = self.router.next_version(tried)
                    if nxt is not None:
                        log.warning("stream guard %s: %s v%d failed before the first token (%s); falling back "
                                    "to v%d", self.name, self.target, version, failed.message, nxt)
                        self.router.fallback("stall" if failed.stalled else "error")
                        version, role, gen.cache_key, gen.semantic = nxt, "fallback", None, None
                        gen.fallback = True
                        continue
                self._outcome(gen, "target_error")
                self._charge(gen, failed.tokens)
                safe_send(gen.sender.fail, failed.client_message, failed.code)
                return
            finally:
                self._retire(responses)
            break
        if done is None:
            return  # cancelled by the client
        text, first_response_s, call_s, tokens = done
        self.router.record(version, ok=True, first_response_s=first_response_s, call_s=call_s, tokens=tokens)
        if text is not None:
            self.router.after_served(version, draw, gen.prompt, sampling, text,
                                     deterministic=gen.params.greedy or gen.params.seed is not None)

    def _forward(self, gen: Generation, version: int, responses: Any, it: Any,
                 t0: float) -> tuple[str | None, float | None, float, int] | None:
        """Forward ``version``'s answer to the client. Returns (its generated text unredacted, or
        None when no comparison wants it; seconds to its first response; seconds to its last;
        tokens generated), None when the client
        cancelled; raises :class:`_TargetFailed` when the target failed or stalled (nothing sent
        to the client for it: the caller decides between a fallback and the client's error)."""
        out = StreamRedactor(self.redactor, self.settings.holdback_chars) if (
            self.redactor.active and self.settings.redaction.redact_outputs) else None
        sender, request = gen.sender, gen.request
        tokens, next_poll, whole = 0, 0.0, []
        keep = self.router.experimenting  # the raw text, for a canary or shadow comparison
        raw: list[str] = []
        first: float | None = None
        max_tokens = gen.params.max_tokens
        try:
            for batch in it:
                if first is None:
                    first = time.perf_counter() - t0
                texts: list[str] = []
                failed = None
                for resp in batch:
                    if resp.has_error():
                        failed = resp.error()
                        break
                    text = _response_text(resp)
                    if text is not None:
                        texts.append(text)
                if gen.stream:
                    tokens += len(texts)
                    piece = "".join(texts)
                    if keep:
                        raw.append(piece)
                    if out is not None and piece:
                        piece = out.feed(piece)
                    if piece:
                        sender.piece(piece)
                        self._sent(gen)
                        if gen.cache_key is not None or gen.semantic is not None:
                            gen.sent.append(piece)
                else:
                    whole.extend(texts)
                if failed is not None:
                    code = _code_name(failed)
                    log.warning("stream guard %s: target %s v%d failed after %d tokens: %s", self.name,
                                self.target, version, tokens, failed.message())
                    try:
                        for _ in it:  # nothing should follow an error; do not leave it half read
                            pass
                    except TargetStalled:
                        pass
                    raise _TargetFailed(code, failed.message(), f"target '{self.target}' failed: {failed.message()}",
                                        first, tokens)
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + self.cancel_poll_s
                    if request.is_cancelled():
                        self._outcome(gen, "cancelled")
                        self._charge(gen, tokens)
                        log.info("stream guard %s: client cancelled after %d tokens", self.name, tokens)
                        safe_send(sender.fail, "the request was cancelled", "CANCELLED")
                        self._stop_target(responses, it, "client cancelled")
                        return None
                if gen.stream and tokens >= max_tokens:
                    # a target that ignores max_tokens: stop here
                    self._stop_target(responses, it, f"max_tokens {max_tokens} reached")
                    break
        except TargetStalled as exc:
            idle = self.settings.guard.target_idle_timeout_s
            log.warning("stream guard %s: target %s v%d %s (stalled, or failed mid-stream)", self.name, self.target,
                        version, exc)
            raise _TargetFailed("UNAVAILABLE", f"stalled: {exc}", f"target '{self.target}' sent nothing for {idle:g} s "
                                "(it stalled or failed mid-stream); retry later", first, tokens, stalled=True) from None
        call_s = time.perf_counter() - t0  # to the target's last response
        redacted = 0
        generated: str | None = None
        if gen.stream:
            rest = out.flush() if out is not None else ""
            redacted = sum(out.counts.values()) if out is not None else 0
            if keep:
                generated = "".join(raw)
        else:
            text = "".join(whole)
            prompt_first = not gen.exclude and text.startswith(gen.prompt)  # the prompt comes first unless excluded
            generated = text[len(gen.prompt):] if prompt_first else text
            tokens = len(generated)  # one token per character: exact for tinylm, an estimate otherwise
            if out is not None:
                (text,), counts = self.redactor.redact_batch([text])
                redacted = sum(counts.values())
            rest = text
            if not keep:
                generated = None
        self.stats["redacted_out"] += redacted
        gen.redacted_out = redacted
        self.stats["tokens"] += tokens
        self._charge(gen, tokens)
        sender.finish(rest if rest or not gen.stream else None)  # non-streamed: exactly one response
        if rest:
            self._sent(gen)
        self._outcome(gen, "ok")
        if gen.cache_key is not None and self.cache is not None:
            text = "".join(gen.sent) + rest if gen.stream else rest
            try:  # what this client got, redacted: the next identical request gets the same
                self.cache.put_many([(gen.cache_key, {OUTPUT: np.array([text.encode("utf-8")], dtype=np.object_)})])
            except Exception:  # noqa: BLE001 - never fails the request it comes after
                log.exception("stream guard %s: cache fill failed", self.name)
        if gen.semantic is not None and self.semantic is not None:
            if gen.stream or gen.exclude:
                answer = "".join(gen.sent) + rest if gen.stream else rest
            else:  # stored without this prompt: a hit puts its own prompt first
                answer = rest[len(gen.prompt):] if rest.startswith(gen.prompt) else rest
            pkey, vec = gen.semantic
            self.semantic.store(gen.tenant, gen.prompt, pkey, answer, embedding=vec,
                                deterministic=gen.params.greedy or gen.params.seed is not None)
        if redacted:
            self.metrics.inc("stream_redactions", redacted, direction="output")
        return generated, first, call_s, tokens

    def _semantic_lookup(self, gen: Generation, version: int, sampling: str) -> bool:
        """Answer ``gen`` from the semantic cache if a close enough prompt of its tenant was
        answered under the same parameters (True); else remember its embedding for the store."""
        sem = self.semantic
        assert sem is not None
        deterministic = gen.params.greedy or gen.params.seed is not None
        eligible = len(gen.prompt) <= sem.config.max_prompt_chars and (
            deterministic or not sem.config.deterministic_only)
        hit, vec, result = None, None, "skipped"
        if eligible:
            pkey = self._semantic_key(gen, version, sampling)
            vec = sem.embed(gen.prompt)
            if vec is None:
                result = "error"
            else:
                hit = sem.lookup(gen.tenant, gen.prompt, pkey, embedding=vec, deterministic=deterministic)
                result = "miss" if hit is None else "hit"
        self.metrics.inc("stream_semantic", 1, result=result, tenant=self.label(gen.tenant))
        if hit is None:
            gen.semantic = (pkey, vec) if result == "miss" else None
            return False
        log.debug("stream guard %s: semantic hit (cosine %.3f) for tenant %s", self.name, hit.cosine, gen.tenant)
        prompt_first = not gen.stream and not gen.exclude
        gen.served_by = "semantic_cache"
        self._replay(gen, gen.prompt + hit.text if prompt_first else hit.text)
        return True

    def finalize(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.router.close()
        if self.local is not None:
            self.local.close()
        if self.audit is not None:
            self.audit.close()
        self.metrics.close()
        log.info("stream guard %s: %s", self.name, json.dumps(self.stats))
