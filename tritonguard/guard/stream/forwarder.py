"""One generation's answer on its way to the client of a decoupled guard.

A :class:`StreamForwarder` owns one generation's stream: it reads the target's responses in lists
(:class:`~tritonguard.guard.stream.target.TargetCalls`), passes each piece through the stages
that change text (output redaction holds back what may still grow into PII), paces a streamed
answer to at most one piece per ``stream_interval_ms`` (what arrives in between goes together),
polls the client's cancel every ``cancel_poll_ms``, stops a target that ignores ``max_tokens``,
and sends through the Triton adapter's response sink. With output rails
(:mod:`~tritonguard.guard.stream.rails`) the target's tokens pass the hold-back first: a block
ends the client's stream (``finish_reason`` ``content_filter``, or a Triton error naming the rail)
and stops the target. A target that fails or stalls before the
client got anything raises :class:`~tritonguard.guard.stream.target.TargetFailed`: the guard then
falls back down the chain. A cache hit is replayed as it was sent the first time.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tritonguard.core.errors import TritonGuardError
from tritonguard.generation.contract import StopScanner, cut_at_stop
from tritonguard.guard.pipeline import Generation, StreamPipeline
from tritonguard.guard.stream.rails import CONTENT_FILTER, Blocked, Rails
from tritonguard.guard.stream.stops import ClientStops
from tritonguard.guard.stream.target import TargetCalls, TargetFailed, TargetStalled, text_of
from tritonguard.triton.backend import response
from tritonguard.triton.streams import ResponseSink, response_failure, send_safely

log = logging.getLogger(__name__)


class ReasonSink(ResponseSink):
    """A sink whose final response also carries ``finish_reason`` (BYTES [1]: ``stop``,
    ``length`` or ``content_filter``), for a guard whose config.pbtxt declares that output (the
    vLLM backend's optional output of the same name). A blocked answer then ends like any other,
    with its reason, instead of with an error."""

    reasons = True

    def __init__(self, request: Any, output: str, sender: Any = None) -> None:
        super().__init__(request, output, sender)
        self.reason = "stop"

    def finish(self, text: str | None) -> None:
        self.closed = True
        self.sender.send(response({self.output: np.array([(text or "").encode("utf-8")], dtype=np.object_),
                                   "finish_reason": np.array([self.reason.encode()], dtype=np.object_)}),
                         flags=self.final)


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


class StreamForwarder:
    def __init__(self, gen: Generation, *, calls: TargetCalls, pipeline: StreamPipeline, name: str, target: str,
                 interval_s: float, cancel_poll_s: float, keep: bool,
                 on_end: Callable[[Generation, str], None], rails: Rails | None = None,
                 stops: ClientStops | None = None) -> None:
        """``keep``: the generated text is returned (a canary or shadow comparison wants it);
        ``on_end(gen, outcome)``: the guard's bookkeeping when the generation ends here;
        ``rails``: the output rails (None: none); ``stops``: the client's stop requests."""
        self.gen, self.calls, self.pipeline, self.name, self.target = gen, calls, pipeline, name, target
        self.stops = stops
        self.interval_s, self.cancel_poll_s, self.keep, self.on_end = interval_s, cancel_poll_s, keep, on_end
        self.rails = rails if rails is not None and rails.active else None
        self.blocked_after: tuple[int, int] | None = None  # (target tokens read at a block, tokens after it)

    def sent(self, piece: str) -> None:
        """``piece`` reached the client: timings and, where a stage wants it, the text."""
        gen = self.gen
        now = time.perf_counter()
        if gen.first_sent is None:
            gen.first_sent = now
        gen.last_sent = now
        gen.pieces_sent += 1
        if gen.keep_text:
            gen.sent.append(piece)

    def replay(self, text: str) -> None:
        """A stage's answer (a cache hit), sent as it was the first time: streamed a word per
        piece, or whole."""
        gen = self.gen
        if gen.stream:
            for piece in replay_pieces(text):
                gen.sender.piece(piece)
                self.sent(piece)
            self.on_end(gen, "ok")  # before the end reaches the client, as in forward()
            gen.sender.finish(None)
        else:
            self.sent(text)
            self.on_end(gen, "ok")
            gen.sender.finish(text)

    def block(self, exc: Blocked, tokens: int, stop: Callable[[], int] | None = None) -> None:
        """A rail blocked the answer after ``tokens`` target tokens: the client's stream ends
        (``finish_reason`` content_filter where the sink carries reasons, else the rail's error),
        nothing it held back goes out, and ``stop()`` stops the target (returns the tokens it
        sent after the block)."""
        gen = self.gen
        gen.tokens_out += tokens
        gen.error = exc
        self.on_end(gen, "blocked")  # the slot back before the client hears the end (forward())
        sender = gen.sender
        if getattr(sender, "reasons", False):
            sender.reason = CONTENT_FILTER
            send_safely(sender.finish, None)
        else:
            send_safely(sender.fail, str(exc), exc.code)
        after = stop() if stop is not None else 0
        self.blocked_after = (tokens, after)
        log.info("stream guard %s: answer blocked by rail '%s' after %d target tokens (%d pieces sent); the "
                 "target sent %d more after the block", self.name, exc.rail, tokens, gen.pieces_sent, after)

    def fail(self, message: str, code: str) -> None:
        """The client's error (its stream closed); a client gone meanwhile is only logged."""
        send_safely(self.gen.sender.fail, message, code)

    def forward(self, version: int, responses: Any, t0: float) -> tuple[str | None, float | None, float, int] | None:
        """Forward ``version``'s answer to the client. Returns (its generated text unredacted, or
        None when no comparison wants it; seconds to its first response; seconds to its last;
        tokens generated), None when the client
        cancelled; raises :class:`TargetFailed` when the target failed or stalled (nothing sent
        to the client for it: the caller decides between a fallback and the client's error)."""
        gen = self.gen
        pipeline, sender, request = self.pipeline, gen.sender, gen.request
        filtered = bool(pipeline.filters)
        tokens, next_poll, whole = 0, 0.0, []
        interval, held = self.interval_s if gen.stream else 0.0, ""  # text held until the interval since the last piece ends

        draining = False  # reading the target's rest to drop it: no wake-ups for held text
        hold = self.rails.holdback() if self.rails is not None and gen.stream else None
        blocked: Blocked | None = None
        # sampling ``stop``: the target gets it too, but one that ignores it is cut here and
        # stopped, so the stop sequence never reaches the client whatever the target does
        stops = StopScanner(gen.params.stop)

        def due() -> float | None:
            """Seconds until the held text is due (None: nothing held): the reader's next wake-up."""
            if draining or not held or gen.last_sent is None:
                return None
            return interval - (time.perf_counter() - gen.last_sent)

        it = self.calls.batches(responses, due if interval else None)
        # the file a stop request of this client leaves (stops.py): looked for at each cancel poll
        stop_file = self.stops.watch(request, gen.tenant) if self.stops is not None else None
        keep = self.keep  # the raw text, for a canary or shadow comparison
        raw: list[str] = []
        first: float | None = None
        max_tokens = gen.params.max_tokens
        try:
            for batch in it:
                if not batch:  # a tick: nothing arrived; what was held back goes out once due
                    if held and time.perf_counter() - (gen.last_sent or 0.0) >= interval:
                        sender.piece(held)
                        self.sent(held)
                        held = ""
                else:
                    if first is None:
                        first = time.perf_counter() - t0
                    texts: list[str] = []
                    failed = None
                    for resp in batch:
                        failed = response_failure(resp)
                        if failed is not None:
                            break
                        text = text_of(resp)
                        if text is not None:
                            texts.append(text)
                    if gen.stream:
                        if tokens + len(texts) > max_tokens:
                            # responses that arrived together past max_tokens (a budget's cut, or a
                            # target that ignores it): not one token more reaches the client
                            texts = texts[:max(max_tokens - tokens, 0)]
                        tokens += len(texts)
                        if keep:
                            raw.append("".join(texts))
                        texts = stops.feed_tokens(texts)
                        piece = "".join(texts)
                        if hold is not None:
                            try:
                                piece = hold.feed(texts)
                            except Blocked as exc:
                                blocked, piece = exc, ""
                        if filtered and piece:
                            piece = pipeline.piece(gen, piece)
                        if interval and gen.first_sent is not None:
                            held += piece
                            piece = ""
                            if held and time.perf_counter() - gen.last_sent >= interval:  # type: ignore[operator]
                                piece, held = held, ""
                        if piece:
                            sender.piece(piece)
                            self.sent(piece)
                    else:
                        whole.extend(texts)
                    if blocked is not None:
                        draining = True
                        why = f"answer blocked by rail '{blocked.rail}'"
                        self.block(blocked, tokens, functools.partial(self.calls.stop, responses, it, why))
                        return None
                    if failed is not None:
                        message, code = failed
                        log.warning("stream guard %s: target %s v%d failed after %d tokens: %s", self.name,
                                    self.target, version, tokens, message)
                        draining = True
                        try:
                            for _ in it:  # nothing should follow an error; do not leave it half read
                                pass
                        except TargetStalled:
                            pass
                        raise TargetFailed(code, message, f"target '{self.target}' failed: {message}", first, tokens)
                    if stops.hit:  # the answer ends here; the target, if it ignored ``stop``, is stopped
                        draining = True
                        self.calls.stop(responses, it, "stop sequence reached")
                        break
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + self.cancel_poll_s
                    asked = stop_file is not None and ClientStops.taken(stop_file)
                    if asked or request.is_cancelled():
                        gen.tokens_out += tokens
                        gen.error = TritonGuardError("the client stopped the request" if asked
                                                     else "the request was cancelled")
                        self.on_end(gen, "cancelled")
                        if asked:  # a plain end: the client reads its stream to the end, nothing cancelled
                            log.info("stream guard %s: client asked to stop after %d tokens", self.name, tokens)
                            send_safely(sender.finish, None)
                        else:
                            log.info("stream guard %s: client cancelled after %d tokens", self.name, tokens)
                            send_safely(sender.fail, "the request was cancelled", "CANCELLED")
                        draining = True
                        self.calls.stop(responses, it, "client stopped" if asked else "client cancelled")
                        return None
                if gen.stream and tokens >= max_tokens:
                    # a target that ignores max_tokens: stop here
                    draining = True
                    self.calls.stop(responses, it, f"max_tokens {max_tokens} reached", tell=False)
                    break
        except TargetStalled as exc:
            idle = self.calls.idle_s
            log.warning("stream guard %s: target %s v%d %s (stalled, or failed mid-stream)", self.name, self.target,
                        version, exc)
            raise TargetFailed("UNAVAILABLE", f"stalled: {exc}", f"target '{self.target}' sent nothing for {idle:g} s "
                                "(it stalled or failed mid-stream); retry later", first, tokens, stalled=True) from None
        call_s = time.perf_counter() - t0  # to the target's last response
        generated: str | None = None
        if gen.stream:
            tail = stops.flush_tokens()  # held back as the start of a stop sequence that never came
            if hold is not None:
                try:
                    last = hold.feed(tail) + hold.finish()
                except Blocked as exc:
                    self.block(exc, tokens)  # the target already ended
                    return None
            else:
                last = "".join(tail)
            if filtered and last:
                last = pipeline.piece(gen, last)
            held += last
            rest = held + pipeline.finish(gen, "")
            if keep:
                generated = cut_at_stop("".join(raw), stops.stops)[0]
        else:
            text = "".join(whole)
            prompt_first = not gen.exclude and text.startswith(gen.prompt)  # the prompt comes first unless excluded
            generated = text[len(gen.prompt):] if prompt_first else text
            if stops.stops:  # a target that ignored ``stop``: its answer is cut here
                generated = cut_at_stop(generated, stops.stops)[0]
                text = gen.prompt + generated if prompt_first else generated
            tokens = len(generated)  # one token per character: exact for tinylm, an estimate otherwise
            if self.rails is not None:
                try:
                    self.rails.judge(generated, "answer", classify=self.rails.answer_model)
                except Blocked as exc:
                    self.block(exc, tokens)
                    return None
            rest = pipeline.finish(gen, text)
            if not keep:
                generated = None
        gen.tokens_out += tokens
        if getattr(sender, "reasons", False):
            sender.reason = "length" if tokens >= max_tokens and not stops.hit else "stop"
        if rest:
            self.sent(rest)
        if gen.keep_text:
            gen.text = "".join(gen.sent)  # what this client gets, redacted: what the caches keep
        # the bookkeeping (caches filled, quota and budget released) before the client hears the
        # end: a client that sends its next request on the final response finds its slot free
        # and, for a deterministic repeat, the answer cached (CI once saw the repeat miss)
        self.on_end(gen, "ok")
        sender.finish(rest if rest or not gen.stream else None)  # non-streamed: exactly one response
        return generated, first, call_s, tokens

