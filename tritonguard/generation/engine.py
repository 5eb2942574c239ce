"""The generator's decode loop: one thread per model instance that admits queued sequences,
prefills them, advances every active one by a token per step, and sends each token (or the
whole text) to its request's sink; cancellations, queue limits and per-token metrics.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from tritonguard.core import catalogue
from tritonguard.generation.contract import write_stop
from tritonguard.generation.decoder import Decoder, Sequence
from tritonguard.triton.metrics import Metrics
from tritonguard.triton.streams import send_safely

# -- metrics ------------------------------------------------------------------------------------


log = logging.getLogger(__name__)
STOP_TTL_S = 60.0
# how often the decode thread lists the stop files (a listdir of a tmpfs directory, ~10 us): a
# stopped generation makes at most this long's worth of tokens more (tinylm: 1-3 ms a token)
STOP_SCAN_S = 0.005


class MetricsSink(Protocol):
    """What the engine needs of :class:`tritonguard.triton.metrics.Metrics` (in-process, no IPC)."""

    def inc(self, family: str, value: float = 1, **labels: str) -> None: ...
    def observe(self, family: str, value: float, **labels: str) -> None: ...


class NoMetrics:
    def inc(self, family: str, value: float = 1, **labels: str) -> None:
        pass

    def observe(self, family: str, value: float, **labels: str) -> None:
        pass


def generation_metrics(model: str, version: str) -> Any:
    return Metrics(model, version, counters=catalogue.GENERATION_COUNTERS, gauges={},
                          histograms=catalogue.GENERATION_HISTOGRAMS, zero_at_load=catalogue.GENERATION_ZERO_AT_LOAD)


class Engine:
    """One decode thread: admits queued sequences up to ``max_active``, prefills them, then
    advances all in flight by one token per loop; polls cancellation every ``cancel_poll_s``."""

    def __init__(self, decoder: Decoder, *, max_active: int = 16, max_queue: int = 256,
                 cancel_poll_s: float = 0.05, name: str = "generator",
                 metrics: MetricsSink | None = None, itl_per_token: bool = False,
                 stop_dir: Path | None = None) -> None:
        """``stop_dir``: where callers leave stop files (:func:`~tritonguard.generation.contract.stop_dir`),
        listed every STOP_SCAN_S; None: stop requests only."""
        self.decoder = decoder
        # observations only go to the in-process sink (a deque the Metrics flusher empties)
        self.metrics: MetricsSink = metrics if metrics is not None else NoMetrics()
        self.itl_per_token = itl_per_token
        self.max_active, self.cancel_poll_s = max_active, cancel_poll_s
        self.queue: queue.Queue[Sequence] = queue.Queue(maxsize=max_queue)
        self.active: list[Sequence] = []
        self._stop = threading.Event()
        self.tokens = 0
        # request ids a caller asked to stop -> when (contract.STOP_PREFIX); read by the decode
        # thread at every step (a dict lookup, no IPC), pruned after STOP_TTL_S
        self._stops: dict[str, float] = {}
        self.stop_dir = stop_dir
        self._next_stop_scan = 0.0
        self._ids: set[str] = set()  # request ids submitted and not ended: the stop files that are ours
        self._thread = threading.Thread(target=self._run, name=f"decode-{name}", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        if seq.request_id:  # before the decode thread can take it (and end it: discard)
            self._ids.add(seq.request_id)
        try:
            self.queue.put_nowait(seq)
        except queue.Full:
            self._ids.discard(seq.request_id)
            self.metrics.inc("gen_requests", outcome="rejected")
            send_safely(seq.sink.fail, "the generator's queue is full; retry later", "UNAVAILABLE")

    def request_stop(self, request_id: str) -> None:
        """Stop the generation of request ``request_id`` at the next decode step (queued or in
        flight; an id that never comes is forgotten after STOP_TTL_S)."""
        now = time.monotonic()
        if len(self._stops) > 256:
            for rid, at in list(self._stops.items()):
                if now - at > STOP_TTL_S:
                    self._stops.pop(rid, None)
        self._stops[request_id] = now

    def relay_stop(self, request_id: str) -> None:
        """A stop request (contract.STOP_PREFIX) for ``request_id``, wherever this server decodes
        it: here at the next step (also if it comes within STOP_TTL_S), and, when it is not one
        of this engine's, through a stop file (contract.write_stop) for the instance of the model
        that holds it (each instance is a process of its own; the server's stubs share the
        directory). A Triton client's stop request lands on any instance."""
        self.request_stop(request_id)
        if self.stop_dir is not None and request_id not in self._ids:
            write_stop(self.stop_dir, request_id)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        pending = list(self.active)
        while True:
            try:
                pending.append(self.queue.get_nowait())
            except queue.Empty:
                break
        for seq in pending:
            if not seq.ended:
                self._ended(seq, "error")
                send_safely(seq.sink.fail, "the model is unloading", "UNAVAILABLE")

    def _ended(self, seq: Sequence, outcome: str) -> None:
        """Per-request accounting at its end (one inc per family, no per-token IPC)."""
        if seq.ended:
            return
        seq.ended = True
        self._ids.discard(seq.request_id)
        m = self.metrics
        m.inc("gen_requests", outcome=outcome)
        if seq.pieces:
            m.inc("gen_tokens", len(seq.pieces), direction="out")
        if (seq.stream and not self.itl_per_token and seq.first_token_at is not None
                and len(seq.pieces) >= 2):
            m.observe("itl", (seq.last_token_at - seq.first_token_at) / (len(seq.pieces) - 1))

    def _admit(self) -> None:
        block = not self.active
        while len(self.active) < self.max_active:
            try:
                seq = self.queue.get(timeout=0.1) if block else self.queue.get_nowait()
            except queue.Empty:
                return
            block = False
            try:
                self.decoder.prefill(seq)
            except Exception as exc:  # noqa: BLE001 - one bad prompt must not stop the loop
                log.exception("prefill failed")
                self._ended(seq, "error")
                send_safely(seq.sink.fail, f"generation failed: {type(exc).__name__}", "INTERNAL")
                continue
            self.metrics.inc("gen_tokens", len(seq.prompt), direction="in")
            self.active.append(seq)

    def _scan_stop_files(self, now: float) -> None:
        """Every STOP_SCAN_S: the stop files naming a generation of this engine become stops
        (and are removed); any file older than STOP_TTL_S (its generation ended elsewhere) goes."""
        if self.stop_dir is None or now < self._next_stop_scan:
            return
        self._next_stop_scan = now + STOP_SCAN_S
        try:
            names = os.listdir(self.stop_dir)
        except OSError:
            return
        for name in names:
            path = self.stop_dir / name
            try:
                if name in self._ids:
                    self.request_stop(name)
                    path.unlink()
                elif time.time() - path.stat().st_mtime > STOP_TTL_S:
                    path.unlink()
            except OSError:  # another engine took or pruned it
                pass

    def _cancelled(self, seq: Sequence, now: float) -> bool:
        if seq.request_id and self._stops and self._stops.pop(seq.request_id, None) is not None:
            seq.stopped = True
            return True
        # a Triton request's is_cancelled() is an IPC round trip: polled every cancel_poll_s. A
        # sink whose check is a flag read (the stream guard's in-process LocalStream) is read at
        # every step: 256 tinylm tokens take less than one 50 ms poll interval
        if not getattr(seq.sink, "cheap_cancel_check", False) and now - seq.last_cancel_check < self.cancel_poll_s:
            return False
        seq.last_cancel_check = now
        return bool(send_safely(seq.sink.cancelled))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if not self.active:
                    continue
                now = time.monotonic()
                self._scan_stop_files(now)
                live = []
                for seq in self.active:
                    if self._cancelled(seq, now):
                        self._ended(seq, "cancelled")
                        if seq.stopped:
                            # a plain final response: python_backend 24.10 does not hand a
                            # decoupled target's error to a BLS caller mid-stream
                            log.info("request %s stopped by its caller after %d tokens: decoding stopped",
                                     seq.request_id, len(seq.pieces))
                            send_safely(seq.sink.finish, None)
                        else:
                            log.info("request cancelled after %d tokens: decoding stopped", len(seq.pieces))
                            send_safely(seq.sink.fail, "the request was cancelled", "CANCELLED")
                    else:
                        live.append(seq)
                for seq, piece in self.decoder.advance(live):
                    if piece is not None:
                        self.tokens += 1
                        if seq.stream:
                            out = seq.stops.feed(piece)  # held back while it may become a stop sequence
                            if out:
                                send_safely(seq.sink.piece, out)
                        self._token_timing(seq)
                    if seq.done and seq.error is not None:
                        log.warning("generation stopped: %s", seq.error)
                        self._ended(seq, "error")
                        send_safely(seq.sink.fail, f"generation failed: the model produced {seq.error}", "INTERNAL")
                    elif seq.done:
                        tail = seq.stops.flush() if seq.stream else ""  # held back and no stop after all
                        if tail:
                            send_safely(seq.sink.piece, tail)
                        text = None if seq.stream else (seq.prompt if seq.prepend_prompt else "") + seq.answer
                        self._ended(seq, "ok")
                        send_safely(seq.sink.finish, text)
                self.active = [s for s in live if not s.done]
            except Exception:  # noqa: BLE001 - fail what is in flight, keep serving
                log.exception("decode step failed")
                for seq in self.active:
                    if not seq.ended:
                        self._ended(seq, "error")
                        send_safely(seq.sink.fail, "generation failed: internal error", "INTERNAL")
                self.active = []

    def _token_timing(self, seq: Sequence) -> None:
        """After a token was sent (stream) or decided (whole text): TTFT on the first, the gap
        since the previous one for streams (per token only with ``itl_per_token``)."""
        t = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = t
            self.metrics.observe("ttft", t - seq.received)
        elif self.itl_per_token and seq.stream:
            self.metrics.observe("itl", t - seq.last_token_at)
        seq.last_token_at = t
