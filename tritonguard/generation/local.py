"""A ``generator``-backend target run inside the stream guard (``placement: inprocess``).

Through BLS every token crosses two stub↔server hops (the generator's response, relayed to the
guard's stub, then the guard's own response), where the unguarded model needs one: on a small
CPU box that costs 15-25 % of the tokens per second. A stream guard whose target is served by
this project's ``generator`` backend can instead load the target's versions itself, as the batch
guard does for ``runtime`` targets: each version gets the generator's own :class:`Engine` (its
decode thread, batched decoding over in-flight requests, the target's ``config.pbtxt``
parameters), and the guard reads its pieces from an in-process queue. What the client gets is
the same text, token for token.

:class:`LocalStream` looks like python_backend's BLS ``ResponseIterator`` to the guard
(responses with ``has_error`` / ``error``, ``cancel()``), and hands out what arrived in lists
(:meth:`LocalStream.batches`) without a reader thread.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tritonguard.core import repository
from tritonguard.core.config import from_params, model_parameters
from tritonguard.core.errors import ConfigError, TritonGuardError
from tritonguard.generation.contract import parse_sampling
from tritonguard.generation.decoder import CharTokenizer, Decoder, Sequence, StepModel
from tritonguard.generation.engine import Engine
from tritonguard.generation.generator import GeneratorConfig
from tritonguard.triton.backend import CODE_NAMES

log = logging.getLogger(__name__)

# pb_utils.TritonError integer codes (python_backend pb_error.h order): an in-process error carries
# the code a BLS one would
CODE_NUMBERS = {name: number for number, name in CODE_NAMES.items()}
END = object()  # the last item of a response queue


def queued_batches(q: Any, idle_s: float, stalled: type[Exception],
                   due: Callable[[], float | None] | None = None) -> Iterator[list[Any]]:
    """The responses of queue ``q`` in lists: each list is the next response (waited for at most
    ``idle_s``, else ``stalled``) and every one already queued behind it, until :data:`END`. An
    exception in the queue is raised after the list before it. A reader that falls behind its
    target so forwards several tokens as one piece; one that keeps up forwards them one by one.
    ``due``: seconds until the reader must wake up although nothing arrived (None: no need); an
    empty list then comes at that time. The idle limit counts from the last response."""
    pending: Any = None
    last = time.monotonic()
    while True:
        if pending is not None:
            item, pending = pending, None
        else:
            wake = due() if due is not None else None
            left = idle_s - (time.monotonic() - last) if due is not None else idle_s
            try:
                item = q.get(timeout=max(0.0, min(left, wake)) if wake is not None else max(left, 0.0))
            except queue.Empty:
                if wake is None or time.monotonic() - last >= idle_s:
                    raise stalled(f"no response for {idle_s:g} s") from None
                yield []
                continue
            if due is not None:
                last = time.monotonic()
        if item is END:
            return
        if isinstance(item, Exception):
            raise item
        batch = [item]
        while True:
            try:
                nxt = q.get_nowait()
            except queue.Empty:
                break
            if nxt is END or isinstance(nxt, Exception):
                pending = nxt  # after this batch
                break
            batch.append(nxt)
        yield batch


class LocalError:
    def __init__(self, message: str, code: str) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return CODE_NUMBERS.get(self._code, 1)


class LocalResponse:
    __slots__ = ("text", "err")

    def __init__(self, text: str | None, err: LocalError | None = None) -> None:
        self.text, self.err = text, err

    def has_error(self) -> bool:
        return self.err is not None

    def error(self) -> LocalError | None:
        return self.err


class LocalStream:
    """One generation's responses: the engine's sink on one side, the guard's iterator on the other."""

    cheap_cancel_check = True  # the engine reads cancelled() at every step, not every cancel_poll_ms

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = False

    # -- the engine's side (a Sequence's sink) ---------------------------------------------
    def piece(self, text: str) -> None:
        self._q.put(LocalResponse(text))

    def finish(self, text: str | None) -> None:
        if text is not None:
            self._q.put(LocalResponse(text))
        self._q.put(END)

    def fail(self, message: str, code: str) -> None:
        self._q.put(LocalResponse(None, LocalError(message, code)))
        self._q.put(END)

    def cancelled(self) -> bool:
        return self._cancel

    # -- the guard's side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop decoding (the engine reads the flag at its next step)."""
        self._cancel = True

    def __iter__(self) -> Iterator[LocalResponse]:
        while True:
            item = self._q.get()
            if item is END:
                return
            yield item

    def batches(self, idle_s: float, stalled: type[Exception],
                due: Callable[[], float | None] | None = None) -> Iterator[list[LocalResponse]]:
        """What arrived, in lists, as ``stream_guard.watched`` hands out BLS responses
        (:func:`queued_batches`)."""
        return queued_batches(self._q, idle_s, stalled, due)


