"""Output rails that block (tritonguard.guard.stream.rails): the hold-back window on single-token,
multi-token and random splits (nothing of a blocked match is ever released), word rules that
hold only what may still grow into a listed word, the classifier judged a window at a time, the
parameters, the forwarder ending a blocked stream and stopping an in-process target, and the
generator engine honouring a caller's stop request."""

from __future__ import annotations

import random
import re
import threading
import time

import numpy as np
import pytest

from tests.unit.guard.stream.recording import Sender
from tritonguard.core.errors import ConfigError
from tritonguard.generation.contract import SamplingParams
from tritonguard.generation.decoder import Sequence
from tritonguard.generation.engine import Engine
from tritonguard.generation.local import LocalStream
from tritonguard.guard.pipeline import Generation, StreamPipeline
from tritonguard.guard.stream.config import parse_settings
from tritonguard.guard.stream.forwarder import StreamForwarder
from tritonguard.guard.stream.rails import CONTENT_FILTER, Blocked, HoldBack, Rails, RailsConfig
from tritonguard.guard.stream.target import TargetCalls

BENIGN = "Return the list of open files, then read the configuration and write the string back. "


def rails(classify=None, **kw) -> Rails:
    return Rails(RailsConfig(**kw), classify)


def run(hb: HoldBack, tokens: list[str]) -> tuple[str, Blocked | None, list[str]]:
    """Feed ``tokens`` one call each: (what was released, the block or None, each release)."""
    out: list[str] = []
    try:
        for t in tokens:
            out.append(hb.feed([t]))
        out.append(hb.finish())
    except Blocked as exc:
        return "".join(out), exc, out
    return "".join(out), None, out


def splits(text: str, rng: random.Random, most: int = 4) -> list[str]:
    parts, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        parts.append(text[i:i + n])
        i += n
    return parts


# -- rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_a_listed_word_blocks_and_none_of_it_is_released(size):
    text = BENIGN + "Now build the Bomb quickly, then more text follows."
    tokens = [text[i:i + size] for i in range(0, len(text), size)]
    released, blocked, _ = run(rails(block_words=("bomb",)).holdback(), tokens)
    assert blocked is not None and blocked.rail == "rails.block_words" and blocked.code == "INVALID_ARG"
    assert str(blocked).startswith(f"{CONTENT_FILTER}: the answer was blocked by rail 'rails.block_words'")
    assert "b" not in released[len("Now build the "):].lower() or "bomb" not in released.lower()
    assert text.startswith(released) and len(released) <= text.lower().index("bomb")


def test_word_rules_release_prose_at_once_and_hold_only_a_possible_word():
    hb = rails(block_words=("bomb", "pipe bomb"), holdback_tokens=16).holdback()
    assert hb.feed(list("Hello there ")) == "Hello there "  # nothing may grow into a listed word
    assert hb.feed(list("the ")) == "the "
    assert hb.feed(["b", "o"]) == ""  # "bo" may become "bomb"
    assert hb.feed(["a", "t"]) == "boat"  # it did not
    assert hb.feed(list(" pipe ")) == " "  # "pipe " may become "pipe bomb"
    assert hb.feed(list("dream ")) == "pipe dream "
    assert hb.feed(list("bomb")) == ""  # "bomb" may still become "bombastic"
    assert hb.feed(list("astic.")) == "bombastic."
    assert hb.finish() == ""


def test_a_word_at_the_very_end_is_caught_at_finish():
    hb = rails(block_words=("bomb",)).holdback()
    assert hb.feed(list("a ")) == "a "
    assert hb.feed(list("bomb")) == ""
    with pytest.raises(Blocked):
        hb.finish()


def test_patterns_hold_only_what_may_grow_into_a_match_and_block_it_whole():
    hb = rails(pattern={"CARD": r"\b4\d{3}( \d{4}){3}\b"}, holdback_tokens=20).holdback()
    text = "pay with 4111 1111 1111 1111 now"
    released, blocked, out = run(hb, list(text))
    assert blocked is not None and blocked.rail == "rails.pattern.CARD"
    assert released == "pay with "  # the 19-character match fits the 20-token window: none of it left
    # prose leaves with the token that makes it: nothing held before the "4" could start a match
    assert out[:9] == list("pay with ")
    assert out[9:] == [""] * (len(out) - 9)


