"""The ``guard`` backend in front of a decoupled generative model (the vLLM backend's contract).

A decoupled guard model (``model_transaction_policy { decoupled: true }``, the inputs
``text_input``, ``stream``, ``sampling_parameters``, ``exclude_input_in_output`` and the output
``text_output``) checks each request, redacts PII in the prompt, streams the target's answer
through a BLS decoupled call and redacts PII in the answer *across token boundaries*:

- ``execute()`` only hands each request to a bounded pool of worker threads (``max_in_flight``;
  a request over it is refused at once), so it returns at once and one long stream never holds
  up the next request.
- A worker runs the generation through the guard's stages (:class:`StreamPipeline`, each concern
  in ``tritonguard/stages/``): ``audit → validate → tenancy → redact in → route → cache →
  semantic cache → redact out``. Their ``admit`` validates, resolves the tenant and admits it
  (``tenancy.quotas``, the token budget ``tokens.*``), redacts the prompt, picks the version and
  may answer from a cache; every refusal is a final error response at once. Output redaction
  (:class:`~tritonguard.privacy.redaction.StreamRedactor`) sees each piece and holds back what may still
  grow into a PII match, so an e-mail or a phone number split over single-character tokens is
  still redacted. Their ``end`` charges the tokens, releases the slots, fills the caches and
  writes the audit record, however the generation ended.
- This module calls the version picked, forwards its answer, and falls back down the chain
  while nothing reached the client.
- A client cancel (``request.is_cancelled()``, polled every ``cancel_poll_ms``) stops the
  forwarding and cancels the BLS stream where python_backend offers ``ResponseIterator.cancel()``
  (r25.04 and later, python_backend PR #398). python_backend 24.10 (Triton 2.51) has no way to cancel a BLS stream:
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
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core import catalogue
from tritonguard.core.config import from_params, model_parameters, split_parameters
from tritonguard.core.errors import ConfigError, QuotaExceeded, TargetError, TritonGuardError
from tritonguard.generation.generator import (
    INPUTS,
    OUTPUT,
    TritonSink,
    safe_send,
)
from tritonguard.generation.local import (
    CODE_NUMBERS,
    END,
    LocalGenerator,
    LocalResponse,
    LocalStream,
    queued_batches,
)
from tritonguard.guard.pipeline import Generation, StreamPipeline
from tritonguard.guard.routing.router import RoutingConfig
from tritonguard.guard.routing.stream import NON_FINITE, StreamRouter, embedding_similarity
from tritonguard.guard.services import AuditedMetrics, audit_file
from tritonguard.guard.stages.audit import AuditStage
from tritonguard.guard.stages.cache import Fingerprints, StreamCacheStage, StreamSemanticStage
from tritonguard.guard.stages.redact import RedactInStage, RedactOutStage
from tritonguard.guard.stages.route import RouteStage
from tritonguard.guard.stages.tenancy import TenancyStage
from tritonguard.guard.stages.validate import (
    StreamValidateStage,
    StreamValidationConfig,
    target_sampling,
)
from tritonguard.privacy.audit import AuditConfig, AuditLog, load_audit_key, open_anchor_store
from tritonguard.privacy.cache import CacheConfig, TieredCache
from tritonguard.privacy.redaction import RedactionConfig, Redactor
from tritonguard.privacy.semantic_cache import SemanticCache, SemanticCacheConfig
from tritonguard.privacy.tenancy import (
    QuotaManager,
    TenancyConfig,
    TenantLabels,
    TokenBudget,
    TokenBudgetConfig,
)
from tritonguard.rollout.breaker import BreakerConfig
from tritonguard.rollout.latency import recorder_for
from tritonguard.rollout.state import open_store
from tritonguard.triton import backend as triton

log = logging.getLogger(__name__)

# pb_utils.TritonError integer codes -> names (python_backend pb_error.h order)
_CODE_NAMES = {number: name for name, number in CODE_NUMBERS.items()}
SECTIONS = ("", "validation", "redaction", "tenancy", "tokens", "cache", "semantic_cache", "routing", "breaker",
            "audit", "similarity")
# Long enough for every built-in at its usual length: an IPv6 with an embedded IPv4 (45), an
# IBAN with spaces (42), an international phone number (<= 40), and e-mails up to 64 characters.
DEFAULT_HOLDBACK = 64



# -- config -------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class StreamGuardConfig:
    """Top-level ``parameters`` of a decoupled guard."""

    target: str = ""
    target_version: int = -1
    # bls: the target is called through Triton (any decoupled model: vLLM, TensorRT-LLM, ...);
    # inprocess: a `generator`-backend target's versions run in this process (no second hop per
    # token; tritonguard.generation.local)
    placement: str = "bls"
    max_in_flight: int = 32  # generations in flight in this instance (worker threads)
    cancel_poll_ms: int = 50
    # the longest wait for the target's next response; past it the client gets UNAVAILABLE (a
    # target that died or failed mid-stream: python_backend 24.10 does not always deliver a
    # decoupled target's error response to a BLS caller, and its iterator has no timeout)
    target_idle_timeout_s: float = 30.0
    # a streamed answer goes out at most one piece per interval (the first at once): what arrives
    # in between is sent together. Each response costs the server and the client about as much
    # as a token; a target slower than this is forwarded token by token as before. 0: every
    # piece at once
    stream_interval_ms: float = 10.0

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("parameter 'target' (the generator model's name) is required")
        if self.max_in_flight < 1:
            raise ValueError(f"parameter 'max_in_flight' must be >= 1, got {self.max_in_flight}")
        if self.cancel_poll_ms < 0:
            raise ValueError(f"parameter 'cancel_poll_ms' must be >= 0, got {self.cancel_poll_ms}")
        if self.placement not in ("bls", "inprocess"):
            raise ValueError(f"parameter 'placement' must be bls or inprocess, got {self.placement!r}")
        if not (0 <= self.stream_interval_ms <= 1000):
            raise ValueError(f"parameter 'stream_interval_ms' must lie in 0..1000, got {self.stream_interval_ms}")
        if not self.target_idle_timeout_s > 0:
            raise ValueError(f"parameter 'target_idle_timeout_s' must be > 0, got {self.target_idle_timeout_s}")


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


# -- cache hits -----------------------------------------------------------------------------
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


def watched(responses: Any, idle_s: float, name: str = "", due: Callable[[], float | None] | None = None) -> Any:
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
    return queued_batches(q, idle_s, TargetStalled, due)


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
        self.quotas = QuotaManager(s.tenancy) if s.tenancy.quotas else None
        self.budget = TokenBudget(s.tokens)
        self.cancel_poll_s = s.guard.cancel_poll_ms / 1000
        self.interval_s = s.guard.stream_interval_ms / 1000
        self.pool = ThreadPoolExecutor(s.guard.max_in_flight, thread_name_prefix=f"stream-{self.name}")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.stats = {"requests": 0, "rejected": 0, "ok": 0, "cancelled": 0, "target_errors": 0,
                      "errors": 0, "redacted_in": 0, "redacted_out": 0, "tokens": 0,
                      "cache_hits": 0}
        self.repo = repo = Path(args["model_repository"]).parent
        self.local = LocalGenerator(repo, self.target, guard=self.name) if s.guard.placement == "inprocess" else None
        self.cache: TieredCache | None = None
        if s.cache.enabled:
            self.cache = cache = TieredCache(s.cache)
            if not cache.enabled:
                self.cache = None
        # counters and histograms go through the in-process Metrics (flushed by its own thread):
        # no IPC on a worker's per-token path. The rollout families are the batch guard's, so the
        # rollout's gates read a stream guard as they read any guard
        self.label = TenantLabels()
        self.metrics = triton.Metrics(
            self.name, args.get("model_version", "1"), counters={**catalogue.GUARD_COUNTERS, **catalogue.STREAM_COUNTERS},
            gauges=catalogue.GUARD_GAUGES, histograms={**catalogue.STREAM_LATENCY, **catalogue.STREAM_HISTOGRAMS},
            zero_at_load=[*(("stream_requests", {"outcome": o, "tenant": s.tenancy.default})
                            for o in catalogue.STREAM_OUTCOMES),
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
        if path:
            self.audit = AuditLog(dataclasses.replace(s.audit, path=path), anchors=open_anchor_store(self.name, repo))
        self._served = False  # goldens over BLS wait for the first request (none in initialize())
        # version choice, goldens, breakers, fallback, canary and shadow: the rollout state in the
        # store that `exporter route/promote/rollback` write (tritonguard.guard.routing.stream)
        self.router = StreamRouter(guard=self.name, repo=repo, target=self.target, run_text=self._run_text,
                                   store=open_store(self.name, repo), config=s.routing, breaker=s.breaker,
                                   metrics=AuditedMetrics(self.metrics, self.audit, self.name) if self.audit
                                   else self.metrics, pin=self.version, ready=lambda _v: self._served,
                                   latency=recorder_for(self.name, repo), similarity=similarity)
        # the path of every generation, in order, holding only the stages this guard's config
        # needs (tritonguard/pipeline.py StreamPipeline; each stage in tritonguard/stages/)
        fingerprints = Fingerprints(repo, self.target, self.name)
        redact_out = self.redactor.active and s.redaction.redact_outputs
        self.pipeline = StreamPipeline([
            *([AuditStage(self.audit, self.name, self.metrics, key=load_audit_key(s.audit.key_env))]
              if self.audit is not None else []),
            StreamValidateStage(self.inputs, s.validation),
            TenancyStage(s.tenancy, self.metrics, self.label, self.quotas, budget=self.budget),
            *([RedactInStage(self.redactor, ["text_input"], s.redaction.model_sees_redacted, False, self.metrics,
                             self.label)] if self.redactor.active and s.redaction.model_sees_redacted else []),
            RouteStage(self.router),
            *([StreamCacheStage(self.cache, self.name, fingerprints, self.metrics, self.label)]
              if self.cache is not None else []),
            *([StreamSemanticStage(self.semantic, self.name, fingerprints, self.metrics, self.label)]
              if self.semantic is not None else []),
            *([RedactOutStage(self.redactor, [OUTPUT], self.metrics, self.label, holdback=s.holdback_chars)]
              if redact_out else []),
        ])
        log.info("stream guard %s: stages %s", self.name, " -> ".join(self.pipeline.names()))
        log.info("stream guard %s -> %s: max_tokens %d, holdback %d chars, redaction %s, max_in_flight %d",
                 self.name, self.target, s.validation.max_tokens, s.holdback_chars,
                 "on" if self.redactor.active else "off", s.guard.max_in_flight)

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

    # -- execute thread: hand each request to a worker ---------------------------------------
    def execute(self, requests: list[Any]) -> None:
        self._served = True
        for request in requests:
            try:
                sender = TritonSink(request, request.get_response_sender())
            except Exception:  # noqa: BLE001
                log.exception("stream guard %s: no response sender", self.name)
                continue
            self.stats["requests"] += 1
            gen = Generation(request=request, sender=sender)
            with self._lock:
                full = self.in_flight >= self.settings.guard.max_in_flight
                if not full:
                    self.in_flight += 1
            if full:  # every worker is busy: refused at once, never queued behind them
                self._refuse(gen, QuotaExceeded(f"model '{self.name}' has {self.in_flight} generations in flight "
                                                "(max_in_flight); retry after 200 ms"))
                continue
            try:
                self.pool.submit(self._run, gen)
            except Exception:  # noqa: BLE001 - pool shut down (unloading)
                self._release_worker()
                safe_send(sender.fail, f"model '{self.name}' is unloading", "UNAVAILABLE")
        return None

    def _release_worker(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _refuse(self, gen: Generation, exc: TritonGuardError) -> None:
        """A refusal before the target: the client's error at once (its code and message), and
        the stages' ends (the audit record, the slots of those that admitted it)."""
        gen.error = exc
        self._end(gen, "target_error" if isinstance(exc, TargetError) else "rejected")
        safe_send(gen.sender.fail, str(exc), exc.code)

    def _end(self, gen: Generation, outcome: str) -> None:
        """A generation ended: its outcome and timings counted, then every admitted stage's end."""
        gen.outcome = outcome
        self.stats[{"target_error": "target_errors", "error": "errors"}.get(outcome, outcome)] += 1
        self.metrics.inc("stream_requests", 1, outcome=outcome,
                         tenant=self.label(gen.tenant or self.settings.tenancy.default))
        if gen.first_sent is not None:
            self.metrics.observe("stream_ttft", gen.first_sent - gen.received)
            if gen.pieces_sent >= 2 and gen.last_sent is not None:
                self.metrics.observe("stream_itl", (gen.last_sent - gen.first_sent) / (gen.pieces_sent - 1))
        self.stats["redacted_in"] += gen.redacted_in
        self.stats["redacted_out"] += gen.redacted_out
        self.stats["tokens"] += gen.tokens_out
        self.pipeline.end(gen)

    @staticmethod
    def _sent(gen: Generation, piece: str) -> None:
        now = time.perf_counter()
        if gen.first_sent is None:
            gen.first_sent = now
        gen.last_sent = now
        gen.pieces_sent += 1
        if gen.keep_text:
            gen.sent.append(piece)

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

    def _batches(self, responses: Any, due: Callable[[], float | None] | None = None) -> Any:
        idle = self.settings.guard.target_idle_timeout_s
        if isinstance(responses, LocalStream):
            return responses.batches(idle, TargetStalled, due)
        return watched(responses, idle, self.name, due)

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
            try:
                self.pipeline.admit(gen)
            except TritonGuardError as exc:
                self._refuse(gen, exc)
                return
            if gen.answer is not None:
                self._replay(gen, gen.answer)
            else:
                self._generate(gen)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
            log.exception("stream guard %s: generation failed", self.name)
            if not gen.outcome:
                gen.error = exc
                self._end(gen, "error")
            if not gen.sender.closed:
                safe_send(gen.sender.fail, f"model '{self.name}': generation failed ({type(exc).__name__})", "INTERNAL")
        finally:
            self._release_worker()

    def _replay(self, gen: Generation, text: str) -> None:
        """A stage's answer (a cache hit), sent as it was the first time: streamed a word per
        piece, or whole."""
        if gen.stream:
            for piece in replay_pieces(text):
                gen.sender.piece(piece)
                self._sent(gen, piece)
            gen.sender.finish(None)
        else:
            gen.sender.finish(text)
            self._sent(gen, text)
        self.stats["cache_hits"] += 1
        self._end(gen, "ok")

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
        """Call the version routing picked and forward its answer; fall back down the chain while
        nothing reached the client; record the outcome on the router (breakers, comparisons)."""
        version = gen.version
        assert version is not None
        sampling = target_sampling(gen)
        tried: set[int] = set()
        while True:
            tried.add(version)
            gen.served_by = f"{self.target}:{version}"
            t0 = time.perf_counter()
            responses = self._bls(version, gen.prompt, gen.stream, sampling, gen.exclude, gen.request)
            try:
                done = self._forward(gen, version, responses, t0)
            except _TargetFailed as failed:
                # the request's fault, not the version's. A BLS target's code arrives as INTERNAL on
                # python_backend 24.10 (server issue #7804) and as sent from r25.04: whatever this
                # release passes on is used; an in-process target's code is always its own
                client_error = failed.code == "INVALID_ARG"
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
                        # a new answer: the caches keep none of it, the stages drop what they held
                        version, gen.version, gen.role, gen.fallback = nxt, nxt, "fallback", True
                        gen.attempt += 1
                        continue
                gen.tokens_out += failed.tokens
                gen.error = TargetError(failed.client_message, failed.code)
                self._end(gen, "target_error")
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
            self.router.after_served(version, gen.draw, gen.prompt, sampling, text, deterministic=gen.deterministic)

    def _forward(self, gen: Generation, version: int, responses: Any, t0: float) -> tuple[str | None, float | None, float, int] | None:
        """Forward ``version``'s answer to the client. Returns (its generated text unredacted, or
        None when no comparison wants it; seconds to its first response; seconds to its last;
        tokens generated), None when the client
        cancelled; raises :class:`_TargetFailed` when the target failed or stalled (nothing sent
        to the client for it: the caller decides between a fallback and the client's error)."""
        pipeline, sender, request = self.pipeline, gen.sender, gen.request
        filtered = bool(pipeline.filters)
        tokens, next_poll, whole = 0, 0.0, []
        interval, held = self.interval_s if gen.stream else 0.0, ""  # text held until the interval since the last piece ends

        draining = False  # reading the target's rest to drop it: no wake-ups for held text

        def due() -> float | None:
            """Seconds until the held text is due (None: nothing held): the reader's next wake-up."""
            if draining or not held or gen.last_sent is None:
                return None
            return interval - (time.perf_counter() - gen.last_sent)

        it = self._batches(responses, due if interval else None)
        keep = self.router.experimenting  # the raw text, for a canary or shadow comparison
        raw: list[str] = []
        first: float | None = None
        max_tokens = gen.params.max_tokens
        try:
            for batch in it:
                if not batch:  # a tick: nothing arrived; what was held back goes out once due
                    if held and time.perf_counter() - (gen.last_sent or 0.0) >= interval:
                        sender.piece(held)
                        self._sent(gen, held)
                        held = ""
                else:
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
                        if filtered and piece:
                            piece = pipeline.piece(gen, piece)
                        if interval and gen.first_sent is not None:
                            held += piece
                            piece = ""
                            if held and time.perf_counter() - gen.last_sent >= interval:  # type: ignore[operator]
                                piece, held = held, ""
                        if piece:
                            sender.piece(piece)
                            self._sent(gen, piece)
                    else:
                        whole.extend(texts)
                    if failed is not None:
                        code = _code_name(failed)
                        log.warning("stream guard %s: target %s v%d failed after %d tokens: %s", self.name,
                                    self.target, version, tokens, failed.message())
                        draining = True
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
                        gen.tokens_out += tokens
                        gen.error = TritonGuardError("the request was cancelled")
                        self._end(gen, "cancelled")
                        log.info("stream guard %s: client cancelled after %d tokens", self.name, tokens)
                        safe_send(sender.fail, "the request was cancelled", "CANCELLED")
                        draining = True
                        self._stop_target(responses, it, "client cancelled")
                        return None
                if gen.stream and tokens >= max_tokens:
                    # a target that ignores max_tokens: stop here
                    draining = True
                    self._stop_target(responses, it, f"max_tokens {max_tokens} reached")
                    break
        except TargetStalled as exc:
            idle = self.settings.guard.target_idle_timeout_s
            log.warning("stream guard %s: target %s v%d %s (stalled, or failed mid-stream)", self.name, self.target,
                        version, exc)
            raise _TargetFailed("UNAVAILABLE", f"stalled: {exc}", f"target '{self.target}' sent nothing for {idle:g} s "
                                "(it stalled or failed mid-stream); retry later", first, tokens, stalled=True) from None
        call_s = time.perf_counter() - t0  # to the target's last response
        generated: str | None = None
        if gen.stream:
            rest = held + pipeline.finish(gen, "")
            if keep:
                generated = "".join(raw)
        else:
            text = "".join(whole)
            prompt_first = not gen.exclude and text.startswith(gen.prompt)  # the prompt comes first unless excluded
            generated = text[len(gen.prompt):] if prompt_first else text
            tokens = len(generated)  # one token per character: exact for tinylm, an estimate otherwise
            rest = pipeline.finish(gen, text)
            if not keep:
                generated = None
        gen.tokens_out += tokens
        sender.finish(rest if rest or not gen.stream else None)  # non-streamed: exactly one response
        if rest:
            self._sent(gen, rest)
        if gen.keep_text:
            gen.text = "".join(gen.sent)  # what this client got, redacted: what the caches keep
        self._end(gen, "ok")
        return generated, first, call_s, tokens

    def finalize(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.router.close()
        if self.local is not None:
            self.local.close()
        if self.audit is not None:
            self.audit.close()
        self.metrics.close()
        log.info("stream guard %s: %s", self.name, json.dumps(self.stats))
