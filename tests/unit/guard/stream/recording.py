"""What the stream forwarder's tests hand it as the client's side: a sender that records every
piece and the final response (or the error) the forwarder sends, shared by the rails, the
OpenAI-protocol target and the token budget's tests."""

from __future__ import annotations


class Sender:
    """``reasons``: the guard's config declares the ``finish_reason`` output (the final response
    carries :attr:`reason`). ``gone_after``: the client goes away after that many pieces (the
    next piece raises ConnectionError, as a closed gRPC stream does)."""

    def __init__(self, reasons: bool = False, gone_after: int | None = None):
        self.pieces: list[str] = []
        self.final: list[tuple] = []
        self.closed = False
        self.reasons = reasons
        self.reason = "stop"
        self.gone_after = gone_after

    def piece(self, text):
        if self.gone_after is not None and len(self.pieces) >= self.gone_after:
            raise ConnectionError("the client is gone")
        self.pieces.append(text)

    def finish(self, text):
        self.closed = True
        self.final.append(("finish", text, self.reason))

    def fail(self, message, code):
        self.closed = True
        self.final.append(("fail", message, code))