class LocalGenerator:
    """The versions of ``target`` (a ``generator``-backend model folder in ``repo``), each run by
    an engine of its own, created on first use."""

    def __init__(self, repo: Path, target: str, *, guard: str = "") -> None:
        self.repo, self.target, self.guard = Path(repo), target, guard
        model_dir = self.repo / target
        if not (model_dir / repository.CONFIG).exists():
            raise ConfigError(f"model '{guard}': placement 'inprocess' needs the target '{target}' in {self.repo}")
        cfg = repository.read_config(model_dir)
        if cfg.get("backend") != "generator":
            raise ConfigError(f"model '{guard}': placement 'inprocess' needs a target served by backend 'generator', "
                              f"'{target}' uses '{cfg.get('backend') or cfg.get('platform')}'")
        self.config = from_params(GeneratorConfig, model_parameters(cfg), model=target)
        self._engines: dict[int, Engine] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _engine(self, version: int) -> Engine:
        engine = self._engines.get(version)
        if engine is not None:
            return engine
        with self._lock:
            if self._closed:
                raise TritonGuardError(f"'{self.target}' is unloading")
            engine = self._engines.get(version)
            if engine is None:
                vdir = self.repo / self.target / str(version)
                tok = CharTokenizer.from_dict(json.loads((vdir / "vocab.json").read_text()))
                model = StepModel(vdir / "model.onnx", self.config.intra_op_threads)
                engine = self._engines[version] = Engine(
                    Decoder(model, tok), max_active=self.config.max_active, max_queue=self.config.max_queue,
                    cancel_poll_s=self.config.cancel_poll_ms / 1000, name=f"{self.target}:{version}")
                log.info("stream guard %s: %s v%d runs in process", self.guard, self.target, version)
        return engine

    def resolve(self, version: int) -> int:
        """``version``, or the latest on disk for -1 (Triton's default policy)."""
        if version > 0:
            return version
        on_disk = repository.complete_versions(self.repo / self.target)  # with a manifest only
        return on_disk[-1] if on_disk else -1

    def open(self, version: int, prompt: str, stream: bool, sampling: str, exclude: bool | None) -> LocalStream:
        """Start one generation on ``version``; its answer comes through the returned stream (an
        error response when the version cannot run or the request breaks the target's rules)."""
        out = LocalStream()
        v = self.resolve(version)
        if v < 1 or not (self.repo / self.target / str(v) / "model.onnx").exists():
            out.fail(f"version {version} of '{self.target}' is not in {self.repo}", "NOT_FOUND")
            return out
        try:
            params = parse_sampling(sampling, max_tokens_cap=self.config.max_tokens_cap,
                                    default_max_tokens=self.config.default_max_tokens)
            engine = self._engine(v)
        except TritonGuardError as exc:
            out.fail(str(exc), getattr(exc, "code", "INTERNAL"))
            return out
        except Exception as exc:  # noqa: BLE001 - an unreadable version fails its requests, not the guard
            log.exception("stream guard %s: %s v%d cannot run in process", self.guard, self.target, v)
            out.fail(f"version {v} of '{self.target}' cannot run: {type(exc).__name__}: {exc}", "INTERNAL")
            return out
        prepend = (not stream) if exclude is None else not exclude
        engine.submit(Sequence(prompt, params, stream=stream, prepend_prompt=prepend, sink=out))
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            engine.stop()
