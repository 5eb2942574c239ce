"""A guard's config.pbtxt parameters -> how the front passes a bearer key on."""

from __future__ import annotations

import pytest

from examples.generator import stream_guard_config
from tritonguard.llm.upstream import Ending, GuardInfo


def info(**params: str) -> GuardInfo:
    return GuardInfo.from_config("g", stream_guard_config("g", "tinylm", **params))


def test_the_key_travels_as_the_guard_reads_it():
    keyed = info(tenancy__auth="api_key", tenancy__keys_file="/k.json", tenancy__key_header="X-Key")
    assert keyed.parameters("sk-1", None) == {"x-key": "sk-1"} and keyed.refuse_anonymous
    jwt = info(tenancy__auth="jwt", tenancy__unauthenticated="default")
    assert jwt.parameters("eyJ", None) == {"authorization": "Bearer eyJ"} and not jwt.refuse_anonymous
    plain = info(validation__default_max_tokens="32")
    assert plain.parameters("sk-1", None) == {} and plain.parameters(None, "acme") == {"tenant": "acme"}
    assert plain.default_max_tokens == 32


def test_a_model_that_is_not_a_stream_guard_is_refused():
    with pytest.raises(ValueError, match="not a stream guard"):
        GuardInfo.from_config("x", {"parameters": {}})


def final_response(**outputs: str):
    """A guard's final gRPC response as tritonclient hands it over (BYTES [1] per output)."""
    from tritonclient.grpc import InferResult, service_pb2  # noqa: PLC0415

    resp = service_pb2.ModelInferResponse(model_name="g", id="1")
    for name, value in outputs.items():
        resp.outputs.add(name=name, datatype="BYTES", shape=[1])
        raw = value.encode()
        resp.raw_output_contents.append(len(raw).to_bytes(4, "little") + raw)
    resp.parameters["triton_final_response"].bool_param = True
    return InferResult(resp)


def test_the_guards_finish_reason_is_read_from_its_final_response():
    declared = info()
    declared_cfg = stream_guard_config("g", "tinylm")
    declared_cfg["output"].append({"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [1]})
    assert not declared.reasons and GuardInfo.from_config("g", declared_cfg).reasons
    for reason in ("length", "stop", "content_filter"):  # a budget's cut is "length"
        ending = Ending()
        ending.read(final_response(text_output="", finish_reason=reason))
        assert ending.reason == reason
    for result in (final_response(text_output="abc"), final_response(finish_reason="exploded")):
        ending = Ending()
        ending.read(result)
        assert ending.reason is None  # none sent, or not a reason OpenAI has: the front counts


def test_a_budget_without_the_finish_reason_output_is_named_at_start():
    """Only the guard knows its budget cut an answer: without its finish_reason output the front
    says at start that such a cut will read 'stop'."""
    cfg = stream_guard_config("g", "tinylm", tokens__per_minute="30")
    why = GuardInfo.from_config("g", cfg).unsure_length
    assert why is not None and "'g'" in why and "finish_reason" in why
    cfg["output"].append({"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [1]})
    assert GuardInfo.from_config("g", cfg).unsure_length is None
    assert info().unsure_length is None  # no budget: nothing is cut
