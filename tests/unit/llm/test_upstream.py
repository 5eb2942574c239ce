"""A guard's config.pbtxt parameters -> how the front passes a bearer key on."""

from __future__ import annotations

import pytest

from examples.generator import stream_guard_config
from tritonguard.llm.upstream import GuardInfo


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