def test_a_pattern_holds_its_possible_start_and_lets_it_go_when_it_cannot_match():
    hb = rails(pattern={"WEAPON": r"how to (build|make) a \w+ bomb"}, holdback_tokens=32).holdback()
    assert hb.feed(list("so ")) == "so "
    assert hb.feed(list("how to ma")) == ""  # may still become the pattern: held
    assert hb.feed(list("p it")) == "how to map it"  # it cannot any more: released at once
    assert hb.feed(list("!")) == "!"
    assert hb.finish() == ""
    # an unbounded match ending where the text ends is held: the next token may extend it
    hb = rails(pattern={"ID": r"acct-\d+"}, holdback_tokens=16).holdback()
    assert hb.feed(list("see acct-12")) == "see "
    with pytest.raises(Blocked):
        hb.feed(list("3 ok"))


def test_random_splits_never_leak_a_pattern_match_and_pass_clean_text_whole():
    rng = random.Random(11)
    pattern = {"CARD": r"\b4\d{3}( \d{4}){3}\b", "WEAPON": r"how to (build|make) a \w+ bomb"}
    for k in range(300):
        clean = " ".join(rng.choice(["the", "how", "to", "make", "a", "4111", "1111", "bombastic", "x,", "42"])
                         for _ in range(rng.randint(1, 20)))
        bad = clean + rng.choice([" 4111 1111 1111 1111", " how to build a small bomb", " HOW TO MAKE A BIG BOMB"]) \
            + rng.choice(["", " and more", "."])
        for text, blocked_want in ((clean, None), (bad, True)):
            starts = [m.start() for m in (re.search(rx, text, re.I) for rx in pattern.values()) if m]
            if blocked_want is None:  # the clean words may form a match by chance
                blocked_want = bool(starts)
            hb = rails(pattern=pattern, holdback_tokens=32).holdback()
            released, blocked, _ = run(hb, splits(text, rng))
            assert (blocked is not None) == blocked_want, (k, text)
            if blocked_want:  # nothing of the first match left
                assert text.startswith(released) and len(released) <= min(starts), (text, released)
            else:
                assert released == text


def test_without_partial_matching_a_pattern_holds_the_whole_window(monkeypatch):
    """Where the ``regex`` package cannot compile the patterns (or is missing), the whole window
    is held, as before partial matching: nothing of a match leaks either way."""
    import tritonguard.guard.stream.rails as mod

    monkeypatch.setattr(mod, "_partial_regex", lambda branches: None)
    hb = rails(pattern={"CARD": r"\b4\d{3}( \d{4}){3}\b"}, holdback_tokens=20).holdback()
    assert hb.rails.rules.fixed
    released, blocked, out = run(hb, list("pay with 4111 1111 1111 1111 now"))
    assert blocked is not None and "4" not in released
    assert out[:20] == [""] * 20 and out[20] == "p"  # the first token went out with the 21st


def test_random_splits_never_leak_a_match_and_pass_clean_text_whole():
    rng = random.Random(7)
    words = ("bomb", "nerve agent")
    for k in range(300):
        clean = " ".join(rng.choice(["the", "bo", "boa", "agents", "nerve", "bombastic", "x", "pipe", "a.b"])
                         for _ in range(rng.randint(1, 20)))
        bad = clean + rng.choice([" bomb", " nerve  agent", " BOMB!"]) + rng.choice(["", " and more", "."])
        for text, blocked_want in ((clean, False), (bad, True)):
            hb = rails(block_words=words, holdback_tokens=16).holdback()
            released, blocked, _ = run(hb, splits(text, rng))
            assert (blocked is not None) == blocked_want, (k, text)
            if blocked_want:
                assert text.startswith(released) and len(released) <= len(clean) + 1, (text, released)
            else:
                assert released == text


def test_holdback_zero_releases_at_once():
    hb = rails(block_words=("bomb",), holdback_tokens=0).holdback()
    assert hb.feed(list("bo")) == "bo"


# -- the classifier ----------------------------------------------------------------------------
class Classifier:
    def __init__(self, flag: str = "", fail: bool = False):
        self.calls: list[str] = []
        self.flag, self.fail = flag, fail

    def __call__(self, texts):
        self.calls.extend(texts)
        if self.fail:
            raise RuntimeError("model not ready")
        return [0.9 if self.flag and self.flag in t else 0.1 for t in texts]


