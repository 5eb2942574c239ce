"""Cache keys, one per request or per batch row, and the value type (:data:`Value`).

Keys are SHA-256 digests of a canonical, unambiguous encoding of (tenant, model, artifact,
inputs, requested outputs, parameters), followed by the model name so that every tier can purge
one model (:func:`key_model`). :func:`row_keys` gives one key per batch row, so a row hits whichever
request it arrived in; :func:`cache_key` is the key of one whole request. Values are
``dict[str, np.ndarray]``; :func:`is_bytes`, :func:`as_bytes` and :func:`numeric` are the
array-to-bytes rules that the keys and the value codec (:mod:`tritonguard.privacy.cache.codec`) share.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Value = dict[str, np.ndarray]
DIGEST = 32  # key = sha256 digest + model name


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def as_bytes(x: Any) -> bytes:
    """One BYTES element as bytes (a str as UTF-8)."""
    return x.encode("utf-8") if isinstance(x, str) else bytes(x)


def is_bytes(arr: np.ndarray) -> bool:
    """Whether ``arr`` holds BYTES elements (object, bytes or str), not numbers."""
    return arr.dtype.kind in "OSU"


def canonical_params(params: Mapping[str, Any]) -> str:
    """The JSON that keys hash for ``params``; pass it instead of the mapping to skip re-encoding."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)


_PREFIXES: dict[tuple, hashlib._Hash] = {}  # hashed key prefixes, reused (copied) per call
_MAX_PREFIXES = 1024


def _prefix(tenant: str, model: str, artifact_sha: str, names: Sequence[str], outputs: Sequence[str],
            params: Mapping[str, Any] | str) -> hashlib._Hash:
    pjson = params if isinstance(params, str) else canonical_params(params)
    memo = (tenant, model, artifact_sha, tuple(names), tuple(outputs), pjson)
    h = _PREFIXES.get(memo)
    if h is None:
        h = hashlib.sha256(b"tritonguard-cache-key-v1\0")
        for s in (tenant, model, artifact_sha):
            h.update(_field(s.encode("utf-8")))
        h.update(_field(json.dumps(sorted(outputs)).encode()))
        h.update(_field(pjson.encode()))
        h.update(struct.pack("<Q", len(names)))
        if len(_PREFIXES) >= _MAX_PREFIXES:
            _PREFIXES.clear()
        _PREFIXES[memo] = h
    return h.copy()


def _meta(name: str, arr: np.ndarray, shape: Sequence[int]) -> bytes:
    dt = b"BYTES" if is_bytes(arr) else arr.dtype.newbyteorder("<").str.encode()
    return _field(name.encode()) + _field(dt) + _field(struct.pack(f"<{len(shape)}Q", *shape))


def numeric(arr: np.ndarray) -> np.ndarray:
    """A numeric array as little-endian and C-ordered, the bytes that are hashed and stored."""
    return arr.astype(arr.dtype.newbyteorder("<"), order="C", copy=False)  # keeps 0-d arrays 0-d


def cache_key(tenant: str, model: str, artifact_sha: str, inputs: Mapping[str, np.ndarray],
              outputs: Sequence[str], params: Mapping[str, Any] | str) -> bytes:
    """Key of one whole request; equals ``row_keys(...)[i]`` for a request of the single row i."""
    names = sorted(inputs)
    h = _prefix(tenant, model, artifact_sha, names, outputs, params)
    for name in names:
        arr = np.asarray(inputs[name])
        h.update(_meta(name, arr, arr.shape))
        if is_bytes(arr):
            for x in arr.reshape(-1):
                h.update(_field(as_bytes(x)))
        else:
            h.update(_field(numeric(arr).tobytes()))
    return h.digest() + model.encode()


def row_keys(tenant: str, model: str, artifact_sha: str, fused_inputs: Mapping[str, np.ndarray],
             outputs: Sequence[str], params: Mapping[str, Any] | str) -> list[bytes]:
    """One key per row (first axis) of a fused batch; the shared prefix is hashed once (and
    remembered). ``params`` may be given as :func:`canonical_params` of the mapping."""
    names = sorted(fused_inputs)
    if not names:
        return []
    n = len(fused_inputs[names[0]])
    base = _prefix(tenant, model, artifact_sha, names, outputs, params)
    tail = model.encode()
    parts = []  # per input: (metadata bytes, per-row byte source)
    for name in names:
        arr = np.asarray(fused_inputs[name])
        if len(arr) != n:
            raise ValueError(f"input '{name}' has {len(arr)} rows, '{names[0]}' has {n}")
        meta = _meta(name, arr, (1, *arr.shape[1:]))
        if is_bytes(arr):
            rows = arr.reshape(n, -1)
            parts.append((meta, [b"".join(_field(as_bytes(x)) for x in r) for r in rows]))
        else:
            flat = memoryview(numeric(arr)).cast("B")
            rb = flat.nbytes // n if n else 0
            meta += struct.pack("<Q", rb)  # the row's length prefix is the same for every row
            parts.append((meta, [flat[i * rb:(i + 1) * rb] for i in range(n)]))
    keys = []
    for i in range(n):
        h = base.copy()
        for meta, rows in parts:
            h.update(meta)
            h.update(rows[i])
        keys.append(h.digest() + tail)
    return keys


def key_model(key: bytes) -> str:
    return key[DIGEST:].decode("utf-8")


def split_rows(value: Mapping[str, np.ndarray], n: int) -> list[Value]:
    """Per-row values of a batch output, ready for :meth:`TieredCache.put_many`."""
    return [{k: v[i:i + 1] for k, v in value.items()} for i in range(n)]
