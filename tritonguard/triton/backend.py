"""The one adapter to ``triton_python_backend_utils``.

C++-backed names in pb_utils (TritonError, InferenceRequest, MetricFamily) exist only inside a
running stub, so everything is looked up lazily, never at import time.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tritonguard.core.errors import InvalidInput, TargetError, TritonGuardError

log = logging.getLogger("tritonguard")

# pb_utils.TritonError integer codes -> names (python_backend pb_error.h order)
CODE_NAMES = {0: "UNKNOWN", 1: "INTERNAL", 2: "NOT_FOUND", 3: "INVALID_ARG", 4: "UNAVAILABLE",
               5: "UNSUPPORTED", 6: "ALREADY_EXISTS", 7: "CANCELLED"}


def pb():
    import triton_python_backend_utils as pb_utils  # noqa: PLC0415

    return pb_utils


def setup_logging() -> None:
    """Library loggers to stderr, which the stub forwards into the server log."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tritonguard %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def model_config(args: Mapping[str, str]) -> dict[str, Any]:
    return json.loads(args["model_config"])


@dataclass(frozen=True)
class ModelArgs:
    """What ``initialize(args)`` tells a Python-based backend, read once: the model's name and
    version, its parsed config.pbtxt, its folder and version folder, its instance."""

    name: str
    version: str
    config: dict[str, Any]
    model_dir: Path  # <repository>/<model>
    instance: str  # e.g. digits_0_0
    instance_kind: str

    @property
    def version_dir(self) -> Path:
        return self.model_dir / self.version

    @property
    def repository(self) -> Path:
        return self.model_dir.parent

    @property
    def decoupled(self) -> bool:
        return bool((self.config.get("model_transaction_policy") or {}).get("decoupled"))

    @property
    def instances(self) -> int:
        return instance_count(self.config)


def prologue(args: Mapping[str, str]) -> ModelArgs:
    """The start of every backend's ``initialize``: library logging to the server log, and the
    arguments read once."""
    setup_logging()
    return ModelArgs(name=args["model_name"], version=str(args.get("model_version", "1")), config=model_config(args),
                     model_dir=Path(args["model_repository"]), instance=args.get("model_instance_name", args["model_name"]),
                     instance_kind=args.get("model_instance_kind", ""))


def request_inputs(request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The request's inputs as numpy arrays. One that cannot be read raises InvalidInput naming
    it, so the caller fails that request alone (its neighbours in the batch are served)."""
    get = pb().get_input_tensor_by_name
    out = {}
    for name in names:
        try:
            t = get(request, name)
            if t is not None:
                out[name] = t.as_numpy()
        except Exception as exc:  # noqa: BLE001 - e.g. a BYTES tensor the stub cannot deserialise
            log.warning("input %r of one request cannot be read: %s: %s", name, type(exc).__name__, exc)
            raise InvalidInput(name, "readable", f"the tensor cannot be read ({type(exc).__name__})") from None
    return out


def request_parameters(request: Any) -> dict[str, Any]:
    try:
        raw = request.parameters()
        return json.loads(raw) if raw and raw != "{}" else {}  # most requests carry none
    except (ValueError, AttributeError):
        return {}


def request_id(request: Any) -> str:
    """The client's request id (KServe v2 ``id``; ``request_id`` in tritonclient), "" for none."""
    try:
        return request.request_id() or ""
    except AttributeError:
        return ""


def requested_outputs(request: Any) -> set[str] | None:
    """Output names the client asked for; None when it named none (then all are sent)."""
    try:
        names = request.requested_output_names()
    except AttributeError:
        return None
    return set(names) if names else None


def error(exc_or_msg: TritonGuardError | str, code: str | None = None) -> Any:
    p = pb()
    if isinstance(exc_or_msg, TritonGuardError):
        msg, code = str(exc_or_msg), code or exc_or_msg.code
    else:
        msg, code = exc_or_msg, code or "INTERNAL"
    return p.InferenceResponse(output_tensors=[], error=p.TritonError(msg, getattr(p.TritonError, code)))


_RESPONSE_PARAMETERS: bool | None = None  # python_backend >= r25.02 only; probed once


def response(outputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None = None) -> Any:
    global _RESPONSE_PARAMETERS
    p = pb()
    tensors = [p.Tensor(name, arr) for name, arr in outputs.items()]
    if parameters and _RESPONSE_PARAMETERS is not False:
        try:
            resp = p.InferenceResponse(output_tensors=tensors, parameters=dict(parameters))
            _RESPONSE_PARAMETERS = True
            return resp
        except TypeError:
            _RESPONSE_PARAMETERS = False
    return p.InferenceResponse(output_tensors=tensors)


def bls(
    model: str,
    version: int,
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    *,
    trace: Any = None,
    timeout_us: int = 0,
) -> dict[str, np.ndarray]:
    """One synchronous BLS call; a target error raises :class:`TargetError` with its code."""
    p = pb()
    kwargs: dict[str, Any] = {
        "model_name": model,
        "model_version": int(version),
        "inputs": [p.Tensor(n, a) for n, a in inputs.items()],
        "requested_output_names": list(outputs),
    }
    if trace is not None:
        kwargs["trace"] = trace
    if timeout_us:
        kwargs["timeout"] = int(timeout_us)
    resp = p.InferenceRequest(**kwargs).exec()
    if resp.has_error():
        err = resp.error()
        code = CODE_NAMES.get(err.code(), "INTERNAL") if hasattr(err, "code") else "INTERNAL"
        raise TargetError(f"target '{model}' failed: {err.message()}", code)
    result = {}
    for name in outputs:
        t = p.get_output_tensor_by_name(resp, name)
        if t is None:
            raise TargetError(f"target '{model}' returned no output '{name}'")
        result[name] = t.as_numpy()
    return result


def instance_count(config: Mapping[str, Any]) -> int:
    """Model instances a ``config.pbtxt`` asks for (its instance groups summed; 1 without any)."""
    return sum(int(g.get("count", 1)) for g in config.get("instance_group") or [{}]) or 1


