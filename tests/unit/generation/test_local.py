"""The stream guard's in-process target (placement inprocess) on a real tinylm build: the same
text as the generator's own decoder, streamed or whole; errors as responses; cancel; stalls."""

from __future__ import annotations

import queue
import time

import pytest

from examples import generator as example
from tritonguard.core.errors import ConfigError
from tritonguard.core.repository import write_config
from tritonguard.generation.contract import SamplingParams
from tritonguard.generation.local import (
    CODE_NUMBERS,
    END,
    LocalGenerator,
    LocalStream,
    queued_batches,
)

GREEDY = '{"max_tokens": 32, "temperature": 0}'


class Stalled(Exception):
    pass


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    r = tmp_path_factory.mktemp("localgen")
    example.build(r, "lm", steps=40)
    return r


@pytest.fixture
def local(repo):
    g = LocalGenerator(repo, "lm", guard="g")
    yield g
    g.close()


def drain(stream: LocalStream) -> tuple[list[str], list[tuple[str, str]]]:
    texts, errors = [], []
    for batch in stream.batches(10, Stalled):
        for r in batch:
            if r.has_error():
                errors.append((r.error().message(), r.error().code()))
            else:
                texts.append(r.text)
    return texts, errors


def test_whole_and_streamed_text_match_the_decoder(repo, local):
    dec = example.decoder(repo / "lm" / "1" / "model.onnx")
    want = dec.generate("Return the", SamplingParams(max_tokens=32, temperature=0))
    texts, errors = drain(local.open(1, "Return the", False, GREEDY, None))
    assert not errors and texts == ["Return the" + want]  # the prompt first, as the generator answers
    texts, errors = drain(local.open(-1, "Return the", False, GREEDY, True))
    assert not errors and texts == [want]  # -1: the latest version
    texts, errors = drain(local.open(1, "Return the", True, GREEDY, None))
    assert not errors and "".join(texts) == want and len(texts) > 1


def test_errors_come_back_as_responses(local):
    _, errors = drain(local.open(1, "x", False, '{"top_k": 2}', None))
    assert len(errors) == 1 and "top_k" in errors[0][0] and errors[0][1] == CODE_NUMBERS["INVALID_ARG"]
    _, errors = drain(local.open(7, "x", False, GREEDY, None))
    assert errors[0][1] == CODE_NUMBERS["NOT_FOUND"]


def test_cancel_stops_decoding(local):
    stream = local.open(1, "Return the", True, '{"max_tokens": 256, "temperature": 0.9, "seed": 3}', None)
    got, at_cancel = 0, None
    t0 = time.monotonic()
    for batch in stream.batches(10, Stalled):
        got += len(batch)
        if got >= 3 and at_cancel is None:
            stream.cancel()
            at_cancel = got
        if any(r.has_error() for r in batch):
            break
    assert time.monotonic() - t0 < 5
    # read at every step (a flag, not Triton's IPC): the engine stops within a step or two of the
    # cancel. (Polled every 50 ms as for Triton requests, the 256 tokens were often all out first.)
    assert at_cancel is not None and got < 256 and got - at_cancel <= 3, (at_cancel, got)


def test_a_silent_stream_stalls():
    with pytest.raises(Stalled):
        next(iter(LocalStream().batches(0.05, Stalled)))


def test_only_generator_targets(tmp_path):
    write_config(tmp_path / "other", {"name": "other", "backend": "python"})
    with pytest.raises(ConfigError, match="backend 'generator'"):
        LocalGenerator(tmp_path, "other", guard="g")
    with pytest.raises(ConfigError, match="needs the target"):
        LocalGenerator(tmp_path, "absent", guard="g")


def test_queued_batches_hands_out_what_arrived_together_and_stalls_after_the_idle_limit():
    q: queue.Queue = queue.Queue()
    for x in ("a", "b", "c"):
        q.put(x)
    it = queued_batches(q, 0.2, Stalled)
    assert next(it) == ["a", "b", "c"]
    q.put("d")
    q.put(END)
    assert list(it) == [["d"]]
    t0 = time.monotonic()
    with pytest.raises(Stalled, match="no response for 0.2 s"):
        next(queued_batches(queue.Queue(), 0.2, Stalled))
    assert time.monotonic() - t0 >= 0.2


def test_queued_batches_wakes_its_reader_when_held_text_is_due_and_counts_idle_from_the_last_response():
    q: queue.Queue = queue.Queue()
    held = {"due": None}
    it = queued_batches(q, 0.5, Stalled, due=lambda: held["due"])
    q.put("a")
    assert next(it) == ["a"]
    held["due"] = 0.05  # the reader holds text due in 50 ms: an empty list then, not a stall
    t0 = time.monotonic()
    assert next(it) == []
    assert 0.04 <= time.monotonic() - t0 < 0.4
    held["due"] = None  # sent: nothing held; the idle limit still counts from "a"
    with pytest.raises(Stalled):
        next(it)
    assert time.monotonic() - t0 < 0.6
