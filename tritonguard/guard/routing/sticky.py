"""Sticky routing: a request that names a ``routing_key`` (a customer, an account, a device) is
placed in the rollout's bands by a stable hash of the key instead of a random draw, so every
request with that key goes to the same version for as long as the rollout state stands, in every
guard instance and replica (BLAKE2b, not Python's per-process ``hash()``).

The point of a key is fixed in [0, 1) and a version under test takes the band below its share
(:meth:`~tritonguard.rollout.state.RolloutState.candidate_mask`): as a candidate's share grows,
the keys it already answered stay on it and new keys join; none moves back to the primary until
the share shrinks. Request parameter ``version=primary`` pins a request to whichever version the
state names primary (a replay of what a rolled-back candidate answered, say).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ROUTING_KEY = "routing_key"  # the request parameter
PRIMARY_PIN = -1  # pin_of("primary"): the version the rollout state names primary
_UNIT = 2.0 ** -53


def key_point(key: Any) -> float:
    """The key's fixed point in [0, 1): the top 53 bits of its BLAKE2b-64 digest (the same in
    every process, on every machine). ``str`` keys are hashed as UTF-8, ``bytes`` as they are,
    anything else (a gRPC int64 parameter) as its decimal text, so ``7`` and ``"7"`` agree."""
    data = key if isinstance(key, bytes) else str(key).encode("utf-8", "surrogatepass")
    return (int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 11) * _UNIT


def _key(params: Mapping[str, Any] | None) -> Any:
    key = params.get(ROUTING_KEY) if params else None
    return None if key is None or key == "" or isinstance(key, bool) else key


def has_keys(params: Sequence[Mapping[str, Any] | None]) -> bool:
    """Whether any request of a batch names a routing key (one dict look-up per request)."""
    return any(_key(p) is not None for p in params)


def apply_keys(params: Sequence[Mapping[str, Any] | None], draws: np.ndarray) -> np.ndarray:
    """``draws`` (per request, uniform in [0, 1)) with the draw of every request that names a
    routing key replaced by the key's point, in place; returned for convenience."""
    for i, p in enumerate(params):
        key = _key(p)
        if key is not None:
            draws[i] = key_point(key)
    return draws
