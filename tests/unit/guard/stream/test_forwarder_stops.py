"""Sampling ``stop`` (the vLLM contract's key) in the stream guard: a target that ignores it is
cut by the guard before the first stop sequence, on any split of its tokens, streamed or whole,
with and without output rails, and stopped; the stop sequence never reaches the client and the
answer ends as a normal one (finish_reason ``stop``), so a client (the OpenAI front) never has to
cancel its stream to end an answer at a stop sequence."""

from __future__ import annotations

import random
import time

import pytest

from tests.unit.guard.stream.recording import Sender
from tests.unit.guard.stream.test_rails import Request, fake_target, rails
from tritonguard.generation.contract import SamplingParams, StopScanner
from tritonguard.generation.local import LocalStream
from tritonguard.guard.pipeline import Generation, StreamPipeline
from tritonguard.guard.stream.forwarder import StreamForwarder
from tritonguard.guard.stream.target import TargetCalls

ANSWER = "the string of the stop here and more STOP after" + "." * 3000


def test_the_scanner_cuts_at_the_first_stop_on_any_split_and_keeps_token_boundaries():
    text = "the string of the stop here and more STOP after"
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        tokens = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        scanner, out = StopScanner(["STOP", "here"]), []
        for t in tokens:
            out.extend(scanner.feed_tokens([t]))
        assert scanner.hit and "".join(out) == "the string of the stop ", tokens
        # whole tokens, but for the one the stop begins in, cut where it begins
        assert out[:-1] == tokens[:len(out) - 1] and tokens[len(out) - 1].startswith(out[-1]), (tokens, out)
        assert scanner.feed_tokens(["more"]) == []  # nothing after the stop
    scanner = StopScanner(["zz"])  # a token that may end in a stop's start is held whole
    assert scanner.feed("abz") == "" and scanner.feed("y") == "abz" and scanner.flush() == "y"
    assert not scanner.hit
    scanner = StopScanner(["xyz"])  # whole tokens held: the fewest covering the last 2 characters
    assert scanner.feed_tokens(["ab", "cx"]) == ["ab"] and scanner.flush_tokens() == ["cx"]
    assert StopScanner([]).feed_tokens(["a", "b"]) == ["a", "b"]


def forward(stream_mode: bool, *, reasons: bool = False, with_rails: bool = False, text: str = ANSWER,
            stop: tuple[str, ...] = ("STOP", "here")):
    stream, counter = LocalStream(), [0]
    sender = Sender(reasons)
    gen = Generation(request=Request(), sender=sender, stream=stream_mode, prompt="p", exclude=True,
                     params=SamplingParams(max_tokens=6000, temperature=0, stop=stop))
    ended: list[str] = []
    calls = TargetCalls(name="g", target="t", local=None, idle_s=5)
    fwd = StreamForwarder(gen, calls=calls, pipeline=StreamPipeline([]), name="g", target="t", interval_s=0,
                          cancel_poll_s=0.05, keep=True, on_end=lambda g, o: ended.append(o),
                          rails=rails(block_words=("bomb",), holdback_tokens=8) if with_rails else None)
    worker = fake_target(stream, text, counter)  # a target that ignores ``stop``
    result = fwd.forward(1, stream, time.perf_counter())
    worker.join(5)
    return result, sender, counter[0], ended


@pytest.mark.parametrize("with_rails", [False, True])
@pytest.mark.parametrize("reasons", [False, True])
def test_a_streamed_answer_ends_before_the_stop_and_the_target_is_stopped(reasons, with_rails):
    result, sender, made, ended = forward(True, reasons=reasons, with_rails=with_rails)
    assert result is not None and ended == ["ok"]
    final = sender.final[0]
    assert final[0] == "finish" and final[2] == "stop"  # an answer's normal end, not an error
    assert "".join(sender.pieces) + (final[1] or "") == "the string of the stop "
    assert result[0] == "the string of the stop "  # what a canary or shadow comparison sees
    # stopped: a few tokens past the stop, far from the 3,000 more it would have sent
    assert made <= len("the string of the stop here") + 8 + 64, made


def test_a_whole_answer_is_cut_too():
    result, sender, _, ended = forward(False)
    assert ended == ["ok"] and sender.final == [("finish", "the string of the stop ", "stop")]
    assert sender.pieces == []


def test_an_answer_without_the_stop_is_whole_and_what_was_held_goes_out():
    result, sender, _, _ = forward(True, text="ends on a possible st", stop=("stop here",))
    assert "".join(sender.pieces) + (sender.final[0][1] or "") == "ends on a possible st"
