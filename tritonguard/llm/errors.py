"""OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``) and the guard's
refusals mapped onto them.

Over Triton's gRPC stream a decoupled model's error reaches the client as its message only (the
``ModelStreamInferResponse.error_message`` field has no status code), so the mapping reads the
guard's messages, which are stable by design: every refusal names its input and rule
(``input 'X' violates RULE: ...``), a tenant's quota or token budget says ``retry after N ms``,
an authentication refusal starts with ``authentication``. A message that matches none of them is
a server error (500), or 503 when it says the target cannot answer now.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# the guard's input names -> the OpenAI request field a client should fix
_FIELDS = {"text_input": "prompt", "stream": "stream", "exclude_input_in_output": "echo"}
_INPUT = re.compile(r"^input '([^']+)' violates ")
_KEY = re.compile(r"key '([^']+)'")
_RETRY = re.compile(r"retry after (\d+) ms")
# a guard that cannot serve this generation now (no healthy version, a stalled or unloading
# target, Triton's own 'not ready' / 'unavailable'): 503, the client may retry
_UNAVAILABLE = ("no healthy version", "retry later", "unloading", "is not ready", "not healthy", "unavailable",
                "stalled")


@dataclass
class OpenAIError(Exception):
    """One error answer: its HTTP status and the OpenAI error object's fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None  # 429/503: sent as Retry-After (s) and retry-after-ms

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s))),
                "retry-after-ms": str(max(1, round(self.retry_after_s * 1000)))}


def bad_request(message: str, param: str | None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def from_guard(message: str, *, chat: bool = False) -> OpenAIError:
    """The guard's (or Triton's) error message -> the OpenAI error a client gets."""
    retry = _RETRY.search(message)
    if message.startswith("authentication"):
        return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")
    m = _INPUT.match(message)
    if m is not None:
        name = m.group(1)
        if name == "sampling_parameters":
            key = _KEY.search(message)
            param = key.group(1) if key else None
        elif name == "text_input":
            param = "messages" if chat else "prompt"
        else:
            param = _FIELDS.get(name, name)
        return bad_request(message, param, "invalid_value")
    if retry is not None:
        seconds = int(retry.group(1)) / 1000
        if message.startswith("tenant '"):  # the tenant's quota or token budget: slow down
            kind = "tokens" if "token budget" in message else "requests"
            return OpenAIError(429, message, kind, None, "rate_limit_exceeded", seconds)
        # the guard itself is full (max_in_flight): overloaded, not the tenant's limit
        return OpenAIError(503, message, "server_error", None, "overloaded", seconds)
    low = message.lower()
    if "unknown model" in low or "is not found" in low:
        return OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")
    if any(s in low for s in _UNAVAILABLE):
        return OpenAIError(503, message, "server_error", None, "service_unavailable", 1.0)
    return OpenAIError(500, message, "server_error", None, None)
