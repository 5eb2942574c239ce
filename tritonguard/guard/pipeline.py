"""The guard's path for one ``execute()`` batch: an ordered list of stages over one :class:`Batch`.

A guard builds its list once, from its configuration (:func:`tritonguard.guard.stages.build`), holding
only the stages it needs::

    validate → tenancy → redact (input) → keys → cache.lookup → route → redact (output)
             → respond → cache.fill → audit → quota release → cost

Each stage is one concern in one module (``tritonguard/guard/stages/``) with one method,
``run(batch)``. A stage reads what earlier stages left on the batch and narrows or fills it:
requests it answers or refuses leave ``batch.route`` (the requests still pending, their fused
inputs ``batch.fused`` and ``batch.sizes``); ``route`` sets ``batch.routed``. When a stage
raises, the rest are skipped except those marked ``always`` (bookkeeping that must happen for
every batch: responses already decided, audit, quota slots); those never raise.

A decoupled (streaming) guard runs the same kind of list over one :class:`Generation` at a
time (:class:`StreamPipeline`, :mod:`tritonguard.guard.stream`)::

    audit → validate → tenancy → redact (input) → route → cache → semantic cache → redact (output)

with the stream half of the same interface: ``admit(gen)`` in order before the target is called
(a stage refuses by raising, or answers by setting ``gen.answer``: a cache hit), ``piece(gen,
text)`` on every piece of the answer on its way to the client (output redaction holds text back
there), ``finish(gen, rest)`` once at its end, and ``end(gen)`` in reverse order for every stage
whose ``admit`` ran (and every ``always`` stage), whatever happened: budgets charged, slots
released, caches filled, the audit record written. The guard itself only runs the list, calls
the target and falls back to the next version when the target fails before the first token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.errors import TritonGuardError
from tritonguard.core.tensors import ModelSignature, concat

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One ``execute()`` batch on its way through the stages (indices are request indices)."""

    params: list[Mapping[str, Any]] = field(default_factory=list)  # request parameters, per request
    inputs: list[dict[str, np.ndarray]] = field(default_factory=list)  # read by validate
    responses: list[Any] = field(default_factory=list)  # one per request; None until decided
    requests: list[Any] = field(default_factory=list)  # the Triton requests (empty off Triton)
    verdict: Any = None  # validation.BatchVerdict
    trace: Any = None  # tracing.BatchTrace when some requests are traced, else None
    served_by: list[bool] = field(default_factory=list)  # per request: wants SERVED_BY
    clock: tuple[int, int] | None = None  # (time_ns, perf_counter_ns) at execute(), when tracing

    tenants: list[str] = field(default_factory=list)  # per request; "" where no valid tenant was named
    errors: dict[int, TritonGuardError] = field(default_factory=dict)  # refusals after validation
    # pending: what still goes to the router (each stage may narrow it)
    route: list[int] = field(default_factory=list)
    fused: dict[str, np.ndarray] = field(default_factory=dict)  # their inputs, as the target sees them
    sizes: list[int] = field(default_factory=list)
    key_inputs: dict[str, np.ndarray] | None = None  # the pending inputs the cache and audit key on (redacted)
    routed: Any = None  # routing.Routed, once routed
    # per request, the uniform draw that places it in a rollout's bands (candidate, arms, primary);
    # drawn by the cache lookup during a rollout (a request in a candidate's band skips the cache:
    # cached answers are the primary's, and would starve the candidate), reused by the router
    draws: np.ndarray | None = None

    hits: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # answered from the cache
    hit_sizes: dict[int, int] = field(default_factory=dict)
    hit_tiers: dict[int, str] = field(default_factory=dict)  # deepest tier a hit's rows came from (traced batches)
    keys: dict[int, list[bytes]] = field(default_factory=dict)  # row keys, per request
    lookup_keys: dict[int, list[bytes]] = field(default_factory=dict)  # row keys of requests the cache looked up
    digests: dict[int, str] = field(default_factory=dict)  # audit digest per valid request
    cache_state: dict[int, str] = field(default_factory=dict)  # hit / miss / bypass; absent: off (no lookup)
    redacted: set[int] = field(default_factory=set)  # requests with PII replaced in their inputs
    admitted: list[str] = field(default_factory=list)  # tenants holding an in-flight slot
    artifact_sha: str | None = None  # of the primary's artifact, when keyed (None: not cacheable)
    primary_label: str = ""  # "<target>:<version>" whose answers may be cached
    cache_label: str = ""  # SERVED_BY of cache hits
    calls: Sequence[Any] = ()  # the router's target calls for this batch (cost, tracing)
    # the serving thread's CPU time spent inside those calls (an in-process target runs on it)
    calls_cpu_ns: int | None = None

    @property
    def valid(self) -> bool:
        return self.verdict is not None and bool(self.verdict.valid)

    def refuse(self, i: int, err: TritonGuardError) -> None:
        """Request ``i`` is answered with ``err`` (after validation: a tenant or quota refusal)."""
        self.errors[i] = err

    def keep(self, positions: Sequence[int]) -> None:
        """Narrow the pending requests to ``positions`` (indices into ``route``)."""
        if len(positions) == len(self.route):
            return
        starts = starts_of(self.sizes)
        total = len(self.route)
        self.fused = take(self.fused, starts, positions, total)
        if self.key_inputs is not None:
            self.key_inputs = take(self.key_inputs, starts, positions, total)
        self.route = [self.route[p] for p in positions]
        self.sizes = [self.sizes[p] for p in positions]