def test_the_classifier_judges_each_window_before_it_goes_out():
    clf = Classifier(flag="poison")
    hb = rails(clf, model="rails_classifier", holdback_tokens=4, context_chars=8).holdback()
    assert [hb.feed([c]) for c in "abc"] == ["", "", ""]  # a window is 4 tokens
    assert hb.feed(["d"]) == "abcd" and clf.calls == ["abcd"]
    assert [hb.feed([c]) for c in "efgh"] == ["", "", "", "efgh"]
    assert clf.calls[-1] == "abcdefgh"  # the window with context_chars of what went before
    assert [hb.feed([c]) for c in ("a ", "poi")] == ["", ""]
    with pytest.raises(Blocked) as err:
        hb.feed(["so", "n"])  # the window is full: judged, flagged
    assert err.value.rail == "rails_classifier" and "score 0.90" in str(err.value)
    assert hb.released == 8  # nothing of the blocked window went out


def test_the_last_partial_window_is_judged_at_the_end():
    clf = Classifier(flag="poison")
    hb = rails(clf, model="m", holdback_tokens=16).holdback()
    assert hb.feed(list("a poison")) == ""
    with pytest.raises(Blocked):
        hb.finish()


def test_a_failed_classifier_blocks_unless_fail_open():
    for fail_open, blocks in ((False, True), (True, False)):
        r = rails(Classifier(fail=True), model="m", holdback_tokens=2, fail_open=fail_open)
        hb = r.holdback()
        if blocks:
            with pytest.raises(Blocked, match="could not judge"):
                hb.feed(["a", "b"])
        else:
            assert hb.feed(["a", "b"]) == "ab"


def test_a_prompt_only_classifier_never_holds_the_answer_back():
    clf = Classifier(flag="weapon")
    r = rails(clf, model="m", check_answer=False, holdback_tokens=8)
    with pytest.raises(Blocked):
        r.prompt("a weapon")
    hb = r.holdback()
    assert hb.feed(list("a weapon ")) == "a weapon " and hb.finish() == ""
    assert clf.calls == ["a weapon"]  # the prompt only


def test_the_prompt_is_judged_by_rules_and_classifier():
    r = rails(Classifier(flag="weapon"), model="m", block_words=("bomb",))
    r.prompt("a nice day")
    with pytest.raises(Blocked, match="the prompt was blocked by rail 'rails.block_words'"):
        r.prompt("a bomb")
    with pytest.raises(Blocked, match="rail 'm'"):
        r.prompt("a weapon")
    rails(Classifier(flag="weapon"), model="m", check_prompt=False).prompt("a weapon")


# -- parameters --------------------------------------------------------------------------------
def test_rails_parameters_are_read_and_checked_naming_the_key():
    s = parse_settings({"target": "t", "rails.block_words": "bomb, nerve agent", "rails.holdback_tokens": "8",
                        "rails.pattern.CARD": r"\d{16}", "rails.model": "rails_classifier"})
    assert s.rails.block_words == ("bomb", "nerve agent") and s.rails.holdback_tokens == 8
    assert s.rails.pattern == {"CARD": r"\d{16}"} and s.rails.active
    assert not parse_settings({"target": "t"}).rails.active
    for params, needle in [({"rails.holdback_tokens": "-1"}, "'rails.holdback_tokens' must lie in 0..4096"),
                           ({"rails.holdback_tokens": "x"}, "'rails.holdback_tokens'"),
                           ({"rails.threshold": "0"}, "'rails.threshold'"),
                           ({"rails.pattern.BAD": "(unclosed"}, "'rails.pattern.BAD': not a valid regular expression"),
                           ({"rails.pattern.EMPTY": "a*"}, "'rails.pattern.EMPTY': the pattern matches the empty"),
                           ({"rails.block_word": "bomb"}, "'rails.block_word'"),
                           ({"rails.model_output": " "}, "'rails.model_output' must not be empty")]:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
            parse_settings({"target": "t", **params})


# -- the forwarder: a blocked stream ends, the in-process target stops -------------------------
class Request:
    def is_cancelled(self):
        return False


