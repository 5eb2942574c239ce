"""The target of a decoupled guard, one generation at a time: opening the call (a BLS stream
to the target's version through the Triton adapter, an in-process one for a ``generator``
target, or a streamed HTTP call to an OpenAI-compatible server, for the whole target or for the
versions declared at a URL), reading its responses in lists with an idle limit, stopping it (a cancel where
python_backend can; else, for a ``generator`` target, a stop request naming the call, then the
rest read and dropped), keeping a finished BLS iterator alive a few
seconds before it is freed (python_backend 24.10), and a whole answer for goldens and comparisons.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from tritonguard.core.errors import TargetError
from tritonguard.generation.contract import OUTPUT, STOP_PREFIX, stop_dir, write_stop
from tritonguard.generation.local import (
    END,
    LocalGenerator,
    LocalResponse,
    LocalStream,
    queued_batches,
)
from tritonguard.triton import backend
from tritonguard.triton.streams import open_stream, response_failure, response_text

log = logging.getLogger(__name__)


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


class TargetFailed(Exception):
    """The target failed or stalled on one generation (nothing of it sent to the client)."""

    def __init__(self, code: str, message: str, client_message: str, first_response_s: float | None,
                 tokens: int, *, stalled: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.client_message = code, message, client_message
        self.first_response_s, self.tokens, self.stalled = first_response_s, tokens, stalled


def text_of(resp: Any) -> str | None:
    """The text of one target response (a BLS response's ``text_output``, or an in-process one's)."""
    if isinstance(resp, LocalResponse):
        return resp.text
    return response_text(resp, OUTPUT)


def _tokens_in(it: Any) -> int:
    """Read the rest of a call's batches; the count of responses that carried text."""
    n = 0
    for batch in it:
        n += sum(1 for resp in batch if text_of(resp) is not None)
    return n


