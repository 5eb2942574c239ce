"""OpenAI request bodies -> one generation for the guard; stop sequences."""

from __future__ import annotations

import pytest

from tritonguard.llm.errors import OpenAIError
from tritonguard.llm.protocol import chunk, parse


def test_a_chat_request_keeps_the_guards_sampling_keys_only():
    ask = parse({"model": "g", "messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_completion_tokens": 8, "temperature": 0, "seed": 3, "user": "ignored", "stream": True,
                 "stream_options": {"include_usage": True}}, chat=True)
    assert ask.sampling == {"max_tokens": 8, "temperature": 0.0, "seed": 3}
    assert ask.messages[1] == {"role": "user", "content": "hi"} and ask.stream and ask.include_usage


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x"}, "model"),
    ({"model": "g"}, "prompt"),
    ({"model": "g", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "g", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "g", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "g", "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": "g", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "g", "prompt": "x", "seed": "1"}, "seed"),
    ({"model": "g", "prompt": "x", "n": 2}, "n"),
    ({"model": "g", "prompt": "x", "logprobs": 2}, "logprobs"),
    ({"model": "g", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "g", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "g", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "g", "prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_a_bad_completion_field_is_named(body, param):
    with pytest.raises(OpenAIError) as info:
        parse(body, chat=False)
    assert info.value.status == 400 and info.value.param == param, info.value.message


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
])
def test_a_bad_message_is_named(messages, param):
    with pytest.raises(OpenAIError) as info:
        parse({"model": "g", "messages": messages}, chat=True)
    assert info.value.param == param


def test_stop_sequences_go_to_the_guard_with_the_sampling_keys():
    ask = parse({"model": "g", "prompt": "x", "stop": "END", "max_tokens": 5}, chat=False)
    assert ask.sampling == {"max_tokens": 5, "stop": ["END"]}
    assert "stop" not in parse({"model": "g", "prompt": "x"}, chat=False).sampling


def test_the_last_chunk_carries_finish_reason_and_usage():
    ask = parse({"model": "g", "messages": [{"role": "user", "content": "x"}], "stream": True}, chat=True)
    first = chunk(ask, "id", 1, "", first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunk(ask, "id", 1, None, "length", use={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert last["usage"]["total_tokens"] == 3