def fake_target(stream: LocalStream, text: str, counter: list[int], delay: float = 0.0005) -> threading.Thread:
    """An engine's side of an in-process stream: a character per step until cancelled."""

    def run():
        for ch in text:
            if stream.cancelled():
                stream.fail("the request was cancelled", "CANCELLED")
                return
            stream.piece(ch)
            counter[0] += 1
            time.sleep(delay)
        stream.finish(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("reasons", [False, True])
def test_a_blocked_stream_ends_without_the_blocked_text_and_stops_the_target(reasons):
    text = "All fine so far. Now the bomb part." + "x" * 5000
    stream, counter = LocalStream(), [0]
    sender = Sender(reasons)
    gen = Generation(request=Request(), sender=sender, stream=True, prompt="p",
                     params=SamplingParams(max_tokens=6000, temperature=0))
    ended = []
    calls = TargetCalls(name="g", target="t", local=None, idle_s=5)
    fwd = StreamForwarder(gen, calls=calls, pipeline=StreamPipeline([]), name="g", target="t", interval_s=0,
                          cancel_poll_s=0.05, keep=False, on_end=lambda g, o: ended.append(o),
                          rails=rails(block_words=("bomb",), holdback_tokens=8))
    worker = fake_target(stream, text, counter)
    assert fwd.forward(1, stream, time.perf_counter()) is None
    worker.join(5)
    sent = "".join(sender.pieces)
    assert "bomb" not in sent and text.startswith(sent) and ended == ["blocked"]
    if reasons:
        assert sender.final == [("finish", None, CONTENT_FILTER)]
    else:
        assert sender.final[0][0] == "fail" and "rails.block_words" in sender.final[0][1]
        assert sender.final[0][2] == "INVALID_ARG"
    tokens, after = fwd.blocked_after
    assert counter[0] - tokens == after  # every token the target made after the block was counted
    assert after <= 8 + 64, (tokens, after)  # stopped: far from the 5,000 it would have sent
    assert gen.error is not None and gen.outcome == ""  # on_end is the guard's; here a recorder


def test_an_unblocked_stream_carries_its_finish_reason():
    for max_tokens, want in ((10, "length"), (100, "stop")):
        stream, counter = LocalStream(), [0]
        sender = Sender(reasons=True)
        gen = Generation(request=Request(), sender=sender, stream=True, prompt="p",
                         params=SamplingParams(max_tokens=max_tokens, temperature=0))
        calls = TargetCalls(name="g", target="t", local=None, idle_s=5)
        fwd = StreamForwarder(gen, calls=calls, pipeline=StreamPipeline([]), name="g", target="t", interval_s=0,
                              cancel_poll_s=0.05, keep=False, on_end=lambda g, o: None,
                              rails=rails(block_words=("bomb",)))
        worker = fake_target(stream, "a benign answer"[:max_tokens], counter)
        assert fwd.forward(1, stream, time.perf_counter()) is not None
        worker.join(5)
        assert "".join(sender.pieces) + (sender.final[0][1] or "") == "a benign answer"[:max_tokens]
        assert sender.final[0][2] == want


# -- the generator's engine honours a caller's stop request -----------------------------------
class Endless:
    def prefill(self, seq):
        seq.logits = np.zeros(4, np.float32)

    def advance(self, seqs):
        time.sleep(0.002)
        out = []
        for s in seqs:
            s.pieces.append("a")
            out.append((s, "a"))
        return out


class Sink:
    def __init__(self):
        self.pieces: list[str] = []
        self.result: tuple | None = None
        self.closed = threading.Event()

    def piece(self, text):
        self.pieces.append(text)

    def finish(self, text):
        self.result = ("finish", text)
        self.closed.set()

    def fail(self, message, code):
        self.result = ("fail", message, code)
        self.closed.set()

    def cancelled(self):
        return False


def test_engine_stops_the_named_request_only_with_a_plain_final_response():
    engine = Engine(Endless(), cancel_poll_s=10)  # type: ignore[arg-type]
    try:
        a, b = Sink(), Sink()
        params = SamplingParams(max_tokens=100000, temperature=0)
        engine.submit(Sequence("p", params, stream=True, sink=a, request_id="tg-a"))
        engine.submit(Sequence("p", params, stream=True, sink=b, request_id="tg-b"))
        deadline = time.monotonic() + 5
        while len(a.pieces) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.request_stop("tg-a")
        at = len(a.pieces)
        assert a.closed.wait(5)
        assert a.result == ("finish", None)  # not an error: a BLS caller on 24.10 gets it
        assert len(a.pieces) <= at + 2  # stopped at the next decode step
        assert not b.closed.is_set()  # the other generation goes on
        engine.request_stop("never-seen")  # an unknown id is kept a while, harmless
        engine.request_stop("tg-b")
        assert b.closed.wait(5) and b.result == ("finish", None)
    finally:
        engine.stop()
