"""The ``guard`` backend in front of a decoupled generative model (the vLLM backend's contract).

A decoupled guard model (``model_transaction_policy { decoupled: true }``, the inputs
``text_input``, ``stream``, ``sampling_parameters``, ``exclude_input_in_output`` and the output
``text_output``) checks each request, redacts PII in the prompt, streams the target's answer and
redacts PII in the answer *across token boundaries*:

- ``execute()`` only hands each request to a bounded pool of worker threads (``max_in_flight``;
  a request over it is refused at once), so it returns at once and one long stream never holds
  up the next request.
- A worker runs the generation through the guard's stages (:class:`StreamPipeline`, built by
  :class:`~tritonguard.guard.stream.services.StreamServices`): ``audit → validate → tenancy →
  redact in → route → cache → semantic cache → redact out``. Their ``admit`` validates, resolves
  the tenant and admits it (``tenancy.quotas``, the token budget ``tokens.*``), redacts the
  prompt, picks the version and may answer from a cache; every refusal is a final error response
  at once. Output redaction sees each piece and holds back what may still grow into a PII match.
  Their ``end`` charges the tokens, releases the slots, fills the caches and writes the audit
  record, however the generation ended.
- The version picked is called (:class:`~tritonguard.guard.stream.target.TargetCalls`: BLS, in
  process for a ``generator`` target, or an OpenAI-compatible server for a version declared at a
  URL in the target's ``endpoints.json``) and its answer forwarded
  (:class:`~tritonguard.guard.stream.forwarder.StreamForwarder`); while nothing reached the client
  a failing version falls back down the chain.
- A client's stop request (its id ``tritonguard-stop:<id of the generation>``, the same
  credential; :mod:`~tritonguard.guard.stream.stops`) ends that generation at the next cancel
  poll with a plain final response and stops the target as below: how a client that went away
  ends an answer without cancelling its stream (the OpenAI front does).
- A client cancel (``request.is_cancelled()``, polled every ``cancel_poll_ms``) stops the
  forwarding and cancels the BLS stream where python_backend offers ``ResponseIterator.cancel()``
  (r25.04 and later, python_backend PR #398); on python_backend 24.10 (Triton 2.51) the worker
  reads the target's remaining responses and drops them (bounded by the ``max_tokens`` it
  forwarded), and logs it; a ``generator``-backend target is first told to stop (a stop request
  naming the call: ``tritonguard.generation.contract.STOP_PREFIX``), so little is left to drop.
- Output rails (``rails.*``, :mod:`~tritonguard.guard.stream.rails`): rules and a classifier
  model judge the prompt (a block is refused like a bad input) and the answer through a bounded
  hold-back; a block ends the stream with ``finish_reason`` ``content_filter`` (when the config
  declares that output) or an INVALID_ARG error naming the rail, and stops the target as above.

Metrics on Triton's /metrics: ``tritonguard_stream_requests_total`` (by outcome and tenant),
``tritonguard_stream_tokens_total`` (in/out, by tenant), ``tritonguard_stream_redactions_total``,
and the histograms ``tritonguard_stream_ttft_seconds`` (hold-back included) and
``tritonguard_stream_itl_seconds`` (one mean per streamed request).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tritonguard.core import catalogue, repository
from tritonguard.core.config import model_parameters
from tritonguard.core.errors import ConfigError, QuotaExceeded, TargetError, TritonGuardError
from tritonguard.generation.contract import INPUTS, OUTPUT
from tritonguard.generation.local import LocalGenerator
from tritonguard.guard import source
from tritonguard.guard.pipeline import Generation
from tritonguard.guard.routing.stream import NON_FINITE, StreamRouter, embedding_similarity
from tritonguard.guard.stages.tenancy import TenancyStage
from tritonguard.guard.stages.validate import target_sampling
from tritonguard.guard.stream.config import SimilarityConfig, parse_settings
from tritonguard.guard.stream.forwarder import ReasonSink, StreamForwarder
from tritonguard.guard.stream.openai_target import VersionTargets, openai_client
from tritonguard.guard.stream.rails import Blocked, Rails, bls_classifier
from tritonguard.guard.stream.services import StreamServices
from tritonguard.guard.stream.stops import ClientStops, is_stop
from tritonguard.guard.stream.target import TargetCalls, TargetFailed
from tritonguard.privacy.cache.semantic import SemanticCacheConfig
from tritonguard.rollout.latency import recorder_for
from tritonguard.rollout.replicas import served_versions, start_heartbeat
from tritonguard.rollout.stores import open_store
from tritonguard.triton import backend as triton
from tritonguard.triton.metrics import Metrics
from tritonguard.triton.streams import ResponseSink, embed_texts, send_safely

log = logging.getLogger(__name__)


class StreamGuardModel:
    """``initialize`` / ``execute`` / ``finalize`` of a decoupled guard (see the module doc)."""

    def initialize(self, args: dict[str, str]) -> None:
        a = triton.prologue(args)
        cfg = a.config
        self.name = a.name
        if not a.decoupled:
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
        self.cancel_poll_s = s.guard.cancel_poll_ms / 1000
        self.interval_s = s.guard.stream_interval_ms / 1000
        self.pool = ThreadPoolExecutor(s.guard.max_in_flight, thread_name_prefix=f"stream-{self.name}")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.stats = {"requests": 0, "rejected": 0, "ok": 0, "cancelled": 0, "target_errors": 0,
                      "errors": 0, "blocked": 0, "redacted_in": 0, "redacted_out": 0, "tokens": 0,
                      "cache_hits": 0}
        # the repository itself, never the parent of Triton's temporary copy (tritonguard/guard/source.py)
        self.source = source.resolve(a.name, a.model_dir, os.environ)
        self.repo = repo = self.source.root
        self.source.fetch(self.target)
        g = s.guard
        self.local = (LocalGenerator(repo, self.target, guard=self.name) if g.placement == "inprocess" else
                      openai_client(g.target_url, g.target_model, g.target_api_key_env, g.target_api_key_file,
                                    guard=self.name, target=self.target, timeout_s=g.target_idle_timeout_s)
                      if g.placement == "openai" else None)
        # versions of the target served at a URL (endpoints.json beside its config.pbtxt), called
        # there whatever the placement: a rollout can move traffic from Triton to another runtime
        self.remote = VersionTargets(repo / self.target, guard=self.name, target=self.target,
                                     timeout_s=g.target_idle_timeout_s)
        self.calls = TargetCalls(name=self.name, target=self.target, local=self.local,
                                 idle_s=s.guard.target_idle_timeout_s,
                                 stop_requests=s.guard.stop_requests and self._stoppable(repo), remote=self.remote)
        # output rails; a final response with finish_reason where the config declares that output
        self.reasons = "finish_reason" in {o["name"] for o in cfg.get("output", [])}
        self.rails: Rails | None = None
        if s.rails.active:
            if s.rails.model in (self.name, self.target):
                raise ConfigError(f"model '{self.name}': parameter 'rails.model' must name a classifier model, "
                                  f"not '{s.rails.model}'")
            self.rails = Rails(s.rails, bls_classifier(s.rails) if s.rails.model else None, name=self.name)
        # counters and histograms go through the in-process Metrics (flushed by its own thread):
        # no IPC on a worker's per-token path. The rollout families are the batch guard's, so the
        # rollout's gates read a stream guard as they read any guard
        self.metrics = Metrics(
            self.name, a.version, counters={**catalogue.GUARD_COUNTERS, **catalogue.STREAM_COUNTERS},
            gauges=catalogue.GUARD_GAUGES, histograms={**catalogue.STREAM_LATENCY, **catalogue.STREAM_HISTOGRAMS},
            zero_at_load=[*(("stream_requests", {"outcome": o, "tenant": s.tenancy.default})
                            for o in catalogue.STREAM_OUTCOMES),
                          "state_errors", "compare_drops", *(["similarity_errors"] if s.similarity.model else [])])
        self.services = StreamServices(s, name=self.name, target=self.target, repo=repo, metrics=self.metrics,
                                       embed=self._embed, instance=a.instance, instances=a.instances)
        self.label = self.services.label
        similarity = None  # sampled_similarity of canary/shadow texts: the trigram cosine
        if s.similarity.model:
            if s.similarity.model in (self.name, self.target):
                raise ConfigError(f"model '{self.name}': parameter 'similarity.model' must name an embedding "
                                  f"model, not '{s.similarity.model}'")
            similarity = embedding_similarity(functools.partial(self._embed, cfg=s.similarity))
        self._served = False  # goldens over BLS wait for the first request (none in initialize())
        # version choice, goldens, breakers, fallback, canary and shadow: the rollout state in the
        # store that `exporter route/promote/rollback` write (tritonguard.guard.routing.stream)
        self.router = StreamRouter(guard=self.name, repo=repo, target=self.target, run_text=self.calls.run_text,
                                   store=open_store(self.name, repo), config=s.routing, breaker=s.breaker,
                                   metrics=self.services.router_metrics(), pin=self.version,
                                   ready=lambda _v: self._served, latency=recorder_for(self.name, repo),
                                   similarity=similarity,
                                   # an object-store repository: a version is routed to once its
                                   # files, or its URL in endpoints.json, are fetched here
                                   present=self._present if self.source.remote else None)
        if self.source.remote:
            source.follow_rollout(self.source, self.router.view, self.target, self._present, guard=self.name)
        self.pipeline = self.services.pipeline(self.router, self.inputs)
        # a client's stop of its own generation, by a stop request instead of a cancel
        # matched to its generation by the tenant the pipeline's own tenancy stage resolves
        tenancy = next(st for st in self.pipeline.stages if isinstance(st, TenancyStage))
        self.stops = ClientStops(self.name, tenancy.tenant_of)
        # this replica in the shared store's registry (Redis only): the exporter finds it there
        self.heartbeat = start_heartbeat(self.name, lambda: served_versions(self.router.state))
        log.info("stream guard %s: stages %s", self.name, " -> ".join(self.pipeline.names()))
        log.info("stream guard %s -> %s: max_tokens %d, holdback %d chars, redaction %s, max_in_flight %d",
                 self.name, self.target, s.validation.max_tokens, s.holdback_chars,
                 "on" if self.services.redactor.active else "off", s.guard.max_in_flight)

    def _present(self, version: int) -> bool:
        """Whether ``version`` of the target is on this replica: its files, fetched and checked,
        or its declaration at a URL in the target's ``endpoints.json`` as fetched."""
        return self.source.present(self.target, version) or self.remote.view.get(version) is not None

    def _stoppable(self, repo: Any) -> bool:
        """Whether the target is served by this project's ``generator`` backend (it honours stop
        requests); any other target (vLLM, TensorRT-LLM) would take one for a generation."""
        try:
            return repository.read_config(repo / self.target).get("backend") == "generator"
        except Exception:  # noqa: BLE001 - unknown: no stop requests
            return False

    def _embed(self, texts: list[str], cfg: SemanticCacheConfig | SimilarityConfig | None = None) -> np.ndarray:
        """Sentence embeddings of ``texts`` [n, dim] from ``cfg.model`` (its ``cfg.input`` BYTES
        [n, 1] -> ``cfg.output``; BLS, not decoupled); by default ``semantic_cache.model``."""
        cfg = self.settings.semantic if cfg is None else cfg
        return embed_texts(cfg.model, cfg.input, cfg.output, texts)

    # -- execute thread: hand each request to a worker ---------------------------------------
    def execute(self, requests: list[Any]) -> None:
        self._served = True
        for request in requests:
            if is_stop(triton.request_id(request)):  # a client stops one of its generations
                self._stop_request(request)
                continue
            try:
                sender = ReasonSink(request, OUTPUT) if self.reasons else ResponseSink(request, OUTPUT)
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
                send_safely(sender.fail, f"model '{self.name}' is unloading", "UNAVAILABLE")
        return None

    def _stop_request(self, request: Any) -> None:
        """A stop request (:mod:`~tritonguard.guard.stream.stops`): the stop file left for the
        instance that holds the generation, and a plain final response at once (an error naming
        why when it cannot be taken)."""
        try:
            sink = ResponseSink(request, OUTPUT)
        except Exception:  # noqa: BLE001
            log.exception("stream guard %s: no response sender", self.name)
            return
        try:
            self.stops.ask(triton.request_id(request), triton.request_parameters(request))
        except TritonGuardError as exc:
            send_safely(sink.fail, str(exc), exc.code)
            return
        send_safely(sink.finish, None)

    def _release_worker(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _refuse(self, gen: Generation, exc: TritonGuardError) -> None:
        """A refusal before the target: the client's error at once (its code and message), and
        the stages' ends (the audit record, the slots of those that admitted it)."""
        gen.error = exc
        self._end(gen, "target_error" if isinstance(exc, TargetError) else
                  "blocked" if isinstance(exc, Blocked) else "rejected")
        send_safely(gen.sender.fail, str(exc), exc.code)

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

    def _forwarder(self, gen: Generation) -> StreamForwarder:
        return StreamForwarder(gen, calls=self.calls, pipeline=self.pipeline, name=self.name, target=self.target,
                               interval_s=self.interval_s, cancel_poll_s=self.cancel_poll_s,
                               keep=self.router.experimenting, on_end=self._end, rails=self.rails,
                               stops=self.stops)

    # -- worker threads: one generation each -----------------------------------------------
    def _run(self, gen: Generation) -> None:
        try:
            try:
                self.pipeline.admit(gen)
                if self.rails is not None:  # the prompt as the target would get it
                    self.rails.prompt(gen.prompt)
            except TritonGuardError as exc:
                self._refuse(gen, exc)
                return
            if gen.answer is not None:
                self.stats["cache_hits"] += 1
                self._forwarder(gen).replay(gen.answer)
            else:
                self._generate(gen)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
            log.exception("stream guard %s: generation failed", self.name)
            if not gen.outcome:
                gen.error = exc
                self._end(gen, "error")
            if not gen.sender.closed:
                send_safely(gen.sender.fail, f"model '{self.name}': generation failed ({type(exc).__name__})", "INTERNAL")
        finally:
            self._release_worker()

    def _generate(self, gen: Generation) -> None:
        """Call the version routing picked and forward its answer; fall back down the chain while
        nothing reached the client; record the outcome on the router (breakers, comparisons)."""
        version = gen.version
        assert version is not None
        sampling = target_sampling(gen)
        tried: set[int] = set()
        forwarder = self._forwarder(gen)
        while True:
            tried.add(version)
            gen.served_by = f"{self.target}:{version}"
            t0 = time.perf_counter()
            responses = self.calls.open(version, gen.prompt, gen.stream, sampling, gen.exclude, gen.request)
            try:
                done = forwarder.forward(version, responses, t0)
            except TargetFailed as failed:
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
                forwarder.fail(failed.client_message, failed.code)
                return
            finally:
                self.calls.retire(responses)
            break
        if done is None:
            return  # cancelled by the client, or blocked by a rail
        text, first_response_s, call_s, tokens = done
        self.router.record(version, ok=True, first_response_s=first_response_s, call_s=call_s, tokens=tokens)
        if text is not None:
            self.router.after_served(version, gen.draw, gen.prompt, sampling, text, deterministic=gen.deterministic)

    def finalize(self) -> None:
        # logged at both ends: an unload that stalls then shows whether Triton called finalize
        # (it does only once every request of the model was released) and which step took long
        t0 = time.monotonic()
        log.info("stream guard %s: unloading (%d generations in flight)", self.name, self.in_flight)
        self.pool.shutdown(wait=False, cancel_futures=True)
        steps = [("heartbeat", getattr(self, "heartbeat", None), "stop"), ("router", self.router, "close"),
                 ("in-process target", self.local, "close"), ("URL versions", getattr(self, "remote", None), "close"),
                 ("source", self.source, "close"),  # the object-store fetcher thread, when there is one
                 ("services", self.services, "close"), ("metrics", self.metrics, "close")]
        for what, obj, method in steps:
            if obj is None:
                continue
            t = time.monotonic()
            getattr(obj, method)()
            took = time.monotonic() - t
            if took > 1.0:
                log.warning("stream guard %s: closing the %s took %.1f s", self.name, what, took)
        log.info("stream guard %s: %s; unloaded in %.1f s", self.name, json.dumps(self.stats), time.monotonic() - t0)
