"""An event's value turned into the guarded model's inputs, checked against the model's
metadata (read over Triton gRPC at start), so a malformed event is a dead letter of its own
instead of a Triton error.

Accepted values (UTF-8 JSON):
- ``{"inputs": {"NAME": nested list, ...}}`` with every input of the model, one row each (the
  shape of the model's input without the batch dimension);
- a bare nested list, when the model has exactly one input.
BYTES inputs take strings (sent UTF-8 encoded). Kafka headers named in :data:`FORWARDED` go to
Triton as gRPC headers (tenant, credentials, W3C trace context)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

FORWARDED = ("x-tenant-id", "x-tritonguard-api-key", "authorization", "traceparent")
DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT64": np.int64,
          "INT32": np.int32, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_,
          "BYTES": np.object_}


class EventError(ValueError):
    """The event cannot be sent: its value does not decode or does not fit the model."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # without the batch dimension; -1 is any length

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(w in (-1, s) for w, s in zip(self.shape, shape, strict=True))


def specs_from_metadata(metadata: dict[str, Any], max_batch_size: int) -> list[InputSpec]:
    """The model's inputs from ``get_model_metadata(as_json=True)``; a batching model's first
    dimension (-1) is the batch."""
    out = []
    for i in metadata.get("inputs", []):
        shape = tuple(int(d) for d in i.get("shape", []))
        if max_batch_size > 0:
            shape = shape[1:]
        if i["datatype"] not in DTYPES:
            raise EventError(f"input {i['name']!r}: datatype {i['datatype']} is not supported by the stream")
        out.append(InputSpec(i["name"], i["datatype"], shape))
    if not out:
        raise EventError("the model has no inputs in its metadata")
    return out


def decode(value: bytes | None, specs: list[InputSpec], batched: bool = True) -> dict[str, np.ndarray]:
    """The event's arrays, each with a batch dimension of 1 when the model batches."""
    if value is None:
        raise EventError("the event has no value")
    try:
        doc = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EventError(f"the value is not JSON: {exc}") from None
    if isinstance(doc, dict) and "inputs" in doc:
        given = doc["inputs"]
        if not isinstance(given, dict):
            raise EventError('"inputs" must be an object of input name to nested list')
    elif isinstance(doc, list) and len(specs) == 1:
        given = {specs[0].name: doc}
    else:
        raise EventError('the value must be {"inputs": {NAME: nested list}}'
                         + (" or a nested list" if len(specs) == 1 else ""))
    unknown = sorted(set(given) - {s.name for s in specs})
    if unknown:
        raise EventError(f"unknown input(s) {', '.join(map(repr, unknown))}; the model takes "
                         f"{', '.join(repr(s.name) for s in specs)}")
    arrays = {}
    for spec in specs:
        if spec.name not in given:
            raise EventError(f"input {spec.name!r} is missing")
        arrays[spec.name] = _array(spec, given[spec.name], batched)
    return arrays


def _array(spec: InputSpec, data: Any, batched: bool) -> np.ndarray:
    try:
        if spec.datatype == "BYTES":
            arr = np.array(data, dtype=object)
            flat = [v.encode() if isinstance(v, str) else None for v in arr.reshape(-1)]
            if any(v is None for v in flat):
                raise EventError(f"input {spec.name!r}: BYTES elements must be strings")
            arr = np.array(flat, dtype=object).reshape(arr.shape)
        else:
            raw = np.array(data)
            if raw.dtype == object or raw.dtype.kind not in "biuf":
                raise EventError(f"input {spec.name!r}: a ragged or non-numeric list")
            arr = raw.astype(DTYPES[spec.datatype])
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, EventError):
            raise
        raise EventError(f"input {spec.name!r}: {exc}") from None
    if not spec.fits(arr.shape):
        want = "x".join("?" if d == -1 else str(d) for d in spec.shape) or "scalar"
        got = "x".join(map(str, arr.shape)) or "scalar"
        raise EventError(f"input {spec.name!r}: shape {got}, the model takes {want}")
    return arr[None, ...] if batched else arr


def forwarded_headers(headers: list[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """The Kafka headers Triton gets as gRPC headers (the last one of a name wins)."""
    out = {}
    for name, value in headers or ():
        if name.lower() in FORWARDED and value is not None:
            out[name.lower()] = value.decode("utf-8", "replace")
    return out
