"""A checkpoint whose logits turn NaN: the generator fails that request with 'non-finite logits'
(which the stream guard's breaker counts as a non-finite answer) and serves its neighbours."""

from __future__ import annotations

import numpy as np
import pytest

from tritonguard.generation.contract import NON_FINITE_LOGITS, SamplingParams
from tritonguard.generation.decoder import CharTokenizer, Decoder, Sequence
from tritonguard.generation.engine import Engine

from .test_generator import ListSink


class PoisonedStep:
    """A step model that writes 'a' forever, with NaN logits once it has read a 'z'."""

    layers, hidden = 1, 2

    def __init__(self, tok: CharTokenizer) -> None:
        self.tok = tok
        self.z = tok.encode("z")[0]
        self.a = tok.encode("a")[0]

    def zeros(self, batch):
        return np.zeros((1, batch, 2), np.float32)

    def run(self, tokens, state):
        state = state.copy()
        state[0, :, 0] += (tokens == self.z).any(axis=1)
        logits = np.full((len(tokens), self.tok.vocab_size), -5.0, np.float32)
        logits[:, self.a] = 5.0
        logits[state[0, :, 0] > 0] = np.nan
        return logits, state


@pytest.fixture
def decoder():
    tok = CharTokenizer()
    return Decoder(PoisonedStep(tok), tok)  # type: ignore[arg-type]


def test_decoder_refuses_to_sample_from_nan(decoder):
    params = SamplingParams(max_tokens=8, temperature=0)
    assert decoder.generate("hello", params) == "a" * 8
    with pytest.raises(ValueError, match=NON_FINITE_LOGITS):
        decoder.generate("fizz", params)


def test_engine_fails_the_poisoned_request_alone(decoder):
    engine = Engine(decoder, cancel_poll_s=0)
    try:
        params = SamplingParams(max_tokens=8, temperature=0)
        bad, good = ListSink(), ListSink()
        engine.submit(Sequence("quiz", params, stream=True, sink=bad))
        engine.submit(Sequence("quiet", params, stream=True, sink=good))
        assert bad.closed.wait(10) and good.closed.wait(10)
        assert bad.error is not None and NON_FINITE_LOGITS in bad.error[0] and bad.error[1] == "INTERNAL"
        assert good.error is None and "".join(good.pieces) == "a" * 8
    finally:
        engine.stop()