def starts_of(sizes: Sequence[int]) -> list[int]:
    """Start row of each request, plus the total (a list: cheaper than numpy for a few requests)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def take(fused: Mapping[str, np.ndarray], starts: Sequence[int], positions: Sequence[int],
         total: int) -> dict[str, np.ndarray]:
    """The rows of the requests at ``positions`` of a fused batch of ``total`` requests."""
    if len(positions) == total:
        return dict(fused)
    if not positions:
        return {}
    return {k: concat([v[starts[p]:starts[p + 1]] for p in positions]) for k, v in fused.items()}


@dataclass
class Generation:
    """One request to a decoupled guard on its way through the stages (its stream half)."""

    prompt: str = ""  # as the target gets it (redacted unless model_sees_redacted=false)
    params: Any = None  # generator.SamplingParams
    stream: bool = False
    exclude: bool | None = None  # exclude_input_in_output as the client sent it (None: absent)
    sampling_keys: tuple[str, ...] = ()  # keys the client set, forwarded
    request: Any = None  # the Triton request (None off Triton: then ``inputs`` and ``parameters``)
    sender: Any = None
    inputs: Mapping[str, np.ndarray] | None = None
    parameters: Mapping[str, Any] | None = None
    received: float = field(default_factory=time.perf_counter)
    admitted: int = 0  # stages whose admit ran to the end (StreamPipeline)
    # set by the stages on admission
    tenant: str = ""
    quota_admitted: bool = False  # holds a tenancy.quotas in-flight slot
    budget_admitted: bool = False  # holds a tokens.max_in_flight slot
    budget_reserved: int = 0  # tokens reserved from the tenant's tokens.per_minute, settled at the end
    version: int | None = None  # the target version routing picked
    role: str = ""  # primary / candidate / shadow... as routing picked it; "fallback" after one
    draw: float = 0.0
    attempt: int = 0  # which call of the target the answer's pieces come from (a fallback: the next)
    answer: str | None = None  # set by a stage that answers itself (a cache hit): replayed as is
    cache_key: bytes | None = None  # a deterministic generation's response-cache key (a miss)
    semantic: tuple[str, Any] | None = None  # (params key, prompt embedding) of a semantic-cache miss
    keep_text: bool = False  # keep what the client was sent (``text``), to fill the caches
    out_redactor: Any = None  # (attempt, redaction.StreamRedactor) of the answer being streamed
    # set on the way out
    first_sent: float | None = None  # when the client got its first text
    last_sent: float | None = None
    pieces_sent: int = 0
    sent: list[str] = field(default_factory=list)  # the pieces sent (only when keep_text)
    text: str | None = None  # the whole answer as the client got it (only when keep_text)
    served_by: str = ""  # "<target>:<version>", "cache" or "semantic_cache" (the audit record)
    redacted_in: int = 0
    redacted_out: int = 0
    fallback: bool = False
    tokens_out: int = 0
    outcome: str = ""  # ok / rejected / cancelled / target_error / error, once it ended
    error: Exception | None = None  # why it was refused or failed

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: the same request gets the same answer from the same artifact."""
        return bool(self.params is not None and (self.params.greedy or self.params.seed is not None))


