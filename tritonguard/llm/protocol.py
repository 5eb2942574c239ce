"""OpenAI request bodies checked and turned into one generation for the guard, and the response
bodies and stream chunks built back.

What the guard's contract can do is served; what it cannot is refused with a 400 naming the field
(``n`` other than 1, ``logprobs``, tools, a ``response_format`` other than text, penalties or a
``logit_bias``), never silently ignored. The sampling keys are the guard's (``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``); the guard itself checks their caps (its
``validation.*``) and its refusals come back as 400s naming the same fields
(:mod:`tritonguard.llm.errors`). The guard applies ``stop``: it cuts the answer before the first
stop sequence and stops its target, so the front never has to cancel a stream for one.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tritonguard.llm.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4  # OpenAI's limit
# fields a client may send whose only value the guard's contract can honour (anything else: 400)
_ONLY = {"n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
         "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
         "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
         "suffix": (None, "")}


@dataclass
class Ask:
    """One OpenAI request, checked: what the guard gets and what the answer needs."""

    chat: bool
    model: str
    prompt: str = ""  # completions: the prompt; chat: filled by the chat template
    messages: list[dict[str, str]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # the guard's sampling keys, as given
    echo: bool = False

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.get("max_tokens")


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {value!r}", name, "invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad_request(f"'{name}' must lie in {bound}, got {value!r}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    if value < lo:
        raise bad_request(f"'{name}' must be at least {lo}, got {value}", name, "invalid_value")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}': only text content parts are supported", where, "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"'{where}' must be a string or a list of text parts", where, "invalid_type")


def _messages(body: dict) -> list[dict[str, str]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list of {role, content}", "messages",
                          "invalid_type" if raw is not None else "missing_required_parameter")
    out = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where, "invalid_type")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role",
                              "invalid_value")
        if msg.get("tool_calls"):
            raise bad_request(f"'{where}.tool_calls': tools are not supported", f"{where}.tool_calls",
                              "unsupported_parameter")
        out.append({"role": role, "content": _text(msg.get("content"), f"{where}.content")})
    return out


def _prompt(body: dict) -> str:
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if isinstance(raw, list):
        raise bad_request("'prompt' must be one string (lists of prompts and token ids are not supported)",
                          "prompt", "invalid_value")
    if not isinstance(raw, str):
        raise bad_request("'prompt' must be a string", "prompt",
                          "invalid_type" if raw is not None else "missing_required_parameter")
    return raw


def _stops(body: dict) -> list[str]:
    raw = body.get("stop")
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad_request(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop",
                          "invalid_value")
    return stops


def parse(body: Any, *, chat: bool) -> Ask:
    """An OpenAI request body -> :class:`Ask`; a broken field raises a 400 naming it."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must name a model (GET /v1/models lists them)", "model",
                          "missing_required_parameter" if model is None else "invalid_type")
    for name, allowed in _ONLY.items():
        value = body.get(name)
        if value not in allowed:
            raise bad_request(f"'{name}' = {value!r} is not supported by this server", name, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request("'response_format': only {\"type\": \"text\"} is supported", "response_format",
                          "unsupported_parameter")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream", "invalid_type")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad_request("'stream_options' is an object, and only allowed with stream: true", "stream_options",
                          "invalid_value")
    stops = _stops(body)
    ask = Ask(chat=chat, model=model, stream=stream, include_usage=bool((options or {}).get("include_usage")))
    if chat:
        ask.messages = _messages(body)
        max_tokens = _integer(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", 1)
        elif body.get("max_tokens") is not None:
            raise bad_request("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens", "invalid_value")
    else:
        ask.prompt = _prompt(body)
        max_tokens = _integer(body, "max_tokens", 1)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise bad_request("'echo' must be a boolean", "echo", "invalid_type")
        ask.echo = echo
    sampling: dict[str, Any] = {}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    for name, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True)):
        value = _number(body, name, lo, hi, lo_open=lo_open)
        if value is not None:
            sampling[name] = value
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad_request(f"'seed' must be an integer, got {seed!r}", "seed", "invalid_type")
        sampling["seed"] = seed
    if stops:
        sampling["stop"] = stops
    ask.sampling = sampling
    return ask


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(ask: Ask, rid: str, text: str, finish: str, use: dict[str, int]) -> dict:
    """The whole (non-streamed) answer."""
    if ask.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if ask.chat else "text_completion", "created": int(time.time()),
            "model": ask.model, "choices": [choice], "usage": use}


def chunk(ask: Ask, rid: str, created: int, text: str | None, finish: str | None = None, *,
          first: bool = False, use: dict[str, int] | None = None, no_choices: bool = False) -> dict:
    """One stream chunk; the last one carries ``finish_reason`` and ``usage``."""
    if no_choices:
        choices: list[dict] = []
    elif ask.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk" if ask.chat else "text_completion", "created": created,
           "model": ask.model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
