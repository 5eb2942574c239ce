"""Tensor specs from a model config, and batch helpers that work on whole batches."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonguard.core.errors import ConfigError

# config.pbtxt TYPE_* -> numpy dtype (BYTES travel as object arrays of bytes)
TRITON_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
NUMPY_TO_TRITON = {np.dtype(v): k for k, v in TRITON_TO_NUMPY.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype  # np.dtype(object) for BYTES
    dims: tuple[int, ...]  # without the batch dimension; -1 = any

    @property
    def is_bytes(self) -> bool:
        return self.dtype == np.dtype(object)

    @property
    def triton_type(self) -> str:
        """KServe v2 datatype name (FP32, BYTES, …)."""
        name = NUMPY_TO_TRITON[self.dtype][len("TYPE_"):]
        return "BYTES" if name == "STRING" else name

    def shape_ok(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.dims) and all(d == -1 or d == s for d, s in zip(self.dims, shape, strict=True))


@dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelSignature:
        def specs(key: str) -> tuple[TensorSpec, ...]:
            out = []
            for t in config.get(key) or []:
                dtype = t.get("data_type", "")
                if dtype not in TRITON_TO_NUMPY:
                    raise ConfigError(f"{key} '{t.get('name')}': unsupported data_type {dtype}")
                dims = tuple(int(d) for d in t.get("dims", []))
                if t.get("reshape", {}).get("shape") is not None:
                    dims = tuple(int(d) for d in t["reshape"]["shape"])
                out.append(TensorSpec(t["name"], np.dtype(TRITON_TO_NUMPY[dtype]), dims))
            return tuple(out)

        return cls(specs("input"), specs("output"), int(config.get("max_batch_size", 0)))

    def input(self, name: str) -> TensorSpec:
        for s in self.inputs:
            if s.name == name:
                return s
        raise KeyError(name)


def concat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate along the batch axis; object (BYTES) arrays included."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays, axis=0)


def offsets(sizes: Sequence[int]) -> np.ndarray:
    """Start index of each request in the fused batch; ``len(sizes) + 1`` entries."""
    # itertools.accumulate: for the few requests of one batch, numpy's cumsum of a list costs
    # more in conversion than it saves
    return np.fromiter(itertools.accumulate(sizes, initial=0), dtype=np.int64, count=len(sizes) + 1)


def split(array: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    """Views of ``array`` per request, from :func:`offsets`."""
    return [array[starts[i]:starts[i + 1]] for i in range(len(starts) - 1)]


def rows_any(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per request: whether any of its rows is True. ``mask`` has one bool per batch row."""
    sizes = np.diff(starts)
    out = np.zeros(len(sizes), dtype=bool)
    nonempty = sizes > 0
    if mask.size and nonempty.any():
        out[nonempty] = np.logical_or.reduceat(mask, starts[:-1][nonempty])
    return out