class Stage:
    """One concern on the guard's path. ``name`` is for logs; a stage marks its own trace span.

    ``run`` serves a whole batch; ``admit`` / ``piece`` / ``finish`` / ``end`` serve one
    generation of a decoupled guard (see the module doc). A stage implements the half its guard
    uses; the defaults do nothing."""

    name = ""
    always = False  # runs (and must not raise) even when an earlier stage raised

    def run(self, batch: Batch) -> None:  # pragma: no cover - the interface
        raise NotImplementedError

    def admit(self, gen: Generation) -> None:
        """Before the target: check (raise a TritonGuardError to refuse), rewrite, or answer."""

    def piece(self, gen: Generation, text: str) -> str:
        """A piece of the answer on its way to the client: what goes on (may be '' for now)."""
        return text

    def finish(self, gen: Generation, rest: str) -> str:
        """The end of a served answer: ``rest`` (a stream: the target's last text, often ''; not
        streamed: the whole answer) and whatever the stage still held back."""
        return rest

    def end(self, gen: Generation) -> None:
        """After the generation, however it ended (``gen.outcome``); must not raise."""

    def close(self) -> None:
        """Release what the stage holds (files, threads) when the model unloads."""


class _Stages:
    """An ordered list of stages: their names (for logs) and their closing, last first."""

    def __init__(self, stages: Sequence[Stage]):
        self.stages = list(stages)

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def close(self) -> None:
        for stage in reversed(self.stages):
            try:
                stage.close()
            except Exception:  # noqa: BLE001
                log.exception("closing stage %s failed", stage.name)


class Pipeline(_Stages):
    """The stages of a guard over one :class:`Batch` (see the module doc)."""

    def run(self, batch: Batch) -> None:
        failed: BaseException | None = None
        for stage in self.stages:
            if failed is None:
                try:
                    stage.run(batch)
                except Exception as exc:  # noqa: BLE001 - re-raised below, after the bookkeeping
                    failed = exc
            elif stage.always:
                try:
                    stage.run(batch)
                except Exception:  # noqa: BLE001 - bookkeeping must never hide the first error
                    log.exception("stage %s failed after an earlier failure", stage.name)
        if failed is not None:
            raise failed


class StreamPipeline(_Stages):
    """The stages of a decoupled guard over one :class:`Generation` (see the module doc)."""

    def __init__(self, stages: Sequence[Stage]):
        super().__init__(stages)
        # only the stages that change the answer's text are called per piece
        self.filters = [s for s in self.stages
                        if type(s).piece is not Stage.piece or type(s).finish is not Stage.finish]

    def admit(self, gen: Generation) -> None:
        """Run each stage's ``admit`` in order until one raises (a refusal: it propagates) or
        answers (``gen.answer``). ``gen.admitted`` counts those that ran to the end; call
        :meth:`end` in either case."""
        gen.admitted = 0
        for stage in self.stages:
            stage.admit(gen)
            gen.admitted += 1
            if gen.answer is not None:
                break

    def piece(self, gen: Generation, text: str) -> str:
        for stage in self.filters:
            text = stage.piece(gen, text)
        return text

    def finish(self, gen: Generation, rest: str) -> str:
        for stage in self.filters:
            rest = stage.finish(gen, rest)
        return rest

    def end(self, gen: Generation) -> None:
        """``end`` of every stage whose ``admit`` ran (and of every ``always`` stage), last
        admitted first: the first stage's ``end`` runs last, like nested ``with`` blocks."""
        n = gen.admitted
        for k in range(len(self.stages) - 1, -1, -1):
            stage = self.stages[k]
            if k < n or stage.always:
                try:
                    stage.end(gen)
                except Exception:  # noqa: BLE001 - one stage's bookkeeping must not skip the rest
                    log.exception("stage %s failed at the end of a generation", stage.name)


@dataclass
class GuardContext:
    """What the stages of one guard share: who it is, its configuration, and the services (the
    metrics, the audit log, the router once attached)."""

    guard: str
    target: str
    signature: ModelSignature
    output_names: list[str]
    config: Any  # guard_config.GuardConfig
    repo: Path
    metrics: Any
    clock: Callable[[], float]
    environ: Mapping[str, str] | None = None
    router: Any = None

    @property
    def batched(self) -> bool:
        return self.signature.max_batch_size > 0


__all__ = ["Batch", "Generation", "Stage", "Pipeline", "StreamPipeline", "GuardContext", "starts_of", "take"]
