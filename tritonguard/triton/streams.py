"""Decoupled (streaming) traffic through python_backend: the responses of one request to its
client, BLS streams to a decoupled target and what their responses carry, and one BLS call of an
embedding model with text rows. Everything that touches ``pb_utils`` for streams is here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tritonguard.core.errors import TargetError
from tritonguard.triton import backend
from tritonguard.triton.backend import CODE_NAMES, error, response

log = logging.getLogger(__name__)


def send_safely(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; a failure (a client gone mid-stream) is logged and None returned: it is
    not the sending loop's problem."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a client gone mid-stream is not the loop's problem
        log.warning("response to one request failed", exc_info=True)
        return None


class ResponseSink:
    """Responses of one decoupled request, as text in ``output``. ``finish(None)`` ends a stream
    with a flags-only final response; ``finish(text)`` sends the text with the final flag (a
    non-streamed answer: exactly one response)."""

    def __init__(self, request: Any, output: str, sender: Any = None) -> None:
        self.request, self.output = request, output
        self.sender = request.get_response_sender() if sender is None else sender
        self.final = backend.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.closed = False  # a final response was sent

    def _text(self, text: str) -> Any:
        return response({self.output: np.array([text.encode("utf-8")], dtype=np.object_)})

    def piece(self, text: str) -> None:
        self.sender.send(self._text(text))

    def finish(self, text: str | None) -> None:
        self.closed = True
        if text is None:
            self.sender.send(flags=self.final)
        else:
            self.sender.send(self._text(text), flags=self.final)

    def fail(self, message: str, code: str) -> None:
        self.closed = True
        self.sender.send(error(message, code), flags=self.final)

    def cancelled(self) -> bool:
        return bool(self.request.is_cancelled())


def open_stream(model: str, version: int, inputs: Mapping[str, np.ndarray], output: str, *,
                parent: Any = None, request_id: str = "") -> Any:
    """A BLS call of decoupled ``model`` v``version``: the iterator of its responses (read with
    :func:`response_text` / :func:`response_failure`). ``parent``: the request whose trace the call
    joins; ``request_id``: the id the target sees (how a caller names it later)."""
    p = backend.pb()
    kwargs: dict[str, Any] = {"model_name": model, "model_version": int(version),
                              "inputs": [p.Tensor(n, a) for n, a in inputs.items()],
                              "requested_output_names": [output]}
    if request_id:
        kwargs["request_id"] = request_id
    if parent is not None:
        try:
            kwargs["trace"] = parent.trace()
        except Exception:  # noqa: BLE001 - tracing is optional
            pass
    return p.InferenceRequest(**kwargs).exec(decoupled=True)


def response_text(resp: Any, output: str) -> str | None:
    """The text ``output`` of one BLS response (None when it carries none: a final flag)."""
    tensor = backend.pb().get_output_tensor_by_name(resp, output)
    if tensor is None:
        return None
    return b"".join(bytes(x) for x in tensor.as_numpy().reshape(-1)).decode("utf-8", "replace")


def response_failure(resp: Any) -> tuple[str, str] | None:
    """(message, code name) when one BLS response is an error, else None."""
    if not resp.has_error():
        return None
    err = resp.error()
    code = CODE_NAMES.get(err.code(), "INTERNAL") if hasattr(err, "code") else "INTERNAL"
    return err.message(), code


def embed_texts(model: str, input_name: str, output: str, texts: list[str]) -> np.ndarray:
    """``model``'s ``output`` for ``texts`` as BYTES [n, 1] rows of ``input_name`` (one
    non-decoupled BLS call); a failed call raises :class:`TargetError`."""
    p = backend.pb()
    data = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
    resp = p.InferenceRequest(model_name=model, inputs=[p.Tensor(input_name, data)],
                              requested_output_names=[output]).exec()
    if resp.has_error():
        raise TargetError(f"embedding model '{model}': {resp.error().message()}")
    return p.get_output_tensor_by_name(resp, output).as_numpy()


def echo_inputs(requests: list[Any]) -> list[Any]:
    """One response per request holding its own input tensors under their names: no copy through
    numpy, nothing deserialised (the text intake's pass-through)."""
    p = backend.pb()
    return [p.InferenceResponse(output_tensors=request.inputs()) for request in requests]
