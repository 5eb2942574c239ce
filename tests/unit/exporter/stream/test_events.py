"""exporter.stream.events: an event's value checked against the model's metadata before it is
sent, so a malformed event is its own dead letter."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exporter.stream.events import EventError, decode, forwarded_headers, specs_from_metadata

META = {"inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [-1, 8, 8]}],
        "outputs": [{"name": "PROBS"}, {"name": "SERVED_BY"}]}


def specs():
    return specs_from_metadata(META, max_batch_size=64)


def test_an_event_becomes_one_row_with_the_batch_dimension():
    image = np.arange(64, dtype=np.float32).reshape(8, 8) / 4
    arrays = decode(json.dumps({"inputs": {"IMAGE": image.tolist()}}).encode(), specs())
    assert arrays["IMAGE"].shape == (1, 8, 8) and arrays["IMAGE"].dtype == np.float32
    np.testing.assert_array_equal(arrays["IMAGE"][0], image)
    # one input: the bare nested list is enough
    np.testing.assert_array_equal(decode(json.dumps(image.tolist()).encode(), specs())["IMAGE"][0], image)


@pytest.mark.parametrize(("value", "words"), [
    (b"\xff\xfe", "not JSON"),
    (b"{not json", "not JSON"),
    (None, "no value"),
    (json.dumps({"inputs": {"IMAGE": [[0.0] * 8] * 7}}).encode(), "shape 7x8, the model takes 8x8"),
    (json.dumps({"inputs": {"IMAGE": [[0.0] * 8] * 8, "EXTRA": [1]}}).encode(), "unknown input(s) 'EXTRA'"),
    (json.dumps({"inputs": {}}).encode(), "'IMAGE' is missing"),
    (json.dumps({"inputs": {"IMAGE": [["a"] * 8] * 8}}).encode(), "non-numeric"),
    (json.dumps({"inputs": {"IMAGE": [[0.0] * 8, [0.0]]}}).encode(), "IMAGE"),
    (json.dumps({"image": 1}).encode(), '{"inputs"'),
])
def test_a_malformed_event_is_refused_with_a_reason(value, words):
    with pytest.raises(EventError, match=None) as exc:
        decode(value, specs())
    assert words in str(exc.value), exc.value


def test_text_inputs_are_sent_utf8_and_shapes_with_any_length_fit():
    meta = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]}, {"name": "IDS", "datatype": "INT64", "shape": [-1, -1]}]}
    s = specs_from_metadata(meta, max_batch_size=8)
    arrays = decode(json.dumps({"inputs": {"TEXT": ["héllo"], "IDS": [1, 2, 3]}}).encode(), s)
    assert arrays["TEXT"].tolist() == [["héllo".encode()]] and arrays["IDS"].shape == (1, 3)
    with pytest.raises(EventError, match="BYTES elements must be strings"):
        decode(json.dumps({"inputs": {"TEXT": [3], "IDS": [1]}}).encode(), s)
    # a model without batching takes the event as it is
    flat = specs_from_metadata({"inputs": [{"name": "IDS", "datatype": "INT64", "shape": [-1]}]}, 0)
    assert decode(b"[1, 2]", flat, batched=False)["IDS"].shape == (2,)


def test_only_tenant_credentials_and_trace_headers_are_forwarded():
    headers = [("x-tenant-id", b"acme"), ("traceparent", b"00-abc-def-01"), ("other", b"x"), ("Authorization", None)]
    assert forwarded_headers(headers) == {"x-tenant-id": "acme", "traceparent": "00-abc-def-01"}