class TargetCalls:
    """Calls of one guard's target: ``name`` (log lines), ``target``, ``local`` (in process, an
    OpenAI-compatible server's client, or None for BLS: each ``open`` returns a
    :class:`LocalStream`) and the idle limit of a call. ``stop_requests``: the target honours
    :data:`~tritonguard.generation.contract.STOP_PREFIX` requests (this project's ``generator``
    backend): each BLS call gets an id, and :meth:`stop` names it in a stop request.
    ``remote(version)``: the client of a version served at a URL
    (:class:`~tritonguard.guard.stream.openai_target.VersionTargets`), None for the others: such a
    version is called there whatever the placement, so one rollout can move traffic between a
    Triton generator and a server outside Triton."""

    def __init__(self, *, name: str, target: str, local: LocalGenerator | None, idle_s: float,
                 stop_requests: bool = False, remote: Callable[[int], Any] | None = None) -> None:
        self.name, self.target, self.local, self.idle_s = name, target, local, idle_s
        self.remote = remote
        self.stop_requests = stop_requests and local is None
        self._ids: dict[int, tuple[int, str]] = {}  # id(responses) -> (version, request id) of open BLS calls
        self._retired: collections.deque = collections.deque(maxlen=65536)
        self._retired_lock = threading.Lock()

    def open(self, version: int, prompt: str, stream: bool, sampling: str, exclude: bool | None,
             request: Any = None) -> Any:
        """The responses of ``version`` for one generation (an iterator)."""
        remote = self.remote(version) if self.remote is not None else None
        if remote is not None:
            return remote.open(version, prompt, stream, sampling, exclude)
        if self.local is not None:
            return self.local.open(version, prompt, stream, sampling, exclude)
        inputs = {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
                  "stream": np.array([stream], dtype=bool),
                  "sampling_parameters": np.array([sampling.encode()], dtype=np.object_)}
        if exclude is not None:
            inputs["exclude_input_in_output"] = np.array([exclude], dtype=bool)
        if not self.stop_requests:
            return open_stream(self.target, version, inputs, OUTPUT, parent=request)
        rid = f"tg-{uuid.uuid4().hex}"
        responses = open_stream(self.target, version, inputs, OUTPUT, parent=request, request_id=rid)
        self._ids[id(responses)] = (version, rid)
        return responses

    def batches(self, responses: Any, due: Callable[[], float | None] | None = None) -> Any:
        """The responses in lists (:func:`watched`)."""
        if isinstance(responses, LocalStream):
            return responses.batches(self.idle_s, TargetStalled, due)
        return watched(responses, self.idle_s, self.name, due)

    def retire(self, responses: Any) -> None:
        """Keep a finished BLS response iterator alive for ``RETIRE_S`` more seconds before it is
        freed. python_backend 24.10 frees an iterator's native state while its stub may still be
        handling that stream's last message: under concurrent BLS streams (measured: a shadow or
        canary call next to live traffic) the guard's stub, or tritonserver, then died within
        about 10 s ('double free or corruption', 'malloc(): unaligned fastbin chunk'); with
        retired iterators kept a few seconds, none did in 60 s runs of the same traffic."""
        if isinstance(responses, LocalStream):
            close = getattr(responses, "close", None)  # an HTTP stream's connection (openai_target)
            if close is not None:
                close()
            return  # nothing of python_backend's in it
        self._ids.pop(id(responses), None)
        now = time.monotonic()
        freed = []
        with self._retired_lock:
            self._retired.append((now, responses))
            # a few at a time (RETIRE_FREE_PER_CALL)
            while (len(freed) < RETIRE_FREE_PER_CALL and self._retired
                   and now - self._retired[0][0] > RETIRE_S):
                freed.append(self._retired.popleft())
        del freed  # the native frees happen here, outside the lock

    def _send_stop(self, responses: Any) -> bool:
        """Ask the target to stop the BLS call ``responses``: a stop file naming its id (the
        generator lists them every 5 ms), else a stop request (a request whose id names
        it; on 24.10 such a BLS call beside the call's own reader can deadlock this stub, see
        :func:`~tritonguard.generation.contract.stop_dir`). The target ends that stream with a
        plain final response at its next decode step."""
        call = self._ids.pop(id(responses), None)
        if call is None:
            return False
        version, rid = call
        directory = stop_dir()
        if directory is not None and write_stop(directory, rid):
            return True
        try:
            p = backend.pb()
            req = p.InferenceRequest(model_name=self.target, model_version=int(version),
                                     inputs=[p.Tensor("text_input", np.array([b""], dtype=np.object_))],
                                     requested_output_names=[OUTPUT], request_id=STOP_PREFIX + rid)
            for _ in req.exec(decoupled=True):  # one final response
                pass
            return True
        except Exception:  # noqa: BLE001 - then the rest is only drained
            log.warning("stream guard %s: the stop request to %s failed", self.name, self.target, exc_info=True)
            return False

    def stop(self, responses: Any, it: Any, why: str, *, tell: bool = True) -> int:
        """Stop the target's stream: cancel it where python_backend can (r25.04+), else tell a
        ``generator`` target to stop it (a stop request; not with ``tell`` false: a target that
        reached the ``max_tokens`` it was given ends by itself), then read and drop the rest.
        Returns the responses read after the stop began (what the target sent that nobody got)."""
        if isinstance(responses, LocalStream):
            # the engine stops decoding it at its next step; an OpenAI server's HTTP stream is closed
            responses.cancel()
            log.debug("stream guard %s: %s; generation stopped", self.name, why)
            try:
                return _tokens_in(it)
            except TargetStalled:
                return 0
        cancel = getattr(responses, "cancel", None)
        if cancel is not None:
            try:
                cancel()
                log.info("stream guard %s: %s; target stream cancelled", self.name, why)
                self._ids.pop(id(responses), None)
                return 0
            except Exception:  # noqa: BLE001
                log.warning("stream guard %s: cancelling the target stream failed", self.name, exc_info=True)
        t0, dropped = time.perf_counter(), 0
        told = tell and self.stop_requests and self._send_stop(responses)
        try:
            dropped = _tokens_in(it)
        except TargetStalled:
            log.warning("stream guard %s: %s; the target then stalled while its rest was drained", self.name, why)
            return dropped
        if told:
            log.info("stream guard %s: %s; target told to stop, %d target responses after it dropped in %.0f ms",
                     self.name, why, dropped, (time.perf_counter() - t0) * 1000)
        elif dropped:
            log.info("stream guard %s: %s; this python_backend cannot cancel a BLS stream, drained %d target "
                     "responses in %.0f ms", self.name, why, dropped, (time.perf_counter() - t0) * 1000)
        return dropped

    def run_text(self, version: int, prompt: str, sampling: str) -> str:
        """``version``'s whole answer, prompt excluded (goldens, canary and shadow runs)."""
        responses = self.open(version, prompt, False, sampling, True)
        texts: list[str] = []
        try:
            for batch in self.batches(responses):
                for resp in batch:
                    failure = response_failure(resp)
                    if failure is not None:
                        raise TargetError(*failure)
                    text = text_of(resp)
                    if text is not None:
                        texts.append(text)
        except TargetStalled as exc:
            raise TargetError(f"target '{self.target}' v{version}: {exc}", "UNAVAILABLE") from None
        finally:
            self.retire(responses)
        return "".join(texts)
